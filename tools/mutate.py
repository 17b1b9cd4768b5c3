"""Mutation check: plant known, plausible bugs in the algorithm code (and the two local-kernel bugs
docs/benchmarks.md cites) and show that a unit test catches each one.

Every mutant below names a file, an exact source snippet that must occur there exactly once (so a
mutant cannot silently rot when the code changes: the tool stops with an error naming it), its
buggy replacement, and the few unit tests (not marked slow) that should catch it. The tool copies
``gspo_megatron/``, ``tests/`` and the pytest/setup files into a temporary directory, checks that
every selection passes there unmutated, then plants one mutant at a time in the copy and runs its
tests (``PYTHONPATH`` and the working directory point at the copy). The working tree is never
written to, even if the tool is killed.

A mutant is *caught* when pytest exits 1 (failing tests); exit codes 2-5 (collection or usage
errors) are reported as ERROR, never as caught. Output: a Markdown table on stdout and a JSON
record (``--out``, default ``runs/mutate/mutate.json``). Exit code 0 when every mutant is caught.

Run it with ``make mutate``, or::

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python tools/mutate.py [--only SUBSTRING] [--list]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gspo_megatron.tools.provenance import git_commit

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("gspo_megatron", "tests", "examples", "setup.py", "pytest.ini", "pyproject.toml",
          "setup.cfg", "conftest.py")
"""(``examples``: the e2e tests read its recipes; without it the YaRN mutant's tests failed
unmutated.)"""
PYTEST_ARGS = ("-q", "-rfE", "-m", "not slow", "-p", "no:cacheprovider", "--color=no")
RUN_TIMEOUT_S = 600

ALG = "gspo_megatron/algorithms/"
PL, ADV, RC = ALG + "policy_loss.py", ALG + "advantages.py", ALG + "rollout_correction.py"
LB, LOSSES = ALG + "losses/base.py", ALG + "losses/"
STATS = "gspo_megatron/routing/stats.py"
LK = "gspo_megatron/backends/megatron/kernels/local.py"
MOE = "gspo_megatron/backends/megatron/kernels/moe.py"
T = "tests/unit/"
LOSS_TESTS = (T + "test_policy_loss.py", T + "test_clip_rule.py")
REGISTRY_TESTS = (T + "test_loss_registry.py", T + "test_loss_peers.py")


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str               # relative to the repository root
    find: str               # must occur exactly once in the file
    replace: str
    tests: tuple[str, ...]  # pytest arguments: files, node ids, "-k EXPR"


MUTANTS: tuple[Mutant, ...] = (
    Mutant("GSPO ratio not length-normalised (sum of log-ratios)", LB,
           "return sums[0] * (1.0 / sums[1].clamp(min=1.0))", "return sums[0]", LOSS_TESTS),
    Mutant("GSPO |y_i| is the padded length (mask ignored)", LB,
           "torch.stack([diff.sum(-1), mask.to(diff.dtype).sum(-1)])",
           "torch.stack([diff.sum(-1), torch.ones_like(diff).sum(-1)])", LOSS_TESTS),
    Mutant("token-mean 1/|y_i| uses the padded length", PL,
           "torch.stack([mask.to(dtype).sum(-1), adv_tok.sum(-1)], dim=-1)",
           "torch.stack([torch.ones_like(adv_tok).sum(-1), adv_tok.sum(-1)], dim=-1)", LOSS_TESTS),
    Mutant("min dropped: clipped term only", LB,
           "obj = torch.minimum(ratio * adv, clipped * adv)", "obj = clipped * adv", LOSS_TESTS),
    Mutant("clipping dropped: unclipped term only", LB,
           "obj = torch.minimum(ratio * adv, clipped * adv)", "obj = ratio * adv", LOSS_TESTS),
    Mutant("clip sides swapped (eps_low <-> eps_high)", LB,
           "clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)",
           "clipped = ratio.clamp(1.0 - eps_high, 1.0 + eps_low)", LOSS_TESTS),
    Mutant("GSPO-token s_i without stop-gradient", LOSSES + "gspo.py",
           "ratio_tok = torch.exp(log_s.detach())[:, None]",
           "ratio_tok = torch.exp(log_s)[:, None]", LOSS_TESTS),
    Mutant("k3 sign flipped (exp(-d) + d - 1)", LB,
           "return torch.exp(d) - d - 1.0", "return torch.exp(-d) + d - 1.0", LOSS_TESTS),
    Mutant("token_mean ignores the given (global) normaliser", PL,
           "normalizer = torch.tensor(float(loss_normalizer), dtype=dtype)",
           "normalizer = total_tokens if aggregation.normalizer == 'tokens' else "
           "torch.tensor(float(loss_normalizer), dtype=dtype)", LOSS_TESTS),
    Mutant("SAPO gate temperatures swapped by the advantage's sign", LOSSES + "sapo.py",
           "tau = torch.where(x.adv_tok > 0, x.zero + p.tau_pos, x.zero + p.tau_neg)",
           "tau = torch.where(x.adv_tok > 0, x.zero + p.tau_neg, x.zero + p.tau_pos)",
           REGISTRY_TESTS),
    Mutant("CISPO weight not stop-gradient (gradient through the ratio)", LOSSES + "cispo.py",
           "w = ratio.clamp(1.0 - p.clip_low, 1.0 + p.clip_high).detach()",
           "w = ratio.clamp(1.0 - p.clip_low, 1.0 + p.clip_high)", REGISTRY_TESTS),
    Mutant("dual clip on positive advantages", LOSSES + "grpo.py",
           "neg = x.adv_tok < 0", "neg = x.adv_tok > 0", REGISTRY_TESTS),
    Mutant("GMPO clips both sides whatever the advantage's sign", LOSSES + "gmpo.py",
           "d_min = sign * torch.minimum(sign * d, sign * clipped)", "d_min = clipped",
           REGISTRY_TESTS),
    Mutant("Dr. GRPO divides by B, not B x the response budget", ALG + "objectives.py",
           "rows *= self.response_budget", "rows *= 1", REGISTRY_TESTS),
    Mutant("group std is the sample std (n - 1)", ADV,
           "std_s = centered_s.pow(2).mean(dim=1, keepdim=True).sqrt()",
           "std_s = scaled.std(dim=1, keepdim=True)", (T + "test_advantages.py",)),
    Mutant("advantages not mean-centred", ADV,
           "adv = centered_s / (std_s + eps / scale)", "adv = scaled / (std_s + eps / scale)",
           (T + "test_advantages.py",)),
    Mutant("routes compared as ordered lists, not sets", STATS,
           "return (a != b).any(-1), inter / union",
           "return (old.long() != new.long()).any(-1), inter / union",
           (T + "test_routing_stats.py",)),
    Mutant("route change rate counts masked positions", STATS,
           "changed=(changed.double() * maskf).sum(-1)", "changed=changed.double().sum(-1)",
           (T + "test_routing_stats.py",)),
    Mutant("TIS truncation is max(w, C), not min(w, C)", RC,
           "return w.clamp(max=config.cap), truncated, none",
           "return w.clamp(min=config.cap), truncated, none",
           (T + "test_rollout_correction.py", "-k", "truncate")),
    Mutant("DAPO soft overlong penalty off by one", ALG + "dapo.py",
           "free = max_length - buffer", "free = max_length - buffer + 1",
           (T + "test_dapo.py", "-k", "overlong_penalty")),
    Mutant("pass@k with replacement: 1 - (1 - c/n)^k", ALG + "pass_at_k.py",
           "for i in range(n - c + 1, n + 1):\n        miss *= 1.0 - k / i",
           "for _ in range(k):\n        miss *= 1.0 - c / n",
           (T + "test_dapo.py", "-k", "pass_at_k or sampled_eval")),
    # The two kernel bugs docs/benchmarks.md (section on the local kernels) says
    # test_local_kernels.py catches; that file is marked slow, hence the -m override.
    Mutant("local SDPA kernel: GQA heads folded group-minor", LK,
           "q.reshape(b, ng, np_ // ng * sq, hn), k, v, attn_mask=mask,",
           "q.reshape(b, np_ // ng, ng, sq, hn).transpose(1, 2).reshape(b, ng, np_ // ng * sq, "
           "hn), k, v, attn_mask=mask,",
           ("-m", "slow", T + "test_local_kernels.py", "-k", "greedy_generation")),
    Mutant("local kernel: cached keys rotated from position 0", LK,
           "return table[start:end]", "return table[:end - start]",
           ("-m", "slow", T + "test_local_kernels.py", "-k", "greedy_generation")),
    Mutant("grouped experts: rows handed to the wrong experts", MOE,
           "offs = tokens_per_expert.cumsum(0).to(device=x.device, dtype=torch.int32)",
           "offs = tokens_per_expert.flip(0).cumsum(0).to(device=x.device, dtype=torch.int32)",
           ("-m", "slow", T + "test_local_kernels.py", "-k", "grouped")),
    Mutant("left-padded rollouts: pad keys not masked", "gspo_megatron/backends/megatron/"
           "engine/hooks.py", "masked = (j > i) | ((j < pads.view(-1, 1, 1)) & (j != i))",
           "masked = j > i", ("-m", "slow", T + "test_rollout.py", "-k", "left_padded")),
    Mutant("static R3: left-padded prompts' routes taken from position 0 (issue 52)",
           "gspo_megatron/backends/megatron/engine/rollout.py",
           "req.gspo_routes[:, pad:pad + n].clone()", "req.gspo_routes[:, :n].clone()",
           ("-m", "slow", T + "test_rollout_routes.py", "-k", "left_padded")),
    # The loop and the checkpoint (issue 34: both passed the whole suite before these tests).
    Mutant("trainer.old_logprobs inverted (recompute takes the engine's)", "gspo_megatron/trainer.py",
           'batch.old_logprobs = (batch.rollout_logprobs if cfg.trainer.old_logprobs == "rollout"',
           'batch.old_logprobs = (batch.rollout_logprobs if cfg.trainer.old_logprobs != "rollout"',
           (T + "test_trainer_stages.py",)),
    Mutant("RNG state read but not restored on resume",
           "gspo_megatron/backends/megatron/checkpoint.py",
           "        _set_rng_state(torch.load(rng_path, weights_only=True))",
           "        torch.load(rng_path, weights_only=True)",
           (T + "test_resume_rng.py",)),
    Mutant("balanced DP ranks: advantages left in the sampled order", "gspo_megatron/stages.py",
           "advantages=torch.tensor([a for _, a in mine], dtype=advantages.dtype),",
           "advantages=advantages,", ("tests/distributed/test_dp_balance.py",)),
    Mutant("balanced DP ranks: every minibatch dealt minibatch 0's sequences",
           "gspo_megatron/layout.py",
           "members = [(int(lengths[r][p]), r, p) for r in range(num_ranks)\n"
           "                   for p in range(m * per, (m + 1) * per)]",
           "members = [(int(lengths[r][p]), r, p) for r in range(num_ranks)\n"
           "                   for p in range(0, per)]",
           (T + "test_packing.py", "-k", "rank_balance")),
    # The first GPU run (H200, 2026-11-26): both passed the whole CPU suite before these tests.
    Mutant("bf16: the warm-up's weights not handed to the RL optimizer's main copies",
           "gspo_megatron/backends/megatron/policy.py",
           "            self._weights_changed()  # the block trained them",
           "            pass  # the block trained them",
           ("-m", "slow", T + "test_update_path.py", "-k", "weights_changed")),
    Mutant("resume keeps a changed LR schedule without a word", "gspo_megatron/cli.py",
           "        if not cfg.optim.override_opt_param_scheduler:",
           "        if False:",
           (T + "test_bad_user_files.py", "-k", "lr_schedule")),
    Mutant("YaRN: the rollout context rotates queries without the cos/sin scale",
           "gspo_megatron/backends/megatron/engine/context.py",
           "                                   mscale=None):\n"
           "            mscale = concentration(config) if mscale is None else mscale",
           "                                   mscale=None):\n"
           "            mscale = 1.0",
           ("-m", "slow", "tests/e2e/test_train_e2e.py", "-k", "yarn")),
)


class MutantError(RuntimeError):
    """A mutant's snippet is missing or ambiguous in the current source."""


