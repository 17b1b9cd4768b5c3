"""The mismatch frontier's command (examples/routing_study/mismatch_frontier.py) without running
it: every (source, arm) cell is a configuration the trainer accepts, the noise calibration finds
the scale of a known power law, the report counts a synthetic grid built to have a known answer,
and bad command lines exit 2 with one line."""

import json
import math

import pytest

from tests.unit.test_routing_frontier import ROOT, _module, _rows


def test_every_cell_is_a_valid_config():
    from gspo_megatron.config.loader import load_config
    from gspo_megatron.config.validation import validate_config

    mf = _module("mismatch_frontier")
    frontier = _module("frontier")
    size = frontier.SIZES["cpu"]
    common = [a for a in frontier.common_overrides(size, "fp32")
              if not a.startswith("--rollout.precision=")]
    recipe = ROOT / "examples" / "configs" / "routing_study.yaml"
    assert sorted(mf.RUN_ORDER) == sorted(mf.SOURCES)  # every source runs
    sources, std = list(mf.SOURCES), 0.01
    # every arm and every source at least once (the 48 cells take ~25 s to validate)
    for i, (arm, (base, extra)) in enumerate(mf.ARMS.items()):
        source = sources[i % len(sources)]
        point = frontier.Point(base, 3.0, 4, 1)
        cfg = load_config(recipe, [*common, *mf.source_overrides(source, std),
                                   *extra, *frontier.point_overrides(point, size, "/x")])
        validate_config(cfg, world_size=1, check_paths=False)
        precision = {"zero": "fp32", "fp32": "fp32", "bf16": "bf16"}.get(source, "fp8")
        assert cfg.rollout.precision == precision
        assert cfg.precision.batch_invariant == (source == "zero")
        assert cfg.rollout.router_noise_std == {"fp8_noise": std,
                                                "fp8_noise_x3": 3 * std}.get(source, 0.0)


def test_calibration_recovers_a_power_law():
    mf = _module("mismatch_frontier")
    law = lambda s: 4.0 * s ** 0.9  # noqa: E731  disagreement vs noise scale
    points = [(s, law(s)) for s in mf.CALIBRATION_STDS]
    for target in (0.02, 0.05, 0.10):  # inside, and outside (extrapolated), the measured range
        std = mf.interpolate_std(points, target)
        assert math.isclose(law(std), target, rel_tol=1e-9)
    with pytest.raises(ValueError, match="two scales"):
        mf.interpolate_std([(0.01, 0.0), (0.02, 0.05)], 0.1)


def _study(root, collapse) -> None:
    """A finished 2 sources x 2 arms x 2 seeds study under ``root``: ``collapse(source, arm,
    seed)`` says which runs' rewards fall to 0 from step 3 on."""
    mf = _module("mismatch_frontier")
    settings = {"command": "x", "device": "cpu", "smoke": False, "sources": ["zero", "bf16"],
                "arms": ["grpo", "gspo"], "seeds": [1, 2], "lr_factor": 3.0, "lr": 1.5e-4,
                "updates": 4, "steps": 12, "jobs": 2, "noise_std": 0.01, "calibration": None,
                "source_overrides": {s: mf.SOURCES[s] for s in ("zero", "bf16")},
                "arm_overrides": {"grpo": [], "gspo": []},
                "base_arms": {"grpo": "grpo", "gspo": "gspo"}, "common": [],
                "start_reward": 0.4, "wall_s": {"total": 60.0}, "machine": "2 CPU cores",
                "date": "today", "commit": "abc"}
    (root).mkdir(parents=True)
    (root / "mismatch_settings.json").write_text(json.dumps(settings))
    report = _module("mismatch_report")
    for source in settings["sources"]:
        kl = 0.0 if source == "zero" else 1e-4
        for arm in settings["arms"]:
            for seed in settings["seeds"]:
                rewards = [0.5] * 12 if not collapse(source, arm, seed) else [0.5] * 3 + [0.0] * 9
                run = root / report.run_dir_of(settings, source, arm, seed)
                run.mkdir(parents=True)
                rows = _rows(rewards, **{"kl/rollout_vs_train": kl,
                                         "routing/rollout/change_rate": 0.0 if kl == 0 else 0.02})
                (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
                (run / "verdict.json").write_text(json.dumps({"stopped": None, "failed": None,
                                                              "wall_s": 1.0}))


def test_report_on_a_known_grid(tmp_path):
    _study(tmp_path / "runs", lambda source, arm, seed: source == "bf16" and arm == "grpo"
           and seed == 2)
    report = _module("mismatch_report")
    path = report.write_report(str(tmp_path / "runs"), str(tmp_path / "out"))
    text = open(path).read()
    assert "| zero | 2/0/0, 0.500 (0.500..0.500) | 2/0/0, 0.500 (0.500..0.500) |" in text
    # the collapsed seed's final reward: the rule's last 10 steps, [0.5] + [0.0] * 9
    assert "| bf16 | 1/0/1, 0.275 (0.050..0.500) | 2/0/0, 0.500 (0.500..0.500) |" in text
    summary = json.load(open(tmp_path / "out" / "summary.json"))
    assert summary["mismatch_per_source"]["zero"]["kl"] == 0.0
    assert math.isclose(summary["mismatch_per_source"]["bf16"]["disagreement"], 0.02)
    for png in ("collapse_map.png", "mismatch_per_source.png"):
        assert (tmp_path / "out" / png).stat().st_size > 0


@pytest.mark.parametrize("argv, message", [
    (["--sources", "bf16,fp4"], "--sources: unknown ['fp4']"),
    (["--arms", "grpo,ppo"], "--arms: unknown ['ppo']"),
    (["--noise-std", "0"], "--noise-std: must be > 0"),
    (["--target-disagreement", "1.5"], "--target-disagreement: a share in (0, 1)"),
    (["--updates", "5"], "--updates: 5 does not divide the rollout batch of 64"),
])
def test_bad_command_line_exits_2_with_one_line(argv, message, capsys):
    mf = _module("mismatch_frontier")
    with pytest.raises(SystemExit) as err:
        mf.main(argv)
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
