"""Shared by the routing-replay tests (unit and torchrun worker)."""

from __future__ import annotations

import torch

from gspo_megatron.backends.megatron.schedule import _run_schedule


def forward_logits(policy, batch, mbs, routing, train):
    """Logits per microbatch (last stage; None elsewhere) through Megatron's schedule, with a
    routing hook; ``train`` also runs a backward (so replay's recompute queue is exercised)."""
    for c in policy.model:
        c.train(train)

    def loss_fn(mb, logits):
        return (logits.float() ** 2).mean(), {"logits": logits.detach().clone()}

    out = _run_schedule(policy.model, batch.split(mbs), forward_only=not train, loss_fn=loss_fn,
                        routing=routing)
    for c in policy.model:
        c.train(True)
    return torch.cat([o["logits"] for o in out]) if out else None
