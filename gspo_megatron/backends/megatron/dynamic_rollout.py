"""Megatron-Core's dynamic inference engine as the rollout engine, on CPU and GPU.

The dynamic engine (``DynamicInferenceEngine`` over a paged ``DynamicInferenceContext``) keeps one
packed token buffer of every active request: a prefill step forwards the new prompts' tokens, a
decode step one token per running request, and a request that ends leaves at once, its slot and KV
blocks taken by the next waiting prompt (continuous batching). A rollout therefore costs what its
real tokens cost, not ``batch x longest response`` as a static batch does.

What this module adds to Megatron's engine (:class:`DynamicRollout`):

* **Sizing from the recipe.** ``rollout.max_batch_size`` is the engine's request limit (Megatron's
  ``from_config`` derives it from the block count instead, 163,836 requests for 20 GB, and then
  fails on a small model); ``rollout.dynamic_buffer_size_gb`` is the paged KV budget (default:
  every slot holds a full-length request, :mod:`gspo_megatron.kv_cache`). The config refuses a
  budget that cannot hold one request before anything is built.
* **Expert parallelism in lock-step.** ``DynamicInferenceEngine.generate`` steps while *its own*
  rank has requests; under EP > 1 the MoE all-to-all couples ranks that hold different prompts, so
  the rank that finishes first would leave the others waiting in a collective (gloo: "Connection
  closed by peer"; NCCL: a hang). Here every rank of the world agrees each step whether anyone
  still has work (one MAX all-reduce of a flag), and a rank without requests runs Megatron's
  ``dummy_forward`` (one all-to-all round with no tokens). Nothing is decoded past EOS.
* **Memory between phases.** After a rollout the KV buffer is released (``engine.suspend()``:
  Megatron's ``deallocate_all_tensors``) and restored before the next (``resume()``), so the old-
  log-prob pass and the updates run without it; :attr:`DynamicRollout.kv_bytes` says what it holds.
* **Held requests** (``rollout.partial_keep_kv``). The requests a partial rollout cuts
  (``GroupStop.hold_cut``) can stay in the engine, KV cache and all, instead of being dropped;
  the next call continues each whose prompt is exactly its prompt + written tokens
  (``GroupStop.continue_held``) without prefilling it again (PipelineRL's in-flight weight
  update: the cached keys and values are the older weights'). The buffer is then not released
  while requests are held. A call that does not continue all of them drops them all.
* **R3.** With a route recorder, every step's routes are recorded from the packed buffer and
  handed to each request by token position (:class:`~.rollout_routes.PackedRouteRecorder`).
"""

from __future__ import annotations

import itertools

import torch

from gspo_megatron.distributed import ParallelGroups, any_rank
from gspo_megatron.kv_cache import (BLOCK_SIZE_TOKENS, blocks_per_request, kv_budget_bytes,
                                    kv_bytes_per_token)


