"""All the GPU work of the project in one invocation: ``tools/gpu_check.sh`` runs this module.

    PYTHONPATH=. python -m tools.gpu_check --out DIR [--only STAGE,...] [--quick]

Each stage is a subprocess with its own time limit, so a failure or a hang is recorded (exit code,
last lines of output) and the next stage still runs. Results go to ``DIR/gpu_check.json`` (one
record per stage, with the figures read from the runs' ``metrics.jsonl``) and every stage's output
to ``DIR/gpu_check.log``. Stages, in order (the most informative first, so that a run cut off
by ``--deadline`` still answers most):

``env``            device, torch / megatron-core versions, which optional kernels import, disk.
``tiny_dynamic``   the demo recipe in bf16 with the dynamic engine and R2: SFT warm-up, 8 RL steps,
                   checkpoints at 4 and 8.
``slice_rl``       examples/configs/gpu_qwen3_slice_rl.yaml: a 1.87B-parameter Qwen3-30B-A3B-shaped
                   slice, bf16, dynamic engine, R2, 3 RL steps + checkpoint, then resumed for one
                   more; step breakdown and peak memory vs ``gspo-plan``'s estimate.
``rollout_bench``  dynamic vs static engine tokens/s on that slice (random prompts, sampling).
``slice_mfu``      tools.bench.gpu_qwen3_slice: forward+backward MFU of a 4-layer slice at 4096
                   tokens against the measured bf16 matmul peak; log-prob memory at full vocabulary.
``tiny_resume``    the same run stopped at step 4 and resumed to 8: metrics compared with
                   ``tiny_dynamic`` field by field.
``tiny_r3``        ``tiny_dynamic`` with R3 (routes recorded by the dynamic engine from its packed
                   buffer and replayed by the trainer), and ``tiny_r3_bf16_rollout``: an fp32
                   trainer sampling from a bf16 copy (``rollout.precision=bf16``) with R3, the
                   rollout/training mismatch R3 is for (``routing/rollout/*``, ``kl/rollout_vs_train``).
``ep2_dynamic_r3_cpu`` the dynamic engine under EP=2 with R3 (ranks in lock-step), on two gloo CPU
                   ranks (two ranks cannot share one GPU's NCCL).
``tiny_packed``    ``tiny_dynamic`` with packed training microbatches (thd, 256-token budget).
``cp2_cpu``        context parallelism 2 on two gloo CPU ranks, packed rows and R3 (the local
                   kernel's CP attention; TE's needs two GPUs).
``tiny_yarn``      ``tiny_dynamic`` with YaRN rope scaling (factor 4) on the GPU's dynamic engine.
``tiny_static``    ``tiny_dynamic`` with the static engine (the A/B reference), and ``tiny_fp32``:
                   ``kl/rollout_vs_train`` and rollout speed per engine and precision.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = [sys.executable, "-m", "gspo_megatron.cli"]
SLICE_RECIPE = "examples/configs/gpu_qwen3_slice_rl.yaml"


def digit_share(response: str, answer: str, example=None) -> float:
    """Benchmark reward for random models: the share of digits among the response's non-space
    characters (0 for an empty response). Graded, so a group of random responses has non-zero
    advantages and an update has a gradient; it rewards nothing useful."""
    chars = [c for c in response if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


# ----------------------------------------------------------------------------- stage commands
def _tiny(run_dir: str, *extra: str) -> list[str]:
    """The demo recipe on the GPU: bf16, dynamic engine, R2, short."""
    return TRAIN + [
        "--precision.bf16=true", "--rollout.engine=dynamic", "--rollout.dynamic_buffer_size_gb=1",
        "--routing.replay=r2", "--sft.steps=100", "--trainer.steps=8", "--trainer.eval_interval=4",
        "--checkpoint.save_interval=4", "--checkpoint.keep_last=2", "--logging.progress=false",
        f"--logging.run_dir={run_dir}", *extra]


def stages(work: str, quick: bool) -> list[tuple[str, list[list[str]], int]]:
    """(name, commands run one after the other, time limit in seconds for all of them)."""
    w = lambda name: os.path.join(work, name)  # noqa: E731
    slice_steps = ["--trainer.steps=2"] if quick else []
    return [
        ("env", [[sys.executable, "-m", "tools.gpu_check", "env"]], 120),
        ("tiny_dynamic", [_tiny(w("tiny_dynamic"))], 300),
        ("slice_plan", [[sys.executable, "-m", "gspo_megatron.tools.plan", "--recipe",
                         SLICE_RECIPE, "--gpus", "1"]], 120),
        ("slice_rl", [TRAIN + ["--config", SLICE_RECIPE, f"--logging.run_dir={w('slice_rl')}",
                               *slice_steps],
                      TRAIN + ["--config", SLICE_RECIPE, f"--logging.run_dir={w('slice_rl')}",
                               "--trainer.steps=4" if not quick else "--trainer.steps=3"]], 600),
        ("rollout_bench", [[sys.executable, "-m", "tools.gpu_check", "rollout-bench"]
                           + (["--quick"] if quick else [])], 420),
        ("slice_mfu", [[sys.executable, "-m", "tools.bench.gpu_qwen3_slice"]
                       + (["--layers", "2", "--seq", "2048", "--iters", "2"] if quick
                          else ["--layers", "4", "--seq", "4096", "--iters", "3"])], 480),
        ("tiny_resume", [_tiny(w("tiny_resume"), "--trainer.steps=4"),
                         _tiny(w("tiny_resume"))], 300),
        ("tiny_r3", [_tiny(w("tiny_r3"), "--routing.replay=r3")], 300),
        ("tiny_r3_bf16_rollout", [_tiny(w("tiny_r3_bf16_rollout"), "--precision.bf16=false",
                                        "--rollout.precision=bf16", "--routing.replay=r3")], 300),
        # The dynamic engine under expert parallelism with R3 (ranks in lock-step): two ranks on
        # one GPU cannot share NCCL, so this stage runs the same path on two gloo CPU ranks.
        ("ep2_dynamic_r3_cpu", [["env", "CUDA_VISIBLE_DEVICES=", sys.executable, "-m",
                                 "torch.distributed.run",
                                 "--nproc-per-node", "2", "-m", "gspo_megatron.cli",
                                 "--parallel.expert_model_parallel_size=2", "--routing.replay=r3",
                                 "--precision.bf16=false", "--sft.steps=20", "--trainer.steps=3",
                                 "--trainer.eval_interval=0", "--logging.progress=false",
                                 f"--logging.run_dir={w('ep2_dynamic_r3_cpu')}"]], 300),
        # Packed training (trainer.max_tokens_per_microbatch): Transformer Engine's thd attention
        # where TE is installed, our packing SDPA kernel on the local spec otherwise.
        ("tiny_packed", [_tiny(w("tiny_packed"), "--trainer.max_tokens_per_microbatch=256")], 300),
        # Context parallelism (one GPU holds one rank): two gloo CPU ranks, the local kernel's
        # CP attention on packed rows with R3; TE's CP attention needs two GPUs. YaRN on the
        # GPU's dynamic engine.
        ("cp2_cpu", [["env", "CUDA_VISIBLE_DEVICES=", sys.executable, "-m",
                      "torch.distributed.run", "--nproc-per-node", "2", "-m", "gspo_megatron.cli",
                      "--parallel.context_parallel_size=2", "--precision.bf16=false",
                      "--trainer.max_tokens_per_microbatch=256", "--routing.replay=r3",
                      "--sft.steps=20", "--trainer.steps=3", "--trainer.eval_interval=0",
                      "--logging.progress=false", f"--logging.run_dir={w('cp2_cpu')}"]], 300),
        ("tiny_yarn", [_tiny(w("tiny_yarn"), "--model.position_embedding_type=yarn",
                             "--model.yarn_rotary_scaling_factor=4",
                             "--model.yarn_original_max_position_embeddings=16")], 300),
        # Rollouts on their own rank (rollout.placement: separate, staleness 1) with R3: the
        # trainer and the rollout rank share the one GPU (each side a 1-rank NCCL world, the
        # gloo bridge between them carrying samples and CUDA weights).
        ("tiny_separate_r3", [[sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                               "2", *TRAIN[1:], *_tiny(w("tiny_separate_r3"))[len(TRAIN):],
                               "--routing.replay=r3", "--rollout.placement=separate",
                               "--rollout.ranks=1", "--rollout.max_staleness=1"]], 300),
        # Partial rollouts with R3: the dynamic engine's early stop, refills mid-rollout and
        # continued requests on CUDA (flash-attn's paged kernels where installed); then with the
        # cut requests' KV cache held through training (rollout.partial_keep_kv).
        ("tiny_partial_r3", [_tiny(w("tiny_partial_r3"), "--rollout.partial_rollouts=true",
                                   "--routing.replay=r3", "--rollout.max_new_tokens=24",
                                   "--model.seq_length=64")], 300),
        ("tiny_partial_keep_kv_r3", [_tiny(w("tiny_partial_keep_kv_r3"),
                                           "--rollout.partial_rollouts=true",
                                           "--rollout.partial_keep_kv=true",
                                           "--routing.replay=r3", "--rollout.max_new_tokens=24",
                                           "--model.seq_length=64")], 300),
        ("tiny_static", [_tiny(w("tiny_static"), "--rollout.engine=static")], 300),
        ("tiny_fp32", [_tiny(w("tiny_fp32"), "--precision.bf16=false")], 300),
    ]


# ----------------------------------------------------------------------------- in-process stages
def env_report() -> dict:
    import importlib.util

    import torch

    out = {"python": sys.version.split()[0], "torch": torch.__version__,
           "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(device=torch.cuda.get_device_name(0), capability=list(p.major_minor)
                   if hasattr(p, "major_minor") else [p.major, p.minor],
                   memory_gib=p.total_memory / 2**30, sms=p.multi_processor_count)
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("megatron-core", "transformer-engine", "flash-attn", "einops", "grouped_gemm",
                 "apex"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    out["torch._grouped_mm"] = hasattr(torch, "_grouped_mm")
    out["triton"] = importlib.util.find_spec("triton") is not None
    usage = shutil.disk_usage(HERE)
    out["disk_free_gib"] = usage.free / 2**30
    return out


def rollout_bench(quick: bool) -> dict:
    """Dynamic vs static engine on the slice recipe's model (random bf16 weights): ``batch``
    prompts of 16 random ids, ``new`` tokens each, temperature 1 over a 1000-id vocabulary; the
    two engines alternate, one warm-up call each, then ``rounds`` timed calls each."""
    import torch

    from gspo_megatron.backends.megatron.model import build_gpt_model
    from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
    from gspo_megatron.backends.megatron.rollout import RolloutEngine
    from gspo_megatron.config import RolloutConfig
    from gspo_megatron.config.loader import load_config

    cfg = load_config(SLICE_RECIPE)
    batch, new, rounds, vocab = (32, 64, 1, 1000) if quick else (128, 256, 2, 1000)
    model_cfg = cfg.model
    groups = initialize_distributed(cfg.parallel, model_cfg, seed=0)
    results: dict = {"batch": batch, "new_tokens": new, "prompt_tokens": 16, "rounds": rounds}
    try:
        gpt = build_gpt_model(model_cfg, cfg.parallel, cfg.precision, pre_process=True,
                              post_process=True)
        rc = RolloutConfig(group_size=2, prompts_per_step=1, max_new_tokens=new,
                           max_batch_size=batch, temperature=1.0, dynamic_buffer_size_gb=4.0)
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(1, vocab, (batch, 16), generator=gen).tolist()
        engines = {}
        for name in ("dynamic", "static"):
            try:
                engines[name] = RolloutEngine(gpt, groups, eos_id=0, pad_id=0, vocab_size=vocab,
                                              config=dataclasses.replace(rc, engine=name))
            except Exception as exc:  # noqa: BLE001 - record and measure the other one
                results[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        for r in range(rounds + 1):
            for name, eng in engines.items():
                if "error" in results.get(name, {}):
                    continue
                try:
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    samples = eng.generate(prompts, seed=r)
                    torch.cuda.synchronize()
                    sec = time.perf_counter() - t
                except Exception as exc:  # noqa: BLE001
                    import traceback

                    results[name] = {"error": traceback.format_exc()[-1500:]}
                    continue
                tokens = sum(len(s.response_ids) for s in samples)
                if r > 0:  # round 0 is the warm-up
                    rec = results.setdefault(name, {"tokens_per_s": [], "seconds": []})
                    rec["tokens_per_s"].append(tokens / sec)
                    rec["seconds"].append(sec)
                    rec["tokens"] = tokens
        results["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    finally:
        destroy_distributed()
    return results


# ----------------------------------------------------------------------------- summaries
def run_figures(run_dir: str) -> dict:
    """The figures the report needs from a run directory's metrics.jsonl and summary.json."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return {}
    rows = [json.loads(line) for line in open(path) if line.strip()]
    keys = ("kl/rollout_vs_train", "loss/policy", "clip/fraction", "optim/grad_norm",
            "reward/mean", "eval/accuracy", "perf/step_s", "perf/rollout_s", "perf/reward_s",
            "perf/old_logprobs_s", "perf/update_s", "perf/checkpoint_s",
            "perf/rollout_tokens_per_s", "perf/peak_mem_gib", "response/mean_length",
            "routing/drift/after_1_updates", "routing/drift/after_3_updates",
            "routing/rollout/change_rate", "routing/rollout/token_change_rate")
    out: dict = {"steps": [r.get("step") for r in rows]}
    for k in keys:
        vals = [r[k] for r in rows if k in r]
        if vals:
            out[k] = vals
    summ = os.path.join(run_dir, "summary.json")
    if os.path.isfile(summ):
        out["summary"] = json.load(open(summ))
    return out


