"""Top-k / top-p on the device in one launch: `filter_logits` turns logits into the tempered,
filtered logits that the fused sampling kernels (`fused_verify`, `fused_sample`) then read at
temperature 1, so that requests with top-k / top-p take the fused path too instead of the sort,
softmax, cumsum and scatter of `probs_from_logits`.

    y, t = filter_logits(logits, temperature, top_k, top_p)
    softmax(y / t) == probs_from_logits(logits, temperature, top_k, top_p)   (sampled rows)

Sampled rows (temperature > 0): y = logits / T (IEEE division, as torch) where the token is kept,
-inf where top-k or top-p drops it, t = 1. Greedy rows: y = logits, t = 0 (the kernels take the
argmax). Kept tokens, as `probs_from_logits` defines them (ties in rank order: lower index
first, its sort being stable):

* top-k (k > 0): the k tokens of largest tempered logit;
* top-p (p < 1), over the top-k-renormalised distribution: a token is kept while the mass ranked
  strictly before it is < p (rank 0 always).

No sort: one program per row searches thresholds over an order-preserving int32 key of the
tempered logit (-0 folded into +0), 4 bits per pass with 16 probes at once (8 passes for 32
bits): for top-k the largest key with >= k tokens at or above it; for top-p the smallest kept key
whose mass above it is < p * Z (unnormalised masses exp(y - max), Z their sum over the top-k
set), then the ties at each threshold are kept in index order (a running count across chunks).
With top-k (k <= BLOCK) the searches do not walk the row: the first pass keeps each lane's
largest key, the k-th largest of those (k distinct tokens reach it) bounds the k-th largest key
from below, and the tokens at or above it (typically ~k to a few k) are compacted in token order
into a list of up to CANDIDATES ids; the row is read three times (temper, compact, write).
Top-p alone: the largest lane maximum above which the lane maxima already hold p of the row's
mass (summed online in the first pass) bounds the top-p threshold from below the same way,
when they hold that much.

Top-k's set equals the torch path's exactly; top-p's boundary sums run in another order than
torch's cumsum, so a token whose prefix mass is within rounding of p can go the other way (as
for the fused kernels' own sums). Offline sm_90 compile: BLOCK 512 with 8 warps, 160 registers,
no spills (1024 spills). H200 (benchmarks/bench_sampling_filters.py): faster than
the torch path on small vocabularies and many rows (V 512: 39 vs 83 us; V 32768 x 48 rows: 191
vs 371), slower on one long row (V 129280: 722 vs 252 us: one program streams it ~3 times);
sampling.fused_filters_enabled picks per call.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.kernels.decode_fused import _div
from dspark.kernels.common import interpreting

_MIN_KEY = tl.constexpr(-2147483648)      # int32 min: every key is >= it
CANDIDATES = 4096       # top-k search list per row (token ids); more candidates: the whole row


@triton.jit
def _key(t):
    """Order-preserving int32 key of fp32 t (as int64): t < t' <=> key < key'; -0 == +0."""
    t = tl.where(t == 0.0, 0.0, t)
    b = t.to(tl.int32, bitcast=True)
    return (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _items(out_row, cand_row, c, L, use_c, BLOCK: tl.constexpr):
    """(tempered logits, keys, valid) of items c .. c + BLOCK of the row's search list: the
    candidate token ids at cand_row (use_c) or the row itself (ids 0 .. V-1)."""
    offs = c + tl.arange(0, BLOCK)
    ok = offs < L
    uc = (offs * 0 + use_c) != 0            # (broadcast first: the interpreter's `&` of a
    idx = tl.where(uc, tl.load(cand_row + offs, mask=ok & uc, other=0), offs)   # 0-d mask fails)
    t = tl.load(out_row + idx, mask=ok, other=float("-inf"))
    return t, _key(t), ok


@triton.jit
def _filter_kernel(logits_ptr, stride_l, out_ptr, stride_o, temp_ptr, topk_ptr, topp_ptr, teff_ptr,
                   cand_ptr, V, CAP, HAS_K: tl.constexpr, HAS_P: tl.constexpr,
                   EXACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    l_row = logits_ptr + row.to(tl.int64) * stride_l
    out_row = out_ptr + row.to(tl.int64) * stride_o
    cand_row = cand_ptr + row.to(tl.int64) * CAP
    T = tl.load(temp_ptr + row)
    greedy = T <= 0
    tl.store(teff_ptr + row, tl.where(greedy, 0.0, 1.0))
    div = tl.where(greedy, 1.0, T)
    # pass 1: tempered logits (greedy rows: as-is); per lane its largest key / value and the
    # sum of exp(t - lane max) (online), giving the row max m and the row's sum z_row
    best = tl.full([BLOCK], _MIN_KEY, tl.int64)
    mv = tl.full([BLOCK], float("-inf"), tl.float32)
    sl = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(0, V, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        ok = offs < V
        t = _div(tl.load(l_row + offs, mask=ok, other=0.0).to(tl.float32), div, EXACT)
        tl.store(out_row + offs, t, mask=ok)
        best = tl.maximum(best, tl.where(ok, _key(t), _MIN_KEY))
        tv = tl.where(ok, t, float("-inf"))
        new = tl.maximum(mv, tv)
        base = tl.where(new == float("-inf"), 0.0, new)     # (no -inf - -inf: sl is 0 there)
        sl = sl * tl.exp(tl.where(new == float("-inf"), 0.0, mv) - base) + tl.exp(tv - base)
        mv = new
    m = tl.max(mv, 0)
    e_lane = tl.exp(mv - m)                              # each lane maximum's mass
    z_row = tl.sum(sl * e_lane, 0)
    k = V
    if HAS_K:
        k = tl.load(topk_ptr + row).to(tl.int32)
        k = tl.where((k <= 0) | (k > V), V, k)
    p = 1.0
    if HAS_P:
        p = tl.load(topp_ptr + row).to(tl.float32)
    j16 = tl.arange(0, 16).to(tl.int64)
    if (T > 0) & ((k < V) | (p < 1.0)):
        # the search list: only the tokens with key >= bound, compacted in token order when
        # they fit in CAP (else the whole row), when a bound is known from the lane maxima:
        # top-k (k <= BLOCK): tau, the k-th largest lane maximum (k distinct tokens are >= tau,
        # so the k-th largest key is too); top-p alone: above theta, the largest lane maximum
        # above which the lane maxima already hold >= p * z_row of mass (the top-p threshold is
        # then >= theta), when they hold that much at all
        L = V
        use_c = tl.zeros([], dtype=tl.int32)            # 0: the row itself, 1: candidates
        bound = tl.full([], _MIN_KEY, tl.int64)
        if (k < V) & (k <= BLOCK):
            for d in tl.static_range(8):
                w = tl.full([], 1, tl.int64) << (28 - 4 * d)
                probes = bound + j16 * w
                cnt = tl.sum((best[:, None] >= probes[None, :]).to(tl.int64), 0)
                bound += tl.max(tl.where(cnt >= k, j16, 0), 0) * w
        if (k >= V) & (p < 1.0):
            pz_row = p * z_row
            if tl.sum(e_lane, 0) >= pz_row:
                for d in tl.static_range(8):
                    w = tl.full([], 1, tl.int64) << (28 - 4 * d)
                    probes = bound + j16 * w
                    a = tl.sum(tl.where(best[:, None] > probes[None, :], e_lane[:, None], 0.0), 0)
                    bound += tl.max(tl.where(a >= pz_row, j16, 0), 0) * w
                bound += 1                                  # keys > theta
        if bound > _MIN_KEY:
            n_c = tl.zeros([], dtype=tl.int64)
            for c in range(0, V, BLOCK):
                offs = c + tl.arange(0, BLOCK)
                ok = offs < V
                sel = ok & (_key(tl.load(out_row + offs, mask=ok, other=0.0)) >= bound)
                pos = n_c + tl.cumsum(sel.to(tl.int64), 0) - 1
                tl.store(cand_row + pos, offs, mask=sel & (pos < CAP))
                n_c += tl.sum(sel.to(tl.int64), 0)
            if n_c <= CAP:
                L = n_c.to(tl.int32)
                use_c = tl.full([], 1, tl.int32)
        # top-k threshold kappa: the largest key with >= k tokens at or above it; need_eq of the
        # tokens at kappa are kept (lowest ids first); z = the top-k set's sum of exp(t - m)
        kappa = tl.full([], _MIN_KEY, tl.int64)
        need_eq = tl.full([], V, tl.int64)
        e_kappa = tl.zeros([], dtype=tl.float32)
        z = tl.zeros([], dtype=tl.float32)
        if k < V:
            for d in tl.static_range(8):
                w = tl.full([], 1, tl.int64) << (28 - 4 * d)
                probes = kappa + j16 * w
                cnt = tl.zeros([16], dtype=tl.int64)
                for c in range(0, L, BLOCK):
                    _, key, ok = _items(out_row, cand_row, c, L, use_c, BLOCK)
                    cnt += tl.sum((ok[:, None] & (key[:, None] >= probes[None, :])).to(tl.int64),
                                  0)
                kappa += tl.max(tl.where(cnt >= k, j16, 0), 0) * w   # probe 0 always holds
            gt = tl.zeros([], dtype=tl.int64)
            for c in range(0, L, BLOCK):
                t, key, ok = _items(out_row, cand_row, c, L, use_c, BLOCK)
                e = tl.exp(t - m)
                gt += tl.sum((ok & (key > kappa)).to(tl.int64), 0)
                z += tl.sum(tl.where(ok & (key > kappa), e, 0.0), 0)
                e_kappa = tl.maximum(e_kappa, tl.max(tl.where(ok & (key == kappa), e, 0.0), 0))
            need_eq = k - gt
            z += need_eq.to(tl.float32) * e_kappa        # the ties at kappa: equal masses
        else:
            z = z_row                                   # no top-k: the whole row
        # top-p: kf = the largest key whose kept mass strictly above is still >= p * z; the
        # kept mass above a key q is the list's mass above max(q, kappa), plus the kept ties at
        # kappa when q < kappa
        pz = p * z
        star = tl.full([], _MIN_KEY, tl.int64)            # keys > star: kept by top-p
        mass_above = tl.zeros([], dtype=tl.float32)
        if p < 1.0:
            kf = tl.full([], _MIN_KEY, tl.int64)          # the mass above MIN_KEY is z >= pz
            for d in tl.static_range(8):
                w = tl.full([], 1, tl.int64) << (28 - 4 * d)
                probes = kf + j16 * w
                a = tl.where(probes < kappa, need_eq.to(tl.float32) * e_kappa, 0.0)
                floor = tl.maximum(probes, kappa)
                for c in range(0, L, BLOCK):
                    t, key, ok = _items(out_row, cand_row, c, L, use_c, BLOCK)
                    e = tl.where(ok, tl.exp(t - m), 0.0)
                    a += tl.sum(tl.where(key[:, None] > floor[None, :], e[:, None], 0.0), 0)
                kf += tl.max(tl.where(a >= pz, j16, 0), 0) * w
            # star = the smallest kept key above kf; mass_above = the kept mass above star
            star = tl.full([], 2147483647, tl.int64)
            for c in range(0, L, BLOCK):
                t, key, ok = _items(out_row, cand_row, c, L, use_c, BLOCK)
                star = tl.minimum(star, tl.min(tl.where(ok & (key > kf) & (key >= kappa), key,
                                                        2147483647), 0))
            for c in range(0, L, BLOCK):
                t, key, ok = _items(out_row, cand_row, c, L, use_c, BLOCK)
                mass_above += tl.sum(tl.where(ok & (key > star), tl.exp(t - m), 0.0), 0)
        # last pass over the row: dropped tokens -inf; ties at kappa kept in id order up to
        # need_eq, ties at star while the mass before them stays < p * z
        seen = tl.zeros([], dtype=tl.int64)
        seen_star = tl.zeros([], dtype=tl.int64)
        for c in range(0, V, BLOCK):
            offs = c + tl.arange(0, BLOCK)
            ok = offs < V
            t = tl.load(out_row + offs, mask=ok, other=float("-inf"))
            key = _key(t)
            eq = ok & (key == kappa)
            rank = seen + tl.cumsum(eq.to(tl.int64), 0) - 1
            seen += tl.sum(eq.to(tl.int64), 0)
            kept = ok & ((key > kappa) | (eq & (rank < need_eq)))
            tie = kept & (key == star)
            r = seen_star + tl.cumsum(tie.to(tl.int64), 0) - 1
            seen_star += tl.sum(tie.to(tl.int64), 0)
            before = mass_above + r.to(tl.float32) * tl.exp(t - m)   # mass ranked before a tie
            keep = kept & ((key > star) | (tie & ((r == 0) | (before < pz))))
            tl.store(out_row + offs, tl.where(keep, t, float("-inf")), mask=ok)


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor,
                  top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
                  block: int | None = None, cap: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y fp32 [N, V], t fp32 [N]) from logits [N, V] (any float dtype, unit column stride) and
    per-row temperature [N], top_k [N] (<= 0: off) / top_p [N] (>= 1: off), either may be None
    (off for every row): see the module docstring. Rows need at least one finite logit."""
    N, V = logits.shape
    dev = logits.device
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    y = torch.empty(N, V, dtype=torch.float32, device=dev)
    t_eff = torch.empty(N, dtype=torch.float32, device=dev)
    if N == 0:
        return y, t_eff
    vec = lambda t, dt: t.to(device=dev, dtype=dt).reshape(N).contiguous()  # noqa: E731
    temp = vec(temperature, torch.float32)
    k = vec(top_k, torch.int64) if top_k is not None else temp
    p = vec(top_p, torch.float32) if top_p is not None else temp
    interp = interpreting()
    BLOCK = block or (256 if interp else 512)
    cap = cap or CANDIDATES
    cand = torch.empty(N, cap, dtype=torch.int32, device=dev)
    _filter_kernel[(N,)](logits, logits.stride(0), y, y.stride(0), temp, k, p, t_eff, cand, V,
                         cap, HAS_K=top_k is not None, HAS_P=top_p is not None,
                         EXACT=not interp, BLOCK=BLOCK, num_warps=4 if interp else 8)
    return y, t_eff
