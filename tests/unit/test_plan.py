"""tools/plan.py: memory of a layout from exact per-rank parameter counts; bad layouts refused."""

import os
import subprocess
import sys

import pytest

from gspo_megatron.model.config import model_config_from_preset
from gspo_megatron.model.params import count_parameters
from gspo_megatron.planner import GIB, Layout, params_per_rank, plan_memory, suggest_layouts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def plan(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan.py"), *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("layout", [Layout(), Layout(tp=2), Layout(ep=4), Layout(pp=2), Layout(tp=2, ep=2, pp=2)])
def test_shards_add_up_to_the_model(layout):
    """Summed over the ranks of one replica, the per-rank counts are the model's parameters
    (replicated tensors — norms, routers — counted once per TP rank)."""
    model = model_config_from_preset("qwen3-30b-a3b")
    total = 0
    for stage in range(layout.pp):
        dense, expert = params_per_rank(model, layout, stage)
        total += dense * layout.tp + expert * layout.ep * layout.etp
    c = count_parameters(model)
    replicated = (2 * model.num_layers + 1) * model.hidden_size + c.routers \
        + 2 * model.head_dim() * model.num_layers
    assert total == c.total + (layout.tp - 1) * replicated


def test_bytes_follow_the_counts():
    model = model_config_from_preset("qwen3-30b-a3b")
    p = plan_memory(model, Layout(tp=2, ep=8), 16, seq_length=4096)
    assert p.weights == 2 * p.params_per_gpu and p.grads == 4 * p.params_per_gpu
    dense_dp, expert_dp = 8, 1  # ETP defaults to TP=2: 16 GPUs / (EP 8 x ETP 2)
    assert p.optimizer == int(12 * p.dense_params_per_gpu / dense_dp + 12 * p.expert_params_per_gpu / expert_dp)
    assert 30 * GIB < p.total < 60 * GIB


def test_cli_refuses_bad_layouts_and_models():
    bad = plan("--model", "qwen3-30b-a3b", "--gpus", "16", "--tp", "3", "--ep", "8")
    assert bad.returncode == 2 and "world size 16 is not divisible" in bad.stderr
    assert "layouts that fit" in bad.stderr
    experts = plan("--model", "qwen3-30b-a3b", "--gpus", "24", "--ep", "24")
    assert experts.returncode == 2 and "num_moe_experts (128) is not divisible" in experts.stderr
    unknown = plan("--model", "qwen9", "--gpus", "8")
    assert unknown.returncode != 0 and "unknown model 'qwen9'" in unknown.stderr
    too_big = plan("--model", "qwen3-235b-a22b", "--gpus", "8", "--ep", "8", "--gpu-memory", "80")
    assert too_big.returncode == 3 and "does not fit" in too_big.stderr
    ok = plan("--model", "qwen3-30b-a3b", "--gpus", "16", "--tp", "2", "--ep", "8")
    assert ok.returncode == 0 and "TP2 PP1 EP8" in ok.stdout


def test_suggestions_fit():
    model = model_config_from_preset("qwen3-235b-a22b")
    plans = suggest_layouts(model, 128, 80, seq_length=4096)
    assert plans and all(p.total <= 0.9 * 80 * GIB for p in plans)
