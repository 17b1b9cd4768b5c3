"""The routing study's report (examples/routing_study/report.py) on synthetic runs: bands are the
min..max over seeds of per-seed smoothed curves, table cells are the mean over seeds with their
spread, depth profiles average each layer over steps, and the collapse rule flags exactly the
seeds it states."""

import importlib.util
import json
import random
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _report_module():
    spec = importlib.util.spec_from_file_location("routing_study_report",
                                                  ROOT / "examples" / "routing_study" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_run(run: Path, rows: list[dict], summary: dict) -> None:
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps(summary))


def _study(tmp_path: Path, steps: int = 30) -> tuple[Path, dict]:
    rng = random.Random(0)
    truth = {}
    for arm in ("gspo", "grpo"):
        for seed in (1, 2, 3):
            rows = []
            for step in range(steps):
                rows.append({"step": step, "reward/mean": rng.random(),
                             "routing/change_rate": rng.random() / 100,
                             "routing/change_rate/layer_0": rng.random() / 100,
                             "routing/change_rate/layer_1": rng.random() / 10,
                             "optim/grad_norm": rng.random(), "perf/step_s": 1.0})
            if arm == "grpo" and seed == 2:  # reward falls to a quarter of its start: collapsed
                for r in rows[-10:]:
                    r["reward/mean"] = 0.01
                for r in rows[:10]:
                    r["reward/mean"] = 0.9
            truth[(arm, seed)] = rows
            _write_run(tmp_path / arm / f"seed_{seed}", rows,
                       {"accuracy_before": 0.2, "accuracy_after": 0.3})
    settings = {"title": "t", "arms": ["gspo", "grpo"], "seeds": [1, 2, 3],
                "arm_overrides": {"gspo": [], "grpo": ["--loss.variant=grpo"]},
                "command": "run_study.py", "recipe": "r.yaml", "common": [], "jobs": 2,
                "machine": "m", "wall_s": {"total": 60.0, "sft": 6.0}, "date": "d", "commit": "c"}
    (tmp_path / "study_settings.json").write_text(json.dumps(settings))
    return tmp_path, truth


def test_bands_table_depth_profile_and_collapse_rule(tmp_path):
    report = _report_module()
    runs, truth = _study(tmp_path / "runs")
    study = report.load_study(str(runs))
    assert list(study) == ["gspo", "grpo"] and [r["seed"] for r in study["grpo"]] == [1, 2, 3]

    # Band at step 7: mean / min / max over seeds of each seed's centred 5-step average.
    xs, mean, low, high = report.band(study["gspo"], "reward/mean")
    smoothed = [sum(r["reward/mean"] for r in truth[("gspo", s)][5:10]) / 5 for s in (1, 2, 3)]
    i = xs.index(7)
    assert mean[i] == pytest.approx(sum(smoothed) / 3)
    assert (low[i], high[i]) == (pytest.approx(min(smoothed)), pytest.approx(max(smoothed)))

    layers, profiles = report.depth_profile(study["grpo"], "routing/change_rate")
    assert layers == [0, 1]
    want = sum(r["routing/change_rate/layer_1"] for r in truth[("grpo", 3)]) / 30
    assert profiles[2][1] == pytest.approx(want)

    assert [report.collapsed(r) for r in study["grpo"]] == [False, True, False]
    assert not any(report.collapsed(r) for r in study["gspo"])

    rows = {label: cells for label, _, cells in report.summary_rows(study)}
    assert rows["seeds"] == ["3", "3"] and rows["seeds collapsed"] == ["0", "1"]
    deep = [sum(r["routing/change_rate/layer_1"] + r["routing/change_rate/layer_0"]
                for r in truth[("gspo", s)]) / 60 for s in (1, 2, 3)]
    assert rows["routes changed, mean over the 4 updates, deepest 2 layers"][0] == (
        f"{sum(deep) / 3:.2%} ({min(deep):.2%}..{max(deep):.2%})")


def test_report_writes_every_plot(tmp_path):
    pytest.importorskip("matplotlib")
    report = _report_module()
    runs, _ = _study(tmp_path / "runs")
    path = report.write_report(str(runs), str(tmp_path / "out"))
    text = Path(path).read_text()
    for name in ("depth_profile.png", "curves.png", "flip_vs_ratio.png", "change_rate_heatmap.png"):
        assert f"![{name}]({name})" in text and (tmp_path / "out" / name).stat().st_size > 0
    assert "| seeds collapsed | 0 | 1 |" in text
    record = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert record["table"]["seeds"] == {"gspo": "3", "grpo": "3"} and record["settings"]["commit"] == "c"


def test_staleness_arms_name_their_placement_and_share_their_arm_colour():
    spec = importlib.util.spec_from_file_location("routing_study_run",
                                                  ROOT / "examples" / "routing_study" / "run_study.py")
    run_study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_study)
    assert run_study.split_arm("grpo_r3_s4") == ("grpo_r3", 4)
    assert run_study.split_arm("gspo_stress") == ("gspo_stress", 0)
    assert run_study.split_arm("gspo_s10") == ("gspo", 10)
    styles = _report_module()._styles(["gspo", "grpo", "gspo_s1", "grpo_s4", "gspo_stress"])
    assert styles["gspo_s1"]["color"] == styles["gspo"]["color"] != styles["grpo"]["color"]
    assert [styles[a]["linestyle"] for a in ("gspo", "gspo_s1", "grpo_s4", "gspo_stress")] == \
        ["-", "--", ":", "--"]


def test_every_registered_loss_is_an_arm_and_loads():
    """SAPO and CISPO are default arms; any registered loss is an arm ``<variant>[_r2|_r3]`` at
    its paper defaults, and every arm's overrides load as a valid recipe."""
    from gspo_megatron.algorithms import LOSSES
    from gspo_megatron.config.loader import load_config

    spec = importlib.util.spec_from_file_location("routing_study_run",
                                                  ROOT / "examples" / "routing_study" / "run_study.py")
    run_study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_study)
    assert {"gspo", "grpo", "sapo", "cispo"} <= set(run_study.ARMS)
    reset = run_study.LOSS_DEFAULTS
    assert "--loss.clip_low=null" in reset and "--loss.tau_pos=null" in reset
    assert run_study.arm_base("geo_mean_r3") == ["--loss.variant=geo_mean", *reset,
                                                 "--routing.replay=r3"]
    assert run_study.arm_base("sapo_r2") == ["--loss.variant=sapo", *reset, "--routing.replay=r2"]
    assert run_study.arm_base("grpo_r2") == run_study.ARMS["grpo_r2"]
    assert run_study.arm_base("ppo") is None and run_study.arm_base("sapo_r4") is None
    recipe = str(ROOT / run_study.RECIPE)
    for arm in [*run_study.ARMS, *LOSSES, *(f"{v}_r3" for v in LOSSES)]:
        cfg = load_config(recipe, run_study.arm_base(arm)).loss
        variant = arm.removesuffix("_r2").removesuffix("_r3")
        if variant in LOSSES and variant not in ("gspo", "grpo"):  # at the paper's defaults
            assert cfg.variant == variant and cfg.params == LOSSES[variant].params(), arm
