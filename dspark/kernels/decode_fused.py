"""Small fused kernels of the V4 decode step: chains of elementwise / gather ops on the same data
that the torch code runs as several launches, as one Triton launch each (the batch-1 decode
forward is launch-bound: each launch costs ~2-3 us inside a CUDA graph).

* `swiglu` — the shared expert's activation: g, u (the w1 / w3 outputs, x.dtype) ->
  x.dtype( silu(min(g, limit)) · clamp(u, ±limit) ) in fp32, as `moe.clamped_swiglu` followed
  by ``.to(x.dtype)`` (2 casts, 2 clamps, silu, mul, cast: 7 launches); torch's silu formula
  g / (1 + exp(-g)). With routing weights (the dense draft MoE, all experts side by side):
  per-expert weights, or the gate's (expert, weight) pairs read in the launch (no [T, E]
  weights scattered first) with shared-expert columns after the routed ones at weight 1.
* `gather_pool` — the compressor's candidate-entry pooling of the fixed-shape step
  (`graph._emit`): per candidate entry e and slot s, the row comes from the compressor ring
  (rows before this forward) or from this forward's rows; slots before position 0 are empty
  (a = 0, z = -inf), unused candidates get z = 0 (kept finite); with the overlap form (ratio 4)
  slot s < m reads the A-half columns and s >= m the B-half; then the gated softmax pool
  Σ_s softmax_s(z) · a (`compressor.gated_pool`). The same launch adds the position term of
  this forward's z rows (z + ape[pos mod m], as `Compressor.rows`) and writes its rows into the
  rings (extra programs; race-free, the plan never reads a ring row it rewrites). A remainder,
  5 gathers, an add, 2 where, 3 masked_fill, a not, 2 cats, softmax, mul, sum, 2 index_copy_
  (18-20 launches) -> 1. Same fp32 formula (one add for the ape term, exp(z - max) / Σ), only
  the order of the slot sums may differ.
* `hadamard_fp4` — the indexer's query / key rounding (`RecordQuant.indexer`):
  fp4_roundtrip(hadamard128(x)) over 128-wide fp32 rows (a GEMM, a scale and ~27 elementwise /
  bit ops -> 1). The transform sums ±x over the ±1 Sylvester matrix (built from the
  bits, exact products: only the order of the 128-term sums differs, here sequential); the FP4 part is exact
  arithmetic as in `layouts.fp4_roundtrip` (scale exponent from the bits of amax, multiplies by
  powers of two, round-half-even by the 2^23 trick, no division or transcendental).

* `route` — the MoE gate after its fp32 logits (`moe.Gate`): scores sqrt(softplus(l)), the
  expert ids (top-k of scores + bias, or the hash table row of the token), their scores
  normalised to sum 1, times the route scale: softplus, sqrt, add, topk (or a gather of the
  table), gather, sum, div, mul (7-8 launches) -> 1. Same fp32 formula; top-k by repeated argmax
  (descending, like torch.topk; exactly equal scores: the lower expert id first). Its body
  (`_route_rows`) also ends `gate_route` (the gate GEMV and this routing in one launch, used by
  `moe.Gate` for few tokens and a 16-bit weight; this kernel routes the other gates).

* `copy_records` — `paged.copy_rows` on an fp8_ds_mla record pool with the precomputed split
  (the staged window rows into the rings, once per layer): 2 gathers + 2 scatters -> 1 launch,
  bytes as-is.

Bf16 roundings by bit arithmetic (fp4_moe._round_to) so the interpreter matches the GPU. On the
GPU (EXACT) exp is libdevice's expf and divisions are IEEE (div_rn), as in torch's CUDA kernels;
the interpreter has no libdevice and uses tl.exp / numpy division (fp32 ulps from torch's CPU
exp, which the tests allow).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra import libdevice

from dspark.cuda import pdl
from dspark.kernels import invariant
from dspark.kernels.fp4_moe import _DT_NAME as _DT, _round_to


@triton.jit
def _exp(x, EXACT: tl.constexpr):
    """expf: on the GPU (EXACT) libdevice's, the one torch's CUDA kernels call; in the
    interpreter (no libdevice there) tl.exp."""
    if EXACT:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _div(a, b, EXACT: tl.constexpr):
    """a / b correctly rounded on the GPU (Triton's fp32 `/` is div.full, not IEEE)."""
    if EXACT:
        return tl.math.div_rn(a, b)
    else:
        return a / b


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, out_ptr, w_ptr, idx_ptr, N, stride_g, stride_u, limit, GROUP,
                   G, DT: tl.constexpr, EXACT: tl.constexpr, BLOCK: tl.constexpr,
                   HAS_W: tl.constexpr = False, PDL: tl.constexpr = False, K: tl.constexpr = 0):
    pdl.launch_dependents(PDL)          # the GEMV after it may start fetching its weights
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    row = t.to(tl.int64)
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    clamp = limit > 0
    u = tl.where(clamp, tl.minimum(tl.maximum(u, -limit), limit), u)
    g = tl.where(clamp, tl.minimum(g, limit), g)
    h = _div(g, 1.0 + _exp(-g, EXACT), EXACT) * u        # torch's silu: g / (1 + exp(-g))
    if HAS_W:                           # the routing weight of the column's expert (fp32)
        if K == 0:                      # dense weights [rows, G]
            h = h * tl.load(w_ptr + row * G + cols // GROUP, mask=mask, other=0.0)
        else:                           # the gate's (expert, weight) pairs [rows, K]
            e = cols // GROUP
            wt = tl.zeros([BLOCK], dtype=tl.float32)
            for j in tl.static_range(K):
                wt += tl.where(e == tl.load(idx_ptr + row * K + j),
                               tl.load(w_ptr + row * K + j), 0.0)
            h = h * tl.where(e < G, wt, 1.0)      # columns past the G routed experts: weight 1
    tl.store(out_ptr + row * N + cols, _round_to(h, DT).to(out_ptr.dtype.element_ty), mask=mask)


def swiglu_supported(g: torch.Tensor, u: torch.Tensor) -> bool:
    return (g.dtype == u.dtype and g.dtype in _DT and g.shape == u.shape and g.dim() >= 1
            and g.stride(-1) == 1 and u.stride(-1) == 1 and g.numel() > 0)


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float,
           weight: torch.Tensor | None = None, experts: torch.Tensor | None = None,
           group: int | None = None, routed: int | None = None) -> torch.Tensor:
    """g.dtype( silu(min(g, limit)) · clamp(u, ±limit) ) computed in fp32 (no clamp when
    limit <= 0): `moe.clamped_swiglu(g.float(), u.float(), limit).to(g.dtype)` in one launch.
    weight (fp32 [rows, G], G dividing the last dim): row r's columns in group j (of N / G
    each: expert j's) are scaled by weight[r, j] before the cast, as clamped_swiglu's routing
    weight over [rows, G, N / G].
    experts (int [rows, k]) with weight [rows, k] (the gate's top-k, distinct per row), `group`
    columns per expert and `routed` experts: column c of row r belongs to expert c // group and
    is scaled by the weight of the slot routing r to it, 0 when none does, as the dense weights
    scattered from those pairs would scale it; columns from routed·group on (the shared
    experts laid after the routed ones) are not scaled. No [rows, E] weights to build first."""
    N = g.shape[-1]
    g2, u2 = g.reshape(-1, N), u.reshape(-1, N)
    G, K = 1, 0
    if experts is not None:
        K, G = experts.shape[-1], int(routed)
        assert weight is not None and weight.dtype == torch.float32 and group > 0 and \
            weight.shape == experts.shape == (g2.shape[0], K) and G * group <= N, \
            (weight.shape, weight.dtype, experts.shape, g2.shape, group, routed)
        weight, experts = weight.contiguous(), experts.contiguous()
    elif weight is not None:
        G = weight.shape[-1]
        assert weight.dtype == torch.float32 and N % G == 0 and weight.shape == (g2.shape[0], G), \
            (weight.shape, weight.dtype, g2.shape)
        weight, group = weight.contiguous(), N // G
    out = torch.empty(g2.shape, dtype=g.dtype, device=g.device)
    BLOCK = min(1024, triton.next_power_of_2(N))
    _swiglu_kernel[(g2.shape[0], triton.cdiv(N, BLOCK))](
        g2, u2, out, weight if weight is not None else out,
        experts if experts is not None else out, N, g2.stride(0), u2.stride(0),
        float(limit), group or N, G, DT=_DT[g.dtype], EXACT=g.is_cuda, BLOCK=BLOCK,
        HAS_W=weight is not None, PDL=pdl.enabled(g.device), K=K, num_warps=4)
    return out.view(g.shape)


