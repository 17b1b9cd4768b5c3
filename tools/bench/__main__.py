"""``python -m tools.bench``: run the benchmarks, print one table, write one JSON file.

    PYTHONPATH=. OMP_NUM_THREADS=1 python -m tools.bench                 # the CPU set (make bench)
    python -m tools.bench --only logprobs,update_step --out runs/bench/x.json
    python -m tools.bench --smoke --in-process                           # toy sizes (the unit test)

Each benchmark runs in its own fresh process by default (clean Megatron state, no memory carried
over); ``--in-process`` runs them all in this one (used by the smoke test). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from gspo_megatron.tools.provenance import git_commit
from tools.bench import BENCHMARKS
from tools.bench.common import (SCHEMA_VERSION, load_average, machine, make_result, now,
                                row, run_child, validate_result)


def run_benchmarks(names: list[str], smoke: bool = False, in_process: bool = False) -> dict:
    report = {"schema": SCHEMA_VERSION, "date": now(), "commit": git_commit(("gspo_megatron", "tools")),
              "machine": machine(),
              "command": " ".join(["python -m tools.bench", *sys.argv[1:]]),
              "smoke": smoke, "load_average_start": load_average(), "benchmarks": []}
    for name in names:
        t = time.perf_counter()
        la = load_average()
        try:
            if in_process:
                import importlib

                mod = importlib.import_module(f"tools.bench.{name}")
                res = mod.run(smoke=smoke)
            else:
                res = run_child(f"tools.bench.{name}", ["--smoke"] if smoke else [])
        except Exception as exc:  # noqa: BLE001 - one failing benchmark must not hide the others
            res = make_result(name, name, "", None, [row("error", str(exc)[-300:], "")],
                              notes=[f"failed: {type(exc).__name__}"])
            res["error"] = True
        res["seconds"] = round(time.perf_counter() - t, 2)
        res["load_average"] = la
        validate_result(res)
        report["benchmarks"].append(res)
        print(f"[bench] {name}: {res['seconds']:.1f} s", file=sys.stderr, flush=True)
    report["load_average_end"] = load_average()
    return report


def format_table(report: dict) -> str:
    lines = [f"benchmarks {report['date']}  commit {report.get('commit', '?')}  load avg start {report['load_average_start']} "
             f"end {report['load_average_end']}"]
    w = 62
    lines.append(f"{'benchmark':<14} {'metric':<{w}} {'value':>12} unit")
    lines.append("-" * (14 + w + 24))
    for res in report["benchmarks"]:
        for r in res["rows"]:
            v = r["value"]
            vs = "-" if v is None else (f"{v:.4g}" if isinstance(v, (int, float)) else str(v))
            lines.append(f"{res['name']:<14} {r['metric'][:w]:<{w}} {vs:>12} {r['unit']}")
        status = {True: "MET", False: "MISSED", None: "n/a"}[res["met"]]
        lines.append(f"{res['name']:<14} target: {res['target']} -> {status}  ({res['seconds']} s)")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    ap.add_argument("--smoke", action="store_true", help="toy sizes: checks the code, not timings")
    ap.add_argument("--in-process", action="store_true", help="run every benchmark in this process")
    ap.add_argument("--out", default="docs/results/bench.json",
                    help="JSON report path (the committed record: docs/results/bench.json)")
    args = ap.parse_args(argv)
    names = list(BENCHMARKS) if not args.only else [n.strip() for n in args.only.split(",")]
    unknown = set(names) - set(BENCHMARKS)
    if unknown:
        ap.error(f"unknown benchmark(s) {sorted(unknown)}; choose from {list(BENCHMARKS)}")
    report = run_benchmarks(names, smoke=args.smoke, in_process=args.in_process)
    print(format_table(report))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.out}")
    return 1 if any(r.get("error") for r in report["benchmarks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
