"""The decoding step reads every build we ship through adapters, not module types
(``kernels/adapters.py``): Transformer Engine's fused norm + linear modules and ``TEGroupedMLP``
(CPU stand-ins with TE's parameter names and layouts, ``tests/helpers/te_standins.py``) and
Megatron's ``GroupedMLP`` (its ``grouped_gemm`` kernel stood in) decode through the multi-step
step function with Megatron's forward's greedy tokens; what no adapter reads is named in one
WARNING line and ``rollout/decode_path`` 0."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.unit.test_fast_decode import assert_same
from tests.unit.test_rollout import EOS, PAD, VOCAB, make_prompts, setup  # noqa: F401

pytestmark = pytest.mark.slow  # builds Megatron models


def build(groups, **overrides):
    """The tiny MoE with a dense first layer (Qwen3's ``mlp_only_layers``), output sharpened."""
    from gspo_megatron.backends.megatron.policy import build_policy
    from gspo_megatron.config import OptimConfig
    from gspo_megatron.config.model import (ParallelConfig, PrecisionConfig,
                                            model_config_from_preset)

    cfg = model_config_from_preset("tiny", vocab_size=VOCAB, seq_length=64, moe_layer_freq=[0, 1],
                                   **overrides)
    torch.manual_seed(5)
    policy = build_policy(cfg, ParallelConfig(), PrecisionConfig(transformer_impl="local"),
                          OptimConfig(), groups, total_steps=1, with_optimizer=False)
    with torch.no_grad():
        policy.unwrapped().output_layer.weight.mul_(30.0)
    return policy


def decode_both(policy, groups, **cfg):
    """(Megatron's forward every step, the step function): engines and their samples."""
    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
    from gspo_megatron.config import RolloutConfig

    prompts, out = make_prompts(12, seed=9), []
    for k in (0, 16):
        engine = RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=PAD, vocab_size=VOCAB,
                               config=RolloutConfig(max_new_tokens=20, max_batch_size=8, top_k=1,
                                                    decode_steps_per_sync=k, **cfg))
        out.append((engine, engine.generate(prompts, seed=0)))
    return out


def forward_logits(model):
    ids = torch.tensor([[3, 5, 7, 4, 9, 6]])
    with torch.no_grad():
        return model(ids, torch.arange(6)[None], attention_mask=None)


def test_te_fused_modules_and_grouped_experts_decode_through_the_step(setup):  # noqa: F811
    from gspo_megatron.backends.megatron.kernels.adapters import FusedNorm
    from gspo_megatron.backends.megatron.kernels.decode import DecodeWeights, unsupported
    from tests.helpers.te_standins import TEGroupedMLP, to_te_standins

    _, groups = setup
    policy = build(groups)
    model = policy.unwrapped()
    before = forward_logits(model)
    to_te_standins(model)
    # the stand-ins are Megatron's forward with TE's norm formula (fp32 here: within rounding)
    assert torch.allclose(forward_logits(model), before, atol=1e-5, rtol=1e-5)
    assert isinstance(model.decoder.layers[1].mlp.experts, TEGroupedMLP)
    assert unsupported(model, groups) is None
    w = DecodeWeights.of(model)
    assert isinstance(w.layers[0].input_norm, FusedNorm)  # attention's, fused into linear_qkv
    assert isinstance(w.layers[0].mlp_norm, FusedNorm)  # the dense MLP's, into its linear_fc1
    assert w.layers[0].qkv is model.decoder.layers[0].self_attention.linear_qkv.weight
    x = torch.randn(3, 1, model.config.hidden_size, dtype=torch.float32)
    from tests.helpers.te_standins import te_rms_norm
    norm = w.layers[0].input_norm
    assert torch.equal(norm(x), te_rms_norm(x, norm.weight, norm.eps))
    (per_step, a), (rounds, b) = decode_both(policy, groups)
    assert per_step.decode_path == 0.0 and rounds.decode_path == 1.0
    assert_same(a, b)
    assert {s.finish_reason for s in a} == {"eos", "length"}


def test_grouped_mlp_experts_are_read_as_views(setup, monkeypatch):  # noqa: F811
    """``moe_grouped_gemm`` with the local spec builds Megatron's ``GroupedMLP`` (its
    ``grouped_gemm`` kernel stood in on CPU): the step reads its ``weight1`` / ``weight2`` as
    Megatron's own ``[E, H, 2F]`` / ``[E, F, H]`` views (no copy) and decodes Megatron's
    forward's greedy tokens."""
    from megatron.core.transformer.moe.experts import GroupedMLP

    from gspo_megatron.backends.megatron.kernels.decode import DecodeWeights, unsupported
    from tests.helpers.te_standins import grouped_mlp_on_cpu

    grouped_mlp_on_cpu(monkeypatch)
    _, groups = setup
    policy = build(groups)
    model = policy.unwrapped()
    experts = model.decoder.layers[1].mlp.experts
    assert type(experts) is GroupedMLP and model.config.moe_grouped_gemm
    assert unsupported(model, groups) is None
    w = DecodeWeights.of(model).layers[1]
    assert w.w1.data_ptr() == experts.weight1.data_ptr() and w.w1.shape[0] == 4
    assert w.w2.data_ptr() == experts.weight2.data_ptr()
    (_, a), (rounds, b) = decode_both(policy, groups)
    assert rounds.dynamic.fast is not None
    assert_same(a, b)


def test_what_no_adapter_reads_is_named_once(setup, caplog):  # noqa: F811
    from gspo_megatron.backends.megatron.kernels.decode import unsupported

    class OpaqueExperts(torch.nn.Module):  # weights under names no adapter knows
        def __init__(self):
            super().__init__()
            self.w_in = torch.nn.Parameter(torch.zeros(1))

    _, groups = setup
    policy = build(groups)
    policy.unwrapped().decoder.layers[1].mlp.experts = OpaqueExperts()
    why = unsupported(policy.unwrapped(), groups)
    assert why.startswith("experts of type OpaqueExperts: no adapter reads their weights")
    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
    from gspo_megatron.config import RolloutConfig

    with caplog.at_level(logging.WARNING):
        engine = RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=PAD, vocab_size=VOCAB,
                               config=RolloutConfig(max_new_tokens=4, max_batch_size=4, top_k=1))
    lines = [r for r in caplog.records if "decode_steps_per_sync" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING and why in lines[0].getMessage()
    assert engine.decode_path == 0.0
