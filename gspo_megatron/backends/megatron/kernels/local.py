"""Faster torch modules for Megatron's *local* layer spec (the CPU path, and GPUs without TE).

Megatron's local spec is written for correctness, not speed, and on a small model its Python
overhead outweighs the matmuls (``tools/bench/rollout.py`` profiled 1,600 expert-module calls and
8,448 ``autograd.Function.apply`` calls per 64-token generate; GEMMs were 19 % of the time). The
classes below are drop-in subclasses: same parameters, same ``state_dict`` and
``sharded_state_dict`` (checkpoints and the HF converters do not see them), same maths. Each takes
its short path only where it is exactly equivalent and otherwise calls Megatron's own forward.

* :class:`RopeOnceSelfAttention`: Megatron's static KV cache stores keys *before* RoPE and
  re-rotates the whole cache at every decoding step, O(context) per token per layer (at batch 128
  that was 30 % of a generate call). This rotates each key once, when it enters the cache, as
  Megatron's dynamic engine and flash decoding already do, and keeps the cache batch-major
  (``[batch, groups, seq, dim]``) so decoding reads each sequence's keys contiguously; the
  attention output is unchanged.
* :class:`SDPADotProductAttention`: one ``scaled_dot_product_attention`` call (GQA without
  expanding the keys) instead of ``repeat_interleave`` + ``baddbmm`` + masked softmax + ``bmm``.
* :class:`DirectColumnParallelLinear` / :class:`DirectRowParallelLinear`: at tensor-parallel size 1
  there is nothing to communicate, so ``F.linear`` replaces the custom ``autograd.Function`` (whose
  backward is the same two matmuls) and the per-call process-group queries.
* The MoE layer's modules (:class:`~.local_moe.LoopedSequentialMLP`,
  :class:`~.local_moe.DirectMoELayer`, :class:`~.local_moe.EagerBiasTopKRouter`) are in
  :mod:`.moe`.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config)
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from gspo_megatron.backends.megatron.kernels import batch_invariant as bi
from gspo_megatron.backends.megatron.kernels.row_attention import (context_parallel_sdpa,
                                                           packed_context_parallel_sdpa,
                                                           packed_sdpa)
from gspo_megatron.backends.megatron.kernels.rotary import RotaryCache, rotate
from gspo_megatron.layout import segment_positions


def single_rank(group) -> bool:
    """Whether ``group`` spans one rank (None: no group)."""
    return group is None or group.size() == 1


def _linear(module, x: torch.Tensor):
    """A Megatron linear layer's ``(output, output_bias)`` at TP=1: ``[s, b, in] -> [s, b, out]``
    (:func:`.batch_invariant.linear` under ``precision.batch_invariant``: no bias there)."""
    if bi.enabled(module.config):
        return bi.linear(x, module.weight), module.bias
    if module.skip_bias_add:
        return F.linear(x, module.weight), module.bias
    return F.linear(x, module.weight, module.bias), None


class RopeOnceSelfAttention(SelfAttention):
    """``SelfAttention`` whose static-batching KV cache holds keys with RoPE already applied, laid
    out batch-major.

    * RoPE once: ``Attention.forward`` applies the key rotation after
      ``_adjust_key_value_for_inference`` has returned the cache ``[:sequence_end]``; this override
      rotates only the new keys ``[sq, b, ng, hn]`` at their absolute positions
      ``[offset, offset + sq)`` and returns no key embedding, so the forward leaves the (already
      rotated) cache alone.
    * Batch-major cache: Megatron's static cache is ``[max_seq, max_batch, ng, hn]``, so one
      sequence's keys for one head are ``max_batch * ng * hn`` floats apart and every decoding step
      reads the whole cache with that stride. Here the cache is ``[max_batch, ng, max_seq, hn]``
      (Hugging Face's layout) and the returned keys/values are ``[sk, b, ng, hn]`` *views* of it,
      which :class:`SDPADotProductAttention` hands to SDPA as contiguous ``[b, ng, sk, hn]`` runs:
      ~2x faster attention at 272 cached positions, batch 128, on one CPU thread.

    * One rotation table per step: the cos/sin of the window's positions are computed once per
      forward step (Megatron recomputes them for queries and keys in every layer) and applied with
      Megatron's own formula, so the rotated tensors are bitwise Megatron's.
    * Left padding: when the context carries ``left_padding`` (``[B]`` pad tokens in front of each
      prompt; :meth:`~gspo_megatron.backends.megatron.engine.rollout.RolloutEngine._left_pad`), queries
      and keys are rotated at their positions in the unpadded sequence, ``j - pads[b]``, as Hugging
      Face derives ``position_ids`` from the attention mask; the pad keys are masked by the mask.

    * Without an inference context (the old-log-prob pass and the update's forward) a lean
      forward (:meth:`_lean_forward`): Megatron's own query/key/value projection and split, one
      cos/sin table per rotary table and dtype shared by every layer and both of queries and keys
      (:class:`~.rotary.RotaryCache`; Megatron recomputes ``cos``/``sin`` for each, and concatenates an
      empty pass-through slice), the core attention and the output projection, without
      ``Attention.forward``'s branches for inference, packing, offloading, recompute and fused
      kernels. Bitwise Megatron's output and gradients (``tests/unit/test_local_kernels.py``);
      ~0.3 ms less per layer call on TRL's workload. Configurations that need any of those
      branches take Megatron's forward.

    * With the dynamic engine's paged context (the rollout), a lean forward too
      (:meth:`_paged_forward`): the projection, the context's key rotation, KV append and query
      rotation, the paged attention and the output projection, the calls and order of
      ``Attention.forward`` with its dynamic-batching branch taken, without its checks, NVTX
      ranges, offloading context managers and ``einops`` rearrange. Bitwise Megatron's output
      (``tests/unit/test_local_kernels.py``); ~13 fewer tensor ops per layer and step.
    """

    def forward(self, hidden_states, attention_mask, key_value_states=None,
                inference_context=None, rotary_pos_emb=None, rotary_pos_cos=None,
                rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        if (inference_context is None and inference_params is None and key_value_states is None
                and rotary_pos_cos is None and rotary_pos_sin is None
                and rotary_pos_cos_sin is None and attention_bias is None
                and (packed_seq_params is None or packed_seq_params.qkv_format == "thd")
                and self._lean
                and (rotary_pos_emb is None or isinstance(rotary_pos_emb, torch.Tensor))):
            return self._lean_forward(hidden_states, attention_mask, rotary_pos_emb,
                                      packed_seq_params)
        if (inference_context is not None and not inference_context.is_static_batching()
                and self._lean and not self.training and key_value_states is None
                and inference_params is None and packed_seq_params is None
                and rotary_pos_cos is None and rotary_pos_sin is None
                and rotary_pos_cos_sin is None and attention_bias is None
                and not inference_context.use_flashinfer_fused_rope
                and not (self.config.fp8 or self.config.fp4)
                and (rotary_pos_emb is None or isinstance(rotary_pos_emb, torch.Tensor))):
            return self._paged_forward(hidden_states, inference_context, rotary_pos_emb)
        return super().forward(
            hidden_states, attention_mask, key_value_states, inference_context, rotary_pos_emb,
            rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin, attention_bias, packed_seq_params,
            sequence_len_offset, inference_params=inference_params)

    @functools.cached_property  # layout and config are fixed once built: decided on first call
    def _lean(self) -> bool:
        """Whether a forward without inference context reduces to :meth:`_lean_forward`: self
        attention, split QKV, no output gate, unfused non-interleaved RoPE on every layer, no
        context parallelism, no core-attention recompute and no activation offloading."""
        c = self.config
        return (self.attention_type == "self" and not c.no_rope_freq
                and not c.fused_single_qkv_rope and not c.attention_output_gate
                and not c.apply_rope_fusion and not c.multi_latent_attention
                and not c.rotary_interleaved and not c.flash_decode
                and not self.checkpoint_core_attention and not self.offload_qkv_linear
                and not self.offload_core_attention and not self.offload_attn_proj)

    @functools.cached_property
    def _mscale(self) -> float:
        return _yarn_get_concentration_factor_from_config(self.config)

    @functools.cached_property
    def _rope_cache(self) -> RotaryCache:
        """This layer's rotary pairs by Megatron's rotary table (one ``lru_cache``d tensor per
        sequence length): made once per table and dtype, not 4 times per forward."""
        return RotaryCache()

    def _lean_forward(self, hidden_states, attention_mask, rotary_pos_emb, packed_seq_params=None):
        """``Attention.forward`` without inference context, for the configurations of
        :attr:`_lean`: ``hidden_states [s, b, h] -> ([s, b, h], bias)``; the same modules and
        ops in the same order, minus the per-call branching and the duplicate RoPE tables.

        Packed (``thd``) microbatches (``b = 1``, ``s`` = the packed row): each token is rotated
        at its position within its own sequence (``cu_seqlens``; Megatron's
        ``_apply_rotary_pos_emb_thd`` does the same per sequence), and the core attention keeps
        every sequence to itself (:class:`SDPADotProductAttention`)."""
        query, key, value = self.get_query_key_value_tensors(hidden_states, None, split_qkv=True)
        if rotary_pos_emb is not None:
            cos, sin, rot_dim = self._rope_cache.get(
                (id(rotary_pos_emb), query.dtype), lambda: rotary_pos_emb, self._mscale,
                query.dtype, pin=(rotary_pos_emb,))
            if packed_seq_params is not None:  # each token at its position in its sequence
                (cos_q, sin_q), (cos_k, sin_k) = _packed_pairs(
                    packed_seq_params, rotary_pos_emb, cos, sin, query, key)
                query, key = rotate(query, cos_q, sin_q, rot_dim), rotate(key, cos_k, sin_k, rot_dim)
            else:
                query, key = rotate(query, cos, sin, rot_dim), rotate(key, cos, sin, rot_dim)
        core_attn_out = self.core_attention(query, key, value, attention_mask,
                                            attn_mask_type=self.attn_mask_type,
                                            attention_bias=None,
                                            packed_seq_params=packed_seq_params)
        return self.linear_proj(core_attn_out)

    def _paged_forward(self, hidden_states, context, rotary_pos_emb):
        """``Attention.forward`` under the dynamic engine's paged context, for the
        configurations of :attr:`_lean`: ``hidden_states [T, 1, h]`` (the step's packed tokens)
        -> ``([T, 1, h], bias)``. Keys are rotated and appended to the paged cache before the
        queries are rotated, as Megatron does; the context's rotation and append functions are
        the ones Megatron calls."""
        query, key, value = self.get_query_key_value_tensors(hidden_states, None, split_qkv=True)
        layer = self.layer_number - self._pp_layer_offset
        if rotary_pos_emb is not None:
            key = context.apply_rotary_emb_key(key, rotary_pos_emb, self.config,
                                               self.pg_collection.cp)
        context.append_key_value_cache(layer, key, value)
        key_cache, value_cache, block_table = context.key_value_cache(layer)
        if rotary_pos_emb is not None:
            query = context.apply_rotary_emb_query(query, rotary_pos_emb, self.config, None,
                                                   self.pg_collection.cp)
        cu_query_lengths, max_seqlen_q = context.cu_query_lengths()
        cu_kv_lengths, kv_lengths, max_seqlen_k = context.cu_kv_lengths()
        out = self.flash_decode_and_prefill(
            query, key_cache, value_cache, max_seqlen_q, max_seqlen_k, cu_query_lengths,
            cu_kv_lengths, kv_lengths, block_table, context.is_decode_only())  # [T, 1, np, hn]
        return self.linear_proj(out.reshape(out.shape[0], out.shape[1], -1))

    @functools.cached_property  # the pipeline layout is fixed once built
    def _pp_layer_offset(self) -> int:
        return self._get_pp_layer_offset_for_inference()

    def _adjust_key_value_for_inference(self, inference_context, query, key, value, rotary_pos_emb,
                                        *args, **kwargs):
        if (inference_context is None or not inference_context.is_static_batching()
                or rotary_pos_emb is None or self.config.flash_decode):
            return super()._adjust_key_value_for_inference(
                inference_context, query, key, value, rotary_pos_emb, *args, **kwargs)
        q_pos_emb, k_pos_emb = rotary_pos_emb
        start = inference_context.sequence_len_offset
        end = start + key.size(0)
        b0 = inference_context.batch_size_offset
        rope = self._rotary(inference_context, q_pos_emb, k_pos_emb, start, end, b0, key)
        if rope is None:  # Megatron's rotation (fused kernels, MLA): keys here, queries in forward
            b = key.size(1)
            q_emb = _positions(inference_context, q_pos_emb, start, end, b0, b)
            k_emb = _positions(inference_context, k_pos_emb, start, end, b0, b)
            key = apply_rotary_pos_emb(key, k_emb, config=self.config,
                                       mscale=_yarn_get_concentration_factor_from_config(self.config),
                                       cp_group=self.pg_collection.cp)
            rotary_out = (q_emb, None)
        else:  # one cos/sin per forward step, shared by the layers, queries and keys
            query, key = rotate(query, *rope), rotate(key, *rope)
            rotary_out = None
        memory = inference_context.key_value_memory_dict
        if self.layer_number not in memory:
            shape = (inference_context.max_batch_size, key.size(2),
                     inference_context.max_sequence_length, key.size(3))  # [B, ng, S, hn]
            memory[self.layer_number] = (key.new_empty(shape), value.new_empty(shape))
        key_memory, value_memory = memory[self.layer_number]
        if end > key_memory.size(2):
            raise ValueError("Current sequence length is longer than expected maximum sequence "
                             "length! Increase inference_max_seq_length.")
        b1 = b0 + key.size(1)
        key_memory[b0:b1, :, start:end] = key.permute(1, 2, 0, 3)  # [sq, b, ng, hn] -> [b, ng, sq, hn]
        value_memory[b0:b1, :, start:end] = value.permute(1, 2, 0, 3)
        # Megatron's rule: prefill keeps the layer's causal mask, decoding (offset > 0) needs none.
        mask_type = AttnMaskType.no_mask if start > 0 else self.attn_mask_type
        return (query, key_memory[b0:b1, :, :end].permute(2, 0, 1, 3),
                value_memory[b0:b1, :, :end].permute(2, 0, 1, 3),
                rotary_out, mask_type, None)

    def _rotary(self, context, q_pos_emb, k_pos_emb, start: int, end: int, b0: int, key):
        """``(cos, sin, rot_dim)`` for the window, computed as Megatron's unfused
        ``_apply_rotary_pos_emb_bshd`` does (so the rotation is bitwise its) once per forward step
        and kept on the context for the other layers; None where Megatron's own rotation must run
        (fused RoPE, MLA, interleaved, queries and keys with different tables)."""
        c = self.config
        if (c.apply_rope_fusion or c.multi_latent_attention or c.rotary_interleaved
                or q_pos_emb is not k_pos_emb):
            return None
        pads = getattr(context, "left_padding", None)
        mscale = _yarn_get_concentration_factor_from_config(c)
        cache = getattr(context, "rotary_cache", None)
        if cache is None:  # (one entry: the layers of one forward step share it)
            cache = context.rotary_cache = RotaryCache(max_entries=1)
        b = key.size(1)
        return cache.get((start, end, b0, b, key.dtype, mscale, k_pos_emb.data_ptr()),
                         lambda: _positions(context, k_pos_emb, start, end, b0, b), mscale,
                         key.dtype, pin=(pads,))



def _packed_positions(params, total: int, device) -> torch.Tensor:
    """``[S]`` int64 position of each token of a packed row (this context-parallel rank's
    ``S`` tokens of it) within its sequence: the ``rope_positions`` the trainer put on the
    ``PackedSeqParams`` (:func:`..schedule.packed_seq_params`), else from its
    ``cu_seqlens_q_padded`` (kept on the params object: one per microbatch, shared by every
    layer)."""
    cached = getattr(params, "rope_positions", None)
    if cached is None or cached.shape[0] != total:
        cu = getattr(params, "cu_seqlens_q_padded", None)
        cu = params.cu_seqlens_q if cu is None else cu
        cached = segment_positions(cu.to(device), total)
        params.rope_positions = cached
    return cached.to(device)


def _packed_pairs(params, table: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  query: torch.Tensor, key: torch.Tensor):
    """``((cos, sin) of the queries, (cos, sin) of the keys)``: the pair ``[max_seqlen, 1, 1,
    rot]`` at each token's position in its sequence of a packed row, ``[S, 1, heads, rot]``;
    made once per microbatch (kept on the ``PackedSeqParams``, as its positions) and shared by
    every layer (their pairs are equal: the same rotary ``table``, the same formula). On CPU
    they are expanded to the head counts of ``query [S, 1, np, hn]`` and ``key [S, 1, ng, hn]``
    (a product broadcast over heads costs ~4x a same-shaped one there: the rotation of TRL's
    workload's update, forward and backward, 280 -> 160 us a layer; the same values, so
    bitwise); elsewhere they stay broadcast views (no memory per head)."""
    kept = getattr(params, "rope_pairs", None)
    if kept is not None and kept[0] is table and kept[1] == (cos.dtype, query.shape, key.shape):
        return kept[2]
    positions = _packed_positions(params, query.shape[0], query.device)
    cos, sin = cos[positions], sin[positions]  # [S, 1, 1, rot]
    pairs = []
    for x in (query, key):
        shape = (*x.shape[:-1], cos.shape[-1])
        pair = (cos.expand(shape), sin.expand(shape))
        pairs.append(tuple(t.contiguous() for t in pair) if x.device.type == "cpu" else pair)
    params.rope_pairs = (table, (cos.dtype, query.shape, key.shape), tuple(pairs))
    return params.rope_pairs[2]


def _positions(context, table: torch.Tensor, start: int, end: int, b0: int, b: int):
    """Rotary embeddings of the window ``[start, end)`` from ``table [S, 1, 1, rot]``: a slice
    ``[sq, 1, 1, rot]``, or per sequence ``[sq, b, 1, rot]`` at ``j - pads[b]`` for a left-padded
    batch (sequence b's token at cache position j is at position j - pads[b] unpadded)."""
    pads = getattr(context, "left_padding", None)
    if pads is None:
        return table[start:end]
    pos = (torch.arange(start, end).view(-1, 1) - pads[b0:b0 + b].view(1, -1)).clamp_(min=0)
    return table[pos, 0]  # [sq, b] positions



class SDPADotProductAttention(DotProductAttention):
    """Megatron's ``DotProductAttention`` computed by ``F.scaled_dot_product_attention``.

    Shapes: ``query [sq, b, np, hn]``, ``key/value [sk, b, ng, hn]`` -> ``[sq, b, np * hn]``.
    Megatron's boolean ``attention_mask`` marks *masked* positions (``True`` = drop); SDPA's marks
    kept ones, hence the ``~``. Without a mask a causal layer is causal when ``sq > 1``, aligned to
    the end of the keys (``sq < sk``: the queries are the last ``sq`` positions, as in chunked
    prefill); ``sq == 1`` (decoding with a KV cache) attends to every cached key.
    """

    def __init__(self, config, *args, **kwargs):
        # Megatron's local kernel refuses context parallelism at build time; this one computes it
        # (:func:`.row_attention.context_parallel_sdpa`), so it is built from a CP = 1 view of the config.
        if config.context_parallel_size > 1:
            single = copy.copy(config)
            single.context_parallel_size = 1
            super().__init__(single, *args, **kwargs)
            self.config = config
        else:
            super().__init__(config, *args, **kwargs)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if bi.enabled(self.config):
            return self._invariant(query, key, value, attention_mask, attn_mask_type,
                                   packed_seq_params)
        if (packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
                and attention_bias is None and attention_mask is None
                and self.config.softmax_type == "vanilla" and self.config.window_size is None
                and not (self.training and self.attention_dropout.p > 0)
                and (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal):
            # Packed sequences: [S, 1, heads, hn] (our lean forward) or [S, heads, hn]
            # (Megatron's thd path); the output keeps the matching [S, 1, np * hn] / [S, np * hn].
            squeeze = query.dim() == 4
            q, k, v = ((x.squeeze(1) if squeeze else x) for x in (query, key, value))
            cp = getattr(self.pg_collection, "cp", None)
            if cp is not None and not single_rank(cp):  # this CP rank's share of the row
                out = packed_context_parallel_sdpa(q, k, v, packed_seq_params, cp,
                                                   self.softmax_scale)
            else:
                out = packed_sdpa(q, k, v, packed_seq_params, self.softmax_scale)
            out = out.reshape(out.shape[0], -1)
            return out.unsqueeze(1) if squeeze else out
        cp = getattr(self.pg_collection, "cp", None)
        if (cp is not None and not single_rank(cp) and packed_seq_params is None
                and attention_mask is None and attention_bias is None
                and query.shape[0] == key.shape[0] and self.config.softmax_type == "vanilla"
                and self.config.window_size is None
                and not (self.training and self.attention_dropout.p > 0)
                and (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal):
            return context_parallel_sdpa(query, key, value, cp, self.softmax_scale)
        if (attention_bias is not None or packed_seq_params is not None
                or self.config.softmax_type != "vanilla" or self.config.window_size is not None
                or (self.training and self.attention_dropout.p > 0)):
            # Megatron's kernel views its inputs: the batch-major KV cache's keys are strided.
            return super().forward(query, key.contiguous(), value.contiguous(), attention_mask,
                                   attn_mask_type, attention_bias, packed_seq_params)
        sq, b, np_, hn = query.shape
        sk = key.shape[0]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        mask, is_causal = None, False
        if attention_mask is not None:
            mask = ~attention_mask.bool()
        elif (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal and sq > 1:
            if sq == sk:
                is_causal = True
            else:
                mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        ng = k.shape[1]
        if not is_causal and np_ != ng and (mask is None or (sq == 1 and mask.shape[1] == 1)):
            # GQA decoding (no mask, or one key mask per sequence [b|1, 1, 1, sk]): fold each
            # group's np/ng query heads into the query length, [b, np, sq, hn] -> [b, ng,
            # np/ng * sq, hn], so SDPA sees plain MHA with no key expansion. Query head i reads
            # KV head i // (np/ng), Megatron's layout. ~20 % faster than enable_gqa on CPU at
            # batch 128.
            out = F.scaled_dot_product_attention(
                q.reshape(b, ng, np_ // ng * sq, hn), k, v, attn_mask=mask,
                scale=self.softmax_scale)
            return out.reshape(b, np_, sq, hn).permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.softmax_scale,
            enable_gqa=np_ != ng)  # [b, np, sq, hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)


    def _invariant(self, query, key, value, attention_mask, attn_mask_type, packed_seq_params):
        """Causal attention through :func:`.batch_invariant.attention` (``precision.
        batch_invariant``): a packed row ``[S, (1,) heads, hn]`` per sequence, or padded rows
        ``query [sq, b, np, hn]``, ``key/value [sk, b, ng, hn]`` (the queries the last ``sq``
        positions; ``attention_mask`` True = masked, as Megatron's) -> Megatron's output shape."""
        if (attention_mask is None and (attn_mask_type or self.attn_mask_type)
                != AttnMaskType.causal):
            raise NotImplementedError("precision.batch_invariant: non-causal attention")
        if packed_seq_params is not None:
            squeeze = query.dim() == 4
            q, k, v = ((x.squeeze(1) if squeeze else x) for x in (query, key, value))
            out = bi.packed_attention(q, k, v, packed_seq_params, self.softmax_scale)
            out = out.reshape(out.shape[0], -1)
            return out.unsqueeze(1) if squeeze else out
        sq, b, np_, hn = query.shape
        sk = key.shape[0]
        if attention_mask is not None:
            allowed = ~attention_mask.bool().reshape(-1, *attention_mask.shape[-2:])
        else:
            allowed = torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril(sk - sq)[None]
        out = bi.attention(query.permute(1, 2, 0, 3), key.transpose(0, 1), value.transpose(0, 1),
                           allowed.expand(b, sq, sk), self.softmax_scale)  # [b, np, sq, hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)


class DirectColumnParallelLinear(ColumnParallelLinear):
    """``ColumnParallelLinear`` that is one ``F.linear`` at tensor-parallel size 1."""

    @functools.cached_property  # layout and config are fixed once built: decided on first call
    def _direct(self) -> bool:
        return (single_rank(self.tp_group) and not self.config.defer_embedding_wgrad_compute
                and not self.gradient_accumulation_fusion
                and self.config._cpu_offloading_context is None)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if weight is not None and self._direct and bi.enabled(self.config):  # tied output layer
            return bi.linear(input_, weight), None
        if weight is not None or not self._direct:
            return super().forward(input_, weight, runtime_gather_output)
        return _linear(self, input_)


class DirectRowParallelLinear(RowParallelLinear):
    """``RowParallelLinear`` that is one ``F.linear`` at tensor-parallel size 1."""

    @functools.cached_property  # layout and config are fixed once built: decided on first call
    def _direct(self) -> bool:
        return (single_rank(self.tp_group) and not self.gradient_accumulation_fusion
                and self.config._cpu_offloading_context is None)

    def forward(self, input_):
        if not self._direct:
            return super().forward(input_)
        return _linear(self, input_)
