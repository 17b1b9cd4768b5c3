"""``gspo-report`` on run directories written by hand: bad input is one line naming the file (and
line), exit code 2 and nothing written; metrics a run did not log leave their plot out with a
line saying why; the page is self-contained."""

import json
import os
import subprocess
import sys

import pytest

from gspo_megatron.tools import report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_run(path, records=None, summary=None, config=None):
    path.mkdir(parents=True, exist_ok=True)
    if records is not None:
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    if config is not None:
        (path / "config.yaml").write_text(config)
    return path


def rewards_only(n=5):
    return [{"step": s, "time": 1.0 + s, "reward/mean": 0.1 * s} for s in range(n)]


def bad(tmp_path, capsys, *args):
    """Run gspo-report on bad input: its exit code and its one stderr line; nothing written."""
    out = tmp_path / "out"
    code = report.main([*map(str, args), "--out", str(out)])
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1, captured
    assert not out.exists()
    return code, captured.err.strip()


def test_bad_run_directories(tmp_path, capsys):
    good = make_run(tmp_path / "good", rewards_only())
    assert bad(tmp_path, capsys, good, tmp_path / "nope") == (
        2, f"gspo-report: error: {tmp_path / 'nope'}: not a directory")
    (tmp_path / "file.txt").write_text("x")
    assert bad(tmp_path, capsys, tmp_path / "file.txt") == (
        2, f"gspo-report: error: {tmp_path / 'file.txt'}: not a directory")
    empty = make_run(tmp_path / "empty")
    assert bad(tmp_path, capsys, empty) == (
        2, f"gspo-report: error: {empty}: no metrics.jsonl (not a gspo-train run directory?)")


@pytest.mark.parametrize("text,where,what", [
    ('{"step": 0, "reward/mean": 0.1}\n{"step": 1, "reward/mean": \n', 2,
     "not a JSON object (Expecting value, column 28)"),
    ('{"step": 0}\n\n{"reward/mean": 1}\n', 3, "not a metrics record (no integer 'step')"),
    ('[1, 2]\n', 1, "not a metrics record (no integer 'step')"),
    ('{"step": "3"}\n', 1, "not a metrics record (no integer 'step')"),
])
def test_a_malformed_line_is_named(tmp_path, capsys, text, where, what):
    run = make_run(tmp_path / "run")
    (run / "metrics.jsonl").write_text(text)
    code, err = bad(tmp_path, capsys, run)
    assert (code, err) == (2, f"gspo-report: error: {run / 'metrics.jsonl'}:{where}: {what}")


def test_other_bad_files(tmp_path, capsys):
    empty_log = make_run(tmp_path / "a", [])
    assert bad(tmp_path, capsys, empty_log)[1].endswith(
        f"{empty_log / 'metrics.jsonl'}: no steps logged")
    summary = make_run(tmp_path / "b", rewards_only())
    (summary / "summary.json").write_text('{"accuracy_after": 0.5,}')
    assert bad(tmp_path, capsys, summary)[1] == (
        f"gspo-report: error: {summary / 'summary.json'}:1: not valid JSON (Expecting property "
        "name enclosed in double quotes)")
    config = make_run(tmp_path / "c", rewards_only(), config="loss:\n  variant: [gspo\nmodel: {}\n")
    code, err = bad(tmp_path, capsys, config)
    assert code == 2 and err.startswith(f"gspo-report: error: {config / 'config.yaml'}:3: not valid YAML")
    binary = make_run(tmp_path / "d")
    (binary / "metrics.jsonl").write_bytes(b"\xff\xfe\x00")
    assert bad(tmp_path, capsys, binary)[1].endswith("metrics.jsonl: not a text file")


def test_bad_options(tmp_path, capsys):
    run = make_run(tmp_path / "run", rewards_only())
    assert bad(tmp_path, capsys, run, "--names", "a,b") == (
        2, "gspo-report: error: --names gives 2 names for 1 runs")
    (tmp_path / "out").write_text("a file")
    code = report.main([str(run), "--out", str(tmp_path / "out")])
    assert code == 2 and capsys.readouterr().err == (
        f"gspo-report: error: --out {tmp_path / 'out'}: not a directory\n")


def test_the_command_prints_no_traceback(tmp_path):
    """The console script's module run as a process: the one line, exit code 2."""
    run = make_run(tmp_path / "run")
    (run / "metrics.jsonl").write_text('{"step": 0}\n{oops\n')
    proc = subprocess.run([sys.executable, "-m", "gspo_megatron.tools.report", str(run)],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"gspo-report: error: {run / 'metrics.jsonl'}:2: not a JSON object "
                           "(Expecting property name enclosed in double quotes, column 2)\n")
    assert not (run / "report").exists()


def test_without_matplotlib_one_line_and_nothing_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    run = make_run(tmp_path / "run", rewards_only())
    assert bad(tmp_path, capsys, run) == (
        1, "gspo-report: error: matplotlib is not installed (pip install matplotlib); no report "
           "written")


def test_metrics_not_logged_leave_their_plot_out_with_the_reason(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = make_run(tmp_path / "run", rewards_only())
    assert report.main([str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    out = run / "report"
    assert lines[-1] == f"gspo-report: wrote {out / 'report.html'} (1 plots)"
    assert lines[:-1] == [
        "gspo-report: not plotted: Response length: no run logged response/mean_length",
        "gspo-report: not plotted: Clip fraction: no run logged clip/fraction",
        "gspo-report: not plotted: Rollout engine vs trainer: no run logged kl/rollout_vs_train",
        "gspo-report: not plotted: Gradient norm: no run logged optim/grad_norm",
        "gspo-report: not plotted: Time per phase: no run logged perf/*_s",
        "gspo-report: not plotted: Route change per MoE layer: no run logged "
        "routing/*/change_rate/layer_i (per MoE layer: routing.diagnostics or routing.replay)",
        "gspo-report: not plotted: Expert load: no run logged routing/load/layer_i/expert_e or "
        "routing/load_imbalance (routing.diagnostics)",
    ]
    assert sorted(os.listdir(out)) == ["report.html", "reward_accuracy.png"]
    page = (out / "report.html").read_text()
    assert "Not plotted" in page and "no run logged clip/fraction" in page
    # a later report of a run that logs less drops the PNG it no longer draws
    (out / "clip_fraction.png").write_bytes(b"an earlier report's")
    assert report.main([str(run)]) == 0
    assert not (out / "clip_fraction.png").exists()


def test_non_finite_values_as_metrics_jsonl_writes_them_are_left_out_of_lines(tmp_path, capsys):
    """MetricsLogger writes NaN / inf as strings ("nan"): the lines skip them, nothing fails."""
    pytest.importorskip("matplotlib")
    records = rewards_only(4)
    records[2]["reward/mean"] = "nan"
    records[3]["optim/grad_norm"] = "inf"
    run = make_run(tmp_path / "run", records)
    assert report.main([str(run)]) == 0
    assert report.series(report.load_run(str(run), "run").rows, "reward/mean") == (
        [0, 1, 3], [0.0, 0.1, pytest.approx(0.3)])
    assert "Gradient norm: no run logged optim/grad_norm" in capsys.readouterr().out


def test_run_names_tell_runs_apart():
    assert report.run_names(["runs/gspo", "runs/grpo/"]) == ["gspo", "grpo"]
    assert report.run_names(["a/demo", "b/demo"]) == ["a/demo", "b/demo"]
    assert report.run_names(["x/demo", "x/demo"]) == ["demo (1)", "demo (2)"]


def test_smoothing_is_a_trailing_mean():
    assert report.smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert report.smooth([2.0], 5) == [2.0]
