"""End-to-end runs of ``gspo-train`` on the tiny MoE (CPU, gloo): learning, exact resume after a
SIGKILL, and a 2-process expert-parallel run."""

import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest

from gspo_megatron.metrics import read_metrics

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


def clean_env(extra=None) -> dict:
    """The test's environment without any torch.distributed rendezvous variables."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", WANDB_MODE="disabled", **(extra or {}))
    return env


def gspo_train(run_dir, *overrides, nproc=1, env_extra=None, check=True, timeout=600):
    """Run gspo-train in its own process group; returns a CompletedProcess with stdout/stderr.

    Output goes to files, not pipes, and the whole group is killed afterwards: a run that SIGKILLs
    itself can leave helper processes (the checkpoint writer) that would hold a pipe open."""
    env = clean_env(env_extra)
    args = ["--config", RECIPE, f"--logging.run_dir={run_dir}", *SMALL, *overrides]
    if nproc == 1:
        cmd = [sys.executable, "-m", "gspo_megatron.cli", *args]
    else:
        from gspo_megatron.backends.megatron.parallel import _free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={_free_port()}", "-m", "gspo_megatron.cli", *args]
    os.makedirs(run_dir, exist_ok=True)
    log_dir = tempfile.mkdtemp(prefix="gspo_train_log_")
    out_path, err_path = os.path.join(log_dir, "stdout"), os.path.join(log_dir, "stderr")
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, cwd=ROOT,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # leftovers of this run only (its own group)
            except ProcessLookupError:
                pass
    result = subprocess.CompletedProcess(cmd, returncode, open(out_path).read(), open(err_path).read())
    if check:
        assert returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def test_kill_after_checkpoint_then_resume_matches_uninterrupted(tmp_path):
    steps = ["--trainer.steps=4", "--checkpoint.save_interval=2"]
    straight = tmp_path / "straight"
    gspo_train(straight, *steps)

    resumed = tmp_path / "resumed"
    killed = gspo_train(resumed, *steps, env_extra={"GSPO_FAULT": "step_start:3"}, check=False)
    assert killed.returncode != 0  # SIGKILLed at the start of step 3, after the step-2 checkpoint
    assert (resumed / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "2"
    proc = gspo_train(resumed, *steps)
    assert "resumed from" in proc.stdout

    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(resumed / "metrics.jsonl")
    assert [m["step"] for m in b] == [0, 1, 2, 3]
    for key in ("reward/mean", "loss/policy", "clip/fraction", "kl/rollout_vs_train", "optim/grad_norm"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    sa = json.loads((straight / "summary.json").read_text())
    sb = json.loads((resumed / "summary.json").read_text())
    assert sa["accuracy_after"] == sb["accuracy_after"]


@pytest.mark.distributed
def test_two_process_expert_parallel_run(tmp_path):
    run = tmp_path / "ep2"
    gspo_train(run, "--trainer.steps=2", "--parallel.expert_model_parallel_size=2", nproc=2)
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:
        for key in ("reward/mean", "reward/accuracy", "clip/fraction", "loss/policy",
                    "kl/rollout_vs_train", "perf/step_s", "perf/rollout_s", "perf/update_s"):
            assert key in m, key
    assert abs(metrics[0]["kl/rollout_vs_train"]) < 1e-3


def test_gspo_raises_reward(tmp_path):
    """The first 150 steps of the demo (same settings and LR schedule, so the same run up to float
    differences): GSPO raises the reward on training prompts (the whole demo goes 0.32 -> 0.63)."""
    run = tmp_path / "learn"
    demo = ["--data.num_train_examples=500", "--data.num_eval_examples=120", "--model.seq_length=64",
            "--rollout.group_size=8", "--rollout.prompts_per_step=16", "--trainer.num_minibatches=4",
            "--trainer.micro_batch_size=16", "--sft.steps=300", "--sft.batch_size=64",
            "--optim.lr_decay_steps=2400", "--trainer.eval_interval=0"]
    gspo_train(run, *demo, "--trainer.steps=150")
    rewards = [m["reward/mean"] for m in read_metrics(run / "metrics.jsonl")]
    first, last = sum(rewards[:30]) / 30, sum(rewards[-30:]) / 30
    assert last > first + 0.03, (first, last)


def test_recipe_without_loss_optim_sft_trains_with_the_papers_defaults(tmp_path):
    """A recipe with only model, data, rollout and trainer sections: gspo-train runs it with the
    paper's GSPO eps, the fine-tuning optimiser and no supervised warm-up."""
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
                          env=clean_env(), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import yaml
    saved = yaml.safe_load((run / "config.yaml").read_text())
    from gspo_megatron.algorithms import PolicyLossConfig
    loss = PolicyLossConfig(**saved["loss"])
    assert (loss.variant, loss.eps_low, loss.eps_high) == ("gspo", 3e-4, 4e-4)  # paper Sec. 5.1
    assert saved["sft"]["steps"] == 0 and saved["optim"]["lr"] == 1e-6
    assert "sft step" not in proc.stdout and not (run / "sft_weights").exists()
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
        # the first update forward replays the rollout's routes: nothing drifted yet
        assert m["routing/drift/after_0_updates"] < 0.05
