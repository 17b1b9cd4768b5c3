"""What the rollout engine's sampling copy does to the live weights and routes beyond a dtype cast:
FP8 weights (``rollout.precision: fp8``) and router-logit noise (``rollout.router_noise_std``).

Both act on the :class:`~.engine.sampling_copy.SamplingCopy` only (the model that samples), never
on the live module the trainer updates, so training is unchanged.

FP8 (:class:`Fp8Weights`): at every refresh of the copy (before every generate: each time the
rollout gets new weights) the linear layers' weights of the live model are quantized to e4m3 with
one scale per ``b x b`` block (:mod:`gspo_megatron.rollouts.fp8`, the layout of Qwen's and
DeepSeek's FP8 checkpoints) and the copy holds ``Q * scale_inv`` in its dtype (bf16):
dequantize-then-matmul, so every kernel that reads the copy's weights (Megatron's forward, the
multi-step decoding step, the experts stacked for grouped GEMMs) computes with FP8 weights.
Quantized: attention ``linear_qkv`` / ``linear_proj`` (and MLA's projections), the experts'
``linear_fc1`` / ``linear_fc2`` (each expert its own blocks), shared experts and dense MLPs. Kept
in the copy's dtype, as FP8 checkpoints and serving engines keep them (DeepSeek-V3's and Qwen3's
FP8 releases, vLLM's and SGLang's block-FP8 layers): embeddings (a lookup, no GEMM to speed up),
norms (vectors), the router (its top-k is a discrete choice that a small error flips, and its
GEMM is tiny) and the output layer (its error is the sampled distribution's error directly).
"""

from __future__ import annotations

import logging
import re
from typing import Iterable

import torch

from gspo_megatron.rollouts.fp8 import (Fp8Linear, dequantize_blockwise, fp8_gemm_runs_on,
                                        fp8_gemm_unfit, fp8_gemm_works, fp8_grouped_gemm_works,
                                        fp8_grouped_linear, fp8_linear, quantize_blockwise,
                                        relative_error)

FP8_WEIGHT = re.compile(
    r"(linear_qkv|linear_proj|linear_q_proj|linear_q_down_proj|linear_q_up_proj"
    r"|linear_kv_down_proj|linear_kv_up_proj|linear_fc1|linear_fc2)\.weight\d*$"
    r"|experts\.weight[12]$")
