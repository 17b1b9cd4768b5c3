"""Compare two runs' ``metrics.jsonl`` (and ``summary.json``) field by field, bitwise.

    python tools/compare_runs.py RUN_A RUN_B [--ignore-prefix perf/ --ignore-prefix time]

Every record's fields are compared as exact JSON values except the ignored prefixes (``perf/`` and
``time`` by default: wall-clock figures). ``summary.json``'s accuracies too (``sft_s`` is a time).
Prints each difference (step, key, both values) and a last line ``N fields compared, M differ``;
exits 1 when anything differs. Used for behaviour-preserving refactors (the demo must not move).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def compare(run_a: str, run_b: str, ignore: tuple[str, ...]) -> tuple[int, list[str]]:
    a, b = _records(run_a), _records(run_b)
    diffs: list[str] = []
    if len(a) != len(b):
        diffs.append(f"record count: {len(a)} vs {len(b)}")
    compared = 0
    for ra, rb in zip(a, b):
        for key in sorted(set(ra) | set(rb)):
            if key.startswith(ignore):
                continue
            compared += 1
            if ra.get(key, "<missing>") != rb.get(key, "<missing>"):
                diffs.append(f"step {ra.get('step')}: {key}: {ra.get(key, '<missing>')!r} vs "
                             f"{rb.get(key, '<missing>')!r}")
    sa, sb = (os.path.join(r, "summary.json") for r in (run_a, run_b))
    if os.path.isfile(sa) and os.path.isfile(sb):
        with open(sa) as fa, open(sb) as fb:
            ja, jb = json.load(fa), json.load(fb)
        for key in sorted(set(ja) | set(jb)):
            if key.endswith("_s"):
                continue
            compared += 1
            if ja.get(key) != jb.get(key):
                diffs.append(f"summary: {key}: {ja.get(key)!r} vs {jb.get(key)!r}")
    return compared, diffs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_a")
    ap.add_argument("run_b")
    ap.add_argument("--ignore-prefix", action="append", default=None,
                    help="skip keys starting with this (default: perf/ and time)")
    args = ap.parse_args(argv)
    ignore = tuple(args.ignore_prefix or ("perf/", "time"))
    compared, diffs = compare(args.run_a, args.run_b, ignore)
    for d in diffs:
        print(d)
    print(f"{compared} fields compared, {len(diffs)} differ")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