def mutate_text(text: str, m: Mutant) -> str:
    """``text`` with ``m.find`` replaced by ``m.replace``; MutantError unless it occurs once."""
    count = text.count(m.find)
    if count != 1:
        raise MutantError(f"mutant {m.name!r}: snippet {m.find!r} occurs {count} times in "
                          f"{m.file} (expected exactly once); update the mutant")
    return text.replace(m.find, m.replace)


def check_snippets(mutants: tuple[Mutant, ...], root: Path = ROOT) -> list[str]:
    """One message per mutant whose snippet does not occur exactly once under ``root``."""
    problems = []
    for m in mutants:
        path = root / m.file
        try:
            mutate_text(path.read_text(), m)
        except FileNotFoundError:
            problems.append(f"mutant {m.name!r}: file {m.file} not found")
        except MutantError as e:
            problems.append(str(e))
    return problems


def make_copy(dest: Path, root: Path = ROOT) -> Path:
    """Copy the sources and tests (no caches) into ``dest``; returns ``dest``."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".hypothesis")
    for name in COPIED:
        src = root / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.is_file():
            shutil.copy2(src, dest / name)
    return dest


def _env(copy: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(copy), OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTEST_ADDOPTS", None)
    return env


def check_import_path(copy: Path) -> None:
    """Make sure ``import gspo_megatron`` in the copy resolves to the copy (not the editable
    install of the working tree)."""
    code = "import importlib.util as u; print(u.find_spec('gspo_megatron').origin)"
    out = subprocess.run([sys.executable, "-c", code], cwd=copy, env=_env(copy),
                         capture_output=True, text=True, check=True).stdout.strip()
    if not Path(out).resolve().is_relative_to(copy.resolve()):
        raise RuntimeError(f"gspo_megatron imports from {out}, not from the copy {copy}")


def run_tests(copy: Path, tests: tuple[str, ...]) -> tuple[int, list[str], float, str]:
    """Run pytest in ``copy``: (exit code, failing test ids, seconds, output tail)."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", *PYTEST_ARGS, *tests], cwd=copy,
                           env=_env(copy), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = 124, f"timed out after {RUN_TIMEOUT_S} s\n{e.stdout or ''}"
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, flags=re.M)
    return rc, failed, time.perf_counter() - t0, "\n".join(out.splitlines()[-30:])


