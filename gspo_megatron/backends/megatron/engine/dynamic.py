"""Megatron-Core's dynamic inference context as the rollout engine, on CPU and GPU.

Megatron's paged ``DynamicInferenceContext`` keeps one packed token buffer of every active
request: a prefill step forwards the new prompts' tokens, a decode step one token per running
request, and a request that ends leaves at once, its slot and KV blocks taken by the next waiting
prompt (continuous batching). A rollout therefore costs what its real tokens cost, not ``batch x
longest response`` as a static batch does.

**The loop is ours** (:meth:`DynamicRollout.generate`), over Megatron's context, model forward
and bookkeeping (``initialize_attention_state``, the controller's forward with its PP broadcast,
``update_requests``: pausing, block allocation, eviction), in place of
``DynamicInferenceEngine.step_modern``: an asyncio event loop per step, a Python object and list
appends per request per token (``post_process_requests``), per-step bucketing of the sampling
parameters and a log-softmax over every prompt token. Here the requests of a call share one
sampling rule (one draw for the whole batch from the controller's generator, over the real
vocabulary's columns only), each step's ``(request ids, tokens, log-probs)`` are kept as three
tensors and joined per request once at the end (:class:`.call.GenerateCall`), and only the sampled tokens'
log-probs are taken. On TRL's workload (128 requests x 16 tokens, CPU) a rollout went from 70
to 50 ms (``docs/benchmarks.md``, section 10; the static engine: 41 ms). The loop alone kept
Megatron's engine's tokens and log-probs bitwise (the demo's metrics did not move); drawing over
the real vocabulary's columns only draws other samples from the same distribution.

What else it adds (:class:`DynamicRollout`):

* **Sizing from the recipe.** ``rollout.max_batch_size`` is the engine's request limit (Megatron's
  ``from_config`` derives it from the block count instead, 163,836 requests for 20 GB, and then
  fails on a small model); ``rollout.dynamic_buffer_size_gb`` is the paged KV budget (default:
  every slot holds a full-length request, :mod:`gspo_megatron.kv_budget`). The config refuses a
  budget that cannot hold one request before anything is built.
* **Expert parallelism in lock-step.** Under EP > 1 the MoE all-to-all couples ranks that hold
  different prompts, so the rank that finishes first would leave the others waiting in a
  collective (gloo: "Connection closed by peer"; NCCL: a hang). The coupled ranks (the EP
  group, :func:`.lockstep.coupled_group`) decide each step's kind by one MAX all-reduce
  (:func:`.lockstep.next_step`: Megatron's step, a round, an idle round, a dummy, done), and a
  rank without requests runs Megatron's ``dummy_forward`` (one all-to-all round with no tokens)
  or a round's idle steps. Nothing is decoded past EOS. With the experts replicated for decoding
  (``rollout.decode_experts``, decided over the same group) no step of a rank involves another,
  and each rank runs alone.
* **Memory between phases.** After a rollout the KV buffer is released (Megatron's
  ``deallocate_all_tensors``) and restored before the next (``resume()``), so the old-log-prob
  pass and the updates run without it; :attr:`DynamicRollout.kv_bytes` says what it holds.
* **Held requests** (``rollout.partial_keep_kv``). The requests a partial rollout cuts
  (``GroupStop.hold_cut``) can stay in the context, KV cache and all, instead of being dropped;
  the next call continues each whose prompt is exactly its prompt + written tokens
  (``GroupStop.continue_ids``) without prefilling it again (PipelineRL's in-flight weight
  update: the cached keys and values are the older weights'). The buffer is then not released
  while requests are held. A call that does not continue all of them drops them all.
* **R3.** With a route recorder, every step's routes are recorded from the packed buffer and
  handed to each request by token position (:class:`~..routing.rollout_routes.PackedRouteRecorder`).
* **Rotary embeddings once per step** (:func:`.context.rollout_context`), and YaRN's scale.
* **Multi-step decoding** (``rollout.decode_steps_per_sync``, :mod:`.rounds`): once every
  request is decoding, up to that many steps per host round trip through one pure-torch step
  (:mod:`..kernels.decode`; CUDA graphs on CUDA, :mod:`..kernels.graphs`), Megatron's tables
  written back once per round. The prefill and mixed steps run the same step function over
  Megatron's layout of the step (:meth:`~.rounds.FastDecoder.mixed_logits`) unless another EP
  rank's step waits on this one (sharded experts: Megatron's forward and dispatcher), and
  Megatron's bookkeeping; the layouts the step function does not cover run Megatron's forward
  at every step.

Left out of Megatron's engine: chunked prefill (a prompt waits until it fits whole:
``max_tokens`` >= the longest sequence, so an empty context always takes the head of the queue),
stop words, top-n log-probs, Megatron's own CUDA graphs, the data-parallel coordinator.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools

import torch

from gspo_megatron.backends.megatron.kernels import batch_invariant as bi
from gspo_megatron.backends.megatron.schedule import set_training
from gspo_megatron.distributed import ParallelGroups
from gspo_megatron.backends.megatron.engine.lockstep import StepKind, coupled_group, next_step
from gspo_megatron.backends.megatron.engine.call import GenerateCall
from gspo_megatron.kv_budget import (BLOCK_SIZE_TOKENS, blocks_per_request, kv_budget_bytes,
                                    kv_bytes_per_token, kv_element_bytes)
from gspo_megatron.rollouts import kv_fp8


class DynamicRollout:
    """The dynamic engine of one :class:`~.rollout.RolloutEngine`: build, generate, suspend.

    ``model``: the ``GPTModel`` that samples (its config sizes the KV cache); ``runner``: the module
    Megatron's wrapper calls (``model``, or the ``Float16Module`` around a precision copy);
    ``tokenizer``: the controller's id tokenizer (:class:`~.hooks.IdTokenizer`)."""

    def __init__(self, *, model, runner, wrapper_config, groups: ParallelGroups, tokenizer,
                 max_batch_size: int, max_sequence_length: int, buffer_size_gb: float | None,
                 decode_steps_per_sync: int = 0, decode_cuda_graphs: bool = False,
                 decode_experts: str = "auto", decode_round_cost_rows: int = 64,
                 kv_cache_dtype: str = "auto"):
        from megatron.core.inference.contexts import StaticInferenceContext

        from gspo_megatron.backends.megatron.engine.admission import AdmittingContext
        from gspo_megatron.backends.megatron.engine.context import rollout_context
        from gspo_megatron.backends.megatron.engine.hooks import (
            RolloutInferenceWrapper,
            RolloutTextGenerationController,
        )

        self.groups = groups
        self.coupled = coupled_group(groups) if groups.ep_size > 1 else None
        """Under EP: the ranks whose decoding steps exchange tensors (:mod:`.lockstep`; None:
        the world), over which the experts' replication and every lock-step are decided."""
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
        self.kv_fp8 = kv_cache_dtype == "fp8"
        """``rollout.kv_cache_dtype: fp8``: Megatron's buffer holds packed e4m3 rows (``uint8``,
        ``kv_channels + 4`` bytes per token and head: :mod:`gspo_megatron.rollouts.kv_fp8`),
        which only the step function reads and writes."""
        if buffer_size_gb is None:  # every slot can hold a request of the full length
            per_token = kv_bytes_per_token(
                cfg.num_layers, cfg.num_query_groups, cfg.kv_channels, groups.tp_size,
                groups.pp_size, *kv_element_bytes(kv_cache_dtype, torch.tensor(
                    [], dtype=wrapper_config.params_dtype).element_size()))
            budget = kv_budget_bytes(max_requests, max_sequence_length, per_token)
            # + half a block: Megatron floors buffer bytes / block bytes
            buffer_size_gb = (budget + BLOCK_SIZE_TOKENS * per_token // 2) / 1024 ** 3
        self.context = rollout_context(AdmittingContext)(
            # FP8: one byte an element, the scale's 4 bytes as 4 more "channels" of each head
            # (Megatron sizes its blocks from these two, so its block count is exact)
            params_dtype=kv_fp8.STORAGE if self.kv_fp8 else wrapper_config.params_dtype,
            num_layers=cfg.num_layers // groups.pp_size,
            kv_channels=kv_fp8.packed_width(cfg.kv_channels) if self.kv_fp8 else cfg.kv_channels,
            num_attention_heads=cfg.num_query_groups,
            tensor_model_parallel_size=groups.tp_size,
            pipeline_model_parallel_size=groups.pp_size,
            max_sequence_length=max_sequence_length,
            buffer_size_gb=buffer_size_gb,
            max_requests=max_requests,
            max_tokens=max(max_requests, max_sequence_length, 2048),
            block_size_tokens=BLOCK_SIZE_TOKENS,
            # The output layer on each request's last token only (a prefill's other tokens
            # were a [prompt, V] GEMM each, thrown away: the loop reads the sampled tokens'
            # log-probs only)
            materialize_only_last_token_logits=True,
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
        self._device = (torch.device("cuda", torch.cuda.current_device())
                        if torch.cuda.is_available() else torch.device("cpu"))
        if self._device.type == "cpu":  # the fallback's per-step gathers stop page-faulting
            from gspo_megatron.compat.cpu import keep_freed_memory

            keep_freed_memory()
        self.steps = 0
        """Engine steps (forward passes) of the last generate, dummy forwards included."""
        self.tokens_forwarded = 0
        """Tokens the last generate forwarded for its requests (prefills and decoding steps;
        not the EP lock-step's idle forwards, nor a round's masked rows)."""
        self._request_ids = itertools.count()
        """Request ids, unique for the engine's life (R3 routes of held requests are kept by id
        across calls; Megatron's own counter restarts at every ``engine.reset()``)."""
        self._held: set[int] = set()
        """Ids of the requests a partial rollout cut and kept (``GroupStop.hold_cut``)."""
        self.fast = _fast_decoder(model, groups, self.context, self.controller, self.wrapper,
                                  decode_steps_per_sync, decode_cuda_graphs, decode_experts,
                                  self.coupled, decode_round_cost_rows)
        """Multi-step decoding (:mod:`.rounds`), or None: Megatron's forward at every step."""
        self.invariant = bi.enabled(getattr(self.wrapper.model, "config", None))
        """``precision.batch_invariant``: the sampler's log-probs by the trainer's function."""
        if self.fast is None and self.invariant:
            raise RuntimeError("precision.batch_invariant: this rollout would decode through "
                               "Megatron's forward, not the invariant kernels (WARNING above)")
        if self.fast is None and self.kv_fp8:
            raise RuntimeError("rollout.kv_cache_dtype='fp8': this rollout would decode through "
                               "Megatron's forward, which cannot read the FP8 cache (WARNING "
                               "above); use kv_cache_dtype 'auto'")
        self.call: GenerateCall | None = None
        """The requests of the current (or last) generate."""
        self.kv_bytes = self._kv_bytes()
        """Bytes the paged KV cache holds now (0 while suspended)."""
        self.suspend()

    def _kv_bytes(self) -> int:
        buf = getattr(self.context, "memory_buffer", None)
        return 0 if buf is None else buf.numel() * buf.element_size()

    def suspend(self) -> None:
        """Release the KV buffer and everything the fast decoder made for the rollout (between
        rollouts: training runs without them)."""
        if self.fast is not None:
            self.fast.release()
        self.context.deallocate_all_tensors()
        self.kv_bytes = self._kv_bytes()

    def resume(self) -> None:
        """Allocate the KV buffer again (before a rollout), with an empty context."""
        if not self.context.is_tensor_state_allocated:
            self.context.allocate_all_tensors(is_init=False)
            self.context.reset()
            if self.fast is not None:
                self.fast.buffer_allocated()
        self.kv_bytes = self._kv_bytes()

    def held_ids(self) -> set[int]:
        """Ids of the requests held from the previous call (``GroupStop.hold_cut``)."""
        return set(self._held)

    def drop_held(self) -> None:
        """Forget the held requests and their KV cache."""
        if self._held:
            self._held.clear()
            self.context.reset()

    def held_state(self) -> dict | None:
        """The requests held from the last call, whole, on the host: what a checkpoint taken at
        a stop signal keeps, since the run that was not stopped continues them, KV cache and
        all. The context's request and token tables and counts, the block allocator, the KV
        blocks the held requests use (not the whole buffer), the held ids and the next request
        id. None when nothing is held."""
        if not self._held:
            return None
        ctx, alloc = self.context, self.context.block_allocator
        n = ctx.total_request_count
        blocks = ctx.request_to_kv_block_ids[:n].flatten()
        blocks = torch.unique(blocks[blocks >= 0]).long()
        return {"fingerprint": self._fingerprint(),
                "context": _plain_state(vars(ctx), skip=("memory_buffer",)),
                "allocator": _plain_state(vars(alloc), skip=("context",)),
                "blocks": blocks.cpu(), "kv": ctx.memory_buffer[:, :, blocks].cpu(),
                "held": sorted(self._held), "next_id": self._peek_request_id()}

    def restore_held(self, state: dict) -> bool:
        """Hold the requests of :meth:`held_state` again: the next call continues them as the
        uninterrupted engine would. True when restored; False (one WARNING, nothing held) when
        this engine's shapes differ from the saving engine's (another ``max_batch_size``, KV
        budget or sequence length: its tables would not fit these): the next call then prefills
        the requests it continues, prompt + written tokens, as after a plain checkpoint."""
        self.resume()
        if state.get("fingerprint") != self._fingerprint():
            import logging

            logging.getLogger(__name__).warning(
                "rollout: the held requests of the checkpoint were saved by an engine of other "
                "shapes (max_batch_size, KV budget or sequence length); they are prefilled again")
            self._held.clear()
            self._request_ids = itertools.count(state["next_id"])
            self.suspend()
            return False
        ctx = self.context
        _load_plain_state(ctx, state["context"])
        _load_plain_state(ctx.block_allocator, state["allocator"])
        blocks = state["blocks"].to(ctx.memory_buffer.device)
        ctx.memory_buffer[:, :, blocks] = state["kv"].to(ctx.memory_buffer.device)
        self._held = set(state["held"])
        self._request_ids = itertools.count(state["next_id"])
        self.kv_bytes = self._kv_bytes()
        return True

    def _fingerprint(self) -> dict:
        """The engine's shapes (the context's and allocator's tensors, the KV buffer, block
        size and count, the longest sequence): what a held state must match to be loaded."""
        ctx, alloc = self.context, self.context.block_allocator
        shapes = {f"{where}.{name}": list(value.shape)
                  for where, obj in (("context", ctx), ("allocator", alloc))
                  for name, value in sorted(vars(obj).items()) if torch.is_tensor(value)}
        return {"shapes": shapes, "block_size": int(ctx.block_size_tokens),
                "blocks": int(alloc.total_count),
                "max_sequence_length": int(ctx.max_sequence_length)}

    def _peek_request_id(self) -> int:
        nxt = next(self._request_ids)
        self._request_ids = itertools.count(nxt)
        return nxt

    def _claim_held(self, stop) -> dict[int, int]:
        """``{call position: held request id}`` (``stop.continue_ids``) when they continue every
        held request; otherwise every held request is dropped and ``{}`` returned."""
        claimed = dict(stop.continue_ids) if stop is not None else {}
        if self._held and sorted(claimed.values()) == sorted(self._held):
            self._held.clear()
            return claimed
        self.drop_held()
        return {}

    def generate(self, prompts: list[list[int]], budgets: list[int], sp,
                 stop=None, refill=None, progress=None, turns=None) -> list["Generated"]:
        """Per request, in order (``prompts``, then those ``refill`` added), what it wrote in
        this call (:class:`Generated`; ``finished`` False for a request ``stop``, a
        :class:`~gspo_megatron.policy.GroupStop`, aborted). ``budgets``: each prompt's new-token
        budget; ``sp``: the call's Megatron ``SamplingParams`` (at temperature 1: the wrapper
        divides the logits by the temperature first); ``refill(running)``: asked before every
        step until ``stop`` is done, the requests ``(prompt, budget)`` to add; ``progress(n)``:
        told the number of requests finished after each step that finishes some. With
        ``stop.hold_cut`` the aborted requests stay in the context (and the KV buffer
        allocated) for the next call to continue (``stop.continue_ids``). ``turns``: a
        multi-turn rollout's :class:`~gspo_megatron.envs.turns.TurnDriver`, told every step's
        tokens (it puts the environments' tokens in place of samples, and keeps requests going
        past a turn's EOS); Megatron's step then runs at every step (no multi-step rounds).
        Collective over the coupled group under EP > 1 (lock-step; with the experts replicated
        for decoding only its start is: each rank then steps alone),
        over the model-parallel group otherwise."""
        held = self._claim_held(stop)
        self.resume()
        try:
            # eval mode (the module flags over a cached list: ``model.eval()`` without its
            # recursive walk); the context keeps the held requests, else it starts empty
            set_training([self.wrapper.model], False)
            if self.fast is not None:
                self.fast.begin()
                if self.kv_fp8 and not self.fast.independent:  # (config: decode_experts)
                    raise RuntimeError("rollout.kv_cache_dtype='fp8': the experts are sharded "
                                       "over EP for this call, so prefills would run Megatron's "
                                       "forward, which cannot read the FP8 cache; set "
                                       "rollout.decode_experts='replicated'")
            if not held:
                self.context.reset()
            # (under CUDA graphs the rounds sample inside the graph: Gumbel-max, no
            # data-dependent kernel; the same distribution as Megatron's multinomial)
            graphs = self.fast is not None and self.fast.graphs is not None
            call = self.call = GenerateCall(sp, self.controller.sampling_rng,
                                     "gumbel" if graphs else "multinomial", self.invariant)
            call.turns = turns
            for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
                if i in held:
                    call.join(held[i], prompt, budget)
                else:
                    call.add(next(self._request_ids), prompt, budget)
            # EP ranks step together while a step's MoE layers exchange tokens (Megatron's
            # dispatcher, or sharded experts in the step function); with every expert here
            # (rollout.decode_experts, decided over the same coupled group) no step of this
            # rank waits on another's: each runs alone
            coupled = self.groups.ep_size > 1 and not (self.fast is not None
                                                       and self.fast.independent)
            self.steps = self.tokens_forwarded = finished = 0
            while True:
                if refill is not None and not stop.done:
                    for prompt, budget in refill(call.running):
                        call.add(next(self._request_ids), prompt, budget)
                mine = (self.context.total_request_count > 0 or bool(call.waiting)) and \
                    not (stop and stop.done)
                plan = (self.fast.plan(early_stop=stop is not None)
                        if mine and self.fast and turns is None and self.fast.ready(call)
                        else None)
                step = next_step(mine, plan, coupled, self.fast is not None, self.coupled)
                if step.kind is StepKind.DONE:
                    break
                if step.kind is StepKind.IDLE_ROUND:
                    self.fast.idle(step.steps, step.rows)
                    self.steps += step.steps
                    continue
                if step.kind is StepKind.DUMMY:
                    self.controller.dummy_forward()  # (its MoE layers' collectives)
                    self.steps += 1
                    continue
                if step.kind is StepKind.ROUND:
                    steps = self._round(call, stop, plan, step.steps, step.rows)
                else:  # Megatron's step
                    steps = [self._step(call)]
                    for request_id in steps[0]:
                        if stop is not None:
                            stop.finished(call.row[request_id])
                    if self.fast is not None:  # (the rounds' length starts from its end rate)
                        self.fast.observe(len(steps[0]))
                done = [request_id for ids in steps for request_id in ids]
                if done and progress is not None:
                    finished += len(done)
                    progress(finished)
                self.steps += len(steps)
            out = call.results()
            if call.running:  # aborted
                if stop.hold_cut:  # the next call continues them by id (Generated.request_id)
                    ctx = self.context
                    self._held.update(ctx.request_ids[:ctx.total_request_count].tolist())
                else:
                    self.context.reset()
            return out
        finally:
            self.call = None  # (its per-step tensors: nothing of the call outlives it)
            if self.fast is not None:
                self.fast.end()
            if not self._held:
                self.suspend()
            self.kv_bytes = self._kv_bytes()

    def _round(self, call: "GenerateCall", stop, plan, steps: int, rows: int) -> list[list[int]]:
        """Decoding steps of one round (:class:`~.rounds.FastDecoder`): per step, the ids of the
        requests that finished at it, ``stop`` told of each in order. A partial rollout's stop
        lands at the round's end: the steps after the one that made it done are kept (their
        tokens are the live policy's, as a request's tokens written before an abort reaches it
        are in slime), not thrown away."""
        per_step, pending = self.fast.run(call, plan, steps, self.wrapper.route_recorder, rows)
        for ids in per_step:
            if stop is not None:
                for request_id in ids:
                    stop.finished(call.row[request_id])
            call.finish(ids)
        self._requeue(call, pending.finish())
        self.tokens_forwarded += pending.forwarded
        return per_step

    def _requeue(self, call: "GenerateCall", result) -> None:
        """Requests Megatron's ``update_requests`` evicted, prefilled again later: prompt +
        written so far."""
        evicted = None if result is None else result.get("evict_request_ids")
        if evicted is not None and evicted.numel():
            evicted = evicted.tolist()
            if self.fast is not None:
                self.fast.evicted(evicted)
            for request_id in reversed(evicted):
                call.requeue(request_id)

    def _step(self, call: "GenerateCall") -> list[int]:
        """One forward of the packed buffer (the waiting requests that fit admitted first: a
        prefill of their prompts beside one decoding token per running request), a token
        sampled per request, Megatron's bookkeeping (finished requests leave, their blocks
        freed; a request needing a block it cannot get is paused, or evicted and queued again).
        Returns the ids of the requests that finished, in slot order."""
        from gspo_megatron.backends.megatron.engine.admission import admit_waiting

        ctx = self.context
        admit_waiting(ctx, call.waiting)
        ctx.initialize_attention_state()
        self.tokens_forwarded += int(ctx.active_token_count)
        if self.fast is not None and self.fast.independent:  # the step function, mixed
            last_logits = self.fast.mixed_logits(self.wrapper.route_recorder)  # [n, V]
        else:
            input_ids, position_ids = ctx.current_input_and_position_ids()  # [1, T_padded]
            # [n, V_padded]: logits / T of each request's last token (the model computed no
            # other rows), the padded vocabulary's columns -inf
            last_logits = self.controller._dynamic_step_forward_logits(
                input_ids, position_ids).squeeze(0)
        first, last = ctx.paused_request_count, ctx.total_request_count
        # Drawn over the real vocabulary only: the padded columns have probability 0, and
        # Megatron's filter + softmax + multinomial cost follows the columns (TRL's workload:
        # 18 real of 128, 0.27 -> 0.06 ms a step). The draws differ from a draw over all
        # columns (torch's multinomial consumes its generator by column count); greedy
        # decoding and the distribution are the same.
        sampled = call.sampler.draw(last_logits[:, :self.wrapper.real_vocab_size])
        logprobs = call.sampler.logprobs(last_logits.float(), sampled)  # [n]
        ids = ctx.request_ids[first:last].clone()  # [n]: update_requests moves the slots
        # (one finish rule: :class:`.sampler.FinishRule`, Megatron's)
        stop_ids = ctx.request_metadata["termination_id"][first:last]
        if call.turns is not None:  # the length limit only: the driver rules on the EOS
            stop_ids = torch.full_like(stop_ids, -1)
        ended = call.finish_rule.ends(sampled, stop_ids, ctx.get_active_sequence_lengths(),
                                      ctx.get_max_sequence_lengths())
        if call.turns is not None:  # (the environment's tokens in place of samples)
            rows = [call.row[r] for r in ids.tolist()]
            sampled, ended, forced = call.turns.step(rows, sampled, ended)
            logprobs = logprobs.masked_fill(forced, 0.0)
        active = ~ended
        call.record(ids, sampled, logprobs)
        finished = [] if bool(active.all()) else ids[~active].tolist()
        call.finish(finished)
        self._requeue(call, ctx.update_requests(active.byte(), sampled.clone()))
        return finished


def _fast_decoder(model, groups, context, controller, wrapper, steps_per_sync: int,
                  cuda_graphs: bool, experts: str, coupled=None, round_cost_rows: int = 64):
    """A :class:`~.rounds.FastDecoder` when ``steps_per_sync`` > 0 and the step function covers
    ``model`` on ``groups`` (else None, with a line saying why)."""
    if steps_per_sync <= 0:
        return None
    from gspo_megatron.backends.megatron.engine.rounds import FastDecoder
    from gspo_megatron.backends.megatron.kernels.decode import unsupported

    why = unsupported(model, groups)
    if why is not None:
        import logging

        # (one WARNING: on a GPU this costs ~10x per decoding step; rollout/decode_path 0)
        logging.getLogger(__name__).warning("rollout.decode_steps_per_sync: %s: decoding through "
                                            "Megatron's forward at every step", why)
        return None
    from gspo_megatron.backends.megatron.engine.megatron_kv import LayoutError

    try:
        return FastDecoder(model, context, controller, wrapper, steps_per_sync, cuda_graphs,
                           experts, coupled, round_cost_rows)
    except LayoutError as exc:  # another Megatron's context: its own forward, never a guess
        import logging

        logging.getLogger(__name__).warning(
            "rollout.decode_steps_per_sync: Megatron's inference context is not laid out as "
            "the multi-step decoder writes it (%s); decoding through Megatron's forward", exc)
        return None


def _plain_state(attrs: dict, skip: tuple[str, ...]) -> dict:
    """Tensors (copied to the host), plain values and the small records (request metadata,
    batch dimensions) among ``attrs``: an object's state that changes with its requests."""
    out = {}
    for name, value in attrs.items():
        if name in skip:
            continue
        if torch.is_tensor(value):
            out[name] = value.detach().cpu().clone()
        elif value is None or isinstance(value, (bool, int, float, str)):
            out[name] = value
        elif isinstance(value, dict) and value and all(torch.is_tensor(v) for v in value.values()):
            out[name] = {k: v.detach().cpu().clone() for k, v in value.items()}
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            out[name] = copy.copy(value)
    return out


def _load_plain_state(obj, state: dict) -> None:
    """:func:`_plain_state` back into ``obj``: tensors copied into its own (same shapes: an
    object built from the same config), the rest set."""
    for name, value in state.items():
        mine = getattr(obj, name, None)
        if torch.is_tensor(value) and torch.is_tensor(mine) and mine.shape == value.shape:
            mine.copy_(value.to(mine.device))
        elif isinstance(value, dict) and isinstance(mine, dict):
            for k, v in value.items():
                mine[k].copy_(v.to(mine[k].device))
        else:
            setattr(obj, name, value.to(mine.device) if torch.is_tensor(value) and
                    torch.is_tensor(mine) else value)
