"""All the GPU work of the project in one invocation: ``tools/gpu_check.sh`` runs this module.

    PYTHONPATH=. python -m tools.gpu_check --out DIR [--only STAGE,...] [--size smoke|quick|full]
        [--parallel N] [--deadline SECONDS]

Each stage is a subprocess with its own time limit, so a failure or a hang is recorded (exit code,
last lines of output) and the next stage still runs. Results go to ``DIR/gpu_check.json`` (one
record per stage, with the figures read from the runs' ``metrics.jsonl``) and every stage's output
to ``DIR/gpu_check.log``. ``--parallel N`` runs the untimed stages N at a time (they share the
GPU; the first H200 run took 115 s for all of them at N = 8), then the timed ones alone.
``--size smoke`` runs every path at its smallest (under 3 minutes at N = 6). Stages:

``env``            device, torch / megatron-core versions, which optional kernels import, disk.
``tiny_dynamic``   the demo recipe in bf16 with the dynamic engine and R2: SFT warm-up, 8 RL steps,
                   checkpoints at 4 and 8; ``tiny_repeat`` the same again (run-to-run equality).
``slice_plan``     ``gspo-plan``'s memory prediction for the slice recipe (compared at the end
                   with ``slice_rl``'s measured peaks: ``plan_vs_measured``).
``slice_mfu``      tools.bench.gpu_qwen3_slice: forward+backward MFU of a 4-layer slice at 4096
                   tokens against the measured bf16 matmul peak; log-prob memory at full vocabulary.
``rollout_bench``  tools.bench.gpu_rollout: the engine paths on the slice (the dynamic engine's
                   per-step loop, its multi-step rounds eager and from CUDA graphs, the static
                   engine), Megatron's modules vs our local kernels: ms per decoding step, tokens/s,
                   the step's memory-bound limit, greedy tokens per path against the per-step
                   loop's, a profile of a few decoding steps. ``tiny_rollout_bench``: the same on
                   the tiny model (fp32).
``fp8_decode``     tools.bench.gpu_fp8: ``rollout.precision: fp8`` on the slice: ms per decoding
                   step with the attention GEMMs in FP8 (``torch._scaled_mm``, 128 x 128 block
                   scales; Hopper) and the experts' grouped GEMMs in FP8
                   (``torch._scaled_grouped_mm``, row-wise scales), with every GEMM dequantized to
                   bf16, with the FP8 KV cache too (``rollout.kv_cache_dtype: fp8``), and bf16's;
                   greedy tokens against bf16's; the GEMMs and grouped GEMMs alone at the slice's
                   shapes (ms, agreement with their float32 twins and bf16). ``tiny_fp8_rollout``:
                   the tiny fp32 trainer sampling from FP8 weights with R3;
                   ``tiny_fp8_kv_rollout``: the same with the FP8 KV cache.
``tiny_zero_mismatch`` ``precision.batch_invariant`` on the tiny bf16 run (free routing, the
                   rollout's routes compared with the trainer's): every step's
                   ``mismatch/tokens_differ``, ``kl/rollout_vs_train`` and
                   ``routing/rollout/change_rate``, then the same run with the mode off; the
                   verdict and the cost on / off in ``zero_mismatch``.
``slice_rl``       examples/configs/gpu_qwen3_slice_rl.yaml: a 1.87B-parameter Qwen3-30B-A3B-shaped
                   slice, bf16, dynamic engine, R2, 2 RL steps + checkpoint, then resumed for one
                   more; step breakdown and peak memory per phase. ``slice_rl_megatron_modules``:
                   the same with Megatron's own modules (``precision.local_kernels: false``).
``tiny_resume``    the tiny run stopped at step 4 and resumed to 8: metrics compared with
                   ``tiny_dynamic`` field by field (``tiny_resume_sync``: checkpoints written
                   synchronously).
``tiny_r3``        ``tiny_dynamic`` with R3 (routes recorded by the dynamic engine from its packed
                   buffer and replayed by the trainer), and ``tiny_r3_bf16_rollout``: an fp32
                   trainer sampling from a bf16 copy (``rollout.precision=bf16``) with R3, the
                   rollout/training mismatch R3 is for (``routing/rollout/*``, ``kl/rollout_vs_train``).
``ep2_dynamic_r3_cpu`` the dynamic engine under EP=2 with R3 (ranks in lock-step), on two gloo CPU
                   ranks (two ranks cannot share one GPU's NCCL).
``tiny_packed``    ``tiny_dynamic`` with packed training microbatches (thd, 256-token budget).
``tiny_offload``   ``tiny_dynamic`` with ``trainer.offload: all`` (Adam's moments, the gradient
                   buffers and the bf16 run's fp32 main copy in pinned host memory during each
                   rollout): compared with ``tiny_dynamic`` field by field (``vs_tiny_dynamic``).
``slice_rl_offload`` ``slice_rl``'s first run with ``trainer.offload: optimizer+grads``: its
                   ``perf/rollout_peak_mem_gib`` against ``slice_rl``'s (the freed state's memory
                   is the allocator's for the KV cache), ``perf/offloaded_gib`` and the step time.
``cp2_cpu``        context parallelism 2 on two gloo CPU ranks, packed rows and R3 (the local
                   kernel's CP attention; TE's needs two GPUs).
``tiny_yarn``      ``tiny_dynamic`` with YaRN rope scaling (factor 4) on the GPU's dynamic engine.
``tiny_separate_r3`` rollouts on their own rank (the trainer and the rollout rank on one GPU), R3.
``tiny_separate_buckets`` the weight transfer of rollouts on their own rank on CUDA: the two
                   ranks on one GPU, max_staleness 1, 10 KiB buckets (the tiny model's 274 KiB of
                   bf16 in 34, 4 tensors split: pinned device-to-host snapshots,
                   gloo sends, host-to-device loads); then at staleness 0, compared field by field
                   with the colocated ``tiny_dynamic`` (``k0_vs_tiny_dynamic``: 0 differ where the
                   GPU repeats itself, ``tiny_repeat``). Runs on CPU too (``--size smoke``, no GPU).
``tiny_partial_r3`` partial rollouts with R3, and with the cut requests' KV cache kept.
``tiny_static``    ``tiny_dynamic`` with the static engine (the A/B reference), and ``tiny_fp32``:
                   ``kl/rollout_vs_train`` and rollout speed per engine and precision.
``routing_frontier`` examples/routing_study/frontier.py ``--device cuda`` (last, alone): GSPO,
                   GRPO, GRPO + R2 / R3 and SAPO over lr x1-x30 and 4 / 16 updates per rollout
                   batch on a 16-layer, 64-expert top-8 MoE, fp32 trainer with bf16 rollouts, runs
                   stopped once collapsed; report in ``work/routing_frontier_report`` (<= 10 min,
                   not run yet). ``--size smoke``: ``--smoke`` on any device.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time

from tools.gpu_check_figures import (HERE, compare_metrics, env_report,  # noqa: F401 (re-exported)
                                     plan_vs_measured, run_figures, zero_mismatch_summary)
TRAIN = [sys.executable, "-m", "gspo_megatron.cli"]
SLICE_RECIPE = "examples/configs/gpu_qwen3_slice_rl.yaml"


def digit_share(response: str, answer: str, example=None) -> float:
    """Benchmark reward for random models: the share of digits among the response's non-space
    characters (0 for an empty response). Graded, so a group of random responses has non-zero
    advantages and an update has a gradient; it rewards nothing useful."""
    chars = [c for c in response if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


# ----------------------------------------------------------------------------- stage commands
SIZES = ("smoke", "quick", "full")
"""``smoke``: every stage at its smallest (does the path run at all; ~2 minutes with ``--parallel``),
``quick``: a first look with figures, ``full``: the figures the docs report."""


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    commands: list[list[str]]
    """Run one after the other; the stage stops at the first that fails."""
    limit: int
    """Seconds for all of its commands together."""
    timed: bool = False
    """Its figures are timings or memory peaks: with ``--parallel`` it runs alone on the GPU,
    after the untimed stages (which share the GPU with each other)."""
    killed: tuple[int, ...] = ()
    """Commands (by index) that are killed on purpose (``GSPO_FAULT``): any exit code goes on."""


ZERO_MISMATCH = ("--routing.replay=none", "--routing.diagnostics=true",
                 "--routing.replay_gap=false")
"""``tiny_zero_mismatch``'s settings beside the mode: free routing, the rollout's routes compared
with the trainer's (``routing/rollout/*``)."""


