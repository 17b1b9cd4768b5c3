"""The frontier study (examples/routing_study/frontier*.py) on synthetic metrics: the stop rule
fires at the step it states and only then, a run is stable / degraded / collapsed as stated, the
largest stable setting is the largest value with every smaller one stable too, the watcher reads a
growing metrics file, the report's frontier matches a grid built to have a known answer, and bad
command lines exit 2 with one line."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUDY = ROOT / "examples" / "routing_study"


def _module(name: str):
    sys.path.insert(0, str(STUDY))
    spec = importlib.util.spec_from_file_location(name, STUDY / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up; the siblings import it by name
    spec.loader.exec_module(module)
    return module


rules = _module("frontier_rules")


def _rows(rewards, grad=1.0, entropy=0.1, **extra):
    """One row per step: ``rewards[i]``, a constant gradient norm and entropy unless lists."""
    def at(v, i):
        return v[i] if isinstance(v, list) else v
    return [{"step": i, "reward/mean": r, "optim/grad_norm": at(grad, i),
             "entropy/mean": at(entropy, i), "loss/total": 0.1,
             **{k: at(v, i) for k, v in extra.items()}} for i, r in enumerate(rewards)]


RULE = rules.StabilityRule(window=3, final_window=4, reward_collapse=0.5, grad_norm_limit=10.0,
                           entropy_collapse=0.1, reward_margin=0.05)


def test_healthy_run_is_stable():
    rows = _rows([0.4, 0.45, 0.5, 0.5, 0.55, 0.6, 0.6, 0.62], entropy=[0.1, 0.09, 0.08, 0.07,
                                                                          0.06, 0.05, 0.05, 0.04])
    assert RULE.collapse(rows) is None
    v = RULE.verdict(rows)
    assert v.status == "stable" and v.stable and v.final_reward == pytest.approx(0.5925)


def test_reward_halving_fires_at_the_first_full_window_below_half():
    # windows (3 steps) from step 2: means 0.267, 0.167 (< 0.5 x 0.4 = 0.2) -> step 3
    rows = _rows([0.4, 0.3, 0.1, 0.1, 0.0, 0.0])
    reason, step = RULE.collapse(rows)
    assert step == 3 and reason.startswith("reward")
    assert RULE.collapse(rows[:3]) is None  # evaluated on what is there so far: no stop yet
    # against a measured start instead of a lucky step 0: 0.2 x 2 is not below half of 0.25
    lucky = _rows([0.6, 0.2, 0.2, 0.2, 0.2, 0.2])
    assert RULE.collapse(lucky) is not None and RULE.collapse(lucky, start_reward=0.25) is None
    assert RULE.verdict(rows).status == "collapsed"


def test_gradient_explosion_and_non_finite():
    rows = _rows([0.4] * 6, grad=[1.0, 1.0, 5.0, 30.0, 40.0, 50.0])
    assert RULE.collapse(rows)[1] == 3 and "gradient" in RULE.collapse(rows)[0]  # (1+5+30)/3 > 10
    # the limit is absolute: a tiny step-0 norm (a batch of tied groups) is no reference
    assert RULE.collapse(_rows([0.4] * 8, grad=[0.03] + [0.6] * 7)) is None
    rows = _rows([0.4] * 4, grad=[1.0, math.nan, 1.0, 1.0])
    assert RULE.collapse(rows) == ("non-finite optim/grad_norm", 1)
    rows = _rows([0.4] * 4, **{"faults/skipped_updates": [0, 0, 1, 0]})
    assert RULE.collapse(rows) == ("update skipped as non-finite", 2)


def test_entropy_collapse_only_without_reward_gain():
    sharp = [0.1, 0.05, 0.005, 0.001, 0.001, 0.001]
    assert RULE.collapse(_rows([0.4, 0.5, 0.6, 0.7, 0.8, 0.8], entropy=sharp)) is None
    hit = RULE.collapse(_rows([0.4, 0.4, 0.35, 0.3, 0.3, 0.3], entropy=sharp))
    assert hit is not None and hit[0].startswith("entropy") and hit[1] == 4  # 0.0023 < 0.01


def test_degraded_against_the_study_start_and_failed_runs():
    rows = _rows([0.4, 0.38, 0.36, 0.35, 0.34, 0.33, 0.33])
    assert RULE.collapse(rows) is None
    assert RULE.verdict(rows).status == "degraded"  # 0.3375 < 0.4 - 0.05
    assert RULE.verdict(rows, start_reward=0.35).status == "stable"  # the study's start instead
    v = RULE.verdict(_rows([0.4] * 6), failed=True)
    assert v.status == "collapsed" and "non-finite" in v.reason
    assert RULE.verdict([], failed=False).status == "degraded"


def test_largest_stable_needs_every_smaller_value_stable():
    best, per_seed = rules.largest_stable({1: [True, True, True], 3: [True, False, True],
                                           10: [False, True, True], 30: [False, False, False]})
    assert best == 1 and per_seed == [3, 1, 10]  # seed 2's stable x10 above its unstable x3: no
    best, per_seed = rules.largest_stable({4: [False, True], 8: [True, True]})
    assert best is None and per_seed == [None, 8]
    assert rules.largest_stable({}) == (None, [])


def test_metrics_tail_reads_growing_file(tmp_path):
    frontier = _module("frontier")
    path = tmp_path / "metrics.jsonl"
    tail = frontier.MetricsTail(str(path))
    assert tail.read() == []
    path.write_text(json.dumps({"step": 0}) + "\n" + '{"step": 1')  # a partial last line
    assert [r["step"] for r in tail.read()] == [0]
    with open(path, "a") as f:
        f.write(', "reward/mean": 0.5}\n')
    assert [r["step"] for r in tail.read()] == [0, 1]


@pytest.mark.parametrize("argv, message", [
    (["--lr-factors", "1,x"], "--lr-factors: expected comma-separated numbers"),
    (["--updates", "5"], "do not divide the rollout batch of 64"),
    (["--arms", "gspo,nope"], "--arms: unknown arm(s) ['nope']"),
    (["--steps", "0"], "--steps: must be >= 1"),
])
def test_bad_command_line_exits_2_with_one_line(argv, message, capsys):
    frontier = _module("frontier")
    with pytest.raises(SystemExit) as err:
        frontier.parse(argv)
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def _synthetic_study(root: Path, collapse_at: dict) -> None:
    """Arms x lr x updates x seeds; a run collapses (reward to 0 from step 3) where
    ``collapse_at[arm](lr, updates, seed)`` is true, else learns."""
    size = dict(arms=list(collapse_at), lr_factors=[1.0, 3.0, 10.0], updates=[4, 16],
                seeds=[1, 2], steps=12, jobs=2)
    (root).mkdir(parents=True, exist_ok=True)
    (root / "frontier_settings.json").write_text(json.dumps({
        "title": "synthetic", "command": "frontier.py", "size": size,
        "rule": {"window": 3, "final_window": 4, "reward_collapse": 0.5, "grad_norm_limit": 10.0,
                 "entropy_collapse": 0.1, "reward_margin": 0.05},
        "common": [], "wall_s": {"sft": 0.0}, "machine": "test", "date": "today", "commit": "x"}))
    for arm, bad in collapse_at.items():
        for f in size["lr_factors"]:
            for n in size["updates"]:
                for s in size["seeds"]:
                    run = root / arm / f"lr_x{f:g}" / f"updates_{n}" / f"seed_{s}"
                    run.mkdir(parents=True)
                    down = bad(f, n, s)
                    rows = [{"step": i, "reward/mean": (0.0 if down and i >= 3 else 0.4 + 0.01 * i),
                             "optim/grad_norm": 1.0, "entropy/mean": 0.1, "loss/total": 0.1,
                             "routing/drift/after_1_updates": 0.001 * f * n,
                             "routing/drift/change_rate": 0.002 * f * n,
                             "routing/drift/change_rate/layer_0": 0.001 * f,
                             "routing/drift/change_rate/layer_1": 0.002 * f,
                             "routing/rollout/change_rate": 0.02,
                             "routing/abs_log_ratio_changed": 0.01 * f,
                             "routing/abs_log_ratio_unchanged": 0.002 * f,
                             "clip/token_fraction": 0.001}
                            for i in range(6 if down else size["steps"])]
                    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
                    (run / "verdict.json").write_text(json.dumps({"stopped": None, "failed": None}))


def test_report_frontier_on_a_known_grid(tmp_path):
    report = _module("frontier_report")
    _synthetic_study(tmp_path / "runs", {
        # gspo: stable up to x3 everywhere, seed 2 also at x10 with 4 updates
        "gspo": lambda f, n, s: f >= 10 and not (s == 2 and n == 4),
        # grpo: only x1 with 4 updates; seed 1 collapses at x3 / 16 updates only
        "grpo": lambda f, n, s: f >= 3 or n == 16,
    })
    settings, runs = report.load_runs(str(tmp_path / "runs"))
    assert len(runs) == 2 * 3 * 2 * 2
    report.judge(runs, rules.StabilityRule(**settings["rule"]))
    fr = report.arm_frontier(runs, "gspo", [1.0, 3.0, 10.0], [4, 16])
    assert fr["largest_stable_lr"][4] == {"all_seeds": 3.0, "per_seed": [3.0, 10.0]}
    assert fr["largest_stable_lr"][16] == {"all_seeds": 3.0, "per_seed": [3.0, 3.0]}
    assert fr["largest_stable_updates"][10.0] == {"all_seeds": None, "per_seed": [None, 4]}
    assert fr["stable_points"] == 4 and fr["stable_points_per_seed"] == [4, 5]
    fr = report.arm_frontier(runs, "grpo", [1.0, 3.0, 10.0], [4, 16])
    assert fr["largest_stable_lr"][4]["all_seeds"] == 1.0
    assert fr["largest_stable_lr"][16]["all_seeds"] is None and fr["stable_points"] == 1
    # a collapsed run's statistics stop at its collapse step
    run = next(r for r in runs if r["arm"] == "grpo" and r["lr_factor"] == 10.0)
    assert run["verdict"].status == "collapsed" and run["verdict"].step == 4

    # a factor not run on every seed is left out of the frontier, not counted as unstable
    cut = [r for r in runs if not (r["arm"] == "gspo" and r["lr_factor"] == 3.0 and r["seed"] == 2
                                   and r["updates"] == 16)]
    fr = report.arm_frontier(cut, "gspo", [1.0, 3.0, 10.0], [4, 16])
    assert fr["left_out"] == [3.0] and fr["largest_stable_lr"][4]["per_seed"] == [1.0, 10.0]

    path = report.write_report(str(tmp_path / "runs"), str(tmp_path / "out"))
    text = Path(path).read_text()
    assert "| gspo | x3 (x3..x10) | x3 (x3) |" in text
    for png in ("stability_map.png", "route_change_vs_lr.png", "layer_heatmaps.png"):
        assert (tmp_path / "out" / png).stat().st_size > 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["frontier"]["grpo"]["stable_points"] == 1


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_point_of_each_size_is_a_valid_config(device):
    """A point the config refuses would cost a lent GPU's minutes: the warm-up and every arm at
    the largest lr and most updates of each size load and validate here."""
    from gspo_megatron.config.loader import load_config
    from gspo_megatron.config.validation import validate_config

    frontier = _module("frontier")
    size = frontier.SIZES[device]
    common = frontier.common_overrides(size)
    recipe = ROOT / "examples" / "configs" / "routing_study.yaml"
    validate_config(load_config(recipe, [*common, f"--sft.steps={size.sft_steps}", "--trainer.steps=0"]),
                    world_size=1, check_paths=False)
    for arm in size.arms:
        point = frontier.Point(arm, size.lr_factors[-1], size.updates[-1], size.seeds[0])
        overrides = [*common, *frontier.point_overrides(point, size, "/nonexistent")]
        cfg = load_config(recipe, overrides)
        validate_config(cfg, world_size=1, check_paths=False)
        assert cfg.trainer.num_minibatches * cfg.trainer.micro_batch_size == size.batch
        assert cfg.rollout.prompts_per_step * cfg.rollout.group_size == size.batch
