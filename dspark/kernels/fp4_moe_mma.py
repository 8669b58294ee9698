"""Grouped FP4 MoE on tensor cores: the decode / verify path of `fp4_moe_grouped` (same contract,
same stack, same numerics up to fp32 summation order).

    out = fp4_moe_mma(x, idx, weights, stack, swiglu_limit)      # fp32 [T, D]

The FMA kernels of fp4_moe.py decode every e2m1 code with ~6 integer / float instructions and
multiply on the CUDA cores: at batch 1 they ran at ~0.4 TB/s on the H200, ALU- and latency-bound.
Here each weight tile goes through `tl.dot_scaled` (e2m1 codes + UE8M0 scales per 32 columns, the
OCP MX layout our packed experts already have: low nibble = even column): Triton decodes the
codes with byte permutes, applies the scale and feeds Hopper's wgmma, with the weight tiles
streamed through shared memory by cp.async (software pipelined), so the kernel streams weights
instead of decoding them.

"Swap AB": the weight rows are the MMA's M side (32 per program) and the token is one column of a
[BLOCK_K, 16] activation tile (the other 15 columns are zero), so no tensor-core work is spent on
padding 1 token up to 16 rows of weights. Operands are exact (e2m1 * 2^k is a bf16 value; x is
bf16), accumulation is fp32: equal to F.linear with the de-quantised expert up to summation order.

* `_mma_gate_up_kernel`, grid (T*k pairs, cdiv(I, BLOCK_N)): gate and up rows of the pair's expert,
  then the clamped SwiGLU epilogue of `_fp4_moe_gate_up_kernel` (g, u rounded to x.dtype, routing
  weight before w2, h stored in x.dtype).
* `_mma_down_kernel`, grid (T*k pairs, cdiv(D, BLOCK_N)): y_p = h_p W2[e_p]^T rounded to x.dtype
  into an fp32 workspace; the last of a token's k pair programs to arrive (per-tile arrival counter,
  as in fp8_gemm's skinny kernel) sums its k slots in slot order (deterministic) into out[t] and
  re-arms the counter. One program per (pair, tile) keeps 6x more programs in flight at batch 1 than
  one per (token, tile).
Experts not held (emap -1) contribute 0, as in the FMA kernels.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dspark.kernels.fp4_moe import _DT_NAME, FP4ExpertStack, _round_to
from dspark.kernels.fp8_gemm import _arrival_counters, _interpreting


def mma_enabled() -> bool:
    """Opt-in (DSPARK_MOE_MMA=1). On the H200 at V4-Flash widths (benchmarks/bench_decode_kernels.py,
    cold L2, CUDA graphs) the best config here (32 x 256, 4 warps, 3 stages) and the CUDA-core
    kernels at their tuned 8 x 16 blocks run the same: 124 vs 128 us per layer at 1 token, 232
    vs 225 at 2, 653 vs 645 at 6 (~0.65-0.7 TB/s, both latency-bound), so the simpler FMA path stays
    the default. This path is the base for verify batches whose tokens share experts (one weight
    tile against up to 16 token columns), not done yet."""
    return os.environ.get("DSPARK_MOE_MMA", "0") == "1"


@triton.jit
def _scaled_rows_dot(x_row_ptr, w_rows_ptr, stride_wn, s_rows_ptr, stride_sn, n_ok, K,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 [BLOCK_N]: x[0:K] . W[n, 0:K] for BLOCK_N packed FP4 rows (K a multiple of BLOCK_K),
    by dot_scaled over [BLOCK_N, BLOCK_K/2] byte tiles against x as column 0 of [BLOCK_K, 16]."""
    rn = tl.arange(0, BLOCK_N)
    jb = tl.arange(0, BLOCK_K // 2)
    jg = tl.arange(0, BLOCK_K // 32)
    jk = tl.arange(0, BLOCK_K)
    col0 = (tl.arange(0, 16) == 0)[None, :]
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        wb = tl.load(w_rows_ptr + rn[:, None] * stride_wn + (k0 // 2 + jb)[None, :],
                     mask=n_ok[:, None], other=0)
        sb = tl.load(s_rows_ptr + rn[:, None] * stride_sn + (k0 // 32 + jg)[None, :],
                     mask=n_ok[:, None], other=0)
        xt = tl.load(x_row_ptr + (k0 + jk)[:, None] + 0 * col0, mask=col0, other=0.0)
        acc = tl.dot_scaled(wb, sb, "e2m1", xt.to(tl.bfloat16), None, "bf16", acc)
    return tl.sum(acc, axis=1)


@triton.jit
def _mma_gate_up_kernel(
    x_ptr, stride_xt, idx_ptr, rw_ptr, emap_ptr,
    w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, h_ptr, stride_hp,
    KSLOTS, I, D, limit,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DT: tl.constexpr,
):
    p = tl.program_id(0)                                    # (token, slot) pair
    pid_n = tl.program_id(1)
    t = p // KSLOTS
    row = tl.load(emap_ptr + tl.load(idx_ptr + p))          # stack row (-1: not held)
    rows_held = tl.where(row >= 0, I, 0)
    row = tl.maximum(row, 0).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < rows_held
    x_row = x_ptr + t.to(tl.int64) * stride_xt
    w_base = w_ptr + row * stride_we + (pid_n * BLOCK_N).to(tl.int64) * stride_wn
    s_base = s_ptr + row * stride_se + (pid_n * BLOCK_N).to(tl.int64) * stride_sn
    g = _scaled_rows_dot(x_row, w_base, stride_wn, s_base, stride_sn, n_ok, D, BLOCK_N, BLOCK_K)
    u = _scaled_rows_dot(x_row, w_base + I * stride_wn, stride_wn, s_base + I * stride_sn,
                         stride_sn, n_ok, D, BLOCK_N, BLOCK_K)
    g = _round_to(g, DT)                                    # the per-expert GEMMs return x.dtype
    u = _round_to(u, DT)
    clamp = limit > 0
    u = tl.where(clamp, tl.minimum(tl.maximum(u, -limit), limit), u)
    g = tl.where(clamp, tl.minimum(g, limit), g)
    h = g / (1.0 + tl.exp(-g)) * u                          # silu(g) * u, fp32
    h = h * tl.load(rw_ptr + p).to(tl.float32)              # routing weight before w2
    h = _round_to(h, DT)
    tl.store(h_ptr + p.to(tl.int64) * stride_hp + rn, h, mask=rn < I)


@triton.jit
def _mma_down_kernel(
    h_ptr, stride_hp, idx_ptr, emap_ptr,
    w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, ws_ptr, out_ptr, stride_ot, cnt_ptr,
    KSLOTS, D, I,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DT: tl.constexpr,
):
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    t = p // KSLOTS
    row = tl.load(emap_ptr + tl.load(idx_ptr + p))
    n_ok = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) < tl.where(row >= 0, D, 0)
    row = tl.maximum(row, 0).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_base = w_ptr + row * stride_we + (pid_n * BLOCK_N).to(tl.int64) * stride_wn
    s_base = s_ptr + row * stride_se + (pid_n * BLOCK_N).to(tl.int64) * stride_sn
    y = _scaled_rows_dot(h_ptr + p.to(tl.int64) * stride_hp, w_base, stride_wn, s_base, stride_sn,
                         n_ok, I, BLOCK_N, BLOCK_K)
    d_ok = rn < D
    tl.store(ws_ptr + p.to(tl.int64) * D + rn, _round_to(y, DT), mask=d_ok)   # expert output
    tl.debug_barrier()                                      # in x.dtype, as the per-expert path
    tile = cnt_ptr + t * tl.num_programs(1) + pid_n
    arrived = tl.atomic_add(tile, 1, sem="acq_rel", scope="gpu")
    if arrived == KSLOTS - 1:                               # last slot of this token's tile
        total = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in range(0, KSLOTS):
            total += tl.load(ws_ptr + (t * KSLOTS + j).to(tl.int64) * D + rn, mask=d_ok, other=0.0,
                             cache_modifier=".cg")
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + rn, total, mask=d_ok)
        tl.atomic_xchg(tile, 0, sem="relaxed", scope="gpu")  # re-arm for the next launch


def _block_k(D: int, I: int) -> int:
    """The widest reduction tile (<= 256 columns, one scale group at least) that divides both
    reduction widths (D for gate / up, I for down): 0 when none does."""
    for bk in (256, 128, 64, 32):
        if D % bk == 0 and I % bk == 0:
            return bk
    return 0


def mma_applies(D: int, I: int) -> bool:
    return _block_k(D, I) > 0


def fp4_moe_mma(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, stack: FP4ExpertStack,
                swiglu_limit: float, block=None, num_warps: int = 4,
                num_stages: int = 3) -> torch.Tensor:
    """Routed-expert output fp32 [T, D] (contract of `fp4_moe_grouped`). block = (BLOCK_N,
    BLOCK_K) for both kernels (tests), else 64 rows and the widest BLOCK_K <= 256 dividing D and
    I (32 rows under the interpreter). 32 rows per program: 148 registers at sm_90 (64 rows take
    224 and ran 2.4x slower at batch 1: fewer programs, fewer resident)."""
    T, D = x.shape
    k = idx.shape[1]
    I = stack.w13.shape[1] // 2
    out = torch.empty(T, D, dtype=torch.float32, device=x.device)
    if T == 0 or k == 0:
        return out.zero_()
    bn, bk = block or (32, _block_k(D, I))
    if not bk or D % bk or I % bk:
        raise ValueError(f"fp4_moe_mma: D={D} and I={I} must be multiples of BLOCK_K={bk}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    idx = idx.contiguous()
    weights = weights.contiguous()
    P = T * k
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    ws = torch.empty(P, D, dtype=torch.float32, device=x.device)
    dt = _DT_NAME[x.dtype]
    w13, s13, w2, s2, emap = stack
    _mma_gate_up_kernel[(P, triton.cdiv(I, bn))](
        x, x.stride(0), idx, weights, emap, w13, w13.stride(0), w13.stride(1), s13, s13.stride(0),
        s13.stride(1), h, h.stride(0), k, I, D, float(swiglu_limit),
        BLOCK_N=bn, BLOCK_K=bk, DT=dt, num_warps=num_warps, num_stages=num_stages)
    n_tiles = triton.cdiv(D, bn)
    cnt = _arrival_counters(x.device, T * n_tiles)
    _mma_down_kernel[(P, n_tiles)](
        h, h.stride(0), idx, emap, w2, w2.stride(0), w2.stride(1), s2, s2.stride(0), s2.stride(1),
        ws, out, out.stride(0), cnt, k, D, I, BLOCK_N=bn, BLOCK_K=bk, DT=dt, num_warps=num_warps,
        num_stages=num_stages)
    return out