def _tiny(run_dir: str, *extra: str, size: str = "full") -> list[str]:
    """The demo recipe on the GPU: bf16, dynamic engine, R2, short (``smoke``: 2 RL steps)."""
    steps = (["--sft.steps=5", "--trainer.steps=2", "--trainer.eval_interval=2",
              "--checkpoint.save_interval=2"] if size == "smoke" else
             ["--sft.steps=100", "--trainer.steps=8", "--trainer.eval_interval=4",
              "--checkpoint.save_interval=4"])
    return TRAIN + [
        "--precision.bf16=true", "--rollout.engine=dynamic", "--rollout.dynamic_buffer_size_gb=1",
        "--routing.replay=r2", *steps, "--checkpoint.keep_last=2", "--logging.progress=false",
        f"--logging.run_dir={run_dir}", *extra]


def stages(work: str, size: str = "full") -> list[Stage]:
    """Every stage of the check, the most informative first, at ``size`` (one of SIZES)."""
    assert size in SIZES, size
    w = lambda name: os.path.join(work, name)  # noqa: E731
    smoke, full = size == "smoke", size == "full"
    tiny = lambda name, *extra: _tiny(w(name), *extra, size=size)  # noqa: E731
    # The two-rank CPU stages' own sizes (they run the same code at any size).
    cpu_steps = (["--sft.steps=5", "--trainer.steps=2"] if smoke
                 else ["--sft.steps=20", "--trainer.steps=3"])
    # One LR schedule for the run and its resumption (null decay steps would follow each
    # command's trainer.steps, and a resume with another schedule is refused).
    slice_cmd = TRAIN + ["--config", SLICE_RECIPE, f"--logging.run_dir={w('slice_rl')}",
                         "--optim.lr_decay_steps=16"]
    if smoke:  # one small step, one checkpoint of 1.87B parameters and Adam, one resumed step
        slice_rl = [slice_cmd + ["--trainer.steps=1", "--rollout.prompts_per_step=2",
                                 "--rollout.max_new_tokens=16", "--trainer.num_minibatches=1"],
                    slice_cmd + ["--trainer.steps=2", "--rollout.prompts_per_step=2",
                                 "--rollout.max_new_tokens=16", "--trainer.num_minibatches=1"]]
    else:  # the first run also says what is live at its memory peak (memory_profile.json)
        slice_rl = [slice_cmd + ["--trainer.steps=2" if full else "--trainer.steps=1",
                                 "--logging.memory_profile_steps=2"],
                    slice_cmd + ["--trainer.steps=3" if full else "--trainer.steps=2"]]
    mfu_size = {"smoke": ["--layers", "1", "--seq", "1024", "--iters", "1"],
                "quick": ["--layers", "2", "--seq", "2048", "--iters", "2"],
                "full": ["--layers", "4", "--seq", "4096", "--iters", "3"]}[size]
    # --standalone: a free rendezvous port of its own (two such stages may run at once)
    def resume(name: str, *extra: str) -> list[list[str]]:
        """``tiny(name)`` killed at the start of the step after its first checkpoint (committed
        during that step), then run again: it resumes from that checkpoint."""
        every = ["--trainer.steps=3", "--checkpoint.save_interval=1"] if smoke else []
        kill = "step_start:2" if smoke else "step_start:5"
        return [["env", f"GSPO_FAULT={kill}", *tiny(name, *every, *extra)],
                tiny(name, *every, *extra)]

    torchrun2 = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", "2"]
    on_cpu = ["env", "CUDA_VISIBLE_DEVICES="]
    return [
        Stage("env", [[sys.executable, "-m", "tools.gpu_check", "env"]], 120),
        Stage("tiny_dynamic", [tiny("tiny_dynamic")], 300),
        Stage("slice_plan", [[sys.executable, "-m", "gspo_megatron.tools.plan", "--recipe",
                              SLICE_RECIPE, "--gpus", "1"]], 120),
        Stage("slice_mfu", [[sys.executable, "-m", "tools.bench.gpu_qwen3_slice", *mfu_size]],
              480, timed=True),
        Stage("rollout_bench", [[sys.executable, "-m", "tools.bench.gpu_rollout", "--size", size]],
              480, timed=True),
        # The fast decoder's instrumentation: decode path, SDPA backend, sync warnings over the
        # rounds, memory reserved after each capture and across three RL steps, ms per step
        # against the weights' read time, graph vs eager greedy tokens.
        Stage("decode_probe", [[sys.executable, "-m", "tools.bench.decode_probe", "--size",
                                size]], 300, timed=True),
        # The multi-step decoding step on the build the GPU has (TE's fused modules and
        # TEGroupedMLP where TE imports): the path taken, greedy tokens against Megatron's
        # forward (eager and CUDA graphs), the SDPA kernel its attention gets, ms per step.
        Stage("decode_build", [[sys.executable, "-m", "tools.bench.gpu_decode"]], 240),
        # The same paths on the tiny model (issue 48's target: <= 3 ms per decoding step).
        Stage("tiny_rollout_bench", [[sys.executable, "-m", "tools.bench.gpu_rollout", "--size",
                                      "smoke" if smoke else "quick", "--tiny"]], 240, timed=True),
        # FP8 rollouts (rollout.precision: fp8): the decoding step with the attention GEMMs as
        # torch._scaled_mm on 128 x 128 block-scaled weights, against bf16's; then the tiny RL
        # run sampling from FP8 weights (kl/rollout_vs_train, routing/rollout/* under R3).
        Stage("fp8_decode", [[sys.executable, "-m", "tools.bench.gpu_fp8", "--size", size]], 300,
              timed=True),
        Stage("tiny_fp8_rollout", [tiny("tiny_fp8_rollout", "--precision.bf16=false",
                                        "--rollout.precision=fp8", "--routing.replay=r3")], 300),
        Stage("tiny_fp8_kv_rollout", [tiny("tiny_fp8_kv_rollout", "--precision.bf16=false",
                                           "--rollout.precision=fp8", "--routing.replay=r3",
                                           "--rollout.kv_cache_dtype=fp8")], 300),
        # Zero mismatch (precision.batch_invariant) in bf16: every step's mismatch/tokens_differ
        # (0 on CPU), kl/rollout_vs_train and routing/rollout/change_rate, then the same run with
        # the mode off (its figures beside: the cost, perf/*, and the mismatch it removes).
        Stage("tiny_zero_mismatch", [
            tiny("tiny_zero_mismatch", *ZERO_MISMATCH, "--precision.batch_invariant=true"),
            tiny("tiny_zero_mismatch_off", *ZERO_MISMATCH)], 400, timed=True),
        # The slice's RL steps with Megatron's own local-spec modules (the local kernels, SDPA
        # attention and grouped expert GEMMs, are the default: 7.8x in a training pass and 8.4x
        # in a decoding step on the H200, 2026-11-27): the comparison.
        Stage("slice_rl_megatron_modules",
              [TRAIN + ["--config", SLICE_RECIPE, "--precision.local_kernels=false",
                        f"--logging.run_dir={w('slice_rl_megatron_modules')}",
                        "--trainer.steps=1" if smoke else "--trainer.steps=2"]], 400, timed=True),
        # Last: it repeats what the H200 run of 2026-11-26 showed (save, resume) and a deadline
        # cuts it first.
        Stage("slice_rl", slice_rl, 600, timed=True),
        # The offload's memory on the slice: the rollout peak without Adam's state and the
        # gradients (gspo-plan's "rollout peak" with --trainer.offload), and what the copies cost.
        Stage("slice_rl_offload", [slice_rl[0] + [
            "--trainer.offload=optimizer+grads", f"--logging.run_dir={w('slice_rl_offload')}"]],
              400, timed=True),
        # Killed at the start of the step after a checkpoint (as tests/e2e kills a CPU run), then
        # resumed: the same trainer.steps throughout, so the same LR schedule. (The H200 run of
        # 2026-11-26 stopped the first run with --trainer.steps=4 instead: a shorter schedule,
        # which the resumed run then kept.)
        Stage("tiny_resume", resume("tiny_resume"), 300, killed=(0,)),
        # tiny_dynamic again, uninterrupted: whether two plain runs agree on this GPU (CUDA's
        # atomics in MoE un-permutation and embedding backward need not), so that a resumed
        # run's differences are read against the run-to-run ones.
        Stage("tiny_repeat", [tiny("tiny_repeat")], 300),
        # tiny_resume with a synchronous checkpoint write: on the H200 (2026-11-26) the resumed
        # run differed from the uninterrupted one from its first step while two plain runs were
        # bitwise equal; this separates the background writer from the rest of the resume.
        Stage("tiny_resume_sync", resume("tiny_resume_sync", "--checkpoint.async_save=false"),
              300, killed=(0,)),
        Stage("tiny_r3", [tiny("tiny_r3", "--routing.replay=r3")], 300),
        Stage("tiny_r3_bf16_rollout", [tiny("tiny_r3_bf16_rollout", "--precision.bf16=false",
                                            "--rollout.precision=bf16",
                                            "--routing.replay=r3")], 300),
        # The dynamic engine under expert parallelism with R3 (ranks in lock-step): two ranks on
        # one GPU cannot share NCCL, so this stage runs the same path on two gloo CPU ranks.
        Stage("ep2_dynamic_r3_cpu", [[*on_cpu, *torchrun2, "-m", "gspo_megatron.cli",
                                      "--parallel.expert_model_parallel_size=2",
                                      "--routing.replay=r3", "--precision.bf16=false", *cpu_steps,
                                      "--trainer.eval_interval=0", "--logging.progress=false",
                                      f"--logging.run_dir={w('ep2_dynamic_r3_cpu')}"]], 300),
        # Packed training (trainer.max_tokens_per_microbatch): Transformer Engine's thd attention
        # where TE is installed, our packing SDPA kernel on the local spec otherwise.
        Stage("tiny_packed", [tiny("tiny_packed", "--trainer.max_tokens_per_microbatch=256")],
              300),
        # The training state in pinned host memory during each rollout (storage freed with
        # resize_(0), refilled after): the CPU CI proves the round trip bitwise; here the pinned
        # non-blocking copies and the CUDA allocator. Compared with tiny_dynamic at the end.
        Stage("tiny_offload", [tiny("tiny_offload", "--trainer.offload=all")], 300),
        # Context parallelism (one GPU holds one rank): two gloo CPU ranks, the local kernel's
        # CP attention on packed rows with R3; TE's CP attention needs two GPUs. YaRN on the
        # GPU's dynamic engine.
        Stage("cp2_cpu", [[*on_cpu, *torchrun2, "-m", "gspo_megatron.cli",
                           "--parallel.context_parallel_size=2", "--precision.bf16=false",
                           "--trainer.max_tokens_per_microbatch=256", "--routing.replay=r3",
                           *cpu_steps, "--trainer.eval_interval=0", "--logging.progress=false",
                           f"--logging.run_dir={w('cp2_cpu')}"]], 300),
        Stage("tiny_yarn", [tiny("tiny_yarn", "--model.position_embedding_type=yarn",
                                 "--model.yarn_rotary_scaling_factor=4",
                                 "--model.yarn_original_max_position_embeddings=16")], 300),
        # Rollouts on their own rank (rollout.placement: separate, staleness 1) with R3: the
        # trainer and the rollout rank share the one GPU (each side a 1-rank NCCL world, the
        # gloo bridge between them carrying samples and the weights from host memory).
        Stage("tiny_separate_r3", [[*torchrun2, *TRAIN[1:],
                                    *tiny("tiny_separate_r3")[len(TRAIN):],
                                    "--routing.replay=r3", "--rollout.placement=separate",
                                    "--rollout.ranks=1", "--rollout.max_staleness=1"]], 300),
        # The weight transfer on CUDA (rollouts.weight_channel): buckets of 10 KiB, so that the
        # tiny model's larger tensors are split and the others packed, at staleness 1 (a version received one step
        # after it was published, nothing of it posted on the trainer's GPU meanwhile); then at
        # staleness 0, which must be the colocated tiny_dynamic run where the GPU repeats itself.
        Stage("tiny_separate_buckets", [
            [*torchrun2, *TRAIN[1:], *tiny(name)[len(TRAIN):], "--rollout.placement=separate",
             "--rollout.ranks=1", f"--rollout.max_staleness={k}", "--rollout.weight_bucket_mb="
             "0.01"] for name, k in (("tiny_separate_buckets", 1),
                                       ("tiny_separate_buckets_k0", 0))], 420),
        # Partial rollouts with R3: the dynamic engine's early stop, refills mid-rollout and
        # continued requests on CUDA (flash-attn's paged kernels where installed); then with the
        # cut requests' KV cache held through training (rollout.partial_keep_kv).
        Stage("tiny_partial_r3", [tiny("tiny_partial_r3", "--rollout.partial_rollouts=true",
                                       "--routing.replay=r3", "--rollout.max_new_tokens=24",
                                       "--model.seq_length=64")], 300),
        Stage("tiny_partial_keep_kv_r3", [tiny("tiny_partial_keep_kv_r3",
                                               "--rollout.partial_rollouts=true",
                                               "--rollout.partial_keep_kv=true",
                                               "--routing.replay=r3",
                                               "--rollout.max_new_tokens=24",
                                               "--model.seq_length=64")], 300),
        Stage("tiny_static", [tiny("tiny_static", "--rollout.engine=static")], 300),
        Stage("tiny_fp32", [tiny("tiny_fp32", "--precision.bf16=false")], 300),
        # Last: the routing stability frontier at its GPU size (its own runs share the GPU, so it
        # runs alone); smoke: the same path at its smallest, on whatever device there is.
        Stage("routing_frontier", [[sys.executable, "examples/routing_study/frontier.py",
                                    *(["--smoke", "--device", "auto"] if smoke else
                                      ["--device", "cuda"]),
                                    "--out", w("routing_frontier"),
                                    "--report", w("routing_frontier_report")]],
              300 if smoke else 600, timed=True),
    ]


