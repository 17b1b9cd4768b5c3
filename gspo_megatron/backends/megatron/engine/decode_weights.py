"""The fast decoder's weights for one rollout call, and their lifetime.

:class:`WeightsProvider` owns what the decoding step reads beyond the model's own parameters:
the experts stacked for the call (:meth:`~..kernels.decode.DecodeWeights.of`; a grouped
container is read in place), under expert parallelism the other ranks' experts gathered here
(``rollout.decode_experts``, decided over the ranks coupled with this one: :mod:`.lockstep`),
and the QK-norm weights joined per head. It hands them out at a call's start
(:meth:`WeightsProvider.acquire`) and lets go of every one at its end
(:meth:`WeightsProvider.release`): nothing of it is kept between rollouts, so the trainer's
passes run without it (``gspo-plan`` counts it in the rollout phase:
:mod:`gspo_megatron.decode_plan`). :meth:`WeightsProvider.held_bytes` says what it holds now.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from gspo_megatron.backends.megatron.engine.lockstep import agree_all
from gspo_megatron.backends.megatron.kernels.decode import DecodeWeights


def replica_bytes(w: DecodeWeights) -> int:
    """Bytes :func:`replicate_experts` adds on this rank: the other EP ranks' experts."""
    if w.ep_group is None:
        return 0
    mine = sum(t.numel() * t.element_size() for layer in w.layers if layer.router is not None
               for t in (layer.w1, layer.w2))
    return mine * (w.ep_group.size() - 1)


def replicate_experts(w: DecodeWeights) -> DecodeWeights:
    """``w`` with every EP rank's experts here (one all-gather per MoE layer and weight; Megatron
    places rank ``r``'s experts at ``r E_l .. (r + 1) E_l - 1``): its steps then need no
    collective, as at EP = 1. Collective over the EP group."""
    import torch.distributed as dist

    group = w.ep_group
    if group is None:
        return w
    first, count = w.local_experts
    assert first == dist.get_rank(group) * count, (first, count)

    def gathered(t: torch.Tensor) -> torch.Tensor:  # [E_l, A, B] view -> [E, A, B] view
        rows = t.transpose(1, 2).contiguous()  # the stacked layout (no copy: stack_experts')
        parts = [torch.empty_like(rows) for _ in range(group.size())]
        dist.all_gather(parts, rows, group=group)
        return torch.cat(parts).transpose(1, 2)

    layers = [layer if layer.router is None else
              dataclasses.replace(layer, w1=gathered(layer.w1), w2=gathered(layer.w2))
              for layer in w.layers]
    return dataclasses.replace(w, layers=layers, ep_group=None,
                               local_experts=(0, count * group.size()))