class DynamicRollout:
    """The dynamic engine of one :class:`~.rollout.RolloutEngine`: build, generate, suspend.

    ``model``: the ``GPTModel`` that samples (its config sizes the KV cache); ``runner``: the module
    Megatron's wrapper calls (``model``, or the ``Float16Module`` around a precision copy);
    ``tokenizer``: the controller's id tokenizer (:class:`~.inference_hooks.IdTokenizer`)."""

    def __init__(self, *, model, runner, wrapper_config, groups: ParallelGroups, tokenizer,
                 max_batch_size: int, max_sequence_length: int, buffer_size_gb: float | None):
        from megatron.core.inference.contexts import StaticInferenceContext

        from gspo_megatron.backends.megatron.dynamic_admission import (AdmittingContext,
                                                                       AdmittingEngine)
        from gspo_megatron.backends.megatron.inference_hooks import (
            RolloutInferenceWrapper,
            RolloutTextGenerationController,
        )

        self.groups = groups
        cfg = model.config
        # The controller's constructor needs a context; the dynamic one replaces it below.
        placeholder = StaticInferenceContext.from_config(wrapper_config)
        self.wrapper = RolloutInferenceWrapper(runner, wrapper_config, placeholder)
        self.wrapper.real_vocab_size = tokenizer.vocab_size
        self.controller = RolloutTextGenerationController(self.wrapper, tokenizer,
                                                          pp_group=groups.pp_group)
        max_requests = int(max_batch_size)
        if groups.tp_size > 1:  # Megatron splits the request table over TP ranks
            max_requests = -(-max_requests // groups.tp_size) * groups.tp_size
        if buffer_size_gb is None:  # every slot can hold a request of the full length
            per_token = kv_bytes_per_token(
                cfg.num_layers, cfg.num_query_groups, cfg.kv_channels, groups.tp_size,
                groups.pp_size, torch.tensor([], dtype=wrapper_config.params_dtype).element_size())
            budget = kv_budget_bytes(max_requests, max_sequence_length, per_token)
            # + half a block: Megatron floors buffer bytes / block bytes
            buffer_size_gb = (budget + BLOCK_SIZE_TOKENS * per_token // 2) / 1024 ** 3
        self.context = _yarn_scaled(AdmittingContext)(
            params_dtype=wrapper_config.params_dtype,
            num_layers=cfg.num_layers // groups.pp_size,
            kv_channels=cfg.kv_channels,
            num_attention_heads=cfg.num_query_groups,
            tensor_model_parallel_size=groups.tp_size,
            pipeline_model_parallel_size=groups.pp_size,
            max_sequence_length=max_sequence_length,
            buffer_size_gb=buffer_size_gb,
            max_requests=max_requests,
            max_tokens=max(max_requests, max_sequence_length, 2048),
            block_size_tokens=BLOCK_SIZE_TOKENS,
            materialize_only_last_token_logits=False,  # log-probs read every token's logits
            use_flashinfer_fused_rope=None,
            unified_memory_level=0,
        )
        need = blocks_per_request(max_sequence_length)
        have = self.context.block_allocator.total_count - 1  # one dummy block
        if have < need:
            raise ValueError(
                f"rollout.dynamic_buffer_size_gb={buffer_size_gb} holds {have} KV blocks of "
                f"{BLOCK_SIZE_TOKENS} tokens, one request of {max_sequence_length} tokens "
                f"needs {need}")
        self.wrapper.inference_context = self.context
        training = model.training
        self.wrapper.prep_model_for_inference()  # puts the model in eval mode ...
        model.train(training)  # ... which training must not inherit (no MoE aux loss in eval)
        self.controller._init_dynamic_sampling_tensors()
        self.engine = AdmittingEngine(controller=self.controller, context=self.context,
                                      random_seed=1234)
        self._device = (torch.device("cuda", torch.cuda.current_device())
                        if torch.cuda.is_available() else torch.device("cpu"))
        if self._device.type == "cpu":  # the fallback's per-step gathers stop page-faulting
            from gspo_megatron.compat.cpu import keep_freed_memory

            keep_freed_memory()
        # No CUDA graphs are built (num_cuda_graphs is None), so suspend / resume have none to
        # delete or capture; without this Megatron's suspend calls delete_cuda_graphs(), a full
        # gc.collect() (0.15 s per rollout on the tiny CPU model, more in a large process).
        self.engine.persist_cuda_graphs = True
        self.steps = 0
        """Engine steps (forward passes) of the last generate, dummy forwards included."""
        self._request_ids = itertools.count()
        """Request ids, unique for the engine's life (R3 routes of held requests are kept by id
        across calls; Megatron's own counter restarts at every ``engine.reset()``)."""
        self._held: dict[tuple[int, ...], list[int]] = {}
        """Requests a partial rollout cut and kept (``GroupStop.hold_cut``), by their prompt and
        written tokens: the next call's prompt for them."""
        self.kv_bytes = self._kv_bytes()
        """Bytes the paged KV cache holds now (0 while suspended)."""
        self.suspend()

    def _kv_bytes(self) -> int:
        buf = getattr(self.context, "memory_buffer", None)
        return 0 if buf is None else buf.numel() * buf.element_size()

    def suspend(self) -> None:
        """Release the KV buffer (between rollouts: training runs without it)."""
        if not self.engine.is_suspended:
            self.engine.suspend()
        self.kv_bytes = self._kv_bytes()

    def resume(self) -> None:
        """Allocate the KV buffer again (before a rollout)."""
        if self.engine.is_suspended:
            self.engine.resume()
            # The controller holds references to the context's request-metadata tensors
            # (termination ids...); resume() allocated new ones, so bind them again (with the
            # old ones no request would ever stop at EOS).
            self.controller._init_dynamic_sampling_tensors()
        self.kv_bytes = self._kv_bytes()

    def held_ids(self) -> set[int]:
        """Ids of the requests held from the previous call (``GroupStop.hold_cut``)."""
        return {request_id for ids in self._held.values() for request_id in ids}

    def drop_held(self) -> None:
        """Forget the held requests and their KV cache."""
        if self._held:
            self._held.clear()
            self.engine.reset()

    def _claim_held(self, prompts: list[list[int]], stop) -> dict[int, int]:
        """``{call position: held request id}`` for the prompts that continue a held request;
        all or nothing: if ``stop`` does not ask for it or a held request is left unclaimed,
        every held request is dropped and ``{}`` returned."""
        claimed: dict[int, int] = {}
        if self._held and stop is not None and stop.continue_held:
            free = {key: list(ids) for key, ids in self._held.items()}
            for i, prompt in enumerate(prompts):
                ids = free.get(tuple(prompt))
                if ids:
                    claimed[i] = ids.pop(0)
            if len(claimed) == sum(map(len, self._held.values())):
                self._held.clear()
                return claimed
        self.drop_held()
        return {}

    def generate(self, prompts: list[list[int]], sps: list, stop=None, refill=None) -> list:
        """Per request, in order (``prompts``, then those ``refill`` added): its finished
        Megatron request record, or, for a request that ``stop`` (a
        :class:`~gspo_megatron.policy.GroupStop`) aborted, the request as it stands (the tokens
        and log-probs written so far; a continued request's include those of earlier calls, after
        its ``prompt_tokens``). ``sps``: each prompt's ``SamplingParams``;
        ``refill(running)``: asked before every step until ``stop`` is done, the requests
        ``(prompt, SamplingParams)`` to add. With ``stop.hold_cut`` the aborted requests stay in
        the engine (and the KV buffer allocated) for the next call to continue
        (``stop.continue_held``). Collective over the world under EP > 1 (lock-step), over the
        model-parallel group otherwise."""
        from gspo_megatron.backends.megatron.dynamic_admission import RolloutRequest

        held = self._claim_held(prompts, stop)
        self.resume()
        try:
            if held:  # the context holds the continued requests: eval mode without its reset
                self.wrapper.model.eval()
            else:
                self.wrapper.prep_model_for_inference()  # eval mode, reset the paged context
            index: dict[int, int] = {}  # request id -> its place in the call

            def add(prompt, sp):  # engine.add_request without its deep copies
                request_id = next(self._request_ids)
                index[request_id] = len(index)
                self.engine._add_request(RolloutRequest(
                    request_id=request_id, sampling_params=sp,
                    prompt_tokens=torch.tensor(prompt, dtype=torch.int64, device=self._device)))
            for i, (prompt, sp) in enumerate(zip(prompts, sps)):
                if i in held:
                    index[held[i]] = len(index)
                else:
                    add(prompt, sp)
            records = {}
            lock_step = self.groups.ep_size > 1
            self.steps = 0
            while True:
                if refill is not None and not stop.done:
                    for prompt, sp in refill(len(index) - len(records)):
                        add(prompt, sp)
                mine = self.engine.has_unfinished_requests() and not (stop and stop.done)
                if not (any_rank(mine) if lock_step else mine):
                    break
                if mine:
                    for rec in self.engine.step_modern()["finished_request_records"]:
                        records[rec.request_id] = rec
                        if stop is not None:
                            stop.finished(index[rec.request_id])
                else:
                    self.controller.dummy_forward()
                self.steps += 1
            out = [records.get(request_id) for request_id in index]
            if any(r is None for r in out):  # aborted: take them as they stand
                out = [r if r is not None else self.engine.get_request(request_id)
                       for request_id, r in zip(index, out)]
                if stop.hold_cut:  # keyed by what the next call's prompt will be
                    for r in out:
                        if not hasattr(r, "requests"):
                            key = tuple(r.prompt_tokens.tolist()) + tuple(r.generated_tokens)
                            self._held.setdefault(key, []).append(r.request_id)
                else:
                    self.engine.reset()
            return out
        finally:
            if not self._held:
                self.suspend()
            self.kv_bytes = self._kv_bytes()


class _SingleRank:
    """What Megatron's rotary functions read of a process group (``size``, ``rank``), for one
    rank: generation rotates whole sequences, whatever the training's context parallelism."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _yarn_scaled(context_class):
    """``context_class`` with YaRN's cos/sin scale in its query and key rotations, on whole
    sequences (a single-rank CP group: the rollout has no context parallelism).
    megatron-core 0.16.1's attention calls the dynamic context's ``apply_rotary_emb_query`` /
    ``apply_rotary_emb_key`` without ``mscale`` (its training and static-engine paths pass it), so
    under YaRN the rollout's attention scores lacked the factor ``mscale^2`` the trainer's have
    (``kl/rollout_vs_train`` 4.5e-5 on the tiny model with factor 4, ~1e-13 without YaRN). The
    subclass passes the config's factor when the caller gives none: 1.0 for plain RoPE, so
    nothing changes there."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config as concentration)

    class RolloutContext(context_class):
        def apply_rotary_emb_query(self, query, query_emb, config, cu_seqlens_q, cp_group,
                                   mscale=None):
            return super().apply_rotary_emb_query(
                query, query_emb, config, cu_seqlens_q, _SingleRank(),
                mscale=concentration(config) if mscale is None else mscale)

        def apply_rotary_emb_key(self, key, key_emb, config, cp_group, mscale=None):
            return super().apply_rotary_emb_key(
                key, key_emb, config, _SingleRank(),
                mscale=concentration(config) if mscale is None else mscale)

    return RolloutContext
