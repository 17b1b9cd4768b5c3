"""End-to-end runs of ``gspo-train`` on the tiny MoE (CPU, gloo): learning, exact resume after a
SIGKILL, and a 2-process expert-parallel run."""

import json
import os
import subprocess
import sys

import pytest

from gspo_megatron.metrics import read_metrics
from tests.helpers import warm

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(ROOT, "examples", "configs", "tiny_gspo.yaml")

# Small but real: the arithmetic task, a short warm-up, a few RL steps.
SMALL = [
    "--data.num_train_examples=200", "--data.num_eval_examples=20", "--model.seq_length=16",
    "--rollout.max_new_tokens=4", "--data.max_prompt_length=8", "--rollout.group_size=4",
    "--rollout.prompts_per_step=4", "--trainer.num_minibatches=2", "--trainer.micro_batch_size=4",
    "--sft.steps=20", "--sft.batch_size=32", "--logging.progress=false",
]


# fp32 rollout engine vs fp32 trainer, same weights: kl/rollout_vs_train (k3, float64) on every step.
# Measured at 3b7e318 (+ this change): <= 2.2e-14 on these tests' small runs (MEASURED lines under
# -s), <= 2.7e-13 over 20 steps of the demo recipe; the bound is the README's "below 2e-12".
ROLLOUT_KL_TOL = 2e-12
# test_gspo_raises_reward: the reward gain, last 30 vs first 30 of 150 demo steps; measured +0.056
# (0.262 -> 0.318 at 1bfd90d, multi-step decoding's draws; deterministic on CPU; +0.101 with the
# per-step loop's draws), so +0.028 fails a run that learns half as fast. (A run that does not
# learn: 0 +- 0.015, the per-step reward's spread 0.057 over 30 steps.)
LEARNING_GAIN = 0.028


def clean_env(extra=None) -> dict:
    """The test's environment without any torch.distributed rendezvous variables."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    env.update(extra or {})  # (may replace the three above, PYTHONPATH included)
    return env


CLI = ["-m", "gspo_megatron.cli"]
BF16_CLI = [os.path.join(ROOT, "tests", "helpers", "bf16_cpu.py")]
"""gspo-train with Megatron's bf16 weights and optimizer on CPU (:mod:`tests.helpers.bf16_cpu`)."""


def gspo_train(run_dir, *overrides, nproc=1, env_extra=None, check=True, timeout=600, cli=CLI,
               recipe=RECIPE):
    """Run gspo-train (forked from the warm interpreter, :mod:`tests.helpers.warm`: a process of
    its own, in its own process group, killed with everything it left once it exits); returns a
    CompletedProcess with stdout/stderr."""
    args = ["--config", recipe, f"--logging.run_dir={run_dir}", *SMALL, *overrides]
    os.makedirs(run_dir, exist_ok=True)
    result = warm.run([*cli, *args], env=clean_env(env_extra), cwd=ROOT,
                      nproc=nproc, timeout=timeout)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


# Packed training (trainer.max_tokens_per_microbatch): SMALL's sequences are at most 8 + 4 = 12
# tokens, so 24 packs two to four per microbatch (the old-log-prob pass, updates and SFT all pack).
PACKED = ["--trainer.max_tokens_per_microbatch=24"]
# Padded microbatches of trainer.micro_batch_size sequences: the opt-out of packing (the default,
# which packs micro_batch_size x model.seq_length = 64 tokens per microbatch here).
PADDED = ["--trainer.pack_sequences=false"]


