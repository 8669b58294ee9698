"""Grouped FP4 MoE on tensor cores, tokens grouped by expert: the prefill / verify path of
`fp4_moe_grouped` (same contract, same stack, same numerics up to fp32 summation order).

    out = fp4_moe_mma(x, idx, weights, stack, swiglu_limit)      # fp32 [T, D]

The CUDA-core kernels of fp4_moe.py run one GEMV per (token, slot) pair, so an expert chosen by n
tokens is read n times: a 128-token prefill re-reads ~9.7 GB of V4-Flash experts per layer. Here the
pairs are first sorted by expert into blocks of up to BLOCK_T pairs of one expert (`align_pairs`,
fixed-shape torch ops, no host sync, CUDA-graph capturable), and each program multiplies one
[BLOCK_N, BLOCK_K] weight tile against the BLOCK_T token columns of its block with `tl.dot_scaled`
(e2m1 codes + UE8M0 scales per 32 columns, the OCP MX layout our packed experts already have: low
nibble = even column; Triton decodes the codes with byte permutes and feeds Hopper's wgmma, the
weight tiles streamed by cp.async): every expert is read once per BLOCK_T tokens. "Swap AB": the
weight rows are the MMA's M side and the tokens its N side (16 columns), so a block of 1 token
costs no more weight traffic than the GEMV. Operands are exact (e2m1 * 2^k is a bf16 value, x is
bf16), accumulation fp32.

* `_mma_gate_up_kernel`, grid (blocks, cdiv(I, BLOCK_N)): gate and up rows of the block's expert for
  its tokens, then the clamped SwiGLU epilogue of `_fp4_moe_gate_up_kernel` (g, u rounded to
  x.dtype, routing weight before w2, h stored in x.dtype per pair).
* `_mma_down_kernel`, grid (blocks, cdiv(D, BLOCK_N)): y_p = h_p W2[e]^T rounded to x.dtype, per
  pair into an fp32 [T*k, D] workspace; the k slots of each token are then summed (one torch sum).
Blocks past the last used one (the grid is sized for the worst case) and experts not held (emap
-1) contribute nothing.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from dspark.kernels.fp4_moe import _DT_NAME, FP4ExpertStack, _round_to, _swiglu_h

BLOCK_T = 16          # token columns per program (the MMA's N side)
# When fp4_moe_grouped takes this path: where the tensor-core decode kernels (fp4_moe_tc,
# fp4_moe_tc_grouped) do not apply (GPUs before sm_90, scales out of their range), against the
# CUDA-core per-pair kernels, from MMA_MIN_TOKENS tokens (below it every expert is used by ~1
# token: the align step's launches cost more than the shared weight reads save; H200,
# benchmarks/results/bench_moe_h200.json: at 16 tokens 1273 us per layer there vs 1526 here).
MMA_MIN_TOKENS = 32


def mma_takes(tokens: int) -> bool:
    """Whether `fp4_moe_grouped` runs a batch of `tokens` here rather than on the CUDA-core
    per-pair kernels. Shape-only: the same choice for every batch of a size."""
    return tokens >= MMA_MIN_TOKENS


def align_pairs(idx: torch.Tensor, num_experts: int, block_t: int = BLOCK_T):
    """(table int32 [S], block_expert int32 [S / block_t]): the T*k (token, slot) pairs of idx
    sorted by expert id (stable) into blocks of block_t slots, each block holding pairs of one
    expert; table[s] = pair id (token * k + slot) or -1 (padding), block_expert[b] = the expert id
    of block b or -1 (unused). S = the worst case (every used expert's last block padded), so the
    shapes depend on T, k and E only: no host sync, capturable."""
    flat = idx.flatten()
    P = flat.numel()
    dev = flat.device
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_t - 1) // block_t * block_t
    pad_start = torch.cumsum(padded, 0) - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    slot = pad_start[sorted_e] + torch.arange(P, device=dev) - cnt_start[sorted_e]
    S = triton.cdiv(P + (block_t - 1) * min(num_experts, P), block_t) * block_t
    table = torch.full((S,), -1, dtype=torch.int32, device=dev)
    table[slot] = order.to(torch.int32)
    block_expert = torch.full((S // block_t,), -1, dtype=torch.int32, device=dev)
    block_expert[slot // block_t] = sorted_e.to(torch.int32)
    return table, block_expert


@triton.jit
def _block_dot(xt_ptrs, xt_mask, w_rows_ptr, stride_wn, s_rows_ptr, stride_sn, n_ok, K,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr):
    """fp32 [BLOCK_N, BLOCK_T]: W[n, 0:K] . X[t, 0:K] for BLOCK_N packed FP4 rows (K a multiple of
    BLOCK_K) against the block's token rows (xt_ptrs [BLOCK_T]: row starts, xt_mask: valid)."""
    rn = tl.arange(0, BLOCK_N)
    jb = tl.arange(0, BLOCK_K // 2)
    jg = tl.arange(0, BLOCK_K // 32)
    jk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        wb = tl.load(w_rows_ptr + rn[:, None] * stride_wn + (k0 // 2 + jb)[None, :],
                     mask=n_ok[:, None], other=0)
        sb = tl.load(s_rows_ptr + rn[:, None] * stride_sn + (k0 // 32 + jg)[None, :],
                     mask=n_ok[:, None], other=0)
        xt = tl.load(xt_ptrs[None, :] + (k0 + jk)[:, None], mask=xt_mask[None, :], other=0.0)
        acc = tl.dot_scaled(wb, sb, "e2m1", xt.to(tl.bfloat16), None, "bf16", acc)
    return acc


@triton.jit
def _block_setup(table_ptr, emap_ptr, b, e, pid_n, n_rows, BLOCK_N: tl.constexpr,
                 BLOCK_T: tl.constexpr):
    """Block b of expert e: its pair ids (int64, 0 where padding), which are real, the expert's
    stack row (int64; 0 when not held), this program's weight rows and which of them to read
    (none when the expert is not held: emap -1)."""
    pairs = tl.load(table_ptr + b * BLOCK_T + tl.arange(0, BLOCK_T))
    valid = pairs >= 0
    row = tl.load(emap_ptr + e)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < tl.where(row >= 0, n_rows, 0)
    return (tl.maximum(pairs, 0).to(tl.int64), valid, tl.maximum(row, 0).to(tl.int64), rn, n_ok)


@triton.jit
def _mma_gate_up_kernel(
    x_ptr, stride_xt, table_ptr, bexp_ptr, rw_ptr, emap_ptr,
    w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, h_ptr, stride_hp,
    KSLOTS, I, D, limit,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, DT: tl.constexpr,
):
    b = tl.program_id(0)                                    # block of pairs of one expert
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + b)
    if e >= 0:
        pairs, valid, row, rn, n_ok = _block_setup(table_ptr, emap_ptr, b, e, pid_n, I,
                                                   BLOCK_N, BLOCK_T)
        xt_ptrs = x_ptr + (pairs // KSLOTS) * stride_xt
        w_base = w_ptr + row * stride_we + (pid_n * BLOCK_N).to(tl.int64) * stride_wn
        s_base = s_ptr + row * stride_se + (pid_n * BLOCK_N).to(tl.int64) * stride_sn
        g = _block_dot(xt_ptrs, valid, w_base, stride_wn, s_base, stride_sn, n_ok, D,
                       BLOCK_N, BLOCK_K, BLOCK_T)
        u = _block_dot(xt_ptrs, valid, w_base + I * stride_wn, stride_wn,
                       s_base + I * stride_sn, stride_sn, n_ok, D, BLOCK_N, BLOCK_K, BLOCK_T)
        rw = tl.load(rw_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[None, :]
        h = _swiglu_h(g, u, limit, rw, DT)
        tl.store(h_ptr + pairs[None, :] * stride_hp + rn[:, None], h,
                 mask=(rn < I)[:, None] & valid[None, :])


@triton.jit
def _mma_down_kernel(
    h_ptr, stride_hp, table_ptr, bexp_ptr, emap_ptr,
    w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, ws_ptr, stride_wsp, D, I,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, DT: tl.constexpr,
):
    b = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + b)
    if e >= 0:
        pairs, valid, row, rn, n_ok = _block_setup(table_ptr, emap_ptr, b, e, pid_n, D,
                                                   BLOCK_N, BLOCK_T)
        w_base = w_ptr + row * stride_we + (pid_n * BLOCK_N).to(tl.int64) * stride_wn
        s_base = s_ptr + row * stride_se + (pid_n * BLOCK_N).to(tl.int64) * stride_sn
        y = _block_dot(h_ptr + pairs * stride_hp, valid, w_base, stride_wn, s_base, stride_sn,
                       n_ok, I, BLOCK_N, BLOCK_K, BLOCK_T)
        tl.store(ws_ptr + pairs[None, :] * stride_wsp + rn[:, None], _round_to(y, DT),
                 mask=(rn < D)[:, None] & valid[None, :])  # each expert's output in x.dtype


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
    """Routed-expert output fp32 [T, D] (contract of `fp4_moe_grouped`; x bf16). block =
    (BLOCK_N, BLOCK_K) for both kernels, else 32 rows (148 registers at sm_90; 64 rows took 224
    and ran 2.4x slower at batch 1) and the widest BLOCK_K <= 256 dividing D and I."""
    T, D = x.shape
    k = idx.shape[1]
    I = stack.w13.shape[1] // 2
    if T == 0 or k == 0:
        return torch.zeros(T, D, dtype=torch.float32, device=x.device)
    bn, bk = block or (32, _block_k(D, I))
    if not bk or D % bk or I % bk:
        raise ValueError(f"fp4_moe_mma: D={D} and I={I} must be multiples of BLOCK_K={bk}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    weights = weights.contiguous()
    table, bexp = align_pairs(idx, stack.emap.numel())
    P = T * k
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    ws = torch.empty(P, D, dtype=torch.float32, device=x.device)
    dt = _DT_NAME[x.dtype]
    w13, s13, w2, s2, emap = stack
    nb = bexp.numel()
    _mma_gate_up_kernel[(nb, triton.cdiv(I, bn))](
        x, x.stride(0), table, bexp, weights, emap, w13, w13.stride(0), w13.stride(1), s13,
        s13.stride(0), s13.stride(1), h, h.stride(0), k, I, D, float(swiglu_limit),
        BLOCK_N=bn, BLOCK_K=bk, BLOCK_T=BLOCK_T, DT=dt, num_warps=num_warps,
        num_stages=num_stages)
    _mma_down_kernel[(nb, triton.cdiv(D, bn))](
        h, h.stride(0), table, bexp, emap, w2, w2.stride(0), w2.stride(1), s2, s2.stride(0),
        s2.stride(1), ws, ws.stride(0), D, I, BLOCK_N=bn, BLOCK_K=bk, BLOCK_T=BLOCK_T, DT=dt,
        num_warps=num_warps, num_stages=num_stages)
    return ws.view(T, k, D).sum(1)      # the k expert outputs of each token (fp32)
