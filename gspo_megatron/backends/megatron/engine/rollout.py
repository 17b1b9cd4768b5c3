"""Rollouts through Megatron-Core's own inference engine.

:class:`RolloutEngine` samples responses from the *live* policy ``GPTModel`` (the very module the
trainer updates; nothing is copied, unless ``rollout.precision`` asks for other numerics: see
*Precision* below) with Megatron-Core's text-generation controller:

* ``rollout.engine: auto`` (the default), on CPU and GPU: Megatron's paged
  ``DynamicInferenceContext`` (continuous batching: a response leaves the packed batch the step
  it ends) driven by our step loop in place of ``DynamicInferenceEngine``'s, sized from the
  recipe, expert-parallel ranks in lock-step, the KV cache released between rollouts
  (:mod:`.dynamic`). Without flash-attn its attention runs on
  :mod:`gspo_megatron.compat.paged_attention` (PyTorch SDPA).
* ``rollout.engine: static``: ``StaticInferenceEngine(legacy=True)`` + ``GPTInferenceWrapper`` +
  ``TextGenerationController`` with a ``StaticInferenceContext`` KV cache, the A/B reference; the
  controller's batch loop is a lean copy of Megatron's (:mod:`.hooks`), a batch's
  prompts are left-padded to one length (:meth:`RolloutEngine._left_pad`).

On CPU the experts run as grouped GEMMs over weights stacked once per generate
(:func:`~gspo_megatron.backends.megatron.kernels.moe.stacked_expert_weights`).

:meth:`RolloutEngine.with_sampling` gives a second sampling configuration (the greedy evaluator)
over the same engine and KV cache.

Sampling semantics (both paths)
-------------------------------
Let ``l = logits[:V] / T`` where ``V`` is the real (unpadded) vocabulary and ``T`` the temperature.
Every forward step's logits are rewritten to ``l`` (padded vocabulary entries ``-inf``) *before*
Megatron samples, and Megatron is asked to sample at temperature 1.0. Megatron then applies its own
top-k or top-p filter to ``l`` and draws with ``torch.multinomial`` from its seeded generator
(``controller.sampling_rng``); ``top_k == 1`` (or ``temperature == 0``) is Megatron's greedy argmax.
Ids ``>= V`` can therefore never be produced (Megatron itself would only *clamp* them to ``V-1``).

``RolloutSample.response_logprobs[i] = log softmax(l)[token_i]``: the log-prob under the
temperature-scaled distribution over the real vocabulary, *before* top-k/top-p truncation -- the
same quantity the trainer computes (:func:`gspo_megatron.backends.megatron.schedule.compute_logprobs` with
``ScoringConfig(temperature=T, vocab_size=V)``). Greedy decoding with ``temperature == 0`` reports
log-probs at ``T = 1``. (For reference: Megatron's own ``return_log_probs`` output is
``log_softmax`` of the *raw* logits over the *padded* vocabulary, i.e. at temperature 1 and
including padded entries; we do not use it on the static path.)

Groups: ``generate`` samples once per entry of ``prompts``; pass each prompt ``G`` times
(:func:`gspo_megatron.stages.rollout_stage` does). Repeated prompts draw independent samples (one
RNG stream over the whole batch).

Precision (``rollout.precision``)
----------------------------------
``auto`` (default): the engine runs the live module itself, in the training precision. ``bf16``
on an fp32 model (or ``fp32`` on a bf16 one): the engine samples from a :class:`SamplingCopy`, a
copy of the live ``GPTModel`` in that dtype (weights and activations, KV cache included; same
TP/EP/PP shards, process groups shared), refreshed from the live weights before every generate --
what a bf16 inference engine beside an fp32 trainer sees. With ``bf16`` the copy runs inside
Megatron's ``Float16Module``: logits are computed in bf16 and upcast to fp32 before the padded
vocabulary is masked and the temperature applied (as vLLM's sampler does), so the reported
log-probs are fp32 log-softmaxes of bf16 logits. (Under PP > 1 Megatron's wrapper casts the last
stage's logits back to the params dtype before broadcasting them, so there they stay bf16.)
The module that samples is :attr:`RolloutEngine.sampling_model` (forward hooks on its routers see
the sampled routes).

Parallelism: every rank of a model-parallel group (TP x PP) calls ``generate`` with the same prompts
and seed and gets the same samples (logits are gathered over TP and, under PP, broadcast from the
last stage; every rank samples from identical logits with an identically seeded generator). Under
expert parallelism (EP > 1) the MoE all-to-alls couple ranks that hold *different* prompts, so
**every rank of the world must call** ``generate`` together; the dynamic engine agrees every step
whether any rank still has work and pads idle ranks with Megatron's ``dummy_forward``; the static
path disables the early stop on EOS (so the number of forward steps is known up front), agrees on
the largest step count and pads the same way. Neither works together with PP > 1. Seeds are used as given: fold the
data-parallel rank into ``seed`` if different DP ranks should draw independent samples.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from typing import Callable

import torch
import torch.distributed as dist

from gspo_megatron.backends.megatron.kernels.moe import stacked_expert_weights
from gspo_megatron.backends.megatron.parallel import drop_inference_buffers
from gspo_megatron.backends.megatron.engine.sampling_copy import SamplingCopy, copy_dtype
from gspo_megatron.backends.megatron.rollout_numerics import attach_rollout_numerics
from gspo_megatron.backends.megatron.schedule import module_list, set_training
from gspo_megatron.config import RolloutConfig
from gspo_megatron.distributed import ParallelGroups
from gspo_megatron.policy import HELD_REQUEST_KEY, GroupStop, RolloutSample

__all__ = ["RolloutEngine", "RolloutSample", "SamplingCopy"]


def _unwrap(model):
    """The ``GPTModel`` inside a list of chunks / Megatron DDP / Float16Module."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise NotImplementedError("virtual pipeline (several model chunks) is not supported")
        model = model[0]
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