# ----------------------------------------------------------------------------- driver
def select_stages(work: str, size: str, only: str | None = None,
                  size_for: str | None = None) -> list[Stage]:
    """The stages to run: all of them in :func:`stages`' order, or those named in ``only`` in
    the order named; ``size_for`` (``"stage=size,..."``) builds the named ones at their own size.
    An unknown stage or size is a ``SystemExit`` naming it."""
    sized = {}
    for item in filter(None, (size_for or "").split(",")):
        name, _, other = item.partition("=")
        if other not in SIZES:
            raise SystemExit(f"gpu_check: --size-for {item!r}: size must be one of {SIZES}")
        sized[name] = other
    by_size = {z: {s.name: s for s in stages(work, z)} for z in {size, *sized.values()}}
    names = list(by_size[size]) if not only else [n for n in only.split(",") if n]
    unknown = [n for n in [*names, *sized] if n not in by_size[size]]
    if unknown:
        raise SystemExit(f"gpu_check: unknown stage(s) {', '.join(unknown)}; "
                         f"stages: {', '.join(by_size[size])}")
    return [by_size[sized.get(n, size)][n] for n in names]


def plan_waves(todo: list[Stage], parallel: int, ordered: bool = False) -> list[list[Stage]]:
    """Stages grouped into waves run one after the other; a wave's stages share the GPU.
    ``parallel`` 1: one stage a wave. Otherwise the timed stages run alone, and the untimed ones
    together: all of them in one first wave, or (``ordered``: ``--only``'s order is the run
    order, the most informative first under a deadline) each run of consecutive untimed stages
    as one wave in its place."""
    if parallel <= 1:
        return [[s] for s in todo]
    if not ordered:
        return [[s for s in todo if not s.timed]] + [[s] for s in todo if s.timed]
    waves: list[list[Stage]] = []
    for s in todo:
        if s.timed or not waves or waves[-1][0].timed:
            waves.append([s])
        else:
            waves[-1].append(s)
    return waves