"""Parameter names (``named_parameters``) whose weights rollouts take in FP8: the linear layers'
(TE's grouped experts number theirs ``weight0``, ``weight1``, ...; the legacy ``GroupedMLP``
stores ``weight1`` / ``weight2`` as ``[in, out]``, quantized transposed)."""

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class Fp8Weights:
    """Block-wise FP8 of the copy's linear weights, requantized from the live ones at every
    refresh (:meth:`apply`), with the quantization error per layer.

    Args:
        pairs: ``(name, copy parameter, live parameter)`` for every weight to quantize.
        block: the block size ``b`` (128 in Qwen's and DeepSeek's checkpoints).

    Attributes:
        packed: with a ``gemm`` (Hopper), the attention weights' ``name ->``
            :class:`~gspo_megatron.rollouts.fp8.Fp8Linear` (``Q [N, K]`` e4m3,
            ``scale_inv [ceil(N/b), ceil(K/b)]``), also set as the copy model's
            ``fp8_gemm_weights`` (by parameter id), which the multi-step decoding step runs as
            FP8 GEMMs (``torch._scaled_mm``); empty elsewhere (the copy's dequantized weights are
            all that is used). The experts' FP8 grouped GEMM (``torch._scaled_grouped_mm``,
            row-wise scales) is made per rollout call from the copy's experts where its probe
            passes (the copy model's ``fp8_expert_gemm``:
            :func:`~.engine.decode_weights.fp8_experts`).
        metrics: the latest ``rollout/fp8_weight_rel_err`` (Frobenius ``||W - Q s|| / ||W||``
            over every quantized weight, against the live weights) and
            ``rollout/fp8_weight_rel_err/layer_{i}`` (per decoder layer).
    """

    def __init__(self, pairs: Iterable[tuple[str, torch.Tensor, torch.Tensor]], block: int,
                 gemm=None, model=None):
        self.pairs = list(pairs)
        self.block = int(block)
        self.gemm = gemm
        """None: dequantized weights only; else the FP8 GEMM ``(x, Q, scale_inv, block)`` the
        decoding step's attention runs (:class:`~gspo_megatron.rollouts.fp8.Fp8Linear`)."""
        self.model = model
        self.packed: dict[str, Fp8Linear] = {}
        self.metrics: dict[str, float] = {}

    @classmethod
    def of(cls, copy_model, live_model, block: int, gemm="auto") -> "Fp8Weights":
        """``gemm``: ``auto`` = :func:`~gspo_megatron.rollouts.fp8.fp8_linear` where it runs
        (Hopper), else None."""
        live = dict(live_model.named_parameters())
        if gemm == "auto":
            device = next(copy_model.parameters()).device
            why = fp8_gemm_works(device) if block == 128 else f"block {block}"
            if why is not None and fp8_gemm_runs_on(device):  # a GPU that should have run it
                logger.warning("rollout.precision=fp8: the FP8 GEMM is off (%s); the decoding "
                               "step multiplies the dequantized bf16 weights", why)
            gemm = fp8_linear if why is None else None
            why = fp8_grouped_gemm_works(device)
            if why is not None and fp8_gemm_runs_on(device):
                logger.warning("rollout.precision=fp8: the experts' FP8 grouped GEMM is off (%s); "
                               "the decoding step multiplies the dequantized bf16 experts", why)
            # what the decoding step's weights provider reads (engine/decode_weights.fp8_experts)
            copy_model.fp8_expert_gemm = fp8_grouped_linear if why is None else None
        return cls(((n, p, live[n]) for n, p in copy_model.named_parameters()
                    if FP8_WEIGHT.search(n)), block, gemm, copy_model)

    @torch.no_grad()
    def apply(self) -> dict[str, float]:
        """Quantize every live weight and write ``Q * scale_inv`` into its copy; returns (and
        keeps in :attr:`metrics`) the quantization error."""
        sums: dict[str | None, list[float]] = {}  # layer index (None: all) -> [err^2, norm^2]
        for name, dst, src in self.pairs:
            transposed = name.endswith(("experts.weight1", "experts.weight2"))  # [in, out]
            w = src.detach().t() if transposed else src.detach()
            q, scale_inv = quantize_blockwise(w, self.block)
            deq = dequantize_blockwise(q, scale_inv, dst.dtype, self.block)
            dst.copy_(deq.t() if transposed else deq)
            if self.gemm is not None and name.endswith(("linear_qkv.weight", "linear_proj.weight")) \
                    and (self.gemm is not fp8_linear or fp8_gemm_unfit(*w.shape, self.block) is None):
                self._pack(name, q, scale_inv)  # (what the kernel does not take: dequantized)
            err, norm = relative_error(w, deq)
            m = _LAYER.search(name)
            for key in (None, int(m.group(1))) if m else (None,):
                acc = sums.setdefault(key, [0.0, 0.0])
                acc[0] += err
                acc[1] += norm

        def rel(key):
            e, n = sums.get(key, (0.0, 0.0))
            return (e / n) ** 0.5 if n > 0 else 0.0

        if self.packed:  # what DecodeWeights.of reads (by parameter)
            self.model.fp8_gemm_weights = {id(dst): self.packed[n] for n, dst, _ in self.pairs
                                           if n in self.packed}
        self.metrics = {"rollout/fp8_weight_rel_err": rel(None)}
        self.metrics.update({f"rollout/fp8_weight_rel_err/layer_{i}": rel(i)
                             for i in sorted(k for k in sums if k is not None)})
        return self.metrics

    def _pack(self, name: str, q: torch.Tensor, scale_inv: torch.Tensor) -> None:
        """Keep ``(q, scale_inv)`` for the GEMM, in the same tensors at every refresh (CUDA
        graphs captured on them read the new weights)."""
        held = self.packed.get(name)
        if held is None:
            self.packed[name] = Fp8Linear(q, scale_inv, self.block, self.gemm)
        else:
            held.q.copy_(q)
            held.scale_inv.copy_(scale_inv)


class RouterNoise:
    """Gaussian noise of standard deviation ``std`` added to router logits ``[T, E]`` (a research
    control for the rollout/training mismatch, ``rollout.router_noise_std``).

    The draws come from the noise's own generator, seeded from each rollout's seed
    (:meth:`seed`): a run is reproducible and no other random stream moves. (On CUDA the engine
    decodes eagerly while the noise is on: a CUDA graph would replay one draw.)"""

    def __init__(self, std: float, device: torch.device):
        self.std = float(std)
        self.generator = torch.Generator(device=torch.device(device))

    def seed(self, seed: int) -> None:
        self.generator.manual_seed(int(seed))

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(logits.shape, generator=self.generator, device=logits.device,
                            dtype=torch.float32)
        return logits + (self.std * noise).to(logits.dtype)


def install_router_noise(model, noise: RouterNoise) -> int:
    """Add ``noise`` to the logits of every ``TopKRouter`` of ``model`` (the sampling copy: its
    routers' ``gating`` is wrapped on the instance, and ``router.logit_noise`` tells the
    multi-step decoding step, which computes the logits itself, to add the same). Returns the
    number of routers."""
    from megatron.core.transformer.moe.router import TopKRouter

    count = 0
    for m in model.modules():
        if isinstance(m, TopKRouter):
            gating = m.gating  # the bound method of the class

            def noisy(x, _gating=gating):
                return noise(_gating(x))

            m.gating = noisy
            m.logit_noise = noise
            count += 1
    return count


def attach_rollout_numerics(copy, config) -> tuple[Fp8Weights | None, RouterNoise | None]:
    """``rollout.precision: fp8`` and ``rollout.router_noise_std`` on the engine's sampling copy
    ``copy`` (:class:`~.engine.sampling_copy.SamplingCopy`, or None when the live module samples:
    then neither is asked for). FP8 weights are quantized at every refresh, after the cast."""
    fp8 = noise = None
    if config.precision == "fp8":
        fp8 = Fp8Weights.of(copy.model, copy.live, config.fp8_block_size)
        copy.on_refresh.append(fp8.apply)
    if config.router_noise_std > 0:
        noise = RouterNoise(config.router_noise_std, next(copy.model.parameters()).device)
        install_router_noise(copy.model, noise)
    return fp8, noise
