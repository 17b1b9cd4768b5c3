"""``logging.tensorboard_dir`` on real runs of ``gspo-train`` (the tiny recipe, CPU): the event
files, read back with TensorBoard's reader, hold every metric of ``metrics.jsonl`` at its step,
and a run killed after a checkpoint then resumed holds each step once.

One run for both tests: 4 steps with checkpoints every 2 and an evaluation at step 1, killed at
the start of step 3 (step 2 logged after the step-2 checkpoint), then resumed. (An uninterrupted
run of its own proved nothing more: steps 0-1 here are written by one process straight through.)"""

import pytest

from gspo_megatron.metrics import read_metrics
from tests.e2e.test_train_e2e import gspo_train
from tests.helpers.tensorboard import as_logged, tensorboard_scalars

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """``(run dir, TensorBoard dir, the steps the reader showed after the kill)``."""
    base = tmp_path_factory.mktemp("tensorboard")
    run, tb = base / "run", base / "tb"
    # (eval_interval 2: the step-1 held-out accuracy is logged too)
    steps = ["--trainer.steps=4", "--checkpoint.save_interval=2", "--trainer.eval_interval=2",
             f"--logging.tensorboard_dir={tb}"]
    killed = gspo_train(run, *steps, env_extra={"GSPO_FAULT": "step_start:3"}, check=False)
    assert killed.returncode != 0
    after_kill = [s for s, _, _ in tensorboard_scalars(tb)["reward/mean"]]
    assert "resumed from" in gspo_train(run, *steps).stdout
    return run, tb, after_kill


def test_event_files_hold_every_metric_of_metrics_jsonl(resumed_run):
    run, tb, _ = resumed_run
    records = read_metrics(run / "metrics.jsonl")
    got = tensorboard_scalars(tb)
    assert got == as_logged(records)  # every tag, step, value (float32) and wall time
    assert {"reward/mean", "clip/fraction", "kl/rollout_vs_train", "optim/grad_norm",
            "perf/update_s", "eval/accuracy"} <= set(got)
    assert [s for s, _, _ in got["eval/accuracy"]] == [1]
    assert [s for s, _, _ in got["reward/mean"]] == [0, 1, 2, 3]


def test_a_resumed_run_holds_each_step_once(resumed_run):
    """The resumed run logs steps 2 and 3; TensorBoard's reader shows each step once, with the
    values and times ``metrics.jsonl`` keeps (the resumed run's step 2, not the killed one's)."""
    run, tb, after_kill = resumed_run
    assert after_kill == [0, 1, 2]
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert tensorboard_scalars(tb) == as_logged(records)
    on_disk = tensorboard_scalars(tb, purge_orphaned_data=False)["reward/mean"]
    assert sorted(s for s, _, _ in on_disk) == [0, 1, 2, 2, 3]  # step 2 twice; the reader hides one
