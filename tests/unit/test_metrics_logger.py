"""MetricsLogger's TensorBoard output (``logging.tensorboard_dir``) read back with TensorBoard's
own reader: every numeric metric at its step, a resumed logger hiding the steps it redoes, and a
missing tensorboard package costing one warning, not the run."""

import logging
import sys

import numpy as np

from gspo_megatron.metrics import MetricsLogger, read_metrics
from tests.helpers.tensorboard import as_logged, tensorboard_scalars


def test_every_numeric_metric_is_a_scalar_at_its_step(tmp_path):
    tb = tmp_path / "tb"
    log = MetricsLogger(str(tmp_path / "run"), enabled=True, tensorboard_dir=str(tb), resume_step=-1)
    for step in range(3):
        log.log(step, {"reward/mean": 0.1 * step, "optim/grad_norm": np.float64(1.5 + step),
                       "kl/rollout_vs_train": 3e-14, "response/num_tokens": 40 + step,
                       "note": "not a number"})
    log.close()
    got = tensorboard_scalars(tb)
    assert got == as_logged(read_metrics(tmp_path / "run" / "metrics.jsonl"))
    assert set(got) == {"reward/mean", "optim/grad_norm", "kl/rollout_vs_train", "response/num_tokens"}


def test_a_resumed_logger_hides_the_steps_it_redoes(tmp_path):
    """Steps 0-3 logged, then a run resumed from the step-2 checkpoint (``resume_step=1``) logs
    2 and 3 again: the reader shows each step once, the second run's values for 2 and 3, as
    ``metrics.jsonl`` keeps them; the first run's events for 2 and 3 are still on disk."""
    run, tb = str(tmp_path / "run"), str(tmp_path / "tb")
    first = MetricsLogger(run, enabled=True, tensorboard_dir=tb, resume_step=-1)
    for step in range(4):
        first.log(step, {"reward/mean": float(step)})
    # (not closed: a killed process; each step was flushed when logged)
    resumed = MetricsLogger(run, enabled=True, tensorboard_dir=tb, resume_step=1)
    for step in (2, 3):
        resumed.log(step, {"reward/mean": 10.0 + step})
    resumed.close()
    got = tensorboard_scalars(tb)["reward/mean"]
    assert [(s, v) for s, v, _ in got] == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0)]
    assert got == as_logged(read_metrics(f"{run}/metrics.jsonl"))["reward/mean"]
    on_disk = tensorboard_scalars(tb, purge_orphaned_data=False)["reward/mean"]
    assert sorted(s for s, _, _ in on_disk) == [0, 1, 2, 2, 3, 3]


def test_only_the_logging_rank_writes(tmp_path):
    log = MetricsLogger(str(tmp_path / "run"), enabled=False, tensorboard_dir=str(tmp_path / "tb"))
    log.log(0, {"reward/mean": 1.0})
    log.close()
    assert not (tmp_path / "tb").exists() and not (tmp_path / "run").exists()


def test_without_tensorboard_one_warning_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with caplog.at_level(logging.WARNING, logger="gspo_megatron.metrics"):
        log = MetricsLogger(str(tmp_path / "run"), enabled=True,
                            tensorboard_dir=str(tmp_path / "tb"), resume_step=-1)
        log.log(0, {"reward/mean": 1.0})
        log.close()
    assert [r.getMessage() for r in caplog.records] == [
        "logging.tensorboard_dir is set but tensorboard is not installed (pip install "
        "tensorboard); no TensorBoard events"]
    assert read_metrics(tmp_path / "run" / "metrics.jsonl")[0]["reward/mean"] == 1.0
    assert not (tmp_path / "tb").exists()
