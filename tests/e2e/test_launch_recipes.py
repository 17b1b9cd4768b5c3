"""Each shipped Qwen3 recipe (``examples/configs/qwen3_*.yaml``) through the SLURM launch scripts
with its own parallel layout, the model shrunk by overrides, on gloo: one RL step and a
checkpoint, then a resume (the stand-ins: ``tests/helpers/fake_slurm.py``). Its own file so that
the suite's workers share the launch tests (one file per worker)."""

import json
import os
import subprocess

import pytest

from gspo_megatron.metrics import read_metrics
from tests.helpers.fake_slurm import LAUNCH, ROOT, SUBMIT, fake_slurm, output  # noqa: F401

# --------------------------------------------------------------------------- shipped recipes
# Each shipped Qwen3 recipe through the launch scripts with its own parallel layout, the model
# shrunk by overrides, on gloo: two RL steps, a checkpoint, a resume. The recipes' expert
# parallelism (8, or 64) needs 8-128 processes, more than 2 cores bear: EP is cut to the TP size,
# so a run is TP processes with one data-parallel rank. Every recipe ships TP 4; the 235B one
# runs it, the 30B ones are halved to TP 2 (the suite's time is bounded; their TP-4 decoding is
# tests/distributed/test_decode_recipes.py's). The GRPO recipe goes through submit.sh on a
# 2-node fake allocation (1 process a node: the multi-node path), the others through
# torchrun_single_node.sh.
RECIPE_LAYOUTS = {  # recipe file -> (MODEL of launch/models, TP shipped, EP shipped, TP as run)
    "qwen3_30b_a3b_gspo.yaml": ("qwen3-30b-a3b", 4, 8, 2),
    "qwen3_30b_a3b_grpo.yaml": ("qwen3-30b-a3b", 4, 8, 2),
    "qwen3_30b_a3b_gspo_16k.yaml": ("qwen3-30b-a3b", 4, 8, 2),
    "qwen3_235b_a22b_gspo.yaml": ("qwen3-235b-a22b", 4, 64, 4),
}
# What a CPU cannot run or a CI machine does not have, and nothing else: the recipe's layout,
# loss, rollout and trainer settings stay as shipped.
SHRINK = [
    # The Qwen3 shape at toy size: 8 heads / 4 KV groups divide TP 4, 8 experts divide EP 4.
    "--model.num_layers=2", "--model.hidden_size=64", "--model.num_attention_heads=8",
    "--model.num_query_groups=4", "--model.kv_channels=8", "--model.ffn_hidden_size=128",
    "--model.num_moe_experts=8", "--model.moe_router_topk=2", "--model.moe_ffn_hidden_size=32",
    "--model.vocab_size=128", "--model.seq_length=16",
    # fp32 on Megatron's local spec (CPU); Megatron's distributed optimizer asserts CUDA tensors.
    "--precision.transformer_impl=auto", "--precision.bf16=false",
    "--optim.use_distributed_optimizer=false",
    # No Hugging Face download, no converted checkpoint, no wandb: a tokenizer trained on the
    # data, random weights.
    "--tokenizer.kind=sentencepiece", "--tokenizer.path=null", "--tokenizer.chat_template_kwargs=null",
    "--checkpoint.init_weights=null", "--logging.wandb_project=null", "--logging.progress=false",
    # Short sequences, 2 prompts x 4 per data-parallel rank (the recipes' minibatches divide 8);
    # the recipe's math_verify reward in threads (4 ranks x 4 worker processes would crowd 2 cores).
    "--data.max_prompt_length=8", "--rollout.max_new_tokens=4", "--overlong.buffer_tokens=0",
    "--rollout.group_size=4", "--rollout.prompts_per_step=2", "--reward.num_workers=0",
    # The resumed run's schedule is the first one's (trainer.steps differs between them).
    "--optim.lr_decay_steps=8",
]


def verl_jsonl(path, n=64) -> str:
    """``n`` one-digit sums in verl's layout (chat prompt, reward_model.ground_truth)."""
    import random

    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"{a}+{b}="}],
                                "reward_model": {"ground_truth": str(a + b)}}) + "\n")
    return str(path)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("recipe", sorted(RECIPE_LAYOUTS))
def test_shipped_recipe_launches_checkpoints_and_resumes(fake_slurm, tmp_path, recipe):
    env, state, run = fake_slurm
    model, tp_shipped, ep_shipped, tp = RECIPE_LAYOUTS[recipe]
    recipe_path = os.path.join(ROOT, "examples", "configs", recipe)
    text = open(recipe_path).read()  # the table above is the recipe's layout
    assert f"tensor_model_parallel_size: {tp_shipped}\n" in text
    assert f"expert_model_parallel_size: {ep_shipped}\n" in text
    via_slurm = recipe == "qwen3_30b_a3b_grpo.yaml"
    env.update(MODEL=model, RECIPE=recipe_path, NNODES="2" if via_slurm else "1",
               GPUS_PER_NODE=str(tp // 2 if via_slurm else tp), SAVE_DIR=str(run / "checkpoints"))
    args = [*SHRINK, f"--data.train_path={verl_jsonl(tmp_path / 'train.jsonl')}",
            f"--parallel.expert_model_parallel_size={tp}"]
    if tp != tp_shipped:
        args.append(f"--parallel.tensor_model_parallel_size={tp}")
    script = SUBMIT if via_slurm else os.path.join(LAUNCH, "torchrun_single_node.sh")

    def launch(steps: int):
        return subprocess.run(["bash", script, *args, f"--trainer.steps={steps}"], env=env,
                              capture_output=True, text=True, timeout=600, cwd=ROOT)

    first = launch(1)
    assert first.returncode == 0, output(first)
    assert f"layout TP{tp} PP1 EP{tp} ETP1 CP1 DP1 on {tp} GPUs" in first.stderr, output(first)
    assert (run / "checkpoints" / "iter_0000001").is_dir()
    second = launch(2)
    assert second.returncode == 0, output(second)
    assert f"resumed from {run / 'checkpoints'} at step 1" in second.stdout, output(second)
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]
    # Each step rolled out and updated: the grad norm is a real, finite, non-zero number.
    assert all(0 < m["optim/grad_norm"] < float("inf") and m["response/num_tokens"] > 0
               for m in metrics), metrics
    # Every rank wrote its part of the final checkpoint.
    rng = sorted(os.listdir(run / "checkpoints" / "iter_0000002" / "rng"))
    assert rng == [f"rank_{r:05d}.pt" for r in range(tp)]
    assert json.loads((run / "summary.json").read_text())["exit_code"] == 0
    if via_slurm:  # 2 nodes of 1 process: sbatch, srun, a torchrun per node, twice
        calls = (state / "sbatch_calls").read_text().splitlines()
        assert len(calls) == 2 and "--nodes=2" in calls[0] and "--gpus-per-node=1" in calls[0]
        assert "--signal=B:USR1@600 --requeue" in calls[0]
        assert "--ntasks-per-node=1" in (state / "srun_calls").read_text()
        for node in (0, 1):
            assert f"node {node}/2: torchrun with 1 processes" in first.stderr, output(first)
            assert f"node {node}: torchrun exited with 0" in first.stderr, output(first)
        assert not (state / "requeue_calls").exists()
