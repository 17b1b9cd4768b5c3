"""gspo-routing-report on a synthetic metrics.jsonl: the table averages each metric over the
steps that logged it (diagnostics every other step, drift every step), and a resumed run's
repeated step counts once."""

import json

import pytest

from gspo_megatron.tools.routing_report import main


def test_report_averages_over_the_steps_that_logged_each_metric(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = []
    for step in range(4):
        r = {"step": step, "reward/mean": 0.1 * step, "perf/step_s": 1.0,
             "routing/drift/after_1_updates": 0.01 * (step + 1),
             "routing/drift/change_rate": 0.02}
        if step % 2 == 0:  # diagnostics_interval = 2
            r.update({"routing/change_rate": 0.1 + step / 100, "routing/change_rate/layer_0": 0.1})
        rows.append(r)
    rows.append(dict(rows[-1], **{"routing/drift/after_1_updates": 0.04}))  # step 3 again (resume)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"accuracy_before": 0.25, "accuracy_after": 0.5}))

    assert main([str(run), "--out", str(tmp_path / "report"), "--no-plots", "--names", "a"]) == 0
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())[0]
    assert summary["steps"] == 4
    assert summary["change_rate"] == pytest.approx((0.10 + 0.12) / 2)  # steps 0 and 2 only
    assert summary["drift_1"] == pytest.approx((0.01 + 0.02 + 0.03 + 0.04) / 4)
    assert summary["acc_after"] == 0.5
    table = (tmp_path / "report" / "README.md").read_text()
    assert "| drift after 1 update (every step) | 0.0250 |" in table
    assert "| route change rate | 0.1100 |" in table


def test_report_has_the_rollout_mismatch_rows_and_plot(tmp_path):
    """R3 / mismatch-correction runs: the table carries the rollout-vs-trainer rows and, with
    matplotlib, the rollout_mismatch.png plot is written."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "reward/mean": 0.1, "kl/rollout_vs_train": 1e-4 * (s + 1),
             "routing/rollout/change_rate": 0.01, "routing/rollout/change_rate/layer_0": 0.02,
             "routing/rollout/change_rate/layer_1": 0.0, "routing/rollout/token_change_rate": 0.03,
             "correction/weight_mean": 1.0, "correction/masked_fraction": 0.25 * s}
            for s in range(2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([str(run), "--out", str(tmp_path / "table"), "--no-plots", "--names", "r3"]) == 0
    table = (tmp_path / "table" / "README.md").read_text()
    assert "| kl/rollout_vs_train | 1.50e-04 |" in table
    assert "| rollout vs trainer: tokens with a differing route | 0.0300 |" in table
    assert "| correction: masked share | 0.1250 |" in table
    pytest.importorskip("matplotlib")
    assert main([str(run), "--out", str(tmp_path / "report"), "--names", "r3"]) == 0
    assert (tmp_path / "report" / "rollout_mismatch.png").is_file()
