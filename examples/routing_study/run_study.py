#!/usr/bin/env python
"""The routing-stability study, one command: GSPO vs GRPO with and without routing replay (R2,
R3), SAPO and CISPO, several seeds each, plus a stress setting, on an 8-layer, 32-expert top-4 MoE.

    PYTHONPATH=. OMP_NUM_THREADS=1 python examples/routing_study/run_study.py   # CPU, ~60 min

1. one supervised warm-up (``examples/configs/routing_study.yaml``, ``--trainer.steps=0``; it
   saves ``<out>/sft/sft_weights``) on the arithmetic-chain task (answers ~35 tokens);
2. every arm x seed from those weights with the routing diagnostics on, ``--jobs`` at a time (one
   thread each): the same problems (``data.seed``), rollout budget, 4-minibatch off-policy
   schedule, learning rate and bf16 rollouts (what clusters sample with; it makes the rollout
   engine and the fp32 trainer disagree, which is what R3 removes). Only ``trainer.seed``
   changes between seeds: the prompt order and the sampled responses;
3. ``report.py`` -> ``--report`` (Markdown + PNGs with min..max bands over seeds).

Loss arms: besides ``ARMS``, any registered loss (``gspo_megatron.algorithms.LOSSES``) is an arm
``<variant>`` or ``<variant>_r2`` / ``<variant>_r3``: the loss at its paper defaults, the recipe's
GSPO eps reset (``geo_mean_r3`` is GMPO with R3).

Staleness arms: an arm name ending in ``_s<k>`` (``grpo_r3_s4``) runs the arm with rollouts on
their own rank ``k`` optimizer steps behind (``rollout.placement: separate``, ``rollout.ranks: 1``,
``rollout.max_staleness: k``: two processes under ``torch.distributed.run --standalone``, the
trainer recomputing the old log-probs); ``--staleness-study`` runs GSPO / GRPO / GRPO+R2 /
GRPO+R3 at staleness 0, 1 and 4 into ``runs/routing_study_staleness`` and reports to
``examples/routing_study/results_staleness``.

``--setting gpu`` is the larger setting for a lent GPU (16 layers, 64 experts top-8, bf16
trainer, more steps); it has not run yet (no GPU lent to the session that wrote it).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from typing import Callable

from gspo_megatron.algorithms import LOSSES, PolicyLossConfig
from gspo_megatron.tools.provenance import git_commit, utc_now
from gspo_megatron.trainer import REQUEUE_EXIT_CODE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join("examples", "configs", "routing_study.yaml")

GRPO = ["--loss.variant=grpo", "--loss.clip_low=0.2", "--loss.clip_high=0.27"]  # paper Sec. 5.1
ARMS: dict[str, list[str]] = {  # arm: overrides on the recipe (GSPO, eps 3e-4 / 4e-4, no replay)
    "gspo": [],
    "grpo": GRPO,
    "grpo_r2": [*GRPO, "--routing.replay=r2"],
    "grpo_r3": [*GRPO, "--routing.replay=r3"],
    "gspo_r3": ["--routing.replay=r3"],
}
# Every other registered loss at its paper's defaults: the recipe's GSPO eps reset to null (a
# knob the variant does not read is an error; one it does read would carry GSPO's value).
LOSS_DEFAULTS = [f"--loss.{knob}=null" for knob in PolicyLossConfig.knobs]
# The soft gate and the clipped importance weight (issue 49): SAPO tau 1.0 / 1.05, CISPO's weight
# capped at 5 with no lower bound.
ARMS.update({v: [f"--loss.variant={v}", *LOSS_DEFAULTS] for v in ("sapo", "cispo")})
LOSS_ARM_RE = re.compile(r"^(?P<loss>.+?)(?:_(?P<replay>r2|r3))?$")
STALENESS_ARMS = ["gspo", "grpo", "grpo_r2", "grpo_r3"]
"""``--staleness-study``: these arms at staleness 0 (colocated), 1 and 4."""
STALENESS_RE = re.compile(r"^(?P<arm>.+?)_s(?P<k>\d+)$")
STRESS_LR_FACTOR = 6.0
"""The stress setting: GSPO and GRPO (no replay) at this multiple of the learning rate."""

SETTINGS: dict[str, dict] = {
    # 2 CPU cores, <= 60 min: what was traded to fit is said in docs/routing.md.
    "cpu": dict(sft_steps=400, steps=50, lr=5e-5, seeds=[1, 2, 3], jobs=2, overrides=[]),
    # A lent H100: a deeper, wider, finer MoE, bf16 trainer (not run yet).
    "gpu": dict(sft_steps=1000, steps=200, lr=5e-5, seeds=[1, 2, 3], jobs=1, overrides=[
        "--model.num_layers=16", "--model.hidden_size=512", "--model.num_attention_heads=8",
        "--model.num_query_groups=4", "--model.kv_channels=64", "--model.ffn_hidden_size=1024",
        "--model.num_moe_experts=64", "--model.moe_router_topk=8", "--model.moe_ffn_hidden_size=128",
        "--precision.bf16=true", "--rollout.prompts_per_step=32", "--trainer.micro_batch_size=64"]),
}


class RunFailed(RuntimeError):
    """A ``gspo-train`` run exited with an error (``returncode``; its output: ``stdout.log``)."""

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


def gspo_train(run_dir: str, overrides: list[str], log, nproc: int = 1,
               stop: Callable[[], str | None] | None = None, poll_s: float = 2.0,
               threads: int = 1) -> float:
    """One ``gspo-train`` run in a child process (``threads`` OMP threads; ``nproc`` ranks under
    ``torch.distributed.run --standalone``, a free port each); its wall time in seconds.

    ``stop``: polled every ``poll_s`` seconds while the run goes; a reason (not None) sends the
    run SIGTERM (the trainer finishes its step, checkpoints and exits with its requeue code, which
    then counts as success). Any other non-zero exit raises :class:`RunFailed`."""
    # ROOT first, the caller's path kept (tools/gpu_check.sh puts the megatron-core wheel there).
    path = os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS=str(threads), WANDB_MODE="disabled")
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                 str(nproc)] if nproc > 1 else [sys.executable])
    cmd = [*launcher, "-m", "gspo_megatron.cli", "--config", RECIPE,
           f"--logging.run_dir={run_dir}", "--logging.progress=false", *overrides]
    start = time.perf_counter()
    reason = None
    out_path = os.path.join(run_dir, "stdout.log")
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                text=True)
        while True:
            try:
                proc.wait(timeout=poll_s)
                break
            except subprocess.TimeoutExpired:
                if stop is not None and reason is None and (reason := stop()) is not None:
                    log(f"stopping {os.path.relpath(run_dir, ROOT)}: {reason}")
                    proc.send_signal(signal.SIGTERM)
    wall = time.perf_counter() - start
    if proc.returncode != 0 and not (reason is not None and proc.returncode == REQUEUE_EXIT_CODE):
        with open(out_path) as f:
            tail = f.read()[-3000:]
        raise RunFailed(f"{run_dir} failed (exit {proc.returncode}):\n{tail}", proc.returncode)
    log(f"done {os.path.relpath(run_dir, ROOT)} in {wall:.0f} s")
    return wall


def arm_base(arm: str) -> list[str] | None:
    """The overrides of an arm without its ``_stress`` / ``_s<k>`` suffix: ``ARMS[arm]``, or
    ``<variant>[_r2|_r3]`` for any registered loss (None: no such arm)."""
    if arm in ARMS:
        return ARMS[arm]
    m = LOSS_ARM_RE.match(arm)
    if m is None or m["loss"] not in LOSSES:
        return None
    base = ARMS.get(m["loss"], [f"--loss.variant={m['loss']}", *LOSS_DEFAULTS])
    return [*base, f"--routing.replay={m['replay']}"] if m["replay"] else base


def split_arm(name: str) -> tuple[str, int]:
    """``grpo_r3_s4`` -> ``("grpo_r3", 4)``; an arm without the suffix runs colocated (0)."""
    m = STALENESS_RE.match(name)
    return (m["arm"], int(m["k"])) if m else (name, 0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setting", choices=sorted(SETTINGS), default="cpu")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "routing_study"))
    ap.add_argument("--report", default=os.path.join(ROOT, "examples", "routing_study", "results"))
    ap.add_argument("--arms", default=",".join([*ARMS, "gspo_stress", "grpo_stress"]),
                    help="comma-separated subset of the arms (X_stress = arm X at the stress LR)")
    ap.add_argument("--seeds", default=None, help="comma-separated RL seeds (default: the setting's)")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the setting's)")
    ap.add_argument("--sft-steps", type=int, default=None)
    ap.add_argument("--jobs", type=int, default=None, help="runs at a time (one thread each)")
    ap.add_argument("--staleness-study", action="store_true",
                    help=f"the arms {STALENESS_ARMS} at staleness 0, 1 and 4 (separate output "
                         f"and report directories unless given)")
    args = ap.parse_args(argv)
    if args.staleness_study:
        args.arms = ",".join(f"{a}{sfx}" for sfx in ("", "_s1", "_s4") for a in STALENESS_ARMS)
        if args.out == ap.get_default("out"):
            args.out += "_staleness"
        if args.report == ap.get_default("report"):
            args.report += "_staleness"
    setting = dict(SETTINGS[args.setting])
    for key in ("steps", "sft_steps", "jobs"):
        if getattr(args, key) is not None:
            setting[key] = getattr(args, key)
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else setting["seeds"]
    arms = args.arms.split(",")
    unknown = [a for a in arms if arm_base(split_arm(a)[0].removesuffix("_stress")) is None]
    if unknown:
        ap.error(f"--arms: unknown arm(s) {unknown}; choose from {list(ARMS)}, a registered loss "
                 f"{list(LOSSES)} (+ _r2 / _r3), or X_stress, X_s<staleness>")

    def arm_overrides(arm: str) -> list[str]:
        arm, staleness = split_arm(arm)
        base = arm_base(arm.removesuffix("_stress"))
        lr = setting["lr"] * (STRESS_LR_FACTOR if arm.endswith("_stress") else 1.0)
        placement = (["--rollout.placement=separate", "--rollout.ranks=1",
                      f"--rollout.max_staleness={staleness}"] if staleness else [])
        return [*base, f"--optim.lr={lr:g}", *placement]

    started = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - started:6.0f} s] {msg}", flush=True)  # noqa: E731
    common = [*setting["overrides"], "--data.seed=1234", "--rollout.precision=bf16"]
    sft_dir = os.path.join(args.out, "sft")
    wall = {"sft": 0.0}
    if not os.path.exists(os.path.join(sft_dir, "sft_weights")):
        log(f"SFT warm-up, {setting['sft_steps']} steps")
        os.makedirs(sft_dir, exist_ok=True)
        wall["sft"] = gspo_train(sft_dir, [*common, f"--sft.steps={setting['sft_steps']}",
                                           "--trainer.steps=0", "--trainer.seed=1234"], log)
    rl = [*common, "--sft.steps=0", f"--trainer.steps={setting['steps']}",
          f"--checkpoint.init_weights={os.path.join(sft_dir, 'sft_weights')}"]
    # Replay arms are the slowest: start them first so the pool drains evenly.
    jobs = sorted(((arm, seed) for arm in arms for seed in seeds),
                  key=lambda job: ("r2" not in job[0] and "r3" not in job[0], job[0], job[1]))
    log(f"{len(jobs)} RL runs ({len(arms)} arms x {len(seeds)} seeds), {setting['jobs']} at a time")
    with concurrent.futures.ThreadPoolExecutor(setting["jobs"]) as pool:
        futures = {}
        for arm, seed in jobs:
            run_dir = os.path.join(args.out, arm, f"seed_{seed}")
            os.makedirs(run_dir, exist_ok=True)
            futures[pool.submit(gspo_train, run_dir, [*rl, *arm_overrides(arm),
                                                      f"--trainer.seed={seed}"], log,
                                2 if split_arm(arm)[1] else 1)] = (arm, seed)
        for future in concurrent.futures.as_completed(futures):
            wall[f"{futures[future][0]}/seed_{futures[future][1]}"] = future.result()
    wall["total"] = time.perf_counter() - started

    with open(os.path.join(args.out, "study_settings.json"), "w") as f:
        json.dump({
            "title": f"Routing study ({args.setting}): {', '.join(arms)}; {len(seeds)} seeds, "
                     f"{setting['steps']} RL steps",
            "command": " ".join(["PYTHONPATH=. OMP_NUM_THREADS=1 python",
                                 os.path.relpath(os.path.abspath(__file__), ROOT),
                                 *(argv if argv is not None else sys.argv[1:])]),
            "recipe": RECIPE, "common": common, "setting": args.setting, **setting,
            "seeds": seeds, "arms": arms, "arm_overrides": {a: arm_overrides(a) for a in arms},
            "wall_s": {k: round(v, 1) for k, v in wall.items()},
            "machine": f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()})",
            "date": utc_now(), "commit": git_commit(("gspo_megatron", "examples")),
        }, f, indent=2)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from report import write_report

    log(f"report: {write_report(args.out, args.report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
