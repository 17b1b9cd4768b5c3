"""The mismatch frontier's command (examples/routing_study/mismatch_frontier.py) without running
it: every (source, arm) cell is a configuration the trainer accepts, the verdict table counts
stable seeds per cell, and bad command lines exit 2 with one line."""

import pytest

from tests.unit.test_routing_frontier import ROOT, _module


def test_every_cell_is_a_valid_config():
    from gspo_megatron.config.loader import load_config
    from gspo_megatron.config.validation import validate_config

    mf = _module("mismatch_frontier")
    frontier = _module("frontier")
    size = frontier.SIZES["cpu"]
    common = [a for a in frontier.common_overrides(size, "fp32")
              if not a.startswith("--rollout.precision=")]
    recipe = ROOT / "examples" / "configs" / "routing_study.yaml"
    sources = list(mf.SOURCES)
    # every arm and every source at least once (the 40 cells take ~20 s to validate)
    for i, (arm, (base, extra)) in enumerate(mf.ARMS.items()):
        source = sources[i % len(sources)]
        point = frontier.Point(base, 1.0, 4, 1)
        cfg = load_config(recipe, [*common, *mf.source_overrides(source, mf.NOISE_STD),
                                   *extra, *frontier.point_overrides(point, size, "/x")])
        validate_config(cfg, world_size=1, check_paths=False)
        assert cfg.rollout.precision == (source if source in ("fp32", "bf16") else "fp8")
        assert cfg.rollout.router_noise_std == {"fp8_noise": mf.NOISE_STD,
                                                "fp8_noise_x3": 3 * mf.NOISE_STD}.get(source, 0.0)


def test_table_counts_stable_seeds():
    mf = _module("mismatch_frontier")
    records = [{"source": "bf16", "arm": "gspo", "stopped": None, "failed": None},
               {"source": "bf16", "arm": "gspo", "stopped": "reward at step 3", "failed": None},
               {"source": "fp8", "arm": "gspo", "stopped": None, "failed": "exit 1: non-finite"}]
    text = mf.table(records, ("bf16", "fp8", "fp32"), ("gspo",))
    assert text.splitlines()[2:] == ["| bf16 | 1/2 |", "| fp8 | 0/1 |", "| fp32 | - |"]


@pytest.mark.parametrize("argv, message", [
    (["--sources", "bf16,fp4"], "--sources: unknown ['fp4']"),
    (["--arms", "grpo,ppo"], "--arms: unknown ['ppo']"),
    (["--noise-std", "0"], "--noise-std: must be > 0"),
    (["--updates", "5"], "--updates: 5 does not divide the rollout batch of 64"),
])
def test_bad_command_line_exits_2_with_one_line(argv, message, capsys):
    mf = _module("mismatch_frontier")
    with pytest.raises(SystemExit) as err:
        mf.main(argv)
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