@triton.jit
def _ape_row(pos_ptr, rows, mask, M):
    """positions[rows] mod M, non-negative like torch's `%` (Triton's is C's remainder)."""
    r = tl.load(pos_ptr + rows, mask=mask, other=0) % M
    return tl.where(r < 0, r + M, r)


@triton.jit
def _gather_pool_kernel(ring_a_ptr, ring_z_ptr, a_ptr, z_ptr, stride_ra, stride_rz, stride_a,
                        stride_z, from_ring_ptr, ring_rows_ptr, fresh_rows_ptr, before_zero_ptr,
                        valid_ptr, out_ptr, ape_ptr, stride_ape, pos_ptr, persist_ptr, E, S, M,
                        D, APE: tl.constexpr, C: tl.constexpr, EXACT: tl.constexpr,
                        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (E [+ T], column blocks of D). Programs e < E pool candidate entry e; programs
    E + t (only when persisting) write token row t into the rings. Reading ring rows and
    writing persisted ones in the same launch is race-free: the plan never has a forward read a
    ring row it rewrites (q <= cache.lookahead + 1, see graph.py's module doc)."""
    e = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    if e < E:
        s = tl.arange(0, BLOCK_S)
        s_ok = s < S
        k = e.to(tl.int64) * S + s
        fr = tl.load(from_ring_ptr + k, mask=s_ok, other=0) != 0
        rr = tl.load(ring_rows_ptr + k, mask=s_ok, other=0).to(tl.int64)
        fw = tl.load(fresh_rows_ptr + k, mask=s_ok, other=0).to(tl.int64)
        bz = tl.load(before_zero_ptr + k, mask=s_ok, other=0) != 0
        col = (s // M) * D                               # overlap: B-half columns for s >= m
        cols = col[:, None] + d[None, :]
        m2 = s_ok[:, None] & (d < D)[None, :]
        from_r = m2 & fr[:, None]
        from_f = m2 & (~fr)[:, None]
        zf = tl.load(z_ptr + fw[:, None] * stride_z + cols, mask=from_f, other=0.0)
        if APE:          # this forward's z rows still lack their position term (rows_raw)
            pr = _ape_row(pos_ptr, fw, s_ok & ~fr, M)
            zf += tl.load(ape_ptr + pr[:, None] * stride_ape + cols, mask=from_f, other=0.0)
        a = tl.where(fr[:, None],
                     tl.load(ring_a_ptr + rr[:, None] * stride_ra + cols, mask=from_r, other=0.0),
                     tl.load(a_ptr + fw[:, None] * stride_a + cols, mask=from_f, other=0.0))
        z = tl.where(fr[:, None],
                     tl.load(ring_z_ptr + rr[:, None] * stride_rz + cols, mask=from_r, other=0.0),
                     zf)
        a = tl.where(bz[:, None], 0.0, a)
        z = tl.where(bz[:, None], float("-inf"), z)
        valid = tl.load(valid_ptr + e) != 0
        z = tl.where(valid, z, 0.0)
        z = tl.where(s_ok[:, None], z, float("-inf"))    # padding slots: weight 0
        mx = tl.max(z, axis=0)
        p = _exp(z - mx[None, :], EXACT)
        w = _div(p, tl.sum(p, axis=0)[None, :], EXACT)
        out = tl.sum(w * a, axis=0)
        tl.store(out_ptr + e.to(tl.int64) * D + d, out, mask=d < D)
    else:                # persist token row t (all c·d columns: both halves of the overlap form)
        t = (e - E).to(tl.int64)
        dst = tl.load(persist_ptr + t).to(tl.int64)
        dm = d < D
        if APE:          # names unlike the pool branch's: one name in both must keep its type
            ape_t = _ape_row(pos_ptr, t, True, M)
        for h in tl.static_range(C):
            row_cols = h * D + d
            av = tl.load(a_ptr + t * stride_a + row_cols, mask=dm)
            zv = tl.load(z_ptr + t * stride_z + row_cols, mask=dm)
            if APE:
                zv += tl.load(ape_ptr + ape_t * stride_ape + row_cols, mask=dm)
            tl.store(ring_a_ptr + dst * stride_ra + row_cols, av, mask=dm)
            tl.store(ring_z_ptr + dst * stride_rz + row_cols, zv, mask=dm)


def _pool_block_d(block_s: int, out_dim: int) -> int:
    """Columns per program: a [BLOCK_S, BLOCK_D] fp32 tile of a and of z (at most 2048 elements
    each: no spills at 4 warps, e.g. ratio 128's 128 slots x 16 columns)."""
    return max(16, min(128, 2048 // block_s, triton.next_power_of_2(out_dim)))


def gather_pool(ring_a, ring_z, a, z, from_ring, ring_rows, fresh_rows, before_zero, valid,
                ratio: int, out_dim: int, ape=None, positions=None,
                persist_dst=None) -> torch.Tensor:
    """fp32 [E, out_dim]: the pooled candidate entries of `graph._emit` (see the module doc).

    ring_a, ring_z [R, c·d] fp32 and a, z [T, c·d] fp32 (rows, last dim contiguous); from_ring,
    before_zero bool [E, c·m]; ring_rows, fresh_rows int64 [E, c·m]; valid bool [E].

    ape fp32 [ratio, c·d] (with positions int64 [T]): z are `Compressor.rows_raw` rows, without
    the position term; the kernel adds ape[positions[t] % ratio] to each z row it reads from
    this forward (one fp32 add, as `Compressor.rows`). persist_dst int64 [T]: the same launch
    also writes the rows into the rings, ring_a[persist_dst[t]] = a[t] and ring_z[persist_dst[t]]
    = z[t] (+ its ape term), as two index_copy_ after the pool would; the caller guarantees that
    no ring row read here is among them."""
    E, S = ring_rows.shape
    T = 0 if persist_dst is None else persist_dst.shape[0]
    for t in (ring_a, ring_z, a, z):
        assert t.dtype == torch.float32 and t.stride(-1) == 1
    C = ring_a.shape[1] // out_dim
    assert ring_a.shape[1] == C * out_dim and a.shape[1] == ring_a.shape[1]
    if ape is not None:
        assert ape.dtype == torch.float32 and ape.stride(-1) == 1 and positions is not None
        assert ape.shape == (ratio, a.shape[1])
    out = torch.empty(E, out_dim, dtype=torch.float32, device=a.device)
    if E + T == 0:
        return out
    BLOCK_S = triton.next_power_of_2(S)
    BLOCK_D = _pool_block_d(BLOCK_S, out_dim)
    idx = ring_rows.contiguous()           # also the stand-in for pointers not given
    _gather_pool_kernel[(E + T, triton.cdiv(out_dim, BLOCK_D))](
        ring_a, ring_z, a, z, ring_a.stride(0), ring_z.stride(0), a.stride(0), z.stride(0),
        from_ring.contiguous().view(torch.uint8), idx, fresh_rows.contiguous(),
        before_zero.contiguous().view(torch.uint8), valid.contiguous().view(torch.uint8), out,
        a if ape is None else ape, 0 if ape is None else ape.stride(0),
        idx if positions is None else positions.contiguous(),
        idx if persist_dst is None else persist_dst.contiguous(), E, S, ratio, out_dim,
        APE=ape is not None, C=C, EXACT=a.is_cuda, BLOCK_S=BLOCK_S, BLOCK_D=BLOCK_D,
        num_warps=4)
    return out


@triton.jit
def _hadamard_fp4_kernel(x_ptr, out_ptr, N, stride_x, inv_sqrt, amax_floor,
                         BLOCK_R: tl.constexpr, DIM: tl.constexpr, FP4_BLOCK: tl.constexpr):
    """Grid (row blocks, DIM / FP4_BLOCK): program (r, c) writes the FP4 block c (columns
    [c·32, c·32 + 32)) of BLOCK_R rows: y = x H[:, block] / sqrt(DIM) with the Sylvester
    H[i, j] = (-1)^popcount(i & j), then the block's e2m1 round trip. Many small programs: a
    decode step has ~65 rows (one token's indexer heads), and one program per 16 rows took
    20-80 us on the H200 (4 programs, long serial FMA chains)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * FP4_BLOCK + tl.arange(0, FP4_BLOCK)                # [32]
    ks = tl.arange(0, DIM)
    rmask = (rows < N)[:, None]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :], mask=rmask,
                other=0.0).to(tl.float32)                                        # [R, DIM]
    v = ks[:, None] & cols[None, :]
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    hmat = tl.where((v & 1) == 0, 1.0, -1.0)                                     # [DIM, 32]
    # exact ±1 products, fp32 sums (only their order differs from the reference GEMM)
    y = tl.sum(x[:, :, None] * hmat[None, :, :], axis=1) * inv_sqrt              # [R, 32]
    # FP4 (e2m1) round trip in 32-blocks
    yb = tl.reshape(y, (BLOCK_R, 1, FP4_BLOCK))
    amax = tl.maximum(tl.max(tl.abs(yb), axis=2), amax_floor)          # [BLOCK_R, 1]
    bits = amax.to(tl.int32, bitcast=True)
    # ceil(log2(amax / 6)) exactly: amax = M·2^E, amax/6 = (M/1.5)·2^(E-2)
    e = ((bits >> 23) & 0xFF) - 127 - 2 + ((bits & 0x7FFFFF) > 0x400000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -126), 126)
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)               # 2^-e, exact
    q = yb * inv[:, :, None]
    a = tl.abs(q)
    up = tl.where(a < 2.0, 2.0, tl.where(a < 4.0, 1.0, 0.5))           # 1 / grid spacing
    spacing = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
    t = a * up                                                          # exact
    t = (t + 8388608.0) - 8388608.0                                     # round half to even
    r = tl.minimum(t * spacing, 6.0)
    sign = q.to(tl.int32, bitcast=True) & (-2147483648)
    r = (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    out = tl.reshape(r * scale[:, :, None], (BLOCK_R, FP4_BLOCK))
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * DIM + cols[None, :], out, mask=rmask)


def hadamard_fp4(x: torch.Tensor) -> torch.Tensor:
    """fp32 fp4_roundtrip(hadamard128(x.float())) for x [..., 128] (see the module doc)."""
    from dspark.formats.layouts import FP4_AMAX_FLOOR, FP4_BLOCK, INDEXER_DIM
    assert x.shape[-1] == INDEXER_DIM
    x2 = x.reshape(-1, INDEXER_DIM)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    n = x2.shape[0]
    # decode: many small programs; long prefills: 4 rows per program at 8 warps (the [R, 128,
    # 32] product stays at 64 values per thread either way)
    BLOCK_R, warps = (2, 4) if n <= 4096 or invariant.on() else (4, 8)
    if n:
        _hadamard_fp4_kernel[(triton.cdiv(n, BLOCK_R), INDEXER_DIM // FP4_BLOCK)](
            x2, out, n, x2.stride(0), INDEXER_DIM ** -0.5, FP4_AMAX_FLOOR, BLOCK_R=BLOCK_R,
            DIM=INDEXER_DIM, FP4_BLOCK=FP4_BLOCK, num_warps=warps)
    return out.view(x.shape)


@triton.jit
def _route_scores(x, EXACT: tl.constexpr):
    """sqrt(softplus(x)) with torch's softplus: x if x > 20 else log1p(exp(x))."""
    e = _exp(x, EXACT)
    if EXACT:
        sp = libdevice.log1p(e)
    else:                       # accurate log1p without libdevice: log(u) · e / (u - 1)
        u = 1.0 + e
        sp = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
    sp = tl.where(x > 20.0, x, sp)
    if EXACT:
        return tl.sqrt_rn(sp)
    else:
        return tl.sqrt(sp)


@triton.jit
def _route_rows(logits_ptr, stride_l, rt, t_ok, bias_ptr, tid_ptr, stride_tid, tok_ptr, idx_ptr,
                w_ptr, E, route_scale, K: tl.constexpr, HASH: tl.constexpr, EXACT: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                CACHE: tl.constexpr, lg_in=None):
    """The routing of the logits rows rt (int64 [BLOCK_T], rows where t_ok): expert ids and
    weights stored to rows rt of idx / w ([T, K]). Shared by `_route_kernel` (one row per
    program) and `gate_route._gate_route_kernel` (all rows in one program, CACHE=".cg" there:
    the logits were written by other programs of that launch). lg_in: the rows already in
    registers (fp32 [BLOCK_T, BLOCK_E], what the logits rows hold; small shapes, see
    gate_route.ROUTE_IN_REGISTERS): then the chosen experts' scores are gathered from registers,
    not reloaded. The bias / hash table loads go first either way (no round trip of their own
    after the logits')."""
    kk = tl.arange(0, BLOCK_K)
    km = t_ok[:, None] & (kk < K)[None, :]                                  # [BLOCK_T, BLOCK_K]
    e = tl.arange(0, BLOCK_E)
    em = t_ok[:, None] & (e < E)[None, :]                                   # [BLOCK_T, BLOCK_E]
    rows = logits_ptr + rt[:, None] * stride_l
    if HASH:
        tok = tl.load(tok_ptr + rt, mask=t_ok, other=0).to(tl.int64)
        idx = tl.load(tid_ptr + tok[:, None] * stride_tid + kk[None, :], mask=km,
                      other=0).to(tl.int64)
    else:
        bias = tl.load(bias_ptr + e, mask=e < E, other=0.0)
    if lg_in is None:
        if not HASH:
            lg = tl.load(rows + e[None, :], mask=em, other=0.0, cache_modifier=CACHE)
    else:
        lg = lg_in
    if not HASH:
        b = tl.where(em, _route_scores(tl.where(em, lg, 0.0), EXACT) + bias[None, :],
                     float("-inf"))
        idx = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int64)
        for k in tl.static_range(K):
            j = tl.argmax(b, 1, tie_break_left=True)                        # [BLOCK_T]
            idx = tl.where(kk[None, :] == k, j.to(tl.int64)[:, None], idx)
            b = tl.where(e[None, :] == j[:, None], float("-inf"), b)
    if lg_in is None:
        w = _route_scores(tl.load(rows + idx, mask=km, other=0.0, cache_modifier=CACHE), EXACT)
    else:   # the chosen logits from registers: one match per (row, slot), an exact sum
        w = _route_scores(tl.sum(tl.where(e[None, None, :] == idx[:, :, None], lg[:, None, :],
                                          0.0), axis=2), EXACT)
    w = tl.where(km, w, 0.0)
    total = tl.where(t_ok, tl.sum(w, axis=1), 1.0)                          # no 0/0 in padding
    w = _div(w, total[:, None], EXACT) * route_scale
    out = rt[:, None] * K + kk[None, :]
    tl.store(idx_ptr + out, idx, mask=km)
    tl.store(w_ptr + out, w, mask=km)


@triton.jit
def _route_kernel(logits_ptr, stride_l, bias_ptr, tid_ptr, stride_tid, tok_ptr, idx_ptr, w_ptr,
                  E, route_scale, K: tl.constexpr, HASH: tl.constexpr, EXACT: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    rt = tl.program_id(0).to(tl.int64) + tl.zeros((1,), dtype=tl.int64)   # this program's row
    _route_rows(logits_ptr, stride_l, rt, rt >= 0, bias_ptr, tid_ptr, stride_tid, tok_ptr,
                idx_ptr, w_ptr, E, route_scale, K, HASH, EXACT, 1, BLOCK_E, BLOCK_K, "")


def route(logits: torch.Tensor, topk: int, route_scale: float, bias: torch.Tensor | None = None,
          tid2eid: torch.Tensor | None = None, token_ids: torch.Tensor | None = None):
    """(expert ids int64 [T, k], weights fp32 [T, k]) from the gate's fp32 logits [T, E]
    (see the module doc): hash routing when tid2eid is given (row token_ids[t]), else top-k of
    scores + bias."""
    T, E = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(-1) == 1
    idx = torch.empty(T, topk, dtype=torch.long, device=logits.device)
    w = torch.empty(T, topk, dtype=torch.float32, device=logits.device)
    if T == 0:
        return idx, w
    hashed = tid2eid is not None
    if hashed:
        assert tid2eid.stride(-1) == 1 and tid2eid.shape[1] == topk
    else:
        assert bias.dtype == torch.float32 and bias.is_contiguous()
    _route_kernel[(T,)](
        logits, logits.stride(0), logits if hashed else bias, tid2eid if hashed else idx,
        tid2eid.stride(0) if hashed else 0, token_ids if hashed else idx, idx, w, E,
        float(route_scale), K=topk, HASH=hashed, EXACT=logits.is_cuda,
        BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(topk), num_warps=4)
    return idx, w


@triton.jit
def _copy_records_kernel(pool_ptr, page_bytes, split_ptr, n, per_page,
                         DATA: tl.constexpr, SCALE: tl.constexpr, BLOCK: tl.constexpr,
                         BLOCK_S: tl.constexpr):
    i = tl.program_id(0)
    sp = tl.load(split_ptr + i).to(tl.int64)
    sr = tl.load(split_ptr + n + i).to(tl.int64)
    dp = tl.load(split_ptr + 2 * n + i).to(tl.int64)
    dr = tl.load(split_ptr + 3 * n + i).to(tl.int64)
    o = tl.arange(0, BLOCK)
    m = o < DATA
    v = tl.load(pool_ptr + sp * page_bytes + sr * DATA + o, mask=m)
    tl.store(pool_ptr + dp * page_bytes + dr * DATA + o, v, mask=m)
    so = tl.arange(0, BLOCK_S)
    base = per_page.to(tl.int64) * DATA
    v = tl.load(pool_ptr + sp * page_bytes + base + sr * SCALE + so, mask=so < SCALE)
    tl.store(pool_ptr + dp * page_bytes + base + dr * SCALE + so, v, mask=so < SCALE)


def copy_records(pool: torch.Tensor, per_page: int, split: torch.Tensor) -> None:
    """`paged.copy_rows(pool, per_page, src, dst, split)` for an fp8_ds_mla uint8 pool
    [pages, page_bytes] and split int64 [4, n] = (src page, src row, dst page, dst row); distinct
    destinations that are no source row (staging -> ring)."""
    from dspark.formats.layouts import DATA_ROW_BYTES, SCALE_ROW_BYTES
    assert pool.dtype == torch.uint8 and pool.stride(1) == 1 and split.shape[0] == 4
    split = split.contiguous()
    n = split.shape[1]
    if n:
        _copy_records_kernel[(n,)](
            pool, pool.stride(0), split, n, per_page, DATA=DATA_ROW_BYTES,
            SCALE=SCALE_ROW_BYTES, BLOCK=triton.next_power_of_2(DATA_ROW_BYTES),
            BLOCK_S=triton.next_power_of_2(SCALE_ROW_BYTES), num_warps=4)