@contextlib.contextmanager
def _sequence_parallel_off(model):
    """Megatron's static inference path refuses sequence parallel on non-MoE layers (and a decode
    step has one token, which cannot be split over TP). Turn it off for generation and restore
    every attribute exactly afterwards (the config object is shared with training)."""
    attrs = ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings")
    holders = module_list(model, "sequence_parallel_attrs",
                          lambda m: [(m, a) for a in attrs if hasattr(m, a)])
    saved = [(m, a, getattr(m, a)) for m, a in holders]
    cfg_sp = model.config.sequence_parallel
    if not (cfg_sp or any(v for _, _, v in saved)):  # already off: nothing to switch
        yield
        return
    try:
        model.config.sequence_parallel = False
        for m, a, _ in saved:
            setattr(m, a, False)
        yield
    finally:
        model.config.sequence_parallel = cfg_sp
        for m, a, v in saved:
            setattr(m, a, v)


@contextlib.contextmanager
def _context_parallel_off(model):
    """Generation runs whole sequences on every context-parallel rank (the ranks of a CP group
    hold the same prompts; Megatron's inference has no CP): the rotary table is not cut to the
    rank's CP share while it runs (``RotaryEmbedding.cp_group`` None, its ``lru_cache`` cleared on
    the way in and out so no table crosses between the two), and the dynamic context's rotations
    see a single rank (:func:`.context.rollout_context`). Nothing to do at CP = 1."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rotaries = [m for m in module_list(model, "rotary_embeddings",
                                       lambda m: [m] if isinstance(m, RotaryEmbedding) else [])
                if getattr(m, "cp_group", None) is not None and m.cp_group.size() > 1]
    if not rotaries:
        yield
        return
    saved = [m.cp_group for m in rotaries]

    def clear():
        for m in rotaries:
            type(m).forward.cache_clear()

    try:
        clear()
        for m in rotaries:
            m.cp_group = None
        yield
    finally:
        for m, group in zip(rotaries, saved):
            m.cp_group = group
        clear()


def choose_backend(requested: str, pp_size: int = 1, ep_size: int = 1) -> str:
    """The engine to build: ``auto`` (the default) = Megatron's dynamic engine, on CPU and GPU
    (:mod:`.dynamic`: continuous batching, EP ranks in lock-step, R3 from the packed
    buffer); ``static`` = Megatron's static batch engine, kept as an A/B reference for the
    benchmarks and the local-kernel tests (a batch decodes until its longest response ends).

    Neither keeps pipeline *and* expert parallel ranks in lock-step: the padding forward
    (``dummy_forward``) has no pipeline send/recv."""
    if pp_size > 1 and ep_size > 1:
        raise NotImplementedError(
            f"parallel.pipeline_model_parallel_size={pp_size} with "
            f"expert_model_parallel_size={ep_size}: the rollout engine keeps EP ranks in "
            "lock-step with Megatron's dummy_forward, which has no pipeline send/recv")
    return "dynamic" if requested == "auto" else requested


class RolloutEngine:
    """Generate responses with Megatron-Core's inference engine from the live policy model.

    Args:
        model: the policy ``GPTModel`` (or its DDP wrapper / ``policy.model`` list; unwrapped here).
            It is used in place: rollouts always see the trainer's current weights.
        groups: this rank's :class:`~gspo_megatron.backends.megatron.parallel.ParallelGroups`.
        eos_id: generation stops on this id (it is kept in ``response_ids``).
        pad_id: padding id (used only for Megatron's internal batch padding).
        vocab_size: the tokenizer's real vocabulary; padded embedding rows are never sampled.
        config: :class:`~gspo_megatron.config.RolloutConfig` (temperature, top_p, top_k,
            max_new_tokens, max_batch_size, group_size; ``engine``: ``"auto"``, ``"static"`` or
            ``"dynamic"`` (:func:`choose_backend`), ``dynamic_buffer_size_gb``).
        max_sequence_length: KV-cache length (prompt + response); default the model's.

    ``config.precision`` (``rollout.precision``) picks the sampling numerics: the live module
    (``auto``, or the model's own dtype) or a :class:`SamplingCopy` in another dtype, refreshed
    before every generate (``last_refresh_s``).
    """

    def __init__(self, model, groups: ParallelGroups, *, eos_id: int, pad_id: int,
                 vocab_size: int, config: RolloutConfig,
                 max_sequence_length: int | None = None, record_routes: bool = False):
        self.model = _unwrap(model)
        self.groups = groups
        self.eos_id, self.pad_id, self.vocab_size = int(eos_id), int(pad_id), int(vocab_size)
        self.config = config
        padded = int(self.model.vocab_size)
        if not 0 < self.vocab_size <= padded:
            raise ValueError(f"vocab_size ({vocab_size}) must be in (0, padded vocab {padded}]")
        if not 0 <= self.eos_id < self.vocab_size:
            raise ValueError(f"eos_id ({eos_id}) outside the vocabulary [0, {vocab_size})")
        self.backend = choose_backend(config.engine, groups.pp_size, groups.ep_size)
        self.max_sequence_length = int(max_sequence_length or self.model.max_sequence_length)
        dtype = copy_dtype(config.precision, self.model)
        if dtype is None and config.router_noise_std > 0:  # the noise goes on a copy's routers
            dtype = next(self.model.parameters()).dtype
        self.copy = SamplingCopy(self.model, dtype) if dtype is not None else None
        """The other-precision copy sampled from, or None (the live module samples)."""
        self.fp8, self.router_noise = attach_rollout_numerics(self.copy, config)
        """``rollout.precision: fp8`` weights and ``rollout.router_noise_std``, or None each."""
        self._build(config.dynamic_buffer_size_gb)
        self._route_recorder = None
        """R3: records the MoE routes of every engine forward (:mod:`..routing.rollout_routes`)."""
        if record_routes:
            from gspo_megatron.backends.megatron.routing.rollout_routes import (PackedRouteRecorder,
                                                                       RolloutRouteRecorder)
            from gspo_megatron.backends.megatron.routing.replay import ModelRouting

            recorder = RolloutRouteRecorder if self.backend == "static" else PackedRouteRecorder
            self._route_recorder = recorder(ModelRouting([self.sampling_model], groups))

    @property
    def sampling_model(self):
        """The ``GPTModel`` whose forward produces the sampled tokens: the live policy, or the
        precision copy (install router hooks here to record the routes rollouts take)."""
        return self.model if self.copy is None else self.copy.model

    @property
    def _runner(self):
        """The module the Megatron wrapper calls (``Float16Module`` around a bf16 copy)."""
        return self.model if self.copy is None else self.copy.module

    def weight_metrics(self) -> dict[str, float]:
        """``rollout/fp8_weight_rel_err*`` of the latest refresh (empty without FP8 weights),
        ``rollout/fp8_expert_requant_rel_err`` where the experts ran as FP8 grouped GEMMs, and
        ``rollout/kv_fp8_rel_err`` of the latest call's prefills with an FP8 KV cache."""
        out = dict(self.fp8.metrics) if self.fp8 is not None else {}
        fast = self.dynamic.fast if self.dynamic is not None else None
        if fast is not None:
            out.update(fast.kv_metrics())
            out.update(fast.provider.fp8_metrics())
        return out

    @property
    def last_refresh_s(self) -> float:
        """Seconds the latest weight refresh of the precision copy took (0 without a copy)."""
        return 0.0 if self.copy is None else self.copy.last_refresh_s

    # ------------------------------------------------------------------ construction
    def _build(self, buffer_size_gb: float) -> None:
        from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
            InferenceWrapperConfig,
        )

        from gspo_megatron.backends.megatron.engine.hooks import (
            IdTokenizer,
            RolloutInferenceWrapper,
            RolloutTextGenerationController,
        )

        cfg = self.sampling_model.config
        self.wrapper_config = InferenceWrapperConfig(
            hidden_size=cfg.hidden_size,
            params_dtype=cfg.params_dtype,
            inference_batch_times_seqlen_threshold=-1,  # PP: never split a batch into microbatches
            padded_vocab_size=int(self.model.vocab_size),
            inference_max_requests=int(self.config.max_batch_size),
            inference_max_seq_length=self.max_sequence_length,
            fp32_residual_connection=cfg.fp32_residual_connection,
        )
        id_tok = IdTokenizer(self.eos_id, self.pad_id, self.vocab_size)
        if self.backend == "static":
            from megatron.core.inference.contexts import StaticInferenceContext
            from megatron.core.inference.engines import StaticInferenceEngine

            context = StaticInferenceContext.from_config(self.wrapper_config)
            self.wrapper = RolloutInferenceWrapper(self._runner, self.wrapper_config, context)
            self.wrapper.real_vocab_size = self.vocab_size
            self.controller = RolloutTextGenerationController(
                self.wrapper, id_tok, pp_group=self.groups.pp_group)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.engine = StaticInferenceEngine(
                    self.controller, max_batch_size=int(self.config.max_batch_size), legacy=True)
            # The legacy engine reseeds torch's *global* RNG on every generate(); we seed only the
            # controller's sampling generator, so training RNG streams are left untouched.
            self.engine.random_seed = None
            self.dynamic = None
        else:
            self._build_dynamic(buffer_size_gb)

    def _build_dynamic(self, buffer_size_gb: float) -> None:
        """Megatron's dynamic engine, sized from the recipe (:mod:`.dynamic`)."""
        from gspo_megatron.backends.megatron.engine.dynamic import DynamicRollout

        from gspo_megatron.backends.megatron.engine.hooks import IdTokenizer

        self.dynamic = DynamicRollout(
            model=self.sampling_model, runner=self._runner, wrapper_config=self.wrapper_config,
            groups=self.groups, tokenizer=IdTokenizer(self.eos_id, self.pad_id, self.vocab_size),
            max_batch_size=self.config.max_batch_size,
            max_sequence_length=self.max_sequence_length, buffer_size_gb=buffer_size_gb,
            decode_steps_per_sync=self.config.decode_steps_per_sync,
            decode_cuda_graphs=self.config.decode_cuda_graphs and self.router_noise is None,
            decode_experts=self.config.decode_experts,
            decode_round_cost_rows=self.config.decode_round_cost_rows,
            kv_cache_dtype=self.config.kv_cache_dtype)
        self.wrapper, self.controller = self.dynamic.wrapper, self.dynamic.controller

    def with_sampling(self, config: RolloutConfig) -> "RolloutEngine":
        """The same engine (model, precision copy, Megatron engine, KV cache) sampling with
        ``config``'s temperature / top-k / top-p / max_new_tokens; e.g. a greedy evaluator beside
        the rollout sampler, without a second KV cache (the dynamic engine's is gigabytes)."""
        if config.max_batch_size != self.config.max_batch_size:
            raise ValueError("with_sampling: max_batch_size is fixed when the engine is built")
        if config.precision != self.config.precision:
            raise ValueError("with_sampling: precision is fixed when the engine is built")
        view = copy.copy(self)
        view.config = config
        view._route_recorder = None  # e.g. the evaluator: its routes are never replayed
        return view

    # ------------------------------------------------------------------ sampling params
    def _sampling(self):
        """Megatron ``SamplingParams`` (at temperature 1: our wrapper already divided by T) and the
        temperature the log-probs are reported at."""
        from megatron.core.inference.sampling_params import SamplingParams

        c = self.config
        greedy = c.temperature == 0 or c.top_k == 1
        score_t = 1.0 if c.temperature == 0 else float(c.temperature)
        sp = SamplingParams(
            temperature=1.0,
            top_k=1 if greedy else int(c.top_k),
            top_p=0.0 if (greedy or c.top_p >= 1.0) else float(c.top_p),
            num_tokens_to_generate=int(c.max_new_tokens),
            # Neither path asks Megatron for log-probs: both record the sampled tokens' own
            # (RolloutTextGenerationController; DynamicRollout._step).
            termination_id=-1 if c.ignore_eos else self.eos_id,
        )
        if c.ignore_eos:  # the static path stops on the tokenizer's EOS unless told not to
            sp.add_attributes({"no_early_termination": True})
        return sp, score_t

    # ------------------------------------------------------------------ public API
    @property
    def decode_path(self) -> float:
        """``rollout/decode_path``: 1.0 when decoding runs the multi-step step function
        (:mod:`..kernels.decode`), 0.0 when Megatron's forward runs every step (
        ``decode_steps_per_sync: 0``, or a layout or build it does not cover: a WARNING said
        why when the engine was built)."""
        return float(self.dynamic is not None and self.dynamic.fast is not None)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], seed: int, budgets: list[int] | None = None,
                 stop: GroupStop | None = None,
                 progress: Callable[[int], None] | None = None,
                 turns=None) -> list[RolloutSample]:
        """One response per prompt (in order), sampled from the current weights. ``turns``: the
        requests are episodes of a multi-turn rollout (:class:`~gspo_megatron.envs.turns.
        TurnDriver`; dynamic engine only): a response holds every turn, the environments'
        tokens included (``extra["policy_mask"]`` says whose each is). ``budgets``:
        each request's new-token budget (default ``max_new_tokens``); ``stop``: a partial
        rollout's early end (dynamic engine only), the requests it cuts returned ``aborted``;
        ``progress(n)``: told how many responses have finished, after each static batch or
        each dynamic engine step that finishes some.

        Collective over the model-parallel group (and over the whole world when EP > 1).
        """
        prompts = [[int(t) for t in p] for p in prompts]
        budgets = budgets or [int(self.config.max_new_tokens)] * len(prompts)
        if (stop is not None or turns is not None
                or budgets != [self.config.max_new_tokens] * len(prompts)) and \
                self.backend != "dynamic":
            raise NotImplementedError("partial rollouts (per-request budgets, an early stop) "
                                      "and multi-turn rollouts need the dynamic engine")
        self._check(prompts, budgets)
        sp, score_t = self._sampling()
        self.wrapper.temperature = score_t
        self.controller.sampling_rng.manual_seed(int(seed))
        if self.copy is not None:
            self.copy.refresh()
        if self.router_noise is not None:
            self.router_noise.seed(seed)
        model = self.sampling_model
        was_training = model.training
        self.wrapper.route_recorder = self._route_recorder
        try:
            # The weights are fixed for the call: CPU experts run as grouped GEMMs over them.
            with stacked_expert_weights(model):
                if self.backend == "static":
                    with _sequence_parallel_off(model):
                        samples = self._generate_static(prompts, sp, progress)
                else:
                    samples = self._generate_dynamic(prompts, sp, budgets, stop, progress, turns)
        finally:
            set_training([model], was_training)  # model.train(), over a cached module list
            self.wrapper.route_recorder = None
            if self._route_recorder is not None:  # the held requests' routes stay
                self._route_recorder.reset(
                    keep=self.dynamic.held_ids() if self.dynamic is not None else ())
            drop_inference_buffers()  # (sequence parallel stays on under EP > 1)
        return samples

    def decode_metrics(self) -> dict[str, float]:
        """The fast decoder's (``rollout/decode_graphs``, ``rollout/decode_graph_captures``:
        :meth:`~.rounds.FastDecoder.metrics`); ``rollout/decode_graphs`` 0 without it."""
        fast = self.dynamic.fast if self.dynamic is not None else None
        return fast.metrics() if fast is not None else {"rollout/decode_graphs": 0.0}

    def held_state(self) -> dict | None:
        """The requests the engine holds (``GroupStop.hold_cut``) whole, with their recorded R3
        routes, for a checkpoint taken at a stop signal; None when it holds none."""
        state = self.dynamic.held_state() if self.dynamic is not None else None
        if state is not None and self._route_recorder is not None:
            state["routes"] = self._route_recorder.state_dict()
        return state

    def restore_held(self, state: dict) -> None:
        """Hold :meth:`held_state`'s requests again (an engine built from the same config)."""
        if not self.dynamic.restore_held(state):  # other shapes: prefilled again
            return
        if self._route_recorder is not None:
            self._route_recorder.load_state_dict(state["routes"])

    def _check(self, prompts: list[list[int]], budgets: list[int], first: int = 0) -> None:
        for i, (p, budget) in enumerate(zip(prompts, budgets), start=first):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise ValueError(f"prompt {i} has ids outside [0, {self.vocab_size})")
            if len(p) + budget > self.max_sequence_length:
                raise ValueError(
                    f"prompt {i}: {len(p)} tokens + {budget} new tokens exceeds the inference "
                    f"max sequence length {self.max_sequence_length}")

    # ------------------------------------------------------------------ static (CPU) path
    def _generate_static(self, prompts, sp, progress=None) -> list[RolloutSample]:
        from megatron.core.inference.inference_request import InferenceRequest

        bs = int(self.config.max_batch_size)
        chunks = [self._left_pad(prompts[s:s + bs]) for s in range(0, len(prompts), bs)]
        ep_sync = self.groups.ep_size > 1 and dist.is_initialized() and dist.get_world_size() > 1
        if ep_sync:
            # Fixed step count per static batch: max_prompt + n_new - min_prompt forward calls.
            sp.add_attributes({"no_early_termination": True})
            mine = sum(max(map(len, c)) + sp.num_tokens_to_generate - min(map(len, c))
                       for c, _ in chunks)
            most = torch.tensor([mine], dtype=torch.long)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            self.wrapper.forward_calls = 0

        samples: list[RolloutSample] = []
        scheduler = self.engine.scheduler
        for chunk, pads in chunks:
            requests = [
                InferenceRequest(request_id=self.engine.get_new_request_id(), prompt="",
                                 sampling_params=sp, prompt_tokens=list(p))
                for p in chunk
            ]
            pad_of = {r.request_id: k for r, k in zip(requests, pads or [0] * len(chunk))}
            self.wrapper.left_padding = torch.tensor(pads) if pads else None
            try:
                done = self.engine.generate(inference_requests=requests)
            finally:
                self.wrapper.left_padding = None
            for req in done:
                scheduler.completed_request_pool.pop(req.request_id, None)
                scheduler.requests.pop(req.request_id, None)
                samples.append(self._static_sample(req, pad_of[req.request_id]))
            if progress is not None:
                progress(len(samples))

        if ep_sync:
            self.sampling_model.eval()
            for _ in range(int(most.item()) - self.wrapper.forward_calls):
                self.wrapper.dummy_forward()
        return samples

    def _left_pad(self, chunk: list[list[int]]) -> tuple[list[list[int]], list[int] | None]:
        """``(prompts, pads)``: the static batch's prompts left-padded to the longest, and the pad
        count per prompt (None: the prompts as given).

        Megatron's static engine prefills up to the *shortest* prompt and then feeds the longer
        prompts' remaining tokens one decoding step at a time, so a batch costs ``n_new + longest
        - shortest`` forward steps (18 instead of 16 for TRL's 4-6-token prompts and 16 new
        tokens; ~1.4x at prompts of 50-500 tokens and 1,024 new ones). Left-padded, every prompt
        is prefilled at once and the batch costs ``n_new`` steps; the pad keys are masked
        (:meth:`RolloutInferenceWrapper.get_batch_for_context_window`) and every token is rotated
        at its unpadded position (:class:`~gspo_megatron.backends.megatron.kernels.local.RopeOnceSelfAttention`),
        so a prompt gets the maths it gets alone (floating point differs at the ulp level, as any
        change of batch shape does). Only where every attention is our SDPA kernel (it takes the
        per-sequence mask) and positions are rotary; otherwise, and for equal lengths, the prompts
        go as given.
        """
        longest = max(map(len, chunk))
        if not self._left_padding_ok or min(map(len, chunk)) == longest:
            return chunk, None
        pads = [longest - len(p) for p in chunk]
        return [[self.pad_id] * k + p for k, p in zip(pads, chunk)], pads

    @functools.cached_property
    def _left_padding_ok(self) -> bool:
        """Whether :meth:`_left_pad` may pad: rotary positions and only SDPA attention."""
        from gspo_megatron.backends.megatron.kernels.local import SDPADotProductAttention

        model = self.sampling_model
        attention = [m.core_attention for m in model.modules() if hasattr(m, "core_attention")]
        return (getattr(model, "position_embedding_type", None) == "rope" and bool(attention)
                and all(isinstance(a, SDPADotProductAttention) for a in attention))

    def _static_sample(self, req, pad: int = 0) -> RolloutSample:
        # The controller's record: the response, ending at its EOS if it stopped early.
        sample = self._finish(req.prompt_tokens[pad:], req.gspo_sampled_tokens,
                              req.gspo_sampled_logprobs)
        if getattr(req, "gspo_routes", None) is not None:
            from gspo_megatron.backends.megatron.routing.rollout_routes import ROLLOUT_ROUTES_KEY

            # [L, positions, k]: every token the engine forwarded (all but the last), without
            # the left padding.
            n = len(sample.prompt_ids) + len(sample.response_ids) - 1
            sample.extra[ROLLOUT_ROUTES_KEY] = req.gspo_routes[:, pad:pad + n].clone()
        return sample

    def _finish(self, prompt, tokens, logprobs, budget: int | None = None) -> RolloutSample:
        """Cut at the first EOS (kept) and name the finish reason (``budget``: the request's
        new-token budget, default ``max_new_tokens``)."""
        if self.eos_id in tokens and not self.config.ignore_eos:
            end = tokens.index(self.eos_id) + 1
            return RolloutSample(list(prompt), tokens[:end], logprobs[:end], "eos")
        n = self.config.max_new_tokens if budget is None else budget
        return RolloutSample(list(prompt), tokens[:n], logprobs[:n], "length")

    # ------------------------------------------------------------------ dynamic path
    def _generate_dynamic(self, prompts, sp, budgets: list[int], stop: GroupStop | None,
                          progress=None, turns=None) -> list[RolloutSample]:
        # Sampling draws from controller.sampling_rng (seeded in generate()).
        prompts, budgets = list(prompts), list(budgets)
        refill = None
        if stop is not None and stop.refill is not None:

            def refill(running: int) -> list:
                """``stop.refill``'s requests, checked, joined to the call's lists."""
                new = stop.refill(running)
                self._check([p for p, _, _ in new], [b for _, b, _ in new], len(prompts))
                added = []
                for p, b, group in new:
                    prompts.append([int(t) for t in p])
                    budgets.append(b)
                    stop.add(group)
                    added.append((prompts[-1], b))
                return added
        # Inference mode (as the static loop): no autograd bookkeeping on any op, ~1.2 ms of
        # a 41 ms rollout on TRL's workload, whose parameters require grad. What leaves it is
        # lists, and the R3 routes copied out below (inference tensors cannot be saved for the
        # update's backward); the context's tensors are only touched in here.
        sp_off = (_sequence_parallel_off(self.sampling_model) if self.groups.ep_size == 1
                  else contextlib.nullcontext())
        with torch.inference_mode(), sp_off, _context_parallel_off(self.sampling_model):
            written = self.dynamic.generate(prompts, budgets, sp, stop, refill, progress, turns)
        held_ids = self.dynamic.held_ids()
        recorder = self._route_recorder
        samples = []
        for row, (prompt, budget, w) in enumerate(zip(prompts, budgets, written)):
            if not w.finished:
                held = {HELD_REQUEST_KEY: w.request_id} if w.request_id in held_ids else {}
                samples.append(RolloutSample(list(prompt), w.tokens, w.logprobs, "aborted", held))
                continue
            if turns is not None:  # every turn: the episode's EOS is not the first
                sample = RolloutSample(list(prompt), w.tokens, w.logprobs,
                                       turns.finish_reason(row), turns.extra(row, w.tokens))
            else:
                sample = self._finish(prompt, w.tokens, w.logprobs, budget)
            if recorder is not None:
                from gspo_megatron.backends.megatron.routing.rollout_routes import ROLLOUT_ROUTES_KEY

                # [L, positions, k]: every token the engine forwarded (all but the last)
                n = len(sample.prompt_ids) + len(sample.response_ids) - 1
                sample.extra[ROLLOUT_ROUTES_KEY] = recorder.take_request(w.request_id, n)
            samples.append(sample)
        return samples