def status_of(rc: int, failed: list[str]) -> str:
    """'caught' (pytest exit 1), 'NOT caught' (exit 0), else 'ERROR (exit N)'."""
    if rc == 1 and failed:
        return "caught"
    if rc == 0:
        return "NOT caught"
    return f"ERROR (exit {rc})" if rc != 124 else "ERROR (timeout)"


def machine() -> dict[str, object]:
    return {"node": platform.node(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


def table(rows: list[dict]) -> str:
    """The Markdown results table (``|`` inside a cell escaped)."""
    lines = ["| # | planted bug | file | caught | first failing test |", "|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        first = f"`{r['failing_tests'][0]}`" if r["failing_tests"] else "-"
        cells = (str(i), r["name"], f"`{r['file']}`", r["status"], first)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", metavar="SUBSTRING", help="run the mutants whose name contains it")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--out", type=Path, default=ROOT / "runs/mutate/mutate.json")
    args = ap.parse_args(argv)
    mutants = tuple(m for m in MUTANTS if not args.only or args.only.lower() in m.name.lower())
    if args.list:
        for i, m in enumerate(mutants, 1):
            print(f"{i:2d}. {m.name}  [{m.file}]  tests: {' '.join(m.tests)}")
        return 0
    if not mutants:
        print(f"no mutant matches {args.only!r} (see --list)", file=sys.stderr)
        return 2
    problems = check_snippets(mutants)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gspo-mutate-") as tmp:
        copy = make_copy(Path(tmp))
        check_import_path(copy)
        baseline = []
        for sel in dict.fromkeys(m.tests for m in mutants):  # each selection once, in order
            rc, failed, secs, tail = run_tests(copy, sel)
            baseline.append({"tests": list(sel), "exit_code": rc, "seconds": round(secs, 1)})
            print(f"baseline {' '.join(sel)}: exit {rc} ({secs:.1f} s)", file=sys.stderr)
            if rc != 0:
                print(f"baseline failed (not mutated!): {failed}\n{tail}", file=sys.stderr)
                return 2
        rows = []
        for i, m in enumerate(mutants, 1):
            target = copy / m.file
            original = target.read_text()
            target.write_text(mutate_text(original, m))
            try:
                rc, failed, secs, tail = run_tests(copy, m.tests)
            finally:
                target.write_text(original)
            status = status_of(rc, failed)
            print(f"[{i}/{len(mutants)}] {m.name}: {status} ({secs:.1f} s)", file=sys.stderr)
            if status.startswith("ERROR"):
                print(tail, file=sys.stderr)
            rows.append({"name": m.name, "file": m.file, "tests": list(m.tests),
                         "caught": status == "caught", "status": status, "exit_code": rc,
                         "failing_tests": failed, "seconds": round(secs, 1)})
    total = time.perf_counter() - t_start
    print(table(rows))
    n_caught = sum(r["caught"] for r in rows)
    print(f"\n{n_caught}/{len(rows)} planted bugs caught; wall time {total:.0f} s")
    report = {"commit": git_commit(("gspo_megatron", "tests")),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "command": " ".join([sys.executable, *sys.argv]),
              "wall_seconds": round(total, 1), "caught": n_caught, "total": len(rows),
              "baseline": baseline, "mutants": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"JSON: {args.out}", file=sys.stderr)
    return 0 if n_caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