def kill_and_resume(tmp_path, *overrides, nproc=1, cli=CLI, resumed_overrides=(), recipe=RECIPE,
                    fault="step_start:3") -> tuple[list[dict], list[dict]]:
    """4 steps with checkpoints every 2: straight, and killed at the start of step 3 (after the
    step-2 checkpoint) then resumed; returns both runs' metrics (the resumed one's steps checked).
    ``resumed_overrides``: for the killed and resumed run only (a setting that must not change a
    metric); ``fault``: where in step 3 it is killed (``GSPO_FAULT``)."""
    steps = ["--trainer.steps=4", "--checkpoint.save_interval=2", *overrides]
    straight = tmp_path / "straight"
    gspo_train(straight, *steps, nproc=nproc, cli=cli, recipe=recipe)
    resumed = tmp_path / "resumed"
    steps = [*steps, *resumed_overrides]
    killed = gspo_train(resumed, *steps, nproc=nproc, env_extra={"GSPO_FAULT": fault},
                        check=False, cli=cli, recipe=recipe)
    assert killed.returncode != 0  # SIGKILLed in step 3, after the step-2 checkpoint
    assert (resumed / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert "resumed from" in gspo_train(resumed, *steps, nproc=nproc, cli=cli,
                                        recipe=recipe).stdout
    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(resumed / "metrics.jsonl")
    assert [m["step"] for m in b] == [0, 1, 2, 3]
    return a, b


# trainer.reference_model with a KL penalty, one minibatch per step (step 0 then on-policy: its KL
# to the reference exactly 0): the padded kill-and-resume run checks it too.
KL_REFERENCE = ["--trainer.reference_model=true", "--loss.kl_coef=0.05",
                "--trainer.num_minibatches=1"]


@pytest.mark.parametrize("layout", [PADDED, PACKED], ids=["padded_kl_reference", "packed"])
def test_kill_after_checkpoint_then_resume_matches_uninterrupted(tmp_path, layout):
    """Killed after its step-2 checkpoint and resumed, a run's every step equals the
    uninterrupted run's. Padded, with ``trainer.reference_model``: the reference is the policy
    after the SFT warm-up (step 0's KL to it exactly 0), and the resumed run loads that reference
    (``reference_weights``), not the policy it resumes (one run for what were two tests)."""
    a, b = kill_and_resume(tmp_path, *layout, *(KL_REFERENCE if layout is PADDED else []))
    # Minibatch 0 of each step is on-policy: the update's forward repeats the old-log-prob pass
    # (bitwise padded; packed, the two passes cut their rows differently: fp32 rounding, 2.4e-7).
    worst = max(m["ratio/first_minibatch_max_abs_log"] for m in a)
    assert worst < 1e-6 if layout is PACKED else worst == 0.0, worst
    keys = ["reward/mean", "loss/policy", "clip/fraction", "kl/rollout_vs_train", "optim/grad_norm"]
    if layout is PADDED:
        kl = [m["kl/ref_k3"] for m in a]
        assert kl[0] == 0.0 and max(kl) > 0, kl  # (a step whose advantages are all 0 moves nothing)
        assert (tmp_path / "resumed" / "checkpoints" / "reference_weights").is_dir()
        keys += ["kl/ref_k3", "loss/total"]
    for key in keys:
        assert [m[key] for m in a] == [m[key] for m in b], key
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    sa = json.loads((straight / "summary.json").read_text())
    sb = json.loads((resumed / "summary.json").read_text())
    assert sa["accuracy_after"] == sb["accuracy_after"]


def _bf16_checkpoint(run_dir) -> bool:
    """Whether ``run_dir``'s last checkpoint holds the bf16 optimizer's fp32 main weights."""
    ckpts = run_dir / "checkpoints"
    latest = (ckpts / "latest_checkpointed_iteration.txt").read_text().strip()
    metadata = (ckpts / f"iter_{int(latest):07d}" / ".metadata").read_bytes()
    return b"optimizer.state.fp32_param" in metadata


def test_bf16_warm_up_then_kill_after_checkpoint_then_resume(tmp_path):
    """Megatron's bf16 optimizer (fp32 main weights), with R2 (one run for what were two tests):

    * the SFT warm-up trains with an optimizer of its own; the RL optimizer's main copies must then
      be refreshed, or its first step writes the pre-warm-up weights back (on an H200: held-out
      accuracy 0.108 -> 0.008, 67 % of tokens routed elsewhere after one update). The first RL
      update is a warm-up step of lr 3e-4 / 20: it moves the routes of no token here (0.0), where
      the stale copies moved 91 %;
    * exact resume (fp32 main weights, Adam state, schedule and RNG restored): every metric of
      every step equals the uninterrupted run's. The killed and resumed run moves its training
      state to host memory for every rollout (``trainer.offload: all``: Adam's moments, the
      gradients and the fp32 main copy), which changes nothing."""
    a, b = kill_and_resume(tmp_path, "--precision.bf16=true", "--routing.replay=r2", *PADDED,
                           cli=BF16_CLI, resumed_overrides=["--trainer.offload=all"])
    assert _bf16_checkpoint(tmp_path / "straight") and _bf16_checkpoint(tmp_path / "resumed")
    assert a[0]["routing/drift/after_1_updates"] < 0.1, a[0]["routing/drift/after_1_updates"]
    # 140,160 parameters: fp32 gradients (4 B) and the fp32 main copy of the bf16 ones (4 B,
    # which fp32 training does not have) from step 0, Adam's m and v (8 B) from step 1.
    moved = [m["perf/offloaded_gib"] * 2 ** 30 for m in b]
    assert moved[0] > 140_160 * 7 and all(x > 140_160 * 15 for x in moved[1:]), moved
    assert all(m["ratio/first_minibatch_max_abs_log"] == 0.0 for m in a)  # bf16 on CPU: bitwise
    for ra, rb in zip(a, b):
        for key in ra:
            if not key.startswith(("perf/", "time")):
                assert ra[key] == rb[key], (ra["step"], key)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [PADDED, PACKED], ids=["padded", "packed"])
