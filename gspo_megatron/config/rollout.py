"""The ``rollout`` section: how responses are sampled (Megatron-Core's inference engine, the fast
decoder, placement, partial rollouts). Re-exported by :mod:`gspo_megatron.config.schema`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Literal

from gspo_megatron.sections import Problem, Section


@dataclass
class RolloutConfig(Section, name="rollout"):
    """Sampling G responses per prompt with Megatron-Core's inference engine."""

    group_size: int = 8
    """G: responses per prompt (the group advantages normalise within)."""
    prompts_per_step: int = 16
    """Prompts per RL step (per data-parallel rank); the rollout batch is prompts x G."""
    max_new_tokens: int = 1024
    """Generation budget per response."""
    ignore_eos: bool = False
    """Sample ``max_new_tokens`` for every response, EOS being an ordinary token (vLLM's
    ``ignore_eos``): for throughput benchmarks at a fixed response length, not for training."""
    temperature: float = 1.0
    """Sampling temperature, > 0 (also applied when the trainer scores tokens). For greedy
    decoding set ``top_k: 1``."""
    top_p: float = 1.0
    """Nucleus sampling threshold in (0, 1] (1.0 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off, 1 = greedy). Not combinable with ``top_p`` < 1."""
    max_batch_size: int = 256
    """Requests the engine decodes at once (the dynamic engine's request slots); more prompts
    wait and take a slot as soon as one frees."""
    engine: Literal["auto", "static", "dynamic"] = "auto"
    """Megatron-Core inference engine. ``auto`` (default) = ``dynamic``: the dynamic engine with a
    paged KV cache and continuous batching, on CPU and GPU (a finished response leaves its slot at
    once, so a rollout costs its real tokens; expert-parallel ranks kept in lock-step; R3 routes
    recorded from its packed buffer). ``static``: Megatron's static batch engine (every batch
    decodes until its longest response ends; under EP until ``max_new_tokens``), kept as the A/B
    reference of the benchmarks and the local-kernel tests."""
    dynamic_buffer_size_gb: float | None = None
    """Memory for the dynamic engine's paged KV cache (Megatron's
    ``inference_dynamic_batching_buffer_size_gb``), per rank. ``null`` (default) = room for
    ``max_batch_size`` requests of ``model.seq_length`` tokens. Smaller budgets work: requests
    beyond it wait (continuous batching) and a running one may be paused; one request of
    ``model.seq_length`` tokens must fit. Released between rollouts (the trainer's passes run
    without it) and allocated again before the next one."""
    decode_steps_per_sync: int = 16
    """The dynamic engine's decoding steps per host round trip (multi-step scheduling, vLLM's
    ``num_scheduler_steps``): once every running request is decoding, up to this many steps run
    as one pure-torch step function over the model's weights and Megatron's paged KV cache
    (``backends/megatron/kernels/decode.py``), with no host read in between; requests that end
    inside a round are masked until its end (so rounds are shorter while many end: the engine's
    ``rounds.round_length``), new prompts join at round boundaries (their prefill
    runs the same step function, unless another EP rank's step waits on this one's). 0 =
    Megatron's forward and bookkeeping at every step. Models the step function does not cover (TP
    or PP rollouts, TE modules, grouped or biased routing) decode through Megatron's forward."""
    decode_experts: Literal["auto", "replicated", "sharded"] = "auto"
    """Where the multi-step decoding step finds the experts under expert parallelism.
    ``sharded``: each EP rank its own, every MoE layer of every decoding step one gather of the
    ranks' tokens and one all-to-all of their partial sums, the ranks in lock-step (prefills
    through Megatron's forward and dispatcher). ``replicated``: every rank all of them, gathered
    once per rollout call (one all-gather per MoE layer); then no step needs another rank
    (decoding rounds and prefills both run the step function), so each rank decodes its own
    requests alone and its call ends with them, at the cost of ``(EP - 1) / EP`` of the experts'
    weights more on each rank for the call. ``auto`` (default): replicated when that extra copy
    takes at most a quarter of the memory free on every EP rank (device memory on CUDA, RAM on
    CPU), sharded otherwise."""
    decode_cuda_graphs: bool = False
    """On CUDA, replay the multi-step decoding step from CUDA graphs (one per batch-size and
    key-window bucket, all in one memory pool: ``backends/megatron/kernels/graphs.py``) instead
    of launching its kernels one by one. Off by default: the capture has not yet passed the GPU
    check (``tools/gpu_check.sh``, stage ``decode_probe``: graph vs eager tokens equal, memory
    reserved flat across RL steps); turn it on where that stage passes on your machine. The
    graphs are dropped at the end of each rollout call and the buckets the last call met are
    captured again when the next starts (not inside its rounds); a capture that raises
    falls back to the eager step with one WARNING and ``rollout/decode_graphs`` 0. Under expert
    parallelism with sharded experts (``decode_experts``) eager, and nothing on CPU."""
    decode_round_cost_rows: int = 64
    """A multi-step decoding round's own cost (its two host reads, the plan, the write-back and
    Megatron's ``update_requests``), in decoding row-steps: what the round length weighs
    against the rows a round computes past their request's end (``rounds.round_length``:
    ``K = sqrt(2 R / (rows p))`` for an end rate ``p``). 64 is the CPU's (~0.44 ms a round
    against ~0.008 ms a row and step on the tiny model); on a memory-bound GPU a masked row is
    nearly free and a round costs a host round trip, so a few thousand (rounds near
    ``decode_steps_per_sync``) fits better; ``tools/gpu_check`` measures both terms."""
    precision: Literal["auto", "fp32", "bf16", "fp8"] = "auto"
    """Numerics the engine samples in. ``auto`` (default) = the model's training precision: the
    engine runs the live policy module itself, no copy (today's behaviour, bitwise). ``bf16`` /
    ``fp32`` different from the training precision: the engine samples from a copy of the live
    policy in that dtype (weights *and* activations, same TP/EP/PP shards, process groups shared),
    refreshed from the live weights before every generate. Why: production inference engines
    (vLLM, SGLang) decode in bf16 while the trainer scores in fp32 (or bf16 with fp32 master
    weights); ``bf16`` on an fp32 trainer reproduces that rollout/training mismatch
    (``kl/rollout_vs_train``) on CPU, so importance-sampling corrections can be tested there. Cost:
    the copy's memory (bf16: half the fp32 parameters) and one cast-copy of every parameter per
    generate (small next to decoding; the run logs it in ``perf/rollout_s``). ``fp8``: the bf16
    copy with its linear layers' weights (attention QKV and output projections, experts, shared
    experts, dense MLPs) in FP8 e4m3 with one scale per ``fp8_block_size`` square block (the
    layout of Qwen's and DeepSeek's FP8 checkpoints), quantized from the live weights at every
    refresh; embeddings, norms, routers and the output layer stay bf16, as FP8 checkpoints keep
    them. On CPU the copy holds the dequantized weights (the numerics of FP8 weights, bf16
    activations); ``tools/gpu_check.py --stage fp8`` times the FP8 GEMMs (``torch._scaled_mm``)
    on Hopper. Logs ``rollout/fp8_weight_rel_err`` (and per layer). Training is unchanged."""
    fp8_block_size: int = 128
    """``precision: fp8``: the side of the square weight blocks that share one scale (128 in
    Qwen's and DeepSeek's FP8 checkpoints and the only size Hopper's block-scaled GEMM takes;
    other powers of two >= 16 are for study on CPU). A dimension it does not divide ends in a
    smaller block."""
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    """What the dynamic engine's paged KV cache stores keys and values in (vLLM's knob of the
    same name). ``auto`` (default): the rollout's compute dtype (``precision``'s). ``fp8``: e4m3
    with one float32 scale per token and key/value head, computed from the vector written (no
    calibration, no saturation; only e4m3's rounding: 2.2 % relative on the tiny model),
    dequantized to the compute dtype when read: about half the KV memory of bf16 (a quarter of
    fp32), so more requests fit the same budget (no faster step: no FP8 attention kernel). Written and read by the multi-step decoding step only, so it
    needs ``engine: dynamic``, ``decode_steps_per_sync > 0``, no pipeline parallelism, and under
    expert parallelism ``decode_experts: replicated``; refused with
    ``precision.batch_invariant``. Logs ``rollout/kv_fp8_rel_err``. Training is unchanged."""
    router_noise_std: float = 0.0
    """A research control, off (0) by default: the rollout's MoE router logits get Gaussian noise
    of this standard deviation (fresh draws per token and layer, seeded from the rollout seed),
    so sampler and trainer route differently by a set amount, as on real clusters (the R3 paper
    measures ~10 % of router decisions differing on Qwen3-30B-A3B). The trainer's routers are
    untouched; the engine samples from a copy of the policy (in ``precision``'s dtype) whose
    routers carry the noise. ``examples/routing_study/router_noise.py`` maps the scale to the
    measured disagreement and ``kl/rollout_vs_train`` (docs/routing.md). The held-out evaluation
    decodes with the same engine, so it sees the noise too (as it sees ``precision``). On CUDA
    the engine decodes without CUDA graphs while it is on."""

    placement: Literal["colocated", "separate"] = "colocated"
    """Where rollouts run. ``colocated`` (default): every rank samples with the live policy, then
    trains (rollout and training alternate). ``separate``: the last ``rollout.ranks`` ranks of the
    job only roll out (a sampling copy of the policy, full on each rollout rank, refreshed with the
    trainer's weights after every optimizer step) and the others only train, the rollout of step
    ``t + max_staleness`` overlapping the training of step ``t`` (NeMo-RL's one-step off-policy,
    verl's async mode)."""
    ranks: int = 0
    """``placement: separate``: how many ranks roll out; one per data-parallel rank of the trainer
    (rollout rank ``j`` samples trainer DP rank ``j``'s prompts)."""
    max_staleness: int = 1
    """``placement: separate``: the rollout of step ``t`` samples with the weights of step
    ``t - max_staleness`` (after that many fewer optimizer steps; ``max(0, .)``), a fixed lag, so a
    run is deterministic whatever the timing. 0: rollout and training alternate as when colocated
    (the same samples, bitwise). The trainer recomputes the old log-probs at the step (the clip is
    relative to the policy being updated); the stale rollout's own log-probs reach the loss only
    through ``rollout_correction``. Ignored when colocated."""

    weight_bucket_mb: float = 512.0
    """``placement: separate``: the most MiB of weights one message carries from a trainer rank
    to a rollout rank (512, the default of verl's ``rollout.update_weights_bucket_megabytes``,
    ``verl/trainer/config/rollout/rollout.yaml``, and of slime's ``--update-weight-buffer-size``,
    ``slime/utils/arguments.py``, there in bytes). Each trainer rank sends its own shard of the
    weights after every optimizer step, packed into buckets of this size (a tensor larger than a
    bucket is cut into blocks that fit), and a rollout rank holds one bucket in host memory at a
    time. Larger: fewer messages; smaller: less host memory on the rollout ranks (``gspo-plan
    --config`` reports it)."""

    partial_rollouts: bool = False
    """Carry a rollout's long tail into the next step (APRIL; slime's partial rollouts): each
    data-parallel rank keeps ``prompts_per_step x group_size`` requests running, fresh groups
    joining as responses end (up to ``in_flight_groups`` groups held); a rollout stops once
    ``prompts_per_step`` groups are complete, and the responses still running go on in the next
    step's rollout (with the newer weights; each token keeps its own sampler's log-prob). Cost:
    responses written by several policies (``rollout/partial_max_age``, ``_carried_share``); it
    keeps long-tailed rollouts from decoding their tail alone (docs/benchmarks.md, section 12).
    Dynamic engine, without dynamic sampling; with ``placement: separate`` the rollout ranks
    hold the groups in flight."""
    in_flight_groups: int = 0
    """``partial_rollouts``: the most groups a data-parallel rank holds (running, or complete
    but waiting for their slowest response), >= ``prompts_per_step``; 0: four times
    ``prompts_per_step``. It bounds the prompts drawn ahead and how stale a carried response
    can get."""

    partial_max_age: int = 0
    """``partial_rollouts``: how long a group may stay unfinished: a rollout does not stop
    before every group drawn ``partial_max_age`` or more steps ago is complete (it waits for
    them as a plain rollout waits for its tail), so no response is written by more than
    ``partial_max_age + 1`` steps' policies (``rollout/partial_max_span``; a complete group may
    still wait a step when more are due than a step trains on); 0: no bound (AReaL bounds the
    same staleness, ``max_head_offpolicyness``)."""

    partial_keep_kv: bool = False
    """``partial_rollouts``: the engine holds the responses a rollout cuts, KV cache and all, and
    the next step's rollout continues them without prefilling their prefix again (PipelineRL's
    in-flight weight update: the earlier tokens' keys and values stay those of the older weights;
    each token still keeps its own sampler's log-prob). Cost: the KV buffer stays allocated
    through the old-log-prob pass and the updates instead of being released; saves about 1.8
    prefilled tokens per token written on long-tailed responses (docs/benchmarks.md, section
    12). After a checkpoint the prefixes are prefilled once (a resumed run holds no cache).
    With ``placement: separate`` the rollout ranks hold them (they do not train, so nothing else
    needs the memory), and prefill once after each ``checkpoint.save_interval`` checkpoint."""

    def in_flight(self) -> int:
        """The most groups a partial rollout holds per data-parallel rank."""
        return self.in_flight_groups or 4 * self.prompts_per_step

    def weight_bucket_bytes(self) -> int:
        """``weight_bucket_mb`` in bytes."""
        return int(self.weight_bucket_mb * (1 << 20))

    def _problems(self) -> Iterator[Problem]:
        if self.partial_rollouts and self.in_flight() < self.prompts_per_step:
            yield self._problem("in_flight_groups", f"must be >= rollout.prompts_per_step "
                                                    f"({self.prompts_per_step}) or 0, got "
                                                    f"{self.in_flight_groups}")
        if self.placement == "separate" and self.ranks < 1:
            yield self._problem("ranks", f"must be >= 1 with rollout.placement='separate', got "
                                         f"{self.ranks}")
        yield from self._at_least(0, "ranks", "max_staleness", "in_flight_groups",
                                  "partial_max_age", "decode_steps_per_sync")
        yield from self._at_least(1, "decode_round_cost_rows")
        if not self.weight_bucket_bytes() >= 1024:
            yield self._problem("weight_bucket_mb", f"must be at least 1/1024 (a KiB: a bucket "
                                                    f"holds whole elements), got "
                                                    f"{self.weight_bucket_mb}")
        if self.dynamic_buffer_size_gb is not None and not self.dynamic_buffer_size_gb > 0:
            yield self._problem("dynamic_buffer_size_gb",
                                f"must be > 0 (or null: sized from max_batch_size), got "
                                f"{self.dynamic_buffer_size_gb}")
        yield from self._at_least(2, "group_size", note=(
            " (GSPO/GRPO advantages are normalised within a group of responses to the same "
            "prompt)"))
        yield from self._at_least(1, "prompts_per_step", "max_new_tokens", "max_batch_size")
        if not self.temperature > 0:
            yield self._problem("temperature", (
                f"must be > 0 (greedy decoding is rollout.top_k: 1), got {self.temperature}"))
        if not 0 < self.top_p <= 1:
            yield self._problem("top_p", f"must be in (0, 1], got {self.top_p}")
        b = self.fp8_block_size
        if b < 16 or b & (b - 1):
            yield self._problem("fp8_block_size", f"must be a power of two >= 16 (128 in FP8 "
                                                  f"checkpoints and Hopper's GEMM), got {b}")
        if not self.router_noise_std >= 0:
            yield self._problem("router_noise_std", f"must be >= 0 (0 = off), got "
                                                    f"{self.router_noise_std}")
        yield from self._at_least(0, "top_k", note=" (0 = off)")
        if self.top_k > 1 and 0 < self.top_p < 1:
            yield self._problem(("top_k", "top_p"), (
                f"must be 0 or 1 when rollout.top_p < 1 ({self.top_p}), got {self.top_k}: "
                "rollout.top_k and rollout.top_p cannot both be active (Megatron-Core's sampler "
                "supports one at a time)"))
