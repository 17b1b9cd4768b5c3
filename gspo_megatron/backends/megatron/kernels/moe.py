"""Faster torch modules for the MoE layer of Megatron's *local* layer spec (the CPU path, and GPUs
without TE): drop-in subclasses as in :mod:`.local` (same parameters, ``state_dict`` and
maths; each takes its short path only where it is exactly equivalent, otherwise Megatron's own).

* :class:`LoopedSequentialMLP`: Megatron's ``SequentialMLP`` calls one ``MLP`` module (two linear
  modules, an activation closure) per expert; this runs the same per-expert GEMM pair as plain
  ``F.linear`` calls and, without autograd, skips experts that received no token. Inside
  :func:`stacked_expert_weights` (the rollout engine's generate) the experts of a CPU model run as
  two ``torch._grouped_mm`` calls instead, bitwise equal to the loop (the HF model's path). With
  autograd (the update's forward) a CPU model's experts are grouped GEMMs too, over weights
  stacked inside autograd each forward: forward and backward bitwise the loop's (-6 % of an
  update's forward + backward on TRL's workload, ``docs/benchmarks.md`` section 10). The same
  grouped GEMMs run on a Hopper GPU in bf16 (:func:`grouped_mm_runs_on`).
* :class:`DirectMoELayer`: on one expert and one tensor rank the token dispatch is Megatron's
  ``permute``/``unpermute`` pair alone, with or without autograd; the all-to-all dispatcher's
  single-rank collectives and its chunk sorts (identity permutations at EP=1, ~40 tensor ops per
  layer and decoding step, as many again in backward) are skipped. Bitwise the dispatcher's
  output and gradients.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import permute, unpermute
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from gspo_megatron.backends.megatron.kernels import batch_invariant as bi
from gspo_megatron.backends.megatron.kernels.local import single_rank
from gspo_megatron.backends.megatron.schedule import module_list


class LoopedSequentialMLP(SequentialMLP):
    """``SequentialMLP`` whose expert loop calls ``F.linear`` directly (expert-TP size 1).

    Per local expert ``e`` with ``n_e`` tokens ``x_e [n_e, H]`` and router probs ``p_e [n_e]``:
    ``out_e = W2_e (p_e * silu(a) * b)`` with ``[a, b] = W1_e x_e`` (SwiGLU; plain activation
    when the config is not gated), exactly :class:`megatron.core.transformer.mlp.MLP`'s maths with
    ``per_token_scale``. Output rows stay in the dispatcher's permuted order.
    """

    @functools.cached_property  # layout and config are fixed once built: decided on first call
    def _direct(self) -> bool:
        c = self.config
        return (single_rank(self.tp_group) and not (c.fp8 or c.fp4) and not c.add_bias_linear
                and not c.moe_apply_probs_on_input and not c.use_te_activation_func
                and c.activation_func_clamp_value is None and not c.bias_activation_fusion
                and not c.gradient_accumulation_fusion)

    stacked: tuple[torch.Tensor, torch.Tensor] | None = None
    """``(W1 [E, H, (2)F], W2 [E, F, H])``: the local experts' weights stacked, as transposed views
    (the memory layout ``F.linear`` reads), while :func:`stacked_expert_weights` is active."""

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if not self._direct:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        if bi.enabled(self.config):  # each expert's rows through the fixed-tile GEMM
            return self._invariant(permuted_local_hidden_states, tokens_per_expert,
                                   permuted_probs), None
        if self.stacked is not None and not torch.is_grad_enabled():
            return self._grouped(permuted_local_hidden_states, tokens_per_expert, permuted_probs,
                                 self.stacked)
        if torch.is_grad_enabled() and self._grouped_training:
            # Stacked inside autograd (the weights change every step): the stack's backward
            # hands each expert its own slice of the grouped GEMM's weight gradient (an exact
            # zero for an expert without tokens, as the loop's empty GEMMs give). Cost: a copy
            # of this layer's expert weights per forward, held until backward (the grouped GEMM
            # saves it), and its gradient; ~0.2 MB per layer on TRL's workload.
            return self._grouped(permuted_local_hidden_states, tokens_per_expert, permuted_probs,
                                 stack_experts(self.local_experts))
        counts = tokens_per_expert.tolist()
        # Without autograd an empty expert is skipped; with it, the empty GEMMs still run so every
        # weight gets a (zero) gradient, as Megatron's DDP bucketing expects.
        skip_empty = not torch.is_grad_enabled()
        outputs = []
        for expert, x, p in zip(self.local_experts,
                                torch.split(permuted_local_hidden_states, counts),
                                torch.split(permuted_probs, counts)):
            if skip_empty and x.shape[0] == 0:
                continue
            h = F.linear(x, expert.linear_fc1.weight)  # [n_e, H] -> [n_e, (2) F]
            outputs.append(F.linear(self._activate(h, p, x.dtype),  # [n_e, F] -> [n_e, H]
                                    expert.linear_fc2.weight))
        if not outputs:  # no expert got a token on this rank
            return permuted_local_hidden_states.new_zeros(permuted_local_hidden_states.shape), None
        return torch.cat(outputs, dim=0), None

    def _activate(self, h: torch.Tensor, probs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``p_e * act(h)`` (SwiGLU when gated): ``[n, (2)F] -> [n, F]``."""
        c = self.config
        return bi.scaled_activation(h, probs, c.activation_func, c.gated_linear_unit,
                                    c.glu_linear_offset, dtype)

    def _invariant(self, x: torch.Tensor, tokens_per_expert, probs) -> torch.Tensor:
        """``[N, H]``: the rows ``x [N, H]`` (expert-major) through their expert by
        :func:`.batch_invariant.expert_linear` (``precision.batch_invariant``); Megatron's
        ``unpermute`` then adds each token's outputs in this (ascending expert) order, as
        :func:`.batch_invariant.experts` does in the decoding step."""
        counts = tokens_per_expert.tolist()
        # (the stack held for a rollout or scoring pass, else stacked now: inside autograd)
        w1, w2 = (self.stacked if self.stacked is not None and not torch.is_grad_enabled()
                  else stack_experts(self.local_experts))
        # [E, (2)F, H] and [E, H, F]: F.linear's layout
        return bi.expert_mlp(x, counts, probs, w1.transpose(1, 2), w2.transpose(1, 2),
                             lambda h, p: self._activate(h, p, x.dtype))

    @functools.cached_property  # layout and device are fixed once built: decided on first call
    def _grouped_training(self) -> bool:
        """Whether the training (autograd) forward runs the experts as grouped GEMMs too: where
        ``torch._grouped_mm`` runs (:func:`grouped_mm_runs_on`; on CPU its forward and backward
        are bitwise the per-expert ``F.linear`` loop's: ``tests/unit/test_local_kernels.py``)."""
        return bool(self.local_experts) and grouped_mm_runs_on(
            self.local_experts[0].linear_fc1.weight)

    def _grouped(self, x, tokens_per_expert, probs, stacked):
        """All local experts in two grouped GEMMs over the rows ``x [N, H]`` sorted by expert:
        ``offs`` are the cumulative row counts (int32), an empty expert is an empty group. One
        kernel call per GEMM instead of ``2 E`` (the loop's Python and dispatch cost per expert is
        most of a decoding step's MoE time at small widths). ``stacked``: ``(W1 [E, H, (2)F],
        W2 [E, F, H])`` as in :attr:`stacked`."""
        w1, w2 = stacked
        # (Megatron's dispatcher may hand the counts over on the host; the kernel wants them
        # beside the rows.)
        offs = tokens_per_expert.cumsum(0).to(device=x.device, dtype=torch.int32)
        h = torch._grouped_mm(x, w1, offs=offs)  # [N, H] x [E, H, (2)F] -> [N, (2)F]
        return torch._grouped_mm(self._activate(h, probs, x.dtype), w2, offs=offs), None