def free_bytes(device: torch.device) -> int:
    """Memory free on ``device`` (the host's available pages on CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class WeightsProvider:
    """The decoding step's weights of ``model`` (the ``GPTModel`` that samples) for one call
    at a time. ``vocab``: the output layer's real rows; ``experts``: ``rollout.decode_experts``;
    ``coupled``: the group that decides the replication (:func:`.lockstep.coupled_group`, the
    one that decides each lock-step; None: the world)."""

    def __init__(self, model, vocab: int, experts: str = "auto", coupled=None):
        self.model = model
        self.vocab = int(vocab)
        self.experts = experts
        self.coupled = coupled
        self.weights: DecodeWeights | None = None
        """The current call's (None between calls)."""
        self.replicated = False
        """Whether the current (or last) call gathered every EP rank's experts here."""
        self.fp8_error_sums: list[torch.Tensor] = []
        """The last call's FP8 experts' ``[2]`` error sums (:meth:`fp8_metrics`)."""

    def acquire(self) -> DecodeWeights:
        """The weights for a call: the model's tensors, the experts stacked (and gathered from
        every EP rank when this call replicates them). Collective over :attr:`coupled` under EP."""
        w = DecodeWeights.of(self.model, self.vocab)
        self.replicated = w.ep_group is not None and self._replicate(w)
        if self.replicated:
            w = replicate_experts(w)
        w = fp8_experts(w, getattr(self.model, "fp8_expert_gemm", None))
        self.fp8_error_sums = [x.error_sums for layer in w.layers
                               for x in (layer.fp8_w1, layer.fp8_w2) if x is not None]
        self.weights = w
        return w

    def fp8_metrics(self) -> dict[str, float]:
        """``rollout/fp8_expert_requant_rel_err``: ``||W - Q s|| / ||W||`` of the last call's
        FP8 experts (:func:`fp8_experts`) against the experts they requantized, every MoE layer;
        empty where the experts stayed bf16 (CPU, or the probe failed). One host read."""
        if not self.fp8_error_sums:
            return {}
        err, norm = torch.stack(self.fp8_error_sums).sum(dim=0).tolist()
        return {"rollout/fp8_expert_requant_rel_err": (err / norm) ** 0.5 if norm > 0 else 0.0}

    def release(self) -> None:
        """The call ended: every tensor made for it (stacks, replicas) is let go."""
        self.weights = None

    def held_bytes(self) -> int:
        """Bytes of the tensors held for the current call beyond the model's own storage (the
        stacked and gathered experts, the joined QK-norm weights); 0 between calls."""
        if self.weights is None:
            return 0
        own = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        seen: dict[int, int] = {}
        for layer in self.weights.layers:
            for t in (x for v in vars(layer).values()
                      for x in (v.tensors() if hasattr(v, "tensors") else (v,))):
                if torch.is_tensor(t):
                    storage = t.untyped_storage()
                    if storage.data_ptr() not in own:
                        seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def _replicate(self, w: DecodeWeights) -> bool:
        """``rollout.decode_experts`` for this call, decided alike on every coupled rank (one
        MIN all-reduce over :attr:`coupled`): ``replicated`` / ``sharded`` as asked; ``auto``:
        whether the other ranks' experts take at most a quarter of the free memory on every
        coupled rank."""
        if self.experts != "auto":
            want = self.experts == "replicated"
        else:
            want = 4 * replica_bytes(w) <= free_bytes(w.embedding.device)
        return agree_all(want, self.coupled)


def fp8_experts(w: DecodeWeights, gemm) -> DecodeWeights:
    """``w`` with each MoE layer's experts also in FP8 for the decoding step's grouped GEMM
    (``rollout.precision: fp8`` where :func:`~gspo_megatron.rollouts.fp8.fp8_grouped_gemm_works`:
    ``gemm``, the copy model's ``fp8_expert_gemm``; None: ``w`` itself). Hopper's
    ``torch._scaled_grouped_mm`` takes one scale per row of each expert, not the 128 x 128
    blocks the copy's weights were quantized in, so the experts the step would multiply (the
    block-wise FP8 weights, dequantized: the CPU path's numerics) are quantized once more, per
    expert and output row, for the call (a second rounding, within e4m3's step of the first:
    ``tools/gpu_check``'s ``fp8_decode`` stage measures its agreement). Made per call, after
    any EP replication, and let go with the call's other tensors. Layers whose ``K`` the kernel
    does not take (:func:`~gspo_megatron.rollouts.fp8.fp8_grouped_unfit`) keep bf16."""
    if gemm is None:
        return w
    from gspo_megatron.rollouts.fp8 import Fp8Experts, fp8_grouped_unfit

    layers = []
    for layer in w.layers:
        if layer.router is not None:  # w1 [E, H, (2) F], w2 [E, F, H]: F.linear's [N, K] per expert
            w1, w2 = layer.w1.transpose(1, 2), layer.w2.transpose(1, 2)
            if fp8_grouped_unfit(w1.shape[-1]) is None and fp8_grouped_unfit(w2.shape[-1]) is None:
                layer = dataclasses.replace(layer, fp8_w1=Fp8Experts(w1, gemm),
                                            fp8_w2=Fp8Experts(w2, gemm))
        layers.append(layer)
    return dataclasses.replace(w, layers=layers)