def test_two_process_expert_parallel_run(tmp_path, layout):
    """EP=2 on two ranks; packed, the ranks first trade samples so each trains about the same
    tokens per minibatch (``trainer.balance_data_parallel``), then each packs its own sequences
    and both run as many microbatches (their expert all-to-alls pair up)."""
    run = tmp_path / "ep2"
    gspo_train(run, "--trainer.steps=2", "--parallel.expert_model_parallel_size=2", *layout,
               nproc=2)
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:
        for key in ("reward/mean", "reward/accuracy", "clip/fraction", "loss/policy",
                    "kl/rollout_vs_train", "perf/step_s", "perf/rollout_s", "perf/update_s"):
            assert key in m, key
    # fp32 engine and trainer on the same weights: the rollout log-probs agree on every step
    kl = [m["kl/rollout_vs_train"] for m in metrics]
    print(f"MEASURED EP=2 kl/rollout_vs_train per step: {kl}")
    assert all(0 <= v < ROLLOUT_KL_TOL for v in kl), kl
    if layout is PACKED:  # balanced: never worse than each rank keeping its own samples
        for m in metrics:
            assert 1.0 <= m["perf/dp_token_imbalance"] <= m["perf/dp_token_imbalance_before"]
    else:
        assert all("perf/dp_token_imbalance" not in m for m in metrics)


@pytest.mark.distributed
def test_sequence_parallel_run_without_warm_up(tmp_path):
    """TP=2 with sequence parallelism, padded, no SFT: the first pass of the run is the
    old-log-prob pass in inference mode, which allocates Megatron's sequence-parallel all-gather
    buffer; the update's forward then writes it (found at 3788b2b: "Inplace update to inference
    tensor outside InferenceMode" unless a warm-up had allocated it first)."""
    run = tmp_path / "tp2sp"
    gspo_train(run, "--trainer.steps=2", "--sft.steps=0", "--parallel.tensor_model_parallel_size=2",
               "--parallel.sequence_parallel=true", *PADDED, nproc=2)
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [0, 1]