def stack_experts(experts) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W1 [E, H, (2)F], W2 [E, F, H])``: the experts' ``linear_fc1`` / ``linear_fc2`` weights
    stacked, as transposed views (the memory layout ``F.linear`` reads; what
    ``torch._grouped_mm`` takes); a copy, inside autograd when it is on."""
    return (torch.stack([e.linear_fc1.weight for e in experts]).transpose(1, 2),
            torch.stack([e.linear_fc2.weight for e in experts]).transpose(1, 2))


def grouped_mm_runs_on(weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes experts shaped and placed like ``weight``: any dtype on
    CPU; bf16 on a Hopper or newer GPU (its CUTLASS kernel: one launch for all experts instead of
    two GEMM launches and a host sync per expert in Megatron's ``SequentialMLP``)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if weight.device.type == "cpu":
        return True
    return (weight.device.type == "cuda" and weight.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(weight.device) >= (9, 0))


@contextlib.contextmanager
def stacked_expert_weights(model):
    """While active, every :class:`LoopedSequentialMLP` of ``model`` that takes its short path,
    on a device where :func:`grouped_mm_runs_on`, runs its experts without autograd as two
    ``torch._grouped_mm`` calls over weights stacked on entry (on CPU bitwise equal to the
    per-expert loop: the stacked weights are transposed views with ``F.linear``'s memory layout).

    Valid only while the weights do not change: the rollout engine wraps one ``generate`` in it.
    Cost: one extra copy of this rank's expert weights for the duration (a ``torch.stack`` per
    layer on entry, ~10 us per layer on the tiny model; 1.2 GB per layer of Qwen3-30B-A3B's
    shape, bf16); nothing without ``torch._grouped_mm``.
    """
    mlps = [m for m in module_list(model, "looped_experts",
                                   lambda m: [m] if isinstance(m, LoopedSequentialMLP) else [])
            if m._direct and m.local_experts
            and grouped_mm_runs_on(m.local_experts[0].linear_fc1.weight)]
    try:
        with torch.no_grad():
            for m in mlps:
                m.stacked = stack_experts(m.local_experts)
        yield
    finally:
        for m in mlps:
            m.stacked = None


def permute_without_host_reads(tokens: torch.Tensor, routing_map: torch.Tensor,
                               probs: torch.Tensor, routed: int):
    """Megatron's ``permute`` (``tokens [T, H]`` into expert-major order, each expert's tokens in
    token order, with their router ``probs [T, E]``) when the number of routes ``routed`` is
    known on the host (``T x k``, no padded token): the positions of the ``routing_map [T, E]``
    entries, expert-major, by a stable sort of the transposed map instead of ``masked_select``,
    so the output sizes never wait for the device (two host reads per MoE layer and decoding
    step fewer; a CUDA graph can hold it). The same indices in the same order: bitwise
    Megatron's ``(permuted tokens [routed, H], permuted probs [routed], sorted token indices)``,
    gradients included (each entry is gathered once)."""
    num_tokens = routing_map.size(0)
    flat = routing_map.T.reshape(-1)  # [E T], expert-major
    # the routed entries first, in their expert-major order (stable), then the rest
    order = torch.argsort((~flat).to(torch.int8), stable=True)[:routed]
    sorted_indices = order % num_tokens
    permuted_probs = probs.T.reshape(-1).index_select(0, order)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


class EagerBiasTopKRouter(TopKRouter):
    """``TopKRouter`` whose ``_apply_expert_bias`` returns at once when expert bias is off.

    Megatron's router calls ``_apply_expert_bias`` (the aux-loss-free balancing counts) in every
    routing, and the method is under ``jit_fuser`` (``torch.compile``): even with the CPU compat's
    eager stance each call passes dynamo's wrapper (~20 us; twice per decoding step and per
    forward on the tiny model) to do nothing unless ``moe_router_enable_expert_bias``. With it on,
    Megatron's method runs as before."""

    def gating(self, input: torch.Tensor):
        """Router logits ``[T, E]`` in the router dtype; under ``precision.batch_invariant``
        through :func:`.batch_invariant.linear` (the decoding step's :func:`..decode._route`
        too), else Megatron's."""
        if not bi.enabled(self.config) or self.bias is not None:
            return super().gating(input)
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(
            self.config.moe_router_dtype, input.dtype)
        return bi.linear(input.to(dtype), self.weight.to(dtype))

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if self.enable_expert_bias:
            return super()._apply_expert_bias(routing_map, padding_mask)
        return None