def _run_command(cmd: list[str], env: dict, timeout: float) -> tuple[int | str, str]:
    """``cmd``'s exit code (``"timeout"`` past ``timeout`` seconds) and output. It runs in a
    process group of its own, output to a file: when it exits (or is killed on purpose) the
    group is killed, so a reward worker or checkpoint writer it leaves behind neither runs on
    nor holds the output open."""
    import signal
    import tempfile

    with tempfile.TemporaryFile(mode="w+") as f:
        proc = subprocess.Popen(cmd, cwd=HERE, env=env, stdout=f, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            rc: int | str = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        f.seek(0)
        return rc, f.read()


def run_stage(stage: Stage, limit: int, threads: int | None = None) -> tuple[dict, str]:
    """Run ``stage``'s commands within ``limit`` seconds (``threads``: its OMP_NUM_THREADS, when
    it shares the machine): its record and its whole output."""
    start = time.perf_counter()
    rec: dict = {"stage": stage.name, "commands": [" ".join(c) for c in stage.commands]}
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    log, out = [], ""
    for index, cmd in enumerate(stage.commands):
        left = limit - (time.perf_counter() - start)
        log.append(f"\n===== {stage.name}: {' '.join(cmd)}\n")
        rc, out = _run_command(cmd, env, max(left, 1))
        log.append(out)
        rec["rc"] = rc
        rec["tail"] = out[-2500:]
        if index in stage.killed:
            rec["killed_rc"], rec["rc"] = rc, 0
        elif rc != 0:
            break
    rec["seconds"] = round(time.perf_counter() - start, 1)
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if last.startswith("{"):
        try:
            rec["result"] = json.loads(last)
        except json.JSONDecodeError:
            pass
    return rec, "".join(log)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", default="all", choices=["all", "env"])
    ap.add_argument("--out", default="runs/gpu_check")
    ap.add_argument("--work", default=None, help="run directories (default OUT/work)")
    ap.add_argument("--only", default=None, help="comma-separated stage names")
    ap.add_argument("--size", choices=SIZES, default="full",
                    help="smoke: every path at its smallest; quick: a first look; full: the docs'")
    ap.add_argument("--quick", action="store_const", const="quick", dest="size",
                    help="the same as --size quick")
    ap.add_argument("--parallel", type=int, default=1,
                    help="untimed stages run this many at a time (they share the GPU), then the "
                         "timed ones one by one")
    ap.add_argument("--size-for", default=None,
                    help="comma-separated STAGE=SIZE: these stages at another size than --size "
                         "(e.g. slice_rl=quick)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds for the whole check: no stage starts or runs past it")
    args = ap.parse_args(argv)
    if args.what == "env":
        print(json.dumps(env_report()))
        return 0

    os.makedirs(args.out, exist_ok=True)
    work = args.work or os.path.join(args.out, "work")
    os.makedirs(work, exist_ok=True)
    todo = select_stages(work, args.size, args.only, args.size_for)
    waves = plan_waves(todo, args.parallel, ordered=bool(args.only))
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "size": args.size,
               "parallel": args.parallel, "stages": []}
    json_path = os.path.join(args.out, "gpu_check.json")
    lock = threading.Lock()
    t0 = time.perf_counter()
    with open(os.path.join(args.out, "gpu_check.log"), "a") as log:

        def one(stage: Stage, threads: int | None = None) -> None:
            limit = stage.limit
            if args.deadline is not None:
                limit = min(limit, args.deadline - (time.perf_counter() - t0))
                if limit < 20:
                    with lock:
                        results["stages"].append({"stage": stage.name, "rc": "not run: deadline"})
                    return
            rec, text = run_stage(stage, int(limit), threads)
            run_dir = os.path.join(work, stage.name)
            if os.path.isdir(run_dir):
                rec["figures"] = run_figures(run_dir)
            if stage.name.startswith("slice_rl"):  # ~30 GB a checkpoint: free the disk
                shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
            with lock:
                log.write(text)
                log.flush()
                results["stages"].append(rec)
                print(f"[gpu_check] {stage.name}: rc={rec.get('rc')} in {rec['seconds']} s "
                      f"(at {time.perf_counter() - t0:.0f} s)", flush=True)
                if rec.get("rc") != 0:  # the failure's last lines, for a reader of stdout alone
                    print("    | " + rec.get("tail", "")[-900:].replace("\n", "\n    | "),
                          flush=True)
                with open(json_path, "w") as f:  # after every stage: a cut-off run keeps its results
                    json.dump(results, f, indent=1)

        for wave in waves:
            workers = max(1, min(args.parallel, len(wave)))
            threads = max(1, (os.cpu_count() or 1) // workers) if workers > 1 else None
            with concurrent.futures.ThreadPoolExecutor(workers) as ex:
                list(ex.map(lambda s: one(s, threads), wave))
        # The resumed run and a repeat against the uninterrupted one, once all have finished.
        recs = {r["stage"]: r for r in results["stages"]}
        for name in ("tiny_resume", "tiny_resume_sync", "tiny_repeat", "tiny_offload"):
            if recs.get(name, {}).get("rc") == 0 and recs.get("tiny_dynamic", {}).get("rc") == 0:
                recs[name]["vs_tiny_dynamic"] = compare_metrics(
                    os.path.join(work, "tiny_dynamic"), os.path.join(work, name))
        if recs.get("tiny_zero_mismatch", {}).get("figures"):
            recs["tiny_zero_mismatch"]["zero_mismatch"] = zero_mismatch_summary(
                recs["tiny_zero_mismatch"]["figures"],
                run_figures(os.path.join(work, "tiny_zero_mismatch_off")))
        if (recs.get("tiny_separate_buckets", {}).get("rc") == 0
                and recs.get("tiny_dynamic", {}).get("rc") == 0):
            recs["tiny_separate_buckets"]["k0_vs_tiny_dynamic"] = compare_metrics(
                os.path.join(work, "tiny_dynamic"), os.path.join(work, "tiny_separate_buckets_k0"))
        if "slice_plan" in recs:
            for name in ("slice_rl", "slice_rl_megatron_modules"):
                if recs.get(name, {}).get("figures"):
                    recs[name]["plan_vs_measured"] = plan_vs_measured(
                        recs["slice_plan"].get("tail", ""), recs[name]["figures"])
        results["seconds"] = round(time.perf_counter() - t0, 1)
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
