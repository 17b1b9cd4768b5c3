"""What the rollout's fast decoder holds on a GPU, per phase (``gspo-plan`` prints it).

The multi-step decoder (``rollout.decode_steps_per_sync``) holds, for one rollout call and no
longer (the engine frees it in ``suspend()``, before the trainer's passes):

- the **stacked experts**: ``SequentialMLP``'s per-expert weights copied into one ``[E_l, H, 2F]``
  / ``[E_l, F, H]`` pair per MoE layer (a grouped-GEMM expert container is read in place: 0);
- the **replicated experts** (``rollout.decode_experts`` replicated, or ``auto`` when it fits): the
  other EP ranks' experts gathered here, ``(EP - 1)`` times this rank's;
- the **FP8 experts** (``rollout.precision: fp8`` on Hopper, where the experts' FP8 grouped GEMM
  runs): the experts of the call requantized per row, one byte a weight and a float32 scale a
  row (:func:`~gspo_megatron.backends.megatron.engine.decode_weights.fp8_experts`);
- a **decoding step's working set** at ``max_batch_size`` requests: the fp32 logits over the real
  vocabulary (and the sampler's temporaries over them), one layer's gathered key window and the
  experts' intermediates. Under CUDA graphs this lives in the graphs' one shared memory pool
  (captured largest bucket first, so the smaller buckets reuse its blocks), held for the call.

Nothing of it is held while training; the KV cache is counted by the planner itself.
"""

from __future__ import annotations

import dataclasses

from gspo_megatron.config.model import ModelConfig

GIB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class DecodePeak:
    """Bytes per GPU the fast decoder adds during a rollout (:func:`decode_peak`)."""

    stacked_experts: int
    """This rank's experts stacked for the call (0 for a grouped-GEMM container: a view)."""
    replicated_experts: int
    """The other EP ranks' experts gathered here (0 when sharded or EP = 1)."""
    logits: int
    """One step's fp32 logits at ``max_batch_size`` rows and the sampler's temporaries."""
    step_activations: int
    """One layer's key window (keys and values, the longest sequence) and its experts'
    intermediates, at ``max_batch_size`` rows."""
    graph_pool: bool
    """Whether the working set (logits + activations) sits in the CUDA graphs' pool."""
    fp8_experts: int = 0
    """The experts of the call in FP8 for the grouped GEMM (0 unless ``rollout.precision:
    fp8``; planned as on Hopper, where the kernel runs)."""

    @property
    def rollout_begin(self) -> int:
        """Held from ``begin()`` to ``suspend()``: the stacked and replicated experts."""
        return self.stacked_experts + self.replicated_experts + self.fp8_experts

    @property
    def step(self) -> int:
        """A decoding step's working set (the graph pool's size under CUDA graphs)."""
        return self.logits + self.step_activations

    @property
    def peak(self) -> int:
        """The decoder's peak during a rollout; 0 while training."""
        return self.rollout_begin + self.step


def decode_peak(model: ModelConfig, *, tp: int, ep: int, etp: int, pp: int, max_batch_size: int,
                seq_length: int, replicated: bool, cuda_graphs: bool, grouped_experts: bool = False,
                bytes_per_weight: int = 2, samplers: int = 3, fp8_experts: bool = False,
                kv_fp8: bool = False) -> DecodePeak:
    """The fast decoder's memory on the busiest rank (first pipeline stage: the most layers of a
    stage are all stages' under an even split). ``replicated``: the experts gathered from every
    EP rank for the call; ``grouped_experts``: a grouped-GEMM container (nothing stacked);
    ``samplers``: fp32 ``[B, V]`` tensors a sampling step holds at once (logits, the Gumbel
    noise or probabilities, the log-sum-exp's temporary); ``fp8_experts``: the call's experts
    also in FP8 (``rollout.precision: fp8``); ``kv_fp8``: the key window is read from an FP8
    cache (``rollout.kv_cache_dtype: fp8``: the packed rows, their float32 dequantization and
    the result in the compute dtype)."""
    h, f = model.hidden_size, model.moe_ffn_hidden_size
    moe_layers = sum(model.layer_is_moe()) // pp
    local = model.num_moe_experts // ep if model.num_moe_experts else 0
    expert_bytes = moe_layers * local * 3 * h * f // etp * bytes_per_weight
    stacked = 0 if grouped_experts else expert_bytes
    replica = expert_bytes * (ep - 1) if replicated else 0
    logits = samplers * max_batch_size * model.vocab_size * 4
    d = model.head_dim()
    kv_window = 2 * max_batch_size * seq_length * (model.num_query_groups // min(
        tp, model.num_query_groups)) * ((d + 4) + 4 * d + d * bytes_per_weight if kv_fp8
                                        else d * bytes_per_weight)
    here = local * ep if replicated else local  # experts the call multiplies on this rank
    fp8 = moe_layers * here * (3 * h * f // etp + 4 * (2 * f // etp + h)) if fp8_experts else 0
    # experts' intermediates: every token through top-k experts' [2F] gate/up and [F] (fp32)
    experts = max_batch_size * max(model.moe_router_topk, 1) * 3 * f // etp * 4
    return DecodePeak(stacked, replica, logits, kv_window + experts, cuda_graphs, fp8)


def decode_lines(peak: DecodePeak) -> list[str]:
    """``gspo-plan``'s lines for :class:`DecodePeak`, one per term and phase."""
    rows = [("decode: stacked experts", peak.stacked_experts),
            ("decode: replicated experts", peak.replicated_experts),
            *([("decode: FP8 experts", peak.fp8_experts)] if peak.fp8_experts else []),
            ("decode: step logits + sampler", peak.logits),
            ("decode: step activations", peak.step_activations),
            ("decode peak, rollout" + (" (graph pool)" if peak.graph_pool else ""), peak.peak),
            ("decode peak, training", 0)]
    return [f"  {name:32s} {value / GIB:8.2f} GiB" for name, value in rows]


def recipe_decode_peak(model: ModelConfig, layout, rollout, free_bytes: float) -> DecodePeak | None:
    """:func:`decode_peak` for a recipe's ``rollout`` section on ``layout`` (a planner
    ``Layout``); None when the fast decoder is off (``decode_steps_per_sync`` 0, the static
    engine). ``decode_experts: auto`` replicates when the replica takes at most a quarter of
    ``free_bytes`` (the GPU's memory less the rollout's peak), as the engine decides."""
    if rollout.decode_steps_per_sync <= 0 or rollout.engine == "static":
        return None
    kwargs = dict(tp=layout.tp, ep=layout.ep, etp=layout.etp, pp=layout.pp,
                  max_batch_size=rollout.max_batch_size, seq_length=model.seq_length,
                  cuda_graphs=bool(rollout.decode_cuda_graphs),
                  fp8_experts=rollout.precision == "fp8",
                  kv_fp8=rollout.kv_cache_dtype == "fp8")
    peak = decode_peak(model, replicated=True, **kwargs)
    replicated = rollout.decode_experts == "replicated" or (
        rollout.decode_experts == "auto" and 4 * peak.replicated_experts <= free_bytes)
    return peak if replicated else decode_peak(model, replicated=False, **kwargs)