class DirectMoELayer(MoELayer):
    """``MoELayer`` whose forward on a single expert/tensor rank routes, permutes and combines
    with Megatron's own ``permute``/``unpermute`` directly (rollout, old-log-prob pass and the
    update's forward alike).

    At EP = TP = 1 the all-to-all dispatcher's work reduces to: ``permute`` the tokens ``[T, H]``
    into expert-major order (with their router probs), run the experts, ``unpermute`` (scatter-add
    the ``k`` expert outputs of each token back). Its all-to-alls are then copies to a group of one
    and its ``sort_chunks_by_idxs`` calls identity permutations (host syncs, a split and a cat
    each), which this path leaves out; the arithmetic, and so the result, is the dispatcher's.
    Under autograd too: the single-rank all-to-alls return their input and the identity sorts a
    ``cat`` of the chunks in order, so their backward hands the gradient through unchanged, and
    ``permute``/``unpermute`` (the only ops left) are the ones the dispatcher runs (tested
    bitwise, gradients included). Saves ~1 ms of an update minibatch's forward + backward on
    TRL's workload (~7 %). The router is still called as a module (forward hooks, R2/R3 route
    recording and replay see it; its aux loss attaches to the probs as before). EP/TP > 1,
    capacity factors, fused permutes, shared experts, latent projections and MoE recompute take
    Megatron's path.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if type(self.router) is TopKRouter:  # the same module and state, a leaner method
            self.router.__class__ = EagerBiasTopKRouter

    @functools.cached_property  # layout and config are fixed once built: decided on first call
    def _direct(self) -> bool:
        c, d = self.config, self.token_dispatcher
        return (isinstance(d, MoEAlltoAllTokenDispatcher) and d.ep_size == 1 and d.tp_size == 1
                and not d.drop_and_pad and c.moe_expert_capacity_factor is None
                and not c.moe_permute_fusion and not c.moe_router_padding_for_quantization
                and not c.moe_latent_size and not self.use_shared_expert
                and not self.moe_layer_recompute
                and self.fwd_execution_map == ["route", "expert_compute", "postprocess"])

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        if intermediate_tensors is not None or not self._direct:
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        probs, routing_map = self.route(hidden_states, padding_mask)  # [T, E] each
        tokens = hidden_states.view(-1, hidden_states.shape[-1])  # [T, H]
        # A padded token (packed row's tail) gets no expert: k routes per real token.
        if padding_mask is None:  # every token has k routes: the sizes are known on the host
            permuted, permuted_probs, mapping = permute_without_host_reads(
                tokens, routing_map, probs, routing_map.size(0) * self.config.moe_router_topk)
        else:
            routed = int((~padding_mask).sum()) * self.config.moe_router_topk
            permuted, permuted_probs, mapping = permute(
                tokens, routing_map, probs=probs, num_out_tokens=routed)  # [T k, H]
        out, bias = self.experts(permuted, routing_map.sum(dim=0).long(), permuted_probs)
        out = unpermute(out, mapping, restore_shape=tokens.shape, routing_map=routing_map)
        return out.view(hidden_states.shape), bias
