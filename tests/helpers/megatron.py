"""Test-only entry points into the Megatron backend: a minibatch update straight through the
schedule (without a ``MegatronPolicy``), gradients saved as weights, grouped sampling. The package
keeps only what the trainer runs."""

from __future__ import annotations

import torch

from gspo_megatron.algorithms import NLLObjective, PolicyGradientObjective, PolicyLossConfig
from gspo_megatron.backends.megatron.schedule import ScoringConfig, run_objective
from gspo_megatron.distributed import ParallelGroups
from gspo_megatron.policy import PolicyBatch, RolloutSample


def train_minibatch(policy_model: list, batch: PolicyBatch, micro_batch_size,
                    loss_cfg: PolicyLossConfig, scoring: ScoringConfig, groups: ParallelGroups,
                    routing=None, corrupt=None, correction=None,
                    response_budget: int | None = None) -> dict[str, float]:
    """One RL minibatch: :class:`PolicyGradientObjective` at the scoring temperature through
    :func:`run_objective` (the trainer goes through ``MegatronPolicy.train_minibatch``).
    ``micro_batch_size``: an int (padded rows) or a :class:`~gspo_megatron.backends.megatron.
    schedule.Microbatching` (packed under a token budget). ``response_budget``: Dr. GRPO's
    constant (the rollout's ``max_new_tokens``)."""
    objective = PolicyGradientObjective(loss_cfg, scoring.temperature, corrupt,
                                        correction=correction, response_budget=response_budget)
    return run_objective(policy_model, batch, micro_batch_size, objective, scoring, groups, routing)


def train_sft_minibatch(policy_model: list, batch: PolicyBatch, micro_batch_size: int,
                        scoring: ScoringConfig, groups: ParallelGroups) -> dict[str, float]:
    """Supervised warm-up minibatch: :class:`NLLObjective` through :func:`run_objective`."""
    return run_objective(policy_model, batch, micro_batch_size, NLLObjective(), scoring, groups)


@torch.no_grad()
def grads_to_params(gpt_model) -> None:
    """Overwrite every parameter with its reduced gradient (``main_grad`` from Megatron DDP), so
    a test can gather them (:func:`full_state`) and compare them across layouts."""
    for p in gpt_model.parameters():
        grad = getattr(p, "main_grad", None)
        if grad is None:
            grad = p.grad
        p.copy_(grad if grad is not None else torch.zeros_like(p))


def full_state(gpt_model) -> dict[str, torch.Tensor] | None:
    """Every tensor of ``gpt_model``'s sharded state dict assembled whole, in fp32, on rank 0
    (None on the other ranks): what ``dist_checkpointing`` saves, unsharded over TP/EP/PP/DP/CP,
    in memory. Every rank's main-replica pieces
    (:class:`~gspo_megatron.backends.megatron.weight_transfer.ShardIndex`) gathered with
    ``all_gather_object``: fine for a test's model, never for a real one. After
    :func:`grads_to_params`, the gradients."""
    import torch.distributed as dist

    from gspo_megatron.backends.megatron.weight_transfer import ShardIndex

    mine = [(p.box, p.tensor.to("cpu", torch.float32, copy=True))
            for p in ShardIndex(gpt_model).pieces(main_only=True)]
    gathered = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if dist.get_rank() != 0:
            return None
    whole: dict[str, torch.Tensor] = {}
    for box, data in (piece for rank in gathered for piece in rank):
        out = whole.setdefault(box.key, torch.zeros(box.global_shape))
        out[tuple(slice(s, s + n) for s, n in zip(box.start, box.shape))] = data
    return whole


def generate_groups(engine, prompts: list[list[int]], seed: int,
                    group_size: int) -> list[list[RolloutSample]]:
    """``group_size`` samples per prompt from ``engine`` (one ``generate``), grouped per prompt."""
    flat = engine.generate([list(p) for p in prompts for _ in range(group_size)], seed)
    return [flat[i * group_size:(i + 1) * group_size] for i in range(len(prompts))]
