"""The dynamic engine's context class: Megatron's ``DynamicInferenceContext`` (with batched
admission, :mod:`.admission`) rotating queries and keys as the rollout needs and appending keys
and values with one copy per tensor (:func:`rollout_context`); used by :mod:`.dynamic`."""

from __future__ import annotations

class _SingleRank:
    """What Megatron's rotary functions read of a process group (``size``, ``rank``), for one
    rank: generation rotates whole sequences, whatever the training's context parallelism."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def rollout_context(context_class):
    """``context_class`` rotating queries and keys as the rollout needs, on whole sequences (a
    single-rank CP group: the rollout has no context parallelism).

    * **YaRN.** megatron-core 0.16.1's attention calls the dynamic context's
      ``apply_rotary_emb_query`` / ``apply_rotary_emb_key`` without ``mscale`` (its training and
      static-engine paths pass it), so under YaRN the rollout's attention scores lacked the factor
      ``mscale^2`` the trainer's have (``kl/rollout_vs_train`` 4.5e-5 on the tiny model with
      factor 4, ~1e-13 without YaRN). The subclass passes the config's factor when the caller
      gives none: 1.0 for plain RoPE, so nothing changes there.
    * **One cos/sin per step.** Megatron gathers the step's rotary rows and takes their cos and
      sin for the queries and again for the keys of every layer, and rotates the packed queries
      one request at a time (``_apply_rotary_pos_emb_thd``: a slice and a host read per request,
      per layer). Here each step computes them once (reset in ``initialize_attention_state``) and
      rotates every token in one ``t * cos + rotate_half(t) * sin``, Megatron's formula on the
      same rows, so the result is bitwise Megatron's. Unfused, non-interleaved, non-MLA RoPE only;
      otherwise Megatron's own functions run.
    """
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config as concentration)

    from megatron.core.inference.contexts.dynamic_context import (
        triton_append_key_value_cache as triton_append)

    from megatron.core import parallel_state

    from gspo_megatron.backends.megatron.kernels.rotary import RotaryCache, rotate

    def plain(config) -> bool:
        return not (config.apply_rope_fusion or config.multi_latent_attention
                    or config.rotary_interleaved)

    class RolloutContext(context_class):
        TOKEN_ROUNDER = 1
        """A step's tokens are padded to a multiple of this (times TP, for sequence
        parallelism), not Megatron's 64: the padding exists to match CUDA-graph batch shapes,
        which this loop does not use, and every padded token runs through every layer (its
        attention, its routing, its experts). With EOS the decoding batch shrinks as requests
        finish (TRL's workload: ~86 of 128 still running on average) while a multiple of 64
        kept it at 128 until 64 were left: -3 ms of a 46 ms rollout there."""

        @classmethod
        def round_up_tokens(cls, value, tp_size=None):
            """Megatron's rounding (>= 0.13: a multiple of ``TOKEN_ROUNDER`` rounded up to one of
            TP) without parsing its version strings at every call (~4 per step)."""
            if tp_size is None:
                tp_size = (parallel_state.get_tensor_model_parallel_world_size()
                           if parallel_state.is_initialized() else 1)
            rounder = -(-cls.TOKEN_ROUNDER // tp_size) * tp_size
            return rounder * -(-int(value) // rounder)

        def initialize_attention_state(self, **kwargs):
            super().initialize_attention_state(**kwargs)
            self.step_tables = {}
            """What every layer of this step shares: whether Megatron's thd rotation is the
            exact mapping (``"exact"``), the tokens' flat KV slots (``"kv_slots"``)."""
            self.step_rotary = RotaryCache()
            """The tokens' rotary pairs of this step, by position index and table."""

        def _rotary(self, table, index: str, mscale: float, dtype):
            return self.step_rotary.get(
                (index, table.data_ptr(), mscale, dtype),
                lambda: table[getattr(self, index)[:self.padded_active_token_count]],
                mscale, dtype)

        def apply_rotary_emb_query(self, query, query_emb, config, cu_seqlens_q, cp_group,
                                   mscale=None):
            mscale = concentration(config) if mscale is None else mscale
            n = self.padded_active_token_count
            if plain(config):
                cos, sin, rot = self._rotary(query_emb, "token_to_pos_ids", mscale, query.dtype)
                if cu_seqlens_q is None:  # Megatron's bshd rotation
                    query[:n] = rotate(query[:n], cos, sin, rot)
                    return query
                exact = self.step_tables.get("exact")
                if exact is None:  # Megatron's thd "exact mapping": a table row per token
                    exact = self.step_tables["exact"] = int(cu_seqlens_q[-1]) == n
                if exact:
                    query[:n] = rotate(query[:n].unsqueeze(1), cos, sin, rot).squeeze(1)
                    return query
            return super().apply_rotary_emb_query(query, query_emb, config, cu_seqlens_q,
                                                  _SingleRank(), mscale=mscale)

        def append_key_value_cache(self, layer_number: int, key, value) -> None:
            """Megatron's append (each token's key and value ``[T, 1, Hk, D]`` into its
            block and slot of the paged buffer) as one ``index_copy_`` per tensor into the
            buffer's flat ``[blocks x block_size]`` slots, the step's slot index computed once
            for every layer; Megatron indexes with two index tensors per write. The same
            copies; Megatron's own path where its Triton kernel runs (a CUDA buffer; Megatron
            calls it whenever Triton imports, and it asserts CUDA tensors) or an MLA latent cache
            is in use."""
            buf = self.memory_buffer
            if (self.cache_mla_latent or (triton_append is not None and buf.is_cuda)
                    or not buf.is_contiguous()):
                return super().append_key_value_cache(layer_number, key, value)
            n = self.padded_active_token_count
            slots = self.step_tables.get("kv_slots")
            if slots is None:  # [n] flat slot of each token: block * block_size + position
                slots = self.step_tables["kv_slots"] = (
                    self.token_to_block_idx[:n] * self.block_size_tokens
                    + self.token_to_local_position_within_kv_block[:n])
            layer = self.layer_map[layer_number - 1]
            heads, dim = buf.shape[-2:]
            buf[0, layer].view(-1, heads, dim).index_copy_(0, slots, key[:n].squeeze(1))
            buf[1, layer].view(-1, heads, dim).index_copy_(0, slots, value[:n].squeeze(1))

        def apply_rotary_emb_key(self, key, key_emb, config, cp_group, mscale=None):
            mscale = concentration(config) if mscale is None else mscale
            if not plain(config):
                return super().apply_rotary_emb_key(key, key_emb, config, _SingleRank(),
                                                    mscale=mscale)
            n = self.padded_active_token_count
            cos, sin, rot = self._rotary(key_emb, "token_to_position_in_request", mscale,
                                         key.dtype)
            if self.is_decode_only():
                return rotate(key[:n], cos, sin, rot)
            key[:n] = rotate(key[:n], cos, sin, rot)
            return key

    return RolloutContext
