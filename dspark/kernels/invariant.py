"""Batch-invariant kernel choices: the deterministic mode's guarantee on CUDA.

A row's result must not depend on how many rows its launch carries or what they hold. Every
kernel family here already reduces each output in an order fixed by its tile and split sizes;
what varies with the token count is which kernel and which sizes a wrapper picks (a GEMV below 9
tokens, K splits that fill the SMs, per-token vs split mHC passes, expert-sorted FP4 blocks that
share MMA columns, cuBLAS's algorithm for each M). Inside `batch_invariant()` the wrappers take
one choice for every token count (each names it where it branches on `on()`), and the matrix
products that reach aten (`mm`, `addmm`, `bmm`, `mv`: the 16-bit and fp32 linears a checkpoint
keeps unquantized, einsums, batched expert GEMVs) run `invariant_bmm` instead of cuBLAS:
fixed 16 x 64 x 32 tiles, no split-K, so every output element sums its K terms in one order.

The choices are read when a kernel is launched, so a CUDA graph captured inside the context
keeps them. The mode is process-wide while entered (one engine's forwards at a time).

Routing aten's products costs a Python call per aten op of the thread while the mode is on. The
engine's work in this mode is graph replays: it enters `choices()` (the kernel choices alone) and
the code that captures or runs a step eagerly enters `products()`, which adds the routing only
inside `choices()` / `batch_invariant()` (both in `invariant_mode`, which imports no Triton).
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import TorchDispatchMode

from .common import interpreting
from .invariant_mode import choices, on, products  # noqa: F401 (the mode's switches, re-exported)


# ---- the matrix product -------------------------------------------------------------------

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


@triton.jit
def _bmm_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                sab, sam, sak, sbb, sbk, sbn, scb, scm, scn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                IEEE: tl.constexpr):
    """c[b] = a[b] @ b[b], one [BLOCK_M, BLOCK_N] tile per program, K in BLOCK_K steps from 0
    up: each element's sum order is a function of K alone."""
    pid_m, pid_n, bat = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_row = a_ptr + bat.to(tl.int64) * sab + rm[:, None].to(tl.int64) * sam
    b_col = b_ptr + bat.to(tl.int64) * sbb + rn[None, :].to(tl.int64) * sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_row + kk[None, :].to(tl.int64) * sak,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_col + kk[:, None].to(tl.int64) * sbk,
                    mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        if IEEE:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    c = c_ptr + bat.to(tl.int64) * scb + rm[:, None].to(tl.int64) * scm \
        + rn[None, :].to(tl.int64) * scn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def invariant_bmm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] (any strides; 2-D operands are one batch) in out_dtype (default
    a's), fp32 accumulation: 16-bit operands on the tensor cores as they are, fp32 ones as exact
    fp32 products (no TF32)."""
    shapes = f"{tuple(a.shape)} @ {tuple(b.shape)}"
    squeeze = a.dim() == 2
    if squeeze:
        a, b = a.unsqueeze(0), b.unsqueeze(0)
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"invariant_bmm: shapes {shapes} do not multiply ([B,] M, K @ [B,] K, N)")
    if a.dtype != b.dtype or a.dtype not in _DTYPES:
        raise ValueError(f"invariant_bmm: operands {a.dtype} and {b.dtype}; expected one of "
                         f"{_DTYPES} for both")
    Bt, M, K = a.shape
    N = b.shape[2]
    c = out if out is not None else torch.empty(Bt, M, N, dtype=out_dtype or a.dtype,
                                                device=a.device)
    if c.dim() == 2:
        c = c.unsqueeze(0)
    if Bt and M and N:
        if K == 0:
            c.zero_()
        else:
            grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N), Bt)
            _bmm_kernel[grid](a, b, c, M, N, K, *a.stride(), *b.stride(), *c.stride(),
                              BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                              IEEE=a.dtype == torch.float32 or interpreting())
    return c[0] if squeeze else c


# ---- aten's matrix products inside the mode -------------------------------------------------

_aten = torch.ops.aten


def _mm(a, b, out_dtype=None):
    return invariant_bmm(a, b, out_dtype)


def _addmm(bias, a, b, beta=1, alpha=1):
    y = invariant_bmm(a, b)
    if alpha != 1:
        y = y * alpha
    return y + (bias if beta == 1 else bias * beta)


def _mv(a, v):
    return invariant_bmm(a, v.unsqueeze(1)).squeeze(1)


def _linear(x, w, bias=None):
    """Under inference mode aten.linear reaches the mode whole (not as addmm / mm)."""
    y = invariant_bmm(x.reshape(-1, x.shape[-1]), w.t()).view(*x.shape[:-1], w.shape[0])
    return y if bias is None else y + bias


def _matmul(a, b):
    if a.dim() == 1 or b.dim() == 1 or a.dim() > 3 or b.dim() > 3:
        return None                      # left to its decomposition (into mm / bmm / mv)
    if a.dim() == 2 and b.dim() == 2:
        return invariant_bmm(a, b)
    if b.dim() == 2:                     # [B, M, K] @ [K, N]: the rows are independent
        return invariant_bmm(a.reshape(-1, a.shape[-1]), b).view(*a.shape[:-1], b.shape[1])
    if a.dim() == 2:
        a = a.expand(b.shape[0], *a.shape)
    return invariant_bmm(a, b.expand(a.shape[0], *b.shape[1:]))


_PRODUCTS = {
    _aten.mm.default: _mm,
    _aten.bmm.default: _mm,
    _aten.addmm.default: _addmm,
    _aten.mv.default: _mv,
    _aten.linear.default: _linear,
    _aten.matmul.default: _matmul,
}
for _op in (_aten.mm, _aten.bmm):        # torch.mm(a, b, out_dtype=...) (torch >= 2.9)
    if "dtype" in _op.overloads():
        _PRODUCTS[_op.dtype] = _mm


_COMPOSITE = (_aten.matmul.default, _aten.einsum.default)


class _InvariantProducts(TorchDispatchMode):
    """Routes aten's CUDA matrix products of supported dtypes to `invariant_bmm`."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = _PRODUCTS.get(func)
        if impl is not None and (args[0].is_cuda or interpreting()) and all(
                t.dtype in _DTYPES for t in args if isinstance(t, torch.Tensor)):
            out = impl(*args, **kwargs)
            if out is not None:
                return out
        if func in _COMPOSITE:           # decompose: its products come back through the mode
            with self:                   # (the mode is off inside its own handler)
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)


@contextlib.contextmanager
def batch_invariant():
    """Launches built inside are batch-invariant (see the module doc), aten's products
    included; re-entrant."""
    with choices(), products():
        yield