def compare_metrics(run_a: str, run_b: str) -> dict:
    """Field-by-field comparison of two runs' metrics (perf/ and time fields excluded): count of
    fields, how many differ, and the largest absolute difference."""
    def load(d):
        return [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl")) if line.strip()]

    a, b = load(run_a), load(run_b)
    n = differ = 0
    worst, worst_key = 0.0, None
    for ra, rb in zip(a, b):
        for k in set(ra) & set(rb):
            if k.startswith(("perf/", "time")):
                continue
            n += 1
            if ra[k] != rb[k]:
                differ += 1
                if isinstance(ra[k], (int, float)) and isinstance(rb[k], (int, float)):
                    d = abs(ra[k] - rb[k])
                    if d > worst:
                        worst, worst_key = d, f"step {ra.get('step')} {k}"
    return {"records": [len(a), len(b)], "fields": n, "differ": differ,
            "max_abs_diff": worst, "max_abs_diff_at": worst_key}


# ----------------------------------------------------------------------------- driver
def run_stage(name: str, commands: list[list[str]], limit: int, log) -> dict:
    start = time.perf_counter()
    rec: dict = {"stage": name, "commands": [" ".join(c) for c in commands]}
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
    for cmd in commands:
        left = limit - (time.perf_counter() - start)
        log.write(f"\n===== {name}: {' '.join(cmd)}\n")
        log.flush()
        try:
            proc = subprocess.run(cmd, cwd=HERE, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=max(left, 1))
            out, rc = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            rc = "timeout"
        log.write(out)
        log.flush()
        rec["rc"] = rc
        rec["tail"] = out[-2500:]
        if rc != 0:
            break
    rec["seconds"] = round(time.perf_counter() - start, 1)
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if last.startswith("{"):
        try:
            rec["result"] = json.loads(last)
        except json.JSONDecodeError:
            pass
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", default="all", choices=["all", "env", "rollout-bench"])
    ap.add_argument("--out", default="runs/gpu_check")
    ap.add_argument("--work", default=None, help="run directories (default OUT/work)")
    ap.add_argument("--only", default=None, help="comma-separated stage names")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a first look)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds for the whole check: no stage starts or runs past it")
    args = ap.parse_args(argv)
    if args.what == "env":
        print(json.dumps(env_report()))
        return 0
    if args.what == "rollout-bench":
        print(json.dumps(rollout_bench(args.quick)))
        return 0

    os.makedirs(args.out, exist_ok=True)
    work = args.work or os.path.join(args.out, "work")
    os.makedirs(work, exist_ok=True)
    only = set(args.only.split(",")) if args.only else None
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": args.quick, "stages": []}
    json_path = os.path.join(args.out, "gpu_check.json")
    with open(os.path.join(args.out, "gpu_check.log"), "a") as log:
        t0 = time.perf_counter()
        for name, commands, limit in stages(work, args.quick):
            if only and name not in only:
                continue
            if args.deadline is not None:
                limit = min(limit, args.deadline - (time.perf_counter() - t0))
                if limit < 20:
                    results["stages"].append({"stage": name, "rc": "not run: deadline"})
                    continue
            rec = run_stage(name, commands, int(limit), log)
            run_dir = os.path.join(work, name)
            if os.path.isdir(run_dir):
                rec["figures"] = run_figures(run_dir)
            if name == "tiny_resume" and rec.get("rc") == 0:
                rec["vs_tiny_dynamic"] = compare_metrics(os.path.join(work, "tiny_dynamic"),
                                                         run_dir)
            if name == "slice_rl":  # ~50 GB of checkpoints: free the disk for what follows
                shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
            results["stages"].append(rec)
            print(f"[gpu_check] {name}: rc={rec.get('rc')} in {rec['seconds']} s", flush=True)
            with open(json_path, "w") as f:  # after every stage: a cut-off run keeps its results
                json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
