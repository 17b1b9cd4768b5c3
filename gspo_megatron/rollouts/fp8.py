"""Block-wise FP8 (e4m3) weight quantization, pure torch: the layout of Qwen's and DeepSeek's FP8
checkpoints, for rollouts that sample from FP8 weights (``rollout.precision: fp8``).

A weight ``W [N, K]`` (out x in) is cut into ``b x b`` blocks (``b = 128`` in those checkpoints;
the last block of a dimension that ``b`` does not divide is smaller: ``ceil(N / b) x ceil(K / b)``
blocks). Each block ``B`` stores

    scale_inv[B] = amax(|W_B|) / 448          (448: the largest finite e4m3 value)
    Q_B          = e4m3(W_B / scale_inv[B])    (round to nearest even, |Q| <= 448)

so ``W ~= Q * scale_inv`` (the checkpoints' ``weight`` and ``weight_scale_inv``). An all-zero block
gets ``scale_inv = 1`` (its ``Q`` is 0 whatever the scale). A stacked tensor ``[..., N, K]``
(e.g. experts ``[E, N, K]``) is quantized per leading index.

The rollout engine's use (:mod:`gspo_megatron.backends.megatron.fp8_rollout`): on CPU the
sampling copy holds ``dequantize(quantize(W))`` (dequantize-then-matmul: what reaches the policy
is what FP8 weights give); on Hopper the same ``Q``, ``scale_inv`` feed ``torch._scaled_mm``
(:func:`fp8_linear`), with the activations quantized per ``1 x b`` group as DeepSeek-V3's FP8
GEMMs do (:func:`quantize_activations`; :func:`fp8_linear_reference` is the same maths in
float32, for CPU tests).
"""

from __future__ import annotations

import math

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
"""The largest finite e4m3 value."""


def _blocks(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1])


