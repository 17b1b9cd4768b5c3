"""Smoke test of the benchmark code (tools/bench): every benchmark runs at toy sizes in this
process and produces a well-formed record, table and JSON report. Timings are not checked."""

import json

import pytest

pytest.importorskip("psutil")
pytest.importorskip("transformers")

from tools.bench import BENCHMARKS  # noqa: E402
from tools.bench.__main__ import format_table, main  # noqa: E402
from tools.bench.common import validate_result  # noqa: E402


def test_every_benchmark_runs_at_toy_size(tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["--smoke", "--in-process", "--out", str(out)])
    report = json.loads(out.read_text())
    errors = [r for r in report["benchmarks"] if r.get("error")]
    assert rc == 0 and not errors, errors
    assert [r["name"] for r in report["benchmarks"]] == list(BENCHMARKS)
    assert report["schema"] == 1 and report["smoke"] is True and "machine" in report
    for res in report["benchmarks"]:
        validate_result(res)
        assert all(isinstance(v, (int, float)) for v in res["ratios"].values())
    by_name = {r["name"]: r for r in report["benchmarks"]}
    assert {"train_time_ours_vs_naive", "train_mem_ours_x_logits"} <= set(by_name["logprobs"]["ratios"])
    assert "gspo_vs_ce" in by_name["update_step"]["ratios"]
    assert "ours_vs_hf_tokens_per_s" in by_name["rollout"]["ratios"]
    assert by_name["rollout"]["rows"][-1]["value"] == 1.0  # greedy tokens identical to HF's
    assert by_name["rl_step"]["met"] is None and by_name["rl_step"]["rows"]
    table = format_table(report)
    for name in BENCHMARKS:
        assert name in table


def test_validate_result_rejects_malformed():
    with pytest.raises(ValueError):
        validate_result({"name": "x"})
    good = {"name": "x", "title": "", "target": "", "met": None, "ratios": {}, "config": {},
            "notes": [], "seconds": 0.0, "rows": [{"metric": "m", "value": 1.0, "unit": "s"}]}
    validate_result(good)
    with pytest.raises(ValueError):
        validate_result(dict(good, rows=[{"metric": "m", "value": [1]}]))
