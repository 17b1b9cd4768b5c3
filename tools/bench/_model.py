"""Single-process Megatron policies and batches for the CPU benchmarks."""

from __future__ import annotations

import contextlib

import torch

# The tiny preset widened: 4 layers (one dense), 8 experts top-2, vocabulary of a few thousand.
SMALL = dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4,
             kv_channels=32, ffn_hidden_size=512, num_moe_experts=8, moe_router_topk=2,
             moe_ffn_hidden_size=256, moe_layer_freq=[1, 0, 1, 1], vocab_size=4096,
             seq_length=256)
TOY = dict(num_layers=2, hidden_size=32, num_attention_heads=2, num_query_groups=1,
           kv_channels=16, ffn_hidden_size=64, num_moe_experts=4, moe_router_topk=2,
           moe_ffn_hidden_size=32, moe_layer_freq=[1, 1], vocab_size=128, seq_length=32)


def model_config(smoke: bool, **overrides):
    from gspo_megatron.config.model import model_config_from_preset

    return model_config_from_preset("tiny", **{**(TOY if smoke else SMALL), **overrides})


@contextlib.contextmanager
def distributed(model_cfg, seed: int = 0):
    """Megatron's parallel state for one process (gloo, TP=PP=EP=1); torn down on exit."""
    from gspo_megatron.compat import apply_compat
    from gspo_megatron.config.model import ParallelConfig
    from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed

    apply_compat()
    groups = initialize_distributed(ParallelConfig(), model_cfg, seed=seed)
    try:
        yield groups
    finally:
        destroy_distributed()


def policy(model_cfg, groups, with_optimizer: bool = True, seed: int = 0, lr: float = 1e-5,
           local_kernels: bool = True, batch_invariant: bool = False):
    """A Megatron-DDP-wrapped policy (local spec, fp32) with Adam; weights from ``seed``.
    ``local_kernels=False``: Megatron's own modules instead of ours (``precision.local_kernels``);
    ``batch_invariant``: ``precision.batch_invariant``."""
    from gspo_megatron.config.model import ParallelConfig, PrecisionConfig
    from gspo_megatron.config import OptimConfig
    from gspo_megatron.backends.megatron.policy import build_policy

    torch.manual_seed(seed)
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed) if torch.cuda.is_available() else None
    return build_policy(model_cfg, ParallelConfig(),
                        PrecisionConfig(transformer_impl="local", local_kernels=local_kernels,
                                        batch_invariant=batch_invariant),
                        OptimConfig(lr=lr), groups, total_steps=10_000,
                        with_optimizer=with_optimizer)


def random_batch(vocab: int, batch: int, seq: int, prompt: int, seed: int = 0):
    """Full-length sequences (prompt + response), advantages ~ N(0, 1)."""
    from gspo_megatron.policy import make_policy_batch

    gen = torch.Generator().manual_seed(seed)
    seqs = torch.randint(1, vocab, (batch, seq), generator=gen).tolist()
    b = make_policy_batch(seqs, [prompt] * batch, pad_id=0)
    b.advantages = torch.randn(batch, generator=gen)
    return b


def with_old_logprobs(policy_obj, batch, micro_batch_size: int, scoring, groups, noise: float = 0.05,
                      seed: int = 0):
    """``batch.old_logprobs`` = the policy's own log-probs + small noise (ratios != 1, some clipped)."""
    from gspo_megatron.backends.megatron.schedule import compute_logprobs

    lp, _ = compute_logprobs(policy_obj.model, batch, micro_batch_size, scoring, groups)
    gen = torch.Generator().manual_seed(seed)
    batch.old_logprobs = (lp + noise * torch.randn(lp.shape, generator=gen)
                          * batch.response_mask).detach()
    return batch