def _expand(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """``scale [..., nN, nK]`` repeated over each block's elements and cut to ``shape [..., N, K]``."""
    full = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return full[..., :shape[-2], :shape[-1]]


def block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``[..., ceil(N / b0), ceil(K / b1)]``: the largest |value| of each block of ``w [..., N, K]``
    (the edge blocks zero-padded, which leaves their maximum unchanged)."""
    n, k = w.shape[-2:]
    nb, kb = _blocks(w.shape, block)
    padded = torch.nn.functional.pad(w.abs(), (0, kb * block[1] - k, 0, nb * block[0] - n))
    tiles = padded.reshape(*w.shape[:-2], nb, block[0], kb, block[1])
    return tiles.amax(dim=(-3, -1))


@torch.no_grad()
def quantize_blockwise(w: torch.Tensor, block: int | tuple[int, int] = 128
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q [..., N, K] float8_e4m3fn, scale_inv [..., ceil(N / b), ceil(K / b)] float32)`` of a
    weight ``w [..., N, K]`` (any float dtype; the division is done in float32, or float64 for a
    float64 input). ``block``: ``b`` or ``(b_rows, b_cols)``."""
    block = (block, block) if isinstance(block, int) else tuple(block)
    if w.dim() < 2 or min(block) < 1:
        raise ValueError(f"quantize_blockwise: needs a [..., N, K] tensor and a block >= 1, got "
                         f"shape {tuple(w.shape)} and block {block}")
    work = w.double() if w.dtype == torch.float64 else w.float()
    amax = block_amax(work, block)
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (work / _expand(scale_inv, w.shape, block)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale_inv.float()


def dequantize_blockwise(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
                         block: int | tuple[int, int] = 128) -> torch.Tensor:
    """``[..., N, K]`` in ``dtype``: ``Q * scale_inv`` per block (the product in float32, or in
    float64 when ``dtype`` is float64, then cast)."""
    block = (block, block) if isinstance(block, int) else tuple(block)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.to(work) * _expand(scale_inv.to(work), q.shape, block)).to(dtype)


def relative_error(w: torch.Tensor, approx: torch.Tensor) -> tuple[float, float]:
    """``(||w - approx||^2, ||w||^2)`` in float64 (sum them over tensors, then divide and take the
    square root: the Frobenius relative error of a group of weights)."""
    w64 = w.detach().double()
    return float((w64 - approx.detach().double()).square().sum()), float(w64.square().sum())


# --------------------------------------------------------------------------- the GEMM (Hopper)
def quantize_activations(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q [T, K] e4m3, scale_inv [T, ceil(K / group)] float32)`` of activations ``x [T, K]``,
    one scale per token and ``group`` columns (DeepSeek-V3's ``1 x 128`` activation tiles)."""
    return quantize_blockwise(x, (1, group))


def fp8_linear_reference(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor,
                         block: int = 128) -> torch.Tensor:
    """``[T, N]`` float32: what :func:`fp8_linear` computes, in float32 on any device: ``x [T, K]``
    quantized per ``1 x block`` group, times ``(Q * scale_inv)^T`` (``Q [N, K]``), accumulated in
    float32."""
    xq, xs = quantize_activations(x, block)
    return dequantize_blockwise(xq, xs, torch.float32, (1, block)) @ \
        dequantize_blockwise(q, scale_inv, torch.float32, block).t()


def fp8_gemm_runs_on(device: torch.device) -> bool:
    """Whether :func:`fp8_linear` has a kernel here: a CUDA device of compute capability 9.0
    (Hopper), where ``torch._scaled_mm`` takes block-wise scales."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


ROW_ALIGN = 16
""":func:`fp8_linear` pads the activation rows to a multiple of this: the 1 x 128 scales are
passed rows-innermost (``[T, K / 128]``, stride ``(1, T)``), and cuBLAS wants that leading
dimension 16-byte aligned (PyTorch's own block-wise tests use 256 rows; a decoding step has any
number)."""


def fp8_gemm_unfit(n: int, k: int, block: int = 128) -> str | None:
    """None where :func:`fp8_linear` takes a ``[N, K]`` weight, else why not: the kernel's block is
    128, ``N`` whole 128-row blocks, and ``K`` whole groups of four 128-column blocks (cuBLAS
    reads the 128 x 128 scales with their ``K / 128`` extent padded to a multiple of 4)."""
    if block != 128:
        return f"block {block} (the kernel's is 128)"
    if n % 128 or k % 512:
        return f"weight [{n}, {k}]: the FP8 GEMM needs N % 128 == 0 and K % 512 == 0"
    return None


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, block: int = 128,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``[T, N]`` in ``out_dtype``: ``x [T, K]`` times the FP8 weight ``(Q [N, K], scale_inv)``
    transposed, as one ``torch._scaled_mm`` (Hopper; :func:`fp8_gemm_runs_on`): activations
    quantized per ``1 x 128`` group, weights per ``128 x 128`` block, float32 accumulation.
    The weight must fit (:func:`fp8_gemm_unfit`); the rows are padded to :data:`ROW_ALIGN` with
    zeros (scale 1, output rows dropped). Elsewhere use :func:`fp8_linear_reference`.
    GPU-only: checked by ``tools/gpu_check.py``'s ``fp8_decode`` stage."""
    rows = x.shape[0]
    pad = -rows % ROW_ALIGN
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    xq, xs = quantize_activations(x, block)
    # The kernel wants the activation scales rows-innermost ([T, K/128] with stride (1, T)) and
    # the second operand column-major (Q^T as a view of the row-major Q).
    out = torch._scaled_mm(xq, q.t(), scale_a=xs.t().contiguous().t(), scale_b=scale_inv.t(),
                           out_dtype=out_dtype)
    return out[:rows] if pad else out


def fp8_gemm_works(device: torch.device, n: int = 256, k: int = 512) -> str | None:
    """None where :func:`fp8_linear` runs on ``device`` (one call at ``[N, K]``, 3 rows, against
    :func:`fp8_linear_reference`), else why not, in a line: the FP8 GEMM is chosen by probing,
    since cuBLAS's support for block-wise scales depends on its version and the shapes."""
    if not fp8_gemm_runs_on(device):
        return f"no FP8 block-scaled GEMM on {device} (Hopper only)"
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(3, k, device=device, generator=g)
    q, s = quantize_blockwise(torch.randn(n, k, device=device, generator=g) * 0.02)
    try:
        got = fp8_linear(x.to(torch.bfloat16), q, s).float()
    except RuntimeError as exc:
        return f"torch._scaled_mm refused block-wise scales: {str(exc).splitlines()[0][:160]}"
    want = fp8_linear_reference(x.to(torch.bfloat16).float(), q, s)
    rel = float((got - want).norm() / want.norm())
    return None if rel < 2e-2 else f"torch._scaled_mm differs from its reference by {rel:.2e}"


class Fp8Linear:
    """An FP8 weight ``(Q [N, K], scale_inv)`` that stands where a ``[N, K]`` weight tensor is
    passed to ``F.linear``: ``F.linear(x [..., K], Fp8Linear)`` runs ``gemm`` (:func:`fp8_linear`
    on Hopper, :func:`fp8_linear_reference` for CPU tests) through torch's ``__torch_function__``
    protocol, so a kernel written for tensors (the multi-step decoding step) takes it unchanged.
    Any other torch function on it is an error (a caller that needs the tensor)."""

    def __init__(self, q: torch.Tensor, scale_inv: torch.Tensor, block: int = 128, gemm=None):
        self.q, self.scale_inv, self.block = q, scale_inv, int(block)
        self.gemm = gemm or fp8_linear
        """``(x [T, K], Q, scale_inv, block) -> [T, N]``."""
        self.shape = q.shape

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and len(args) == 2 and not kwargs.get("bias") \
                and isinstance(args[1], cls):
            x, w = args
            out = w.gemm(x.reshape(-1, x.shape[-1]), w.q, w.scale_inv, w.block)
            return out.to(x.dtype).view(*x.shape[:-1], w.q.shape[0])
        raise TypeError(f"Fp8Linear supports F.linear(x, weight) only, not {func}")


# ------------------------------------------------------------ the experts' grouped GEMM (Hopper)
def quantize_rowwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q [..., N, K] e4m3, scale [..., N] float32)``: one scale per output row of
    ``w [..., N, K]`` (``amax / 448`` over the row): the only weight scaling
    ``torch._scaled_grouped_mm`` takes (float32 scales per row of each expert)."""
    q, scale = quantize_blockwise(w, (1, w.shape[-1]))
    return q, scale.squeeze(-1)


def fp8_grouped_unfit(k: int) -> str | None:
    """None where :func:`fp8_grouped_linear` takes experts ``[E, N, K]``, else why not: the
    kernel reads one-byte operands whose leading dimension ``K`` (the rows' and the
    column-major experts') must be a multiple of 16 bytes (torch's check; the output's rows are
    padded by torch itself, so ``N`` is free)."""
    if k % 16:
        return f"experts [E, N, {k}]: the FP8 grouped GEMM needs K % 16 == 0"
    return None


def fp8_grouped_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor,
                       out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``[T, N]`` in ``out_dtype``: rows ``x [T, K]`` in expert-major order (expert ``e``'s rows
    end at ``offs[e]``, int32 ``[E]``) times their expert's FP8 weight ``(Q [E, N, K],
    scale [E, N])`` transposed, as one ``torch._scaled_grouped_mm``: the rows quantized with
    one scale each (``[T]``), the experts one per output row, float32 accumulation. The
    arguments (torch 2.13's checks, ``_meta_registrations.py``): ``mat_a`` e4m3 row-major,
    ``mat_b`` e4m3 column-major in its last two dimensions (``Q^T`` as a view), ``scale_a``
    float32 ``[T]`` contiguous, ``scale_b`` float32 ``[E, N]``, ``offs`` int32. Verified on a
    CPU build: the signature (``torch/_C/_VariableFunctions.pyi``) and these checks, by running
    this function on meta tensors (``tests/unit/test_fp8_experts.py``); not verifiable there:
    limits of the CUDA kernel beyond them (what :func:`fp8_grouped_gemm_works` probes at build).
    Elsewhere :func:`fp8_grouped_reference`. GPU-only: checked by ``tools/gpu_check.py``'s
    ``fp8_decode`` stage."""
    xq, xs = quantize_blockwise(x, (1, x.shape[-1]))
    return torch._scaled_grouped_mm(xq, q.transpose(-2, -1), xs.view(-1), scale, offs=offs,
                                    out_dtype=out_dtype)


def fp8_grouped_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                          offs: torch.Tensor) -> torch.Tensor:
    """``[T, N]`` float32: what :func:`fp8_grouped_linear` computes, on any device: each row of
    ``x`` quantized with its own scale, times its expert's ``(Q * scale)^T``, in float32. Rows
    past ``offs[-1]`` are 0."""
    xq, xs = quantize_blockwise(x, (1, x.shape[-1]))
    a = xq.float() * xs
    w = q.float() * scale.float().unsqueeze(-1)  # [E, N, K]
    out = a.new_zeros(x.shape[0], q.shape[-2])
    ends = offs.tolist()
    for e, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
        if end > start:
            out[start:end] = a[start:end] @ w[e].t()
    return out


