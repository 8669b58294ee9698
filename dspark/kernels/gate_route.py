"""The MoE gate of few tokens (decode, verify) as one launch: the fp32 logits x @ W^T of the
bf16 / fp16 gate weight [E, D] and the routing after them (`decode_fused.route`: scores
sqrt(softplus), top-k of scores + bias or the hash table row, normalisation, route scale).

Unfused, the batch-1 decode step spends 3 launches per MoE layer on this: cuBLAS's split-K GEMM
and its reduce kernel for `norm.linear_fp32`, then `route` (13.8 us per gate on an H200 in a
CUDA graph, weights not in L2; 6.6 us fused, see `_blocks`). Here the grid splits the weight
into expert blocks x D-splits (enough programs to stream the 2 MB weight at bandwidth); each
program multiplies its weight tile by all T tokens (exact 16-bit products, fp32 accumulation:
only the summation order differs from the GEMM) and stores an fp32 partial to a workspace.
Arrival counters (per device, as in `fp8_gemm._fp8_skinny_kernel`) find the program that
completes the logits: the partials are summed in split order (deterministic) by the last program
to arrive, or, with more tokens, per expert block by that block's last split; then the last one
routes all T rows at once (`decode_fused._route_rows`, the same code as `route`) and re-arms the
counters. No host sync, fixed shapes: CUDA-graph safe.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from dspark.kernels.decode_fused import _route_rows
from dspark.kernels import invariant
from dspark.kernels.common import interpreting, mma, pick_precision
from dspark.cuda import side_stream
from dspark.cuda.graph_capture import held_buffer

MAX_T = 16              # token counts taken (decode, verify); more: GEMM + `route`
MAX_E = 1024            # experts held by the routing program's [T, E] tile
BLOCK_D = 128
BY_BLOCK_ABOVE = 8192   # partial floats above which the expert blocks sum their own (BY_BLOCK)
_DEVICE_BUFFERS: dict = {}    # (device, stream lane) -> zeroed int32 arrival counters
# the last program routes from the logits sums in its registers (no store-and-reload, the chosen
# experts' scores gathered there) while rows x slots x experts (the gather's selection) is at
# most this many elements: decode / few-token verify at 256 experts; above, through memory
ROUTE_IN_REGISTERS = tl.constexpr(16384)




@triton.jit
def _sum_splits(part_ptr, logits_ptr, at, m, T, E, SPLIT: tl.constexpr):
    """logits[at] = the SPLIT partials [SPLIT, T, E] at `at` summed in split order (the same sum
    whichever program arrives last); .cg loads: they were stored by other programs. Returns the
    sums (0 where not m)."""
    total = tl.load(part_ptr + at, mask=m, other=0.0, cache_modifier=".cg")
    for j in tl.static_range(1, SPLIT):
        total += tl.load(part_ptr + j * T * E + at, mask=m, other=0.0, cache_modifier=".cg")
    tl.store(logits_ptr + at, total, mask=m)
    return total


@triton.jit
def _gate_route_kernel(
    x_ptr, stride_x, g_ptr, stride_g, part_ptr, logits_ptr, cnt_ptr,
    bias_ptr, tid_ptr, stride_tid, tok_ptr, idx_ptr, w_ptr,
    T, E, D, D_PER_SPLIT, route_scale,
    K: tl.constexpr, HASH: tl.constexpr, EXACT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
    BY_BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (n, s): logits^T of experts n*BLOCK_N.. over columns s*D_PER_SPLIT.. as a
    [BLOCK_N, BLOCK_T] MMA tile (weight rows on the M side; tokens padded to BLOCK_T >= 16),
    stored to the logits [T, E] (SPLIT == 1) or to the partial workspace [SPLIT, T, E]. Then the
    program that completes the logits routes rows 0..T-1 (BLOCK_R >= T):
    * SPLIT == 1: the last program to arrive (counter cnt[0]);
    * BY_BLOCK: the last split of expert block n to arrive (counter cnt[1 + n]) sums that
      block's partials into the logits, then the last block to do so (cnt[0]) routes; the sum
      is spread over the expert blocks (many tokens);
    * else: the last program to arrive (cnt[0]) sums all partials and routes (few tokens: one
      atomic round trip less).
    Every counter is re-armed to zero by the program that saw it complete."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rt = tl.arange(0, BLOCK_T).to(tl.int64)
    rd = tl.arange(0, BLOCK_D)
    n_ok = rn < E
    t_ok = rt < T
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    d_lo = pid_s * D_PER_SPLIT
    d_hi = tl.minimum(d_lo + D_PER_SPLIT, D)
    for d0 in range(d_lo, d_hi, BLOCK_D):
        dd = d0 + rd
        d_ok = dd < D
        g = tl.load(g_ptr + rn[:, None] * stride_g + dd[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        xt = tl.load(x_ptr + rt[None, :] * stride_x + dd[:, None],
                     mask=t_ok[None, :] & d_ok[:, None], other=0.0)
        acc += mma(g, xt, PRECISION)
    tile = rt[None, :] * E + rn[:, None]
    tile_ok = n_ok[:, None] & t_ok[None, :]
    rr = tl.arange(0, BLOCK_R).to(tl.int64)                # the real rows (BLOCK_R <= BLOCK_T)
    r_ok = rr < T
    if SPLIT == 1:
        tl.store(logits_ptr + tile, acc, mask=tile_ok)
        report = True
        reporters = tl.num_programs(0)
    else:
        tl.store(part_ptr + pid_s * T * E + tile, acc, mask=tile_ok)
        if BY_BLOCK:
            tl.debug_barrier()                             # all of this program's stores first
            block_cnt = cnt_ptr + 1 + pid_n
            report = tl.atomic_add(block_cnt, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
            if report:                                     # last split of expert block n
                _sum_splits(part_ptr, logits_ptr, rr[None, :] * E + rn[:, None],
                            n_ok[:, None] & r_ok[None, :], T, E, SPLIT)
                tl.atomic_xchg(block_cnt, 0, sem="relaxed", scope="gpu")   # re-arm
            reporters = tl.num_programs(0)
        else:
            report = True
            reporters = tl.num_programs(0) * tl.num_programs(1)
    if report:
        tl.debug_barrier()                                 # this program's stores first
        arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == reporters - 1:                       # the logits are complete
            lg = None                                      # (routed from the logits rows)
            if SPLIT > 1 and not BY_BLOCK:
                re = tl.arange(0, BLOCK_E)
                total = _sum_splits(part_ptr, logits_ptr, rr[:, None] * E + re[None, :],
                                    r_ok[:, None] & (re < E)[None, :], T, E, SPLIT)
                if BLOCK_R * BLOCK_K * BLOCK_E <= ROUTE_IN_REGISTERS:
                    lg = total                             # routed from the sums in registers
                else:
                    tl.debug_barrier()                     # the logits rows before the routing
            _route_rows(logits_ptr, E, rr, r_ok, bias_ptr, tid_ptr, stride_tid, tok_ptr,
                        idx_ptr, w_ptr, E, route_scale, K, HASH, EXACT, BLOCK_R, BLOCK_E,
                        BLOCK_K, ".cg", lg)
            tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")   # re-arm


def _counters(device, n: int) -> torch.Tensor:
    """This device's zeroed int32 arrival counters (cnt[0]: expert blocks done, cnt[1 + n]: the
    splits of expert block n), one buffer per stream lane (side_stream.lane()). Every launch
    leaves them at zero; launches of one lane run one after the other."""
    # (a larger buffer never frees the smaller one: captured graphs keep using theirs)
    return held_buffer(_DEVICE_BUFFERS, (device, side_stream.lane()), n,
                       lambda m: torch.zeros(max(m, 128), dtype=torch.int32, device=device))


def _blocks(T: int, E: int, D: int, interp: bool):
    """(BLOCK_N experts per program, D splits, warps, BY_BLOCK or None: by size). GPU: ~64
    programs (E = 256, D = 4096: 4 expert blocks x 16 splits of [64, 256] bf16 weight tiles);
    more warps for more tokens (the routing program's [T, E] tile). Measured on an H200 (CUDA
    graph, 64 gates of distinct weights, E = 256, D = 4096, k = 6): 6.6 / 7.2 / 8.1 / 9.7 / 11.7
    us at T = 1 / 2 / 4 / 8 / 16 (hash gates 5.1 .. 7.4), against 13.8 / 20.6 / 20.7 / 26.0 /
    26.2 us for linear_fp32 + `route`. Small tiles in the interpreter."""
    nd = triton.cdiv(D, BLOCK_D)
    if interp:
        return 16, min(3, nd), 4, None
    bn = 64 if E >= 128 else 16
    warps = 4 if T <= 2 else 8 if T <= 8 else 16
    return bn, max(1, min(nd, triton.cdiv(64, triton.cdiv(E, bn)))), warps, None


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gate_route` takes x [T, D] with this gate weight [E, D] (else: linear_fp32 and
    `decode_fused.route`)."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_T and weight.dim() == 2 and not invariant.on()
            and weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype
            and x.shape[1] == weight.shape[1] and weight.shape[0] <= MAX_E
            and x.device == weight.device and x.stride(-1) == 1 and weight.stride(-1) == 1)


def gate_route(x: torch.Tensor, weight: torch.Tensor, topk: int, route_scale: float,
               bias: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
               token_ids: torch.Tensor | None = None, block=None):
    """(expert ids int64 [T, k], weights fp32 [T, k], fp32 logits [T, E]) of the gate weight
    [E, D] on x [T, D] (`supported`): hash routing when tid2eid is given (row token_ids[t]),
    else top-k of scores + bias. block = (BLOCK_N, D splits[, warps[, BY_BLOCK]]), else picked by
    shape."""
    assert supported(x, weight)
    T, D = x.shape
    E = weight.shape[0]
    dev = x.device
    hashed = tid2eid is not None
    if hashed:
        assert tid2eid.stride(-1) == 1 and tid2eid.shape[1] == topk
        token_ids = token_ids.reshape(-1)
        assert token_ids.numel() == T
        if token_ids.stride(0) != 1:
            token_ids = token_ids.contiguous()
    else:
        assert bias.dtype == torch.float32 and bias.is_contiguous() and bias.numel() == E
    assert 0 < topk <= E
    interp = interpreting()
    block = tuple(block) + (4, None)[len(block) - 2:] if block else _blocks(T, E, D, interp)
    bn, split, warps, by_block = block
    nd = triton.cdiv(D, BLOCK_D)
    split = max(1, min(split, nd))
    d_per = triton.cdiv(nd, split) * BLOCK_D
    split = triton.cdiv(D, d_per)
    if by_block is None:           # one program sums all partials while they are few
        by_block = split * T * E > BY_BLOCK_ABOVE
    idx = torch.empty(T, topk, dtype=torch.long, device=dev)
    w = torch.empty(T, topk, dtype=torch.float32, device=dev)
    ws = torch.empty((split + 1 if split > 1 else 1) * T * E, dtype=torch.float32, device=dev)
    logits = ws[:T * E].view(T, E)                      # partials after it
    grid = (triton.cdiv(E, bn), split)
    precision = pick_precision(x.dtype, "fp16" if x.dtype == torch.float16 else None)
    _gate_route_kernel[grid](
        x, x.stride(0), weight, weight.stride(0), ws[T * E:] if split > 1 else ws, logits,
        _counters(dev, 1 + grid[0]), ws if hashed else bias, tid2eid if hashed else idx,
        tid2eid.stride(0) if hashed else 0, token_ids if hashed else idx, idx, w,
        T, E, D, d_per, float(route_scale), K=topk, HASH=hashed, EXACT=x.is_cuda,
        PRECISION=precision, BLOCK_N=bn, BLOCK_T=max(16, triton.next_power_of_2(T)),
        BLOCK_D=BLOCK_D, SPLIT=split, BY_BLOCK=by_block, BLOCK_R=triton.next_power_of_2(T),
        BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(topk), num_warps=warps)
    return idx, w, logits
