"""RMSNorm computed in fp32 (weights may be stored bf16).

`F.rms_norm` on fp32 input is one aten op (fused on recent CUDA builds) instead of six, with the
same formula x·rsqrt(mean(x²) + eps)·w. The input is cast to fp32 first so the weight multiply
also happens in fp32 and the result is rounded to x.dtype once, as the reference does.

On CUDA (no autograd) the cast / norm / cast chain is one Triton launch instead
(`dspark.kernels.norm_rope`, which also fuses the RoPE that follows most norms: see
`fused.norm_rope`). NORM_BACKEND overrides the choice like mhc.BACKEND: "reference" = torch
everywhere (the default with dspark.debug.REFERENCE_KERNELS), "triton" = the kernel everywhere
(tests; CPU tensors then need TRITON_INTERPRET=1).
"""
import torch
import torch.nn.functional as F
from torch import nn

from dspark import debug


FP32_CACHE_MAX_NUMEL = 1 << 22    # larger weights (e.g. a big vocab head) are cast per call
NORM_BACKENDS = ("auto", "reference", "triton")
NORM_BACKEND = "reference" if debug.REFERENCE_KERNELS else "auto"


def fused_backend(x: torch.Tensor, *tensors) -> bool:
    """Whether the fused Triton kernels (norm / RoPE, dspark.kernels.decode_fused) should run on
    x and the other tensors: NORM_BACKEND "triton", or "auto" on CUDA; never under autograd."""
    if NORM_BACKEND not in NORM_BACKENDS:
        raise ValueError(f"norm backend {NORM_BACKEND!r}: use one of {NORM_BACKENDS}")
    if NORM_BACKEND == "reference" or (NORM_BACKEND == "auto" and not x.is_cuda):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, *tensors)):
        return False                  # the kernels have no backward
    return True


def fused_kernels(x: torch.Tensor, dtype, out_dtype, *tensors):
    """dspark.kernels.norm_rope when the fused kernel should run on x (and the optional other
    tensors, e.g. a norm weight) with these rounding / output dtypes, else None."""
    if not fused_backend(x, *tensors):
        return None
    from dspark.kernels import norm_rope    # imports triton: only where the kernel runs
    return norm_rope if norm_rope.supported(x, dtype, out_dtype) else None


def derived(holder, attr: str, sources, build):
    """``build()`` (something computed from the tensors `sources`, e.g. a cast or a concatenation
    of weights) kept on ``holder.<attr>`` and reused while every source is unchanged (same
    storage, dtype, device and version counter). With grad mode on (training: autograd must see
    the computation) and for inference tensors (no version counter: in-place changes are
    untracked) it is ``build()`` on every call."""
    if torch.is_grad_enabled():
        return build()
    try:
        key = tuple((s.data_ptr(), s._version, s.dtype, s.device) for s in sources)
    except RuntimeError:
        return build()
    hit = getattr(holder, attr, None)
    if hit is not None and hit[0] == key:
        return hit[1]
    with torch.no_grad():
        value = build()
    setattr(holder, attr, (key, value))
    return value


def fp32(w: torch.Tensor) -> torch.Tensor:
    """``w.float()`` without a cast kernel per call: an fp32 copy of a non-fp32 weight is kept
    on the tensor (`derived`). Same values as ``w.float()``; weights above FP32_CACHE_MAX_NUMEL
    are cast per call."""
    if w.dtype == torch.float32:
        return w
    if w.numel() > FP32_CACHE_MAX_NUMEL:
        return w.float()
    return derived(w, "_dspark_fp32", (w,), w.float)


_MM_OUT_DTYPE = [True]        # torch.mm(..., out_dtype=) usable here (set False on first failure)


def linear_fp32(x: torch.Tensor, w: torch.Tensor, skinny: bool = False,
                head: bool = False, argmax_out: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``x @ w.T`` (the fp32 logits of the reference numerics) without an fp32 copy of a
    large bf16 weight per call: on CUDA, when x already has w's 16-bit dtype, cuBLAS multiplies
    the 16-bit values and accumulates / writes fp32 (``torch.mm(out_dtype=float32)``). Same
    products as ``F.linear(x.float(), w.float())`` (16-bit values are exact in fp32), only the
    summation order may differ. skinny: few tokens (decode, verify) take the skinny Triton
    kernel instead (`fp8_gemm.linear16_skinny`: one launch, same products; asked for by the
    compressor projections and (head) the vocabulary head, where the H200 measured it, not by
    the router). Elsewhere: ``F.linear(x.float(), fp32(w))``.
    argmax_out (int64 [T], x [T, K]): also the rows' argmax into it (`sampling.argmax_rows`'s
    result; on the head's skinny kernel its first pass runs in the GEMV's launch). out (fp32 [T, N]): the result there (the skinny
    kernel writes it in place; else a copy)."""
    if (skinny or head) and x.is_cuda and not torch.is_grad_enabled():
        from dspark.kernels import fp8_gemm      # (Triton: not imported by the CPU reference)
        if fp8_gemm.linear16_skinny_applies(x, w, head):
            return fp8_gemm.linear16_skinny(x, w, torch.float32, argmax_out, out=out)
    if (x.is_cuda and w.dtype in (torch.bfloat16, torch.float16) and x.dtype == w.dtype
            and _MM_OUT_DTYPE[0] and not torch.is_grad_enabled()):
        try:
            y = torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32)
            return _finish(y.view(*x.shape[:-1], w.shape[0]), argmax_out, out)
        except (RuntimeError, TypeError):    # older torch / cuBLAS without fp32 output
            _MM_OUT_DTYPE[0] = False
    return _finish(F.linear(x.float(), fp32(w)), argmax_out, out)


def _finish(y: torch.Tensor, argmax_out: torch.Tensor | None,
            out: torch.Tensor | None) -> torch.Tensor:
    """y in `out` (when given and not already there), its rows' argmax into `argmax_out`."""
    if out is not None and out.data_ptr() != y.data_ptr():
        out.copy_(y)
        y = out
    if argmax_out is not None:
        from dspark.sampling import argmax_rows
        argmax_rows(y, out=argmax_out)
    return y


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMS normalisation in fp32 (used per query head and inside mHC)."""
    x = x.float()
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = fused_kernels(x, x.dtype, x.dtype, self.weight)
        if k is not None and self.weight.is_contiguous():
            return k.norm_rope(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        return F.rms_norm(x.float(), (x.shape[-1],), fp32(self.weight), self.eps).to(x.dtype)