@pytest.mark.distributed
def test_context_parallel_run_kill_and_resume(tmp_path):
    """CP=2 on two ranks with packed microbatches and R3, the long-response recipe's path: every
    sequence of a packed row cut into Megatron's 2 x CP chunks (the local attention kernel
    gathers keys and values over the CP group), rollouts on whole sequences on both ranks, their
    routes replayed on each rank's chunks; the engine's log-probs equal the sharded trainer's,
    and a run killed after its step-2 checkpoint resumes to the uninterrupted run's metrics
    bitwise. (Padded rows under CP: tests/distributed/test_parallel_invariance.py.)"""
    a, b = kill_and_resume(tmp_path, "--parallel.context_parallel_size=2", *PACKED,
                           "--routing.replay=r3", nproc=2)
    for key in ("reward/mean", "loss/policy", "clip/fraction", "kl/rollout_vs_train",
                "optim/grad_norm", "routing/rollout/change_rate"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    kl = [m["kl/rollout_vs_train"] for m in a]
    print(f"MEASURED CP=2 packed R3 kl/rollout_vs_train per step: {kl}")
    assert all(0 <= v < ROLLOUT_KL_TOL for v in kl), kl


def test_yarn_rollouts_match_the_trainer(tmp_path):
    """YaRN (``model.position_embedding_type=yarn``, factor 4 over a 4-token original context,
    so prompts and responses run to 3x past it): the dynamic engine's log-probs equal the
    trainer's on every step (3.2e-5 before the engine's rotations got YaRN's cos/sin scale,
    ``engine.context.rollout_context``)."""
    run = tmp_path / "yarn"
    gspo_train(run, "--trainer.steps=2", "--sft.steps=0", "--model.position_embedding_type=yarn",
               "--model.yarn_rotary_scaling_factor=4",
               "--model.yarn_original_max_position_embeddings=4")
    kl = [m["kl/rollout_vs_train"] for m in read_metrics(run / "metrics.jsonl")]
    print(f"MEASURED YaRN kl/rollout_vs_train per step: {kl}")
    assert len(kl) == 2 and all(0 <= v < ROLLOUT_KL_TOL for v in kl), kl


def test_gspo_raises_reward(tmp_path):
    """The first 150 steps of the demo (same settings and LR schedule, so the same run up to float
    differences): GSPO raises the reward on training prompts. Measured at 1bfd90d: mean reward
    0.262 over the first 30 steps, 0.318 over the last 30 (the MEASURED line under -s)."""
    run = tmp_path / "learn"
    demo = ["--data.num_train_examples=500", "--data.num_eval_examples=120", "--model.seq_length=64",
            "--rollout.group_size=8", "--rollout.prompts_per_step=16", "--trainer.num_minibatches=4",
            "--trainer.micro_batch_size=16", "--sft.steps=300", "--sft.batch_size=64",
            "--optim.lr_decay_steps=2400", "--trainer.eval_interval=0"]
    gspo_train(run, *demo, "--trainer.steps=150")
    metrics = read_metrics(run / "metrics.jsonl")
    rewards = [m["reward/mean"] for m in metrics]
    first, last = sum(rewards[:30]) / 30, sum(rewards[-30:]) / 30
    print(f"MEASURED reward mean, first 30 steps {first:.4f}, last 30 {last:.4f}")
    assert last > first + LEARNING_GAIN, (first, last)
    kl = [m["kl/rollout_vs_train"] for m in metrics]
    assert all(0 <= v < ROLLOUT_KL_TOL for v in kl), max(kl)


def test_recipe_without_loss_optim_sft_trains_with_the_papers_defaults(tmp_path):
    """A recipe with only model, data, rollout and trainer sections: gspo-train runs it with the
    paper's GSPO eps, the fine-tuning optimiser and no supervised warm-up.

    Started the way a user starts it, a fresh ``python -m gspo_megatron.cli`` (the other runs here
    are forked from the warm interpreter), so the cold start stays covered end to end."""
    recipe = tmp_path / "minimal.yaml"
    recipe.write_text(
        "model: {preset: tiny, seq_length: 16}\n"
        "data: {source: arithmetic, num_train_examples: 64, num_eval_examples: 4, "
        "max_prompt_length: 8}\n"
        "rollout: {group_size: 4, prompts_per_step: 4, max_new_tokens: 4}\n"
        "trainer: {steps: 2, num_minibatches: 2, micro_batch_size: 4}\n")
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "--config", str(recipe),
                           f"--logging.run_dir={run}", "--logging.progress=false"],
                          env=clean_env({"GSPO_LOG_LEVEL": "INFO"}), capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import yaml
    saved = yaml.safe_load((run / "config.yaml").read_text())
    from gspo_megatron.algorithms import PolicyLossConfig
    loss = PolicyLossConfig(**saved["loss"])
    assert (loss.variant, loss.eps_low, loss.eps_high) == ("gspo", 3e-4, 4e-4)  # paper Sec. 5.1
    assert saved["sft"]["steps"] == 0 and saved["optim"]["lr"] == 1e-6
    assert "sft step" not in proc.stdout and not (run / "sft_weights").exists()
    # The layer spec is chosen once for the run's models and said in one INFO line.
    assert (proc.stdout + proc.stderr).count("layer spec: ") == 1, proc.stderr[-2000:]
    records = read_metrics(str(run / "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["optim/lr"] == pytest.approx(1e-6) for r in records)  # constant, no warm-up


def test_r3_with_bf16_rollouts_and_mismatch_correction(tmp_path):
    """R3 end to end: bf16 rollouts (a real engine/trainer mismatch on CPU), the engine's routes
    replayed in the old-policy pass and the updates, token-level TIS on pi_old / pi_rollout."""
    run = tmp_path / "r3"
    gspo_train(run, "--trainer.steps=2", "--routing.replay=r3", "--rollout.precision=bf16",
               "--rollout_correction.mode=truncate", "--model.num_moe_experts=16",
               "--model.moe_router_topk=4")
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:
        assert m["kl/rollout_vs_train"] > 1e-8  # bf16 engine vs fp32 trainer (fp32: ~1e-14)
        for key in ("routing/rollout/change_rate", "routing/rollout/token_change_rate",
                    "routing/rollout/change_rate/layer_1", "correction/weight_mean",
                    "correction/truncated_fraction", "routing/drift/after_0_updates"):
            assert key in m, key
        assert 0 <= m["routing/rollout/change_rate"] <= m["routing/rollout/token_change_rate"] <= 1
        # pi_old (fp32 trainer) / pi_rollout (bf16 engine): around 1, never exactly 1 everywhere
        # (measured min 0.91-0.99, max 1.01-1.02 over 20 steps; all 1.0 would mean the correction
        # compares the engine's log-probs with themselves)
        assert 0.5 < m["correction/weight_min"] < 1.0 < m["correction/weight_max"] < 2.0
        assert abs(m["correction/weight_mean"] - 1.0) < 0.05
        # the first update forward replays the rollout's routes: nothing drifted yet
        assert m["routing/drift/after_0_updates"] < 0.05


def test_dapo_dynamic_sampling_overlong_and_pass_at_k(tmp_path):
    """DAPO's dynamic sampling, overlong masking + soft penalty and the sampled evaluation on the
    real engine and trainer: every step trains on exactly prompts_per_step groups, extra rollouts
    are counted, pass@k is logged at the eval interval and in the summary, and a resumed run
    matches the uninterrupted one."""
    features = ["--dynamic_sampling.enabled=true", "--dynamic_sampling.max_extra_batches=2",
                # buffer 1: the penalty on the budget's last token only, so groups tie often
                # enough that every step redraws (buffer 2 spread the rewards: no ties in 3 steps)
                "--overlong.mask_truncated=true", "--overlong.buffer_tokens=1",
                "--evaluation.num_samples=4", "--evaluation.temperature=1.0",
                "--trainer.eval_interval=2"]
    run = tmp_path / "dapo"
    out = gspo_train(run, "--trainer.steps=3", *features).stdout
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics:
        assert m["sampling/kept_groups"] + m["sampling/filled_groups"] == 4
        assert 1 <= m["sampling/rollout_batches"] <= 3
        assert m["sampling/extra_rollouts"] == (m["sampling/rollout_batches"] - 1) * 4 * 4
        assert m["response/clip_rate"] == pytest.approx(1 - m["response/eos_fraction"])
        assert 1 <= m["response/max_length"] <= 4
    assert sum(m["sampling/rollout_batches"] for m in metrics) > 3  # ties happened and were redrawn
    assert all(m["kl/rollout_vs_train"] < ROLLOUT_KL_TOL for m in metrics)
    evals = metrics[1]
    ladder = [evals[f"eval/pass@{k}"] for k in (1, 2, 4)]
    assert ladder == sorted(ladder) and 0 <= ladder[0] <= ladder[-1] <= 1
    assert evals["eval/pass@1"] == pytest.approx(evals["eval/mean@4"])
    summary = json.load(open(run / "summary.json"))
    assert {"eval/pass@4_before", "eval/pass@4_after", "eval/mean@4_after"} <= set(summary)
    assert "pass@4" in out and "mean@4" in out  # progress line and the before/after lines
    # Resume: 2 steps, then on to 3, equals the straight run's step 2 (extra batches included).
    part = tmp_path / "part"
    gspo_train(part, "--trainer.steps=2", "--checkpoint.save_interval=1", *features)
    gspo_train(part, "--trainer.steps=3", *features)
    resumed = read_metrics(part / "metrics.jsonl")
    assert [m["step"] for m in resumed] == [0, 1, 2]
    same = [k for k in metrics[2] if not k.startswith("perf/") and k != "time"]
    assert {k: resumed[2].get(k) for k in same} == {k: metrics[2][k] for k in same}


def test_grpo_token_mean_on_two_data_parallel_ranks(tmp_path):
    """GRPO end to end with DAPO's token-mean aggregation on DP=2, whose loss normaliser is the
    response-token count summed over both ranks: the paper's GRPO eps (0.2 / 0.27) clip per token,
    every step updates, and the rollout log-probs agree with the trainer's."""
    run = tmp_path / "grpo"
    gspo_train(run, "--trainer.steps=3", "--loss.variant=grpo", "--loss.aggregation=token_mean",
               "--loss.clip_low=null", "--loss.clip_high=null", nproc=2)
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    config = open(run / "config.yaml").read()
    assert "variant: grpo" in config and "aggregation: token_mean" in config
    for m in metrics:
        assert m["optim/skipped"] == 0 and m["optim/grad_norm"] > 0
        assert 0 <= m["clip/fraction"] <= 1 and m["response/num_tokens"] > 0
        assert m["kl/rollout_vs_train"] < ROLLOUT_KL_TOL
    # the first minibatch is on-policy (ratio 1): later ones move, so some token ratios do
    assert max(m["ratio/max"] for m in metrics) > 1.0