def fp8_grouped_gemm_works(device: torch.device, experts: int = 4, n: int = 256,
                           k: int = 512) -> str | None:
    """None where :func:`fp8_grouped_linear` runs on ``device`` (one call, 21 rows over
    ``experts`` groups of uneven size, one empty, against :func:`fp8_grouped_reference`), else
    why not, in a line."""
    if not fp8_gemm_runs_on(device):
        return f"no FP8 grouped GEMM on {device} (Hopper only)"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(21, k, device=device, generator=g).to(torch.bfloat16)
    q, s = quantize_rowwise(torch.randn(experts, n, k, device=device, generator=g) * 0.02)
    offs = torch.tensor([5, 5, 16, 21][:experts], device=device, dtype=torch.int32)
    try:
        got = fp8_grouped_linear(x, q, s, offs).float()
    except RuntimeError as exc:
        return f"torch._scaled_grouped_mm refused: {str(exc).splitlines()[0][:160]}"
    want = fp8_grouped_reference(x.float(), q, s, offs)
    rel = float((got - want).norm() / want.norm())
    return None if rel < 2e-2 else f"torch._scaled_grouped_mm differs from its reference by {rel:.2e}"


class Fp8Experts:
    """One MoE layer's expert weight in FP8 for the decoding step's grouped GEMM: ``q [E, N, K]``
    e4m3 and ``scale [E, N]`` (:func:`quantize_rowwise` of the experts the step would multiply,
    ``weight_nk``, ``F.linear``'s ``[N, K]`` per expert), run by ``gemm``
    (:func:`fp8_grouped_linear` on Hopper, :func:`fp8_grouped_reference` in CPU tests) as
    ``gemm(rows, q, scale, offs)``. Quantized ``chunk`` experts at a time, so the float32
    temporaries stay a few experts' size (all 128 of a Qwen3-30B-A3B layer at once: ~5 GB);
    :attr:`error_sums` ``[2]`` float32 on the device: ``(||W - Q s||^2, ||W||^2)``."""

    def __init__(self, weight_nk: torch.Tensor, gemm=None, chunk: int = 8):
        e, n, k = weight_nk.shape
        self.q = torch.empty(e, n, k, dtype=E4M3, device=weight_nk.device)
        self.scale = torch.empty(e, n, dtype=torch.float32, device=weight_nk.device)
        self.error_sums = torch.zeros(2, dtype=torch.float32, device=weight_nk.device)
        for first in range(0, e, chunk):
            part = weight_nk[first:first + chunk]
            q, scale = quantize_rowwise(part)
            self.q[first:first + chunk], self.scale[first:first + chunk] = q, scale
            w32 = part.float()
            self.error_sums += torch.stack(((w32 - q.float() * scale.unsqueeze(-1)).square().sum(),
                                            w32.square().sum()))
        self.gemm = gemm or fp8_grouped_linear

    def __call__(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """``[T, N]`` in ``x``'s dtype."""
        return self.gemm(x, self.q, self.scale, offs).to(x.dtype)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q, self.scale
