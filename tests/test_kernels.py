"""Triton kernels (sparse MQA, lightning indexer, cache writes) against their torch references,
and the torch references against naive per-query loops written from the spec formulas.

Without CUDA the kernels run under TRITON_INTERPRET=1 on small shapes. Triton reads that variable
when it is imported (its own tl.* helpers are @jit functions too), so it is set here before
anything imports triton; if triton was imported earlier in this process without it (another
module imported first), the Triton tests are skipped with that reason — set TRITON_INTERPRET=1 in
the environment or in tests/conftest.py then. GPU-sized comparisons are marked ``gpu`` and
skipped without CUDA.
"""
from triton_env import DEV, INTERPRET, gpu, needs_cuda, triton_ok  # noqa: F401 (before triton)

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import dspark.kernels.cache_write as cw  # noqa: E402
import dspark.kernels.indexer as ix  # noqa: E402
import dspark.kernels.sparse_mqa as smqa  # noqa: E402
import dspark.kernels.sparse_mqa_torch as smqa_ref  # noqa: E402
from dspark.formats import layouts as L  # noqa: E402

SCALE = 512 ** -0.5


def prec_and_tol(qdtype):
    """fp32 q: exact fp32 MMAs ('ieee') so the kernel logic is checked tightly on GPU too;
    bf16 q: production bf16 MMAs on GPU (P is rounded to bf16 -> ~1e-2 of the output scale)."""
    if qdtype == torch.float32:
        return "ieee", 1e-3
    return None, (1e-3 if INTERPRET else 1e-2)


# ---------------------------------------------------------------------------------------------
# builders
# ---------------------------------------------------------------------------------------------

def make_fp8_cache(num_pages, N, gen, device=DEV, spread=True):
    """Fill every entry of an fp8_ds_mla cache through the torch layout writer; return
    (cache, x) with x the fp32 vectors written at slot = entry id."""
    n = num_pages * N
    x = torch.randn(n, 512, generator=gen)
    if spread:  # different magnitudes per 64-group exercise distinct scales
        x = x * torch.exp2(torch.randint(-6, 6, (n, 8), generator=gen).float()).repeat_interleave(64, 1)
    cache = torch.zeros(num_pages, L.fp8_ds_mla_page_bytes(N), dtype=torch.uint8)
    L.write_fp8_ds_mla(cache, N, torch.arange(n), x)
    return cache.to(device), x


def make_indices(T, K, n_entries, gen, p_masked=0.25, all_masked_row=None):
    idx = torch.randint(0, n_entries, (T, K), generator=gen, dtype=torch.int32)
    idx[torch.rand(T, K, generator=gen) < p_masked] = -1
    if all_masked_row is not None:
        idx[all_masked_row] = -1
    return idx


def rel_err(a, b):
    """Max abs error relative to the reference's scale (outputs have no natural per-element scale)."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def naive_attention(q, rows_of, idx_lists, sink, scale):
    """Per (token, head) loop in float64 straight from §3.4: o = Σ e^ℓ v / (Σ e^ℓ + e^sink).

    rows_of(list_no, ids) -> fp32 [n, 512] de-quantised keys; idx_lists: list of [T, K] (−1 =
    masked; lengths already applied by the caller)."""
    T, H, _ = q.shape
    out = torch.zeros(T, H, 512, dtype=torch.float64)
    for t in range(T):
        keys = []
        for li, idx in enumerate(idx_lists):
            ids = idx[t][idx[t] >= 0].long()
            if ids.numel():
                keys.append(rows_of(li, ids).double())
        kv = torch.cat(keys) if keys else torch.zeros(0, 512, dtype=torch.float64)
        for h in range(H):
            logits = (kv @ q[t, h].double()) * scale
            w = torch.exp(logits)
            out[t, h] = (w[:, None] * kv).sum(0) / (w.sum() + math.exp(float(sink[h])))
    return out


def cut_lengths(idx, lengths):
    idx = idx.clone()
    pos = torch.arange(idx.shape[1])
    idx[pos[None, :] >= lengths[:, None]] = -1
    return idx


# ---------------------------------------------------------------------------------------------
# torch references vs naive loops
# ---------------------------------------------------------------------------------------------

def test_sparse_mqa_fp8_reference_vs_naive():
    gen = torch.Generator().manual_seed(1)
    N, P, T, H = 8, 3, 4, 6
    cache, _ = make_fp8_cache(P, N, gen, device="cpu")
    cache2, _ = make_fp8_cache(2, 4, gen, device="cpu")  # second cache, other N and page size
    q = torch.randn(T, H, 512, generator=gen) * 3
    sink = torch.randn(H, generator=gen)
    idx = make_indices(T, 20, P * N, gen, all_masked_row=1)
    idx2 = make_indices(T, 5, 8, gen)
    lengths = torch.tensor([20, 20, 7, 0], dtype=torch.int32)
    idx2[1] = -1  # token 1: nothing in either list -> sink only -> 0
    got = smqa_ref.sparse_mqa_fp8_torch(q, cache, N, idx, sink, SCALE, lengths=lengths,
                                    extra_cache=cache2, extra_entries_per_page=4,
                                    extra_indices=idx2)
    rows = [lambda ids: L.read_fp8_ds_mla(cache, N, ids), lambda ids: L.read_fp8_ds_mla(cache2, 4, ids)]
    want = naive_attention(q, lambda li, ids: rows[li](ids), [cut_lengths(idx, lengths), idx2],
                           sink, SCALE)
    assert rel_err(got.double(), want) < 1e-5
    assert torch.all(got[1] == 0)


def test_sparse_mqa_dense_reference_vs_naive():
    gen = torch.Generator().manual_seed(2)
    T, H, E = 5, 4, 30
    kv = torch.randn(E, 512, generator=gen).bfloat16()
    q = torch.randn(T, H, 512, generator=gen).bfloat16()
    sink = torch.randn(H, generator=gen) * 2
    idx = make_indices(T, 17, E, gen, all_masked_row=4)
    got = smqa_ref.sparse_mqa_dense_torch(q, kv, idx, sink, SCALE)
    want = naive_attention(q, lambda li, ids: kv[ids].float(), [idx], sink, SCALE)
    assert rel_err(got.double(), want) < 1e-5


def test_global_indices_from_page_table():
    N = 4
    pt = torch.tensor([[7, 2, 5], [1, 0, 3]], dtype=torch.int32)
    local = torch.tensor([[0, 5, 11, -1], [3, 4, -1, 9]], dtype=torch.int32)
    req = torch.tensor([0, 1])
    got = smqa.global_indices_from_page_table(local, req, pt, N)
    want = [[7 * 4 + 0, 2 * 4 + 1, 5 * 4 + 3, -1], [1 * 4 + 3, 0 * 4 + 0, -1, 3 * 4 + 1]]
    assert got.dtype == torch.int32 and got.tolist() == want


# ---------------------------------------------------------------------------------------------
# sparse MQA kernels vs references
# ---------------------------------------------------------------------------------------------

@triton_ok
@pytest.mark.parametrize("T,H,K,block_h,block_k,split_d,qdtype", [
    (5, 4, 40, 16, 16, 1, torch.float32),     # heads padded to 16, 3 key tiles (last partial)
    (3, 24, 33, 16, 32, 2, torch.float32),    # 2 head blocks (2nd partial), NoPE/RoPE halves
    (4, 16, 20, 16, 16, 4, torch.bfloat16),   # 4 column quarters
])
def test_sparse_mqa_fp8_kernel(T, H, K, block_h, block_k, split_d, qdtype):
    gen = torch.Generator().manual_seed(3 + T + H)
    N, P = 8, 3
    cache, _ = make_fp8_cache(P, N, gen)
    q = (torch.randn(T, H, 512, generator=gen) * 2).to(DEV, qdtype)
    sink = torch.randn(H, generator=gen).to(DEV)
    idx = make_indices(T, K, P * N, gen, all_masked_row=1).to(DEV)
    prec, tol = prec_and_tol(qdtype)
    got = smqa.sparse_mqa_fp8(q, cache, N, idx, sink, SCALE, block_h=block_h, block_k=block_k,
                              split_d=split_d, precision=prec)
    want = smqa_ref.sparse_mqa_fp8_torch(q, cache, N, idx, sink, SCALE)
    assert got.shape == (T, H, 512) and got.dtype == torch.float32
    assert rel_err(got, want) < tol
    assert torch.all(got[1] == 0), "all-masked row must be exactly zero"


@triton_ok
def test_sparse_mqa_fp8_kernel_two_lists_and_lengths():
    """Window list over one cache + compressed list over another (different N), one softmax."""
    gen = torch.Generator().manual_seed(4)
    T, H = 6, 8
    cache, _ = make_fp8_cache(3, 8, gen)
    cache2, _ = make_fp8_cache(4, 2, gen)        # N = 2: C128-like tiny pages
    q = torch.randn(T, H, 512, generator=gen).to(DEV)
    sink = (torch.randn(H, generator=gen) * 3).to(DEV)
    idx = make_indices(T, 24, 24, gen).to(DEV)
    idx2 = make_indices(T, 10, 8, gen).to(DEV)
    lengths = torch.tensor([24, 0, 5, 17, 16, 1], dtype=torch.int32, device=DEV)
    lengths2 = torch.tensor([10, 0, 3, 10, 0, 7], dtype=torch.int32, device=DEV)
    kw = dict(lengths=lengths, extra_cache=cache2, extra_entries_per_page=2,
              extra_indices=idx2, extra_lengths=lengths2)
    got = smqa.sparse_mqa_fp8(q, cache, 8, idx, sink, SCALE, block_k=16, split_d=2,
                              precision="ieee", **kw)
    want = smqa_ref.sparse_mqa_fp8_torch(q, cache, 8, idx, sink, SCALE, **kw)
    assert rel_err(got, want) < 1e-3
    assert torch.all(got[1] == 0)
    # lengths must really cut the lists: same as masking the tails explicitly
    idx_cut = cut_lengths(idx.cpu(), lengths.cpu()).to(DEV)
    idx2_cut = cut_lengths(idx2.cpu(), lengths2.cpu()).to(DEV)
    alt = smqa.sparse_mqa_fp8(q, cache, 8, idx_cut, sink, SCALE, block_k=16, extra_cache=cache2,
                              extra_entries_per_page=2, extra_indices=idx2_cut,
                              precision="ieee")
    assert rel_err(alt, got) < 1e-5
    full = smqa.sparse_mqa_fp8(q, cache, 8, idx, sink, SCALE, block_k=16, extra_cache=cache2,
                               extra_entries_per_page=2, extra_indices=idx2, precision="ieee")
    assert rel_err(full, got) > 1e-2, "lengths had no effect"


@triton_ok
@pytest.mark.parametrize("sink_value,q_gain", [(40.0, 1.0), (-40.0, 1.0), (0.0, 60.0)])
def test_sparse_mqa_fp8_kernel_extreme_logits(sink_value, q_gain):
    """Huge / tiny sinks and very peaked softmaxes stay finite and match the reference."""
    gen = torch.Generator().manual_seed(5)
    T, H, N = 3, 4, 8
    cache, _ = make_fp8_cache(2, N, gen)
    q = (torch.randn(T, H, 512, generator=gen) * q_gain).to(DEV)
    sink = torch.full((H,), sink_value, device=DEV)
    idx = make_indices(T, 16, 2 * N, gen).to(DEV)
    got = smqa.sparse_mqa_fp8(q, cache, N, idx, sink, SCALE, block_k=16, precision="ieee")
    want = smqa_ref.sparse_mqa_fp8_torch(q, cache, N, idx, sink, SCALE)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() <= 1e-3 * want.abs().max() + 1e-20


@triton_ok
@pytest.mark.parametrize("kv_dtype,qdtype,split_d", [(torch.bfloat16, torch.bfloat16, 1),
                                                     (torch.float32, torch.float32, 2)])
def test_sparse_mqa_dense_kernel(kv_dtype, qdtype, split_d):
    gen = torch.Generator().manual_seed(6)
    T, H, E = 5, 12, 50
    kv = torch.randn(E, 512, generator=gen).to(DEV, kv_dtype)
    kv2 = torch.randn(9, 512, generator=gen).to(DEV, kv_dtype)
    q = torch.randn(T, H, 512, generator=gen).to(DEV, qdtype)
    sink = torch.randn(H, generator=gen).to(DEV)
    idx = make_indices(T, 37, E, gen, all_masked_row=3).to(DEV)
    idx2 = make_indices(T, 4, 9, gen).to(DEV)
    idx2[3] = -1
    prec, tol = prec_and_tol(qdtype)
    got = smqa.sparse_mqa_dense(q, kv, idx, sink, SCALE, block_k=16, extra_kv=kv2,
                                extra_indices=idx2, split_d=split_d, precision=prec)
    want = smqa_ref.sparse_mqa_dense_torch(q, kv, idx, sink, SCALE, extra_kv=kv2, extra_indices=idx2)
    assert rel_err(got, want) < tol
    assert torch.all(got[3] == 0)


@triton_ok
@pytest.mark.parametrize("cfg", [
    dict(impl="v3", block_h=32, block_k=16, kv_splits=3),         # flash-decoding + combine
    dict(impl="v3", block_h=16, block_k=32, kv_splits=4),         # splits with no keys
])
def test_sparse_mqa_fp8_kernel_split_kv(cfg):
    """Split-KV: two lists over two caches (different N), lengths, masked ids, an all-masked
    token, heads not a multiple of BLOCK_H, splits left without keys."""
    gen = torch.Generator().manual_seed(7)
    T, H = 5, 20
    cache, _ = make_fp8_cache(3, 8, gen)
    cache2, _ = make_fp8_cache(4, 2, gen)
    q = (torch.randn(T, H, 512, generator=gen) * 2).to(DEV)
    sink = (torch.randn(H, generator=gen) * 2).to(DEV)
    idx = make_indices(T, 37, 24, gen, all_masked_row=1).to(DEV)
    idx2 = make_indices(T, 11, 8, gen, all_masked_row=1).to(DEV)
    lengths = torch.tensor([37, 30, 0, 20, 36], dtype=torch.int32, device=DEV)
    kw = dict(lengths=lengths, extra_cache=cache2, extra_entries_per_page=2, extra_indices=idx2)
    got = smqa.sparse_mqa_fp8(q, cache, 8, idx, sink, SCALE, precision="ieee", **kw, **cfg)
    want = smqa_ref.sparse_mqa_fp8_torch(q, cache, 8, idx, sink, SCALE, **kw)
    assert got.shape == (T, H, 512) and got.dtype == torch.float32
    assert rel_err(got, want) < 1e-3
    assert torch.all(got[1] == 0), "all-masked row must be exactly zero"


@triton_ok
@pytest.mark.parametrize("cfg", [
    dict(impl="v3", block_h=16, block_k=16),                      # 2 head blocks, one loop a+b
    dict(impl="v3", block_h=32, block_k=32, kv_splits=3),         # splits straddle the lists
    dict(impl="v3", block_h=16, block_k=16, kv_splits=5),         # more splits than some tiles
    dict(impl="v3", block_h=16, block_k=16, early_decode=True),   # chunks decoded up front
    dict(impl="v3", block_h=32, block_k=32, kv_splits=2, early_decode=True),
    dict(impl="v3", block_h=16, block_k=16, precision="fp16"),    # fp16 MMA operands
])
@pytest.mark.parametrize("n2", [2, 3])                            # pow2 (shift) / general N
def test_sparse_mqa_fp8_kernel_v3(cfg, n2):
    """v3 (sparse_mqa_v3.py): two lists over two caches (the second's N a power of two or not),
    lengths cutting lists (one token with none in list a, T not a multiple of anything), masked
    ids, an all-masked token, an empty second list for one token, heads not a multiple of
    BLOCK_H, fp32 q."""
    gen = torch.Generator().manual_seed(11)
    T, H = 5, 20
    cache, _ = make_fp8_cache(3, 8, gen)
    cache2, _ = make_fp8_cache(4, n2, gen)
    q = (torch.randn(T, H, 512, generator=gen) * 2).to(DEV)
    sink = (torch.randn(H, generator=gen) * 2).to(DEV)
    idx = make_indices(T, 37, 24, gen, all_masked_row=1).to(DEV)
    idx2 = make_indices(T, 11, 4 * n2, gen, all_masked_row=1).to(DEV)
    lengths = torch.tensor([37, 30, 0, 20, 36], dtype=torch.int32, device=DEV)
    lengths2 = torch.tensor([11, 11, 7, 0, 3], dtype=torch.int32, device=DEV)
    kw = dict(lengths=lengths, extra_cache=cache2, extra_entries_per_page=n2,
              extra_indices=idx2, extra_lengths=lengths2)
    cfg = {"precision": "ieee", **cfg}
    got = smqa.sparse_mqa_fp8(q, cache, 8, idx, sink, SCALE, **kw, **cfg)
    want = smqa_ref.sparse_mqa_fp8_torch(q, cache, 8, idx, sink, SCALE, **kw)
    assert got.shape == (T, H, 512) and got.dtype == torch.float32
    assert rel_err(got, want) < (1e-3 if cfg["precision"] == "ieee" else 1e-2)  # fp16 q, P
    assert torch.all(got[1] == 0), "all-masked row must be exactly zero"
    assert smqa.LAST_LAUNCH["config"]["impl"] == "v3"


@triton_ok
@pytest.mark.parametrize("cfg,dtype", [(dict(impl="v3", block_h=16, block_k=16, kv_splits=3),
                                        torch.bfloat16),
                                       (dict(impl="v3", block_h=16, block_k=16, kv_splits=2),
                                        torch.float32),
                                       (dict(impl="v3", block_h=16, block_k=16), torch.bfloat16),
                                       (dict(impl="v1", block_k=16), torch.float32)])
def test_sparse_mqa_fp8_inverse_rope_in_combine(cfg, dtype, monkeypatch):
    """rope=(cis, positions, dtype): the output equals norm_rope's inverse RoPE of the plain
    output, bit for bit (in the split-KV combine launch; without splits norm_rope follows), the
    combine's head blocks not a multiple of H."""
    from dspark.kernels.norm_rope import norm_rope
    monkeypatch.setattr(smqa, "COMBINE_BLOCK_H", 8)        # head blocks not dividing H
    gen = torch.Generator().manual_seed(13)
    T, H, N, R = 3, 20, 8, 64
    cache, _ = make_fp8_cache(4, N, gen)
    q = torch.randn(T, H, 512, generator=gen).to(DEV, torch.bfloat16)
    sink = torch.randn(H, generator=gen).to(DEV)
    idx = make_indices(T, 29, 4 * N, gen).to(DEV)
    ang = torch.rand(40, R // 2, generator=gen) * 6.3
    cis = torch.polar(torch.ones_like(ang), -ang).to(DEV)            # conjugated rotations
    pos = torch.tensor([7, 39, 0], device=DEV)
    plain = smqa.sparse_mqa_fp8(q, cache, N, idx, sink, SCALE, **cfg)
    want = norm_rope(plain, cis=cis, rope_dim=R, dtype=dtype, positions=pos)
    got = smqa.sparse_mqa_fp8(q, cache, N, idx, sink, SCALE, rope=(cis, pos, dtype), **cfg)
    assert got.dtype == dtype and got.shape == (T, H, 512)
    assert torch.equal(got, want)
    assert not torch.equal(got[..., -R:].float(), plain[..., -R:].to(dtype).float())


@triton_ok
def test_sparse_mqa_fp8_kernel_v3_single_list_bf16():
    """v3 with one list only (no extra cache), bf16 q, T = 3 (not a multiple of the tiles)."""
    gen = torch.Generator().manual_seed(12)
    T, H, N = 3, 16, 8
    cache, _ = make_fp8_cache(4, N, gen)
    q = torch.randn(T, H, 512, generator=gen).to(DEV, torch.bfloat16)
    sink = torch.randn(H, generator=gen).to(DEV)
    idx = make_indices(T, 21, 4 * N, gen, all_masked_row=2).to(DEV)
    prec, tol = prec_and_tol(torch.bfloat16)
    got = smqa.sparse_mqa_fp8(q, cache, N, idx, sink, SCALE, impl="v3", block_h=16,
                              block_k=16, precision=prec)
    want = smqa_ref.sparse_mqa_fp8_torch(q, cache, N, idx, sink, SCALE)
    assert rel_err(got, want) < tol
    assert torch.all(got[2] == 0)


@triton_ok
@pytest.mark.parametrize("cfg", [dict(impl="v1", split_d=2),
                                 dict(impl="v3", kv_splits=2),
                                 dict(impl="v3", early_decode=True)])
def test_sparse_mqa_dense_kernel_configs(cfg):
    gen = torch.Generator().manual_seed(8)
    T, H, E = 4, 12, 50
    kv = torch.randn(E, 512, generator=gen).to(DEV)
    kv2 = torch.randn(9, 512, generator=gen).to(DEV)
    q = torch.randn(T, H, 512, generator=gen).to(DEV)
    sink = torch.randn(H, generator=gen).to(DEV)
    idx = make_indices(T, 37, E, gen, all_masked_row=3).to(DEV)
    idx2 = make_indices(T, 4, 9, gen, all_masked_row=3).to(DEV)
    got = smqa.sparse_mqa_dense(q, kv, idx, sink, SCALE, block_k=16, extra_kv=kv2,
                                extra_indices=idx2, precision="ieee", **cfg)
    want = smqa_ref.sparse_mqa_dense_torch(q, kv, idx, sink, SCALE, extra_kv=kv2, extra_indices=idx2)
    assert rel_err(got, want) < 1e-3
    assert torch.all(got[3] == 0)


def test_sparse_mqa_default_config_table(monkeypatch):
    """No knobs + bf16 + H >= 64: the DEFAULT_CONFIGS row for T; any knob: heuristic + knobs."""
    few = dict(impl="v3", block_h=64, block_k=32, split_d=1, kv_splits=2, num_warps=4,
               num_stages=2)
    many = dict(impl="v3", block_h=64, block_k=64, split_d=1, kv_splits=1, num_warps=8,
                num_stages=1, maxnreg=None)
    monkeypatch.setattr(smqa, "DEFAULT_CONFIGS", [(32, few), (None, many)])
    new = dict(early_decode=False, fp16_operands=False)              # v3 knobs, default values
    assert smqa._resolve_config(32, 64, "bf16", {}) == {**few, "maxnreg": None, **new}
    assert smqa._resolve_config(33, 64, "bf16", {}) == {**many, **new}
    # fp32 operands / few heads / any explicit knob: the heuristic, knobs on top
    assert smqa._resolve_config(8, 64, "ieee", {})["block_k"] == 32
    assert smqa._resolve_config(8, 16, "bf16", {})["impl"] == "v1"
    cfg = smqa._resolve_config(8, 64, "bf16", dict(impl="v1", split_d=2, block_k=None))
    assert cfg["impl"] == "v1" and cfg["split_d"] == 2 and cfg["kv_splits"] == 1
    with pytest.raises(AssertionError):
        smqa._resolve_config(8, 64, "bf16", dict(impl="v1", split_d=3))
    with pytest.raises(AssertionError):
        smqa._resolve_config(8, 64, "bf16", dict(kv_splits=2))      # v1 has no split-KV
    with pytest.raises(AssertionError):
        smqa._resolve_config(8, 64, "bf16", dict(impl="v2"))        # no such kernel
    cfg = smqa._resolve_config(8, 64, "bf16", dict(impl="v3", block_k=32, num_stages=2))
    assert cfg["impl"] == "v3" and cfg["split_d"] == 1 and cfg["kv_splits"] == 1
    with pytest.raises(AssertionError):
        smqa._resolve_config(8, 64, "bf16", dict(impl="v3", split_d=2))
    with pytest.raises(AssertionError):
        smqa._resolve_config(8, 64, "bf16", dict(impl="v1", early_decode=True))
    for bound, row in smqa.DEFAULT_CONFIGS:                          # shipped rows are valid
        smqa._resolve_config(1, 64, "bf16", dict(row))


# ---------------------------------------------------------------------------------------------
# cache writes: byte-identical to the torch layout writers
# ---------------------------------------------------------------------------------------------

def edge_rows(n, dim, gen):
    """Rows that hit the rounding corners: e4m3 ties and subnormals, amax at / just above
    1.75·2^k (scale boundary), all-zero tiles (amax floor), -0.0, fp32 values on bf16 ties."""
    x = torch.randn(n, dim, generator=gen) * torch.logspace(-5, 4, n)[:, None]
    f32 = torch.float32
    # row 0: tile maxima exactly 448·2^k and the next float up (scale e vs e+1)
    x[0] = torch.randn(dim, generator=gen)
    for g in range(dim // 64):
        a = torch.tensor(448.0 * 2.0 ** (g - 3), dtype=f32)
        x[0, g * 64] = a if g % 2 == 0 else torch.nextafter(a, torch.tensor(float("inf")))
    # row 1: e4m3 round-half-even ties (scale 1: amax 448) incl. subnormal-range ties
    ties = torch.tensor([448.0, 1.0625, 1.1875, 2.125, 2.375, 0.0029296875, 0.0048828125,
                         0.0009765625, 0.001953125, 0.0166015625, -1.0625, -0.0029296875])
    x[1] = ties.repeat(dim // len(ties) + 1)[:dim]
    # row 2: zeros (amax floor) and negative zeros
    x[2] = 0.0
    x[2, 1::2] = -0.0
    # row 3: exact bf16 ties in fp32 (bit 15 set, lower bits clear) -> RNE to even
    mant = torch.randint(0, 1 << 7, (dim,), generator=gen, dtype=torch.int32)
    x[3] = (0x3F800000 | (mant << 16) | 0x8000).view(torch.float32)     # values in [1, 2)
    x[3, 1::2] *= -1
    # row 4: tiny values that become e4m3 subnormals next to a large one in the same tile
    x[4] = torch.randn(dim, generator=gen) * 1e-3
    x[4, ::64] = 300.0
    return x


@triton_ok
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_fp8_ds_mla_triton_byte_identical(dtype):
    gen = torch.Generator().manual_seed(7)
    N, P, n = 4, 4, 12
    x = edge_rows(n, 512, gen).to(dtype)
    slots = torch.randperm(P * N, generator=gen)[:n]
    base = torch.randint(0, 256, (P, L.fp8_ds_mla_page_bytes(N)), generator=gen, dtype=torch.uint8)
    want = base.clone()
    L.write_fp8_ds_mla(want, N, slots, x)
    got = base.clone().to(DEV)
    cw.write_fp8_ds_mla_triton(got, N, slots.to(DEV), x.to(DEV))
    diff = (got.cpu() != want).nonzero()
    assert diff.numel() == 0, f"{len(diff)} bytes differ, first at {diff[:4].tolist()}"
    # negative slots are skipped: cache unchanged
    again = got.clone()
    cw.write_fp8_ds_mla_triton(again, N, torch.full((n,), -1, device=DEV), x.to(DEV))
    assert torch.equal(again, got)


@triton_ok
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_ds_mla_roundtrip_triton_bit_identical(dtype):
    """The one-launch storage rounding (QuantSim.kv on CUDA) == the record round trip and the
    torch QuantSim formula, bit for bit, on the edge rows (ties, zeros, subnormal codes) plus
    random rows of widely different magnitudes, for a [.., 2, 512] shaped input."""
    from dspark.runner import QuantSim
    gen = torch.Generator().manual_seed(11)
    x = torch.cat([edge_rows(5, 512, gen),
                   torch.randn(7, 512, generator=gen) * torch.logspace(-6, 4, 7)[:, None]])
    x = x.to(dtype).view(6, 2, 512)
    want = L.fp8_ds_mla_roundtrip(x.to(DEV)).cpu()           # the torch formula, same device
    got = cw.fp8_ds_mla_roundtrip_triton(x.to(DEV)).cpu()
    assert got.dtype == dtype and got.shape == x.shape
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    bad = (got.view(bits) != want.view(bits)).nonzero()
    assert bad.numel() == 0, (f"{len(bad)} values differ, e.g. at {bad[:3].tolist()}: got "
                              f"{[got[tuple(i)].item() for i in bad[:3]]}, want "
                              f"{[want[tuple(i)].item() for i in bad[:3]]}, input "
                              f"{[x[tuple(i)].item() for i in bad[:3]]}")
    assert torch.equal(QuantSim().kv(x), L.fp8_ds_mla_roundtrip(x))   # CPU: the torch formula


@triton_ok
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_indexer_fp8_triton_byte_identical(dtype):
    gen = torch.Generator().manual_seed(8)
    N, P, n = 8, 3, 10
    x = edge_rows(n, 128, gen).to(dtype)
    slots = torch.randperm(P * N, generator=gen)[:n]
    base = torch.randint(0, 256, (P, L.indexer_page_bytes(N)), generator=gen, dtype=torch.uint8)
    want = base.clone()
    L.write_indexer_fp8(want, N, slots, x)
    got = base.clone().to(DEV)
    slots_skip = slots.clone()
    slots_skip[2] = -1
    cw.write_indexer_fp8_triton(got, N, slots.to(DEV), x.to(DEV))
    assert torch.equal(got.cpu(), want)
    got2 = base.clone().to(DEV)
    cw.write_indexer_fp8_triton(got2, N, slots_skip.to(DEV), x.to(DEV))
    want2 = base.clone()
    keep = slots_skip >= 0
    L.write_indexer_fp8(want2, N, slots[keep], x[keep])
    assert torch.equal(got2.cpu(), want2)


# ---------------------------------------------------------------------------------------------
# lightning indexer
# ---------------------------------------------------------------------------------------------

def make_indexer_case(gen, T=6, HI=8, N=8, num_pages=10, R=3, max_pages=3, device=DEV,
                      relu_ties=False):
    keys = torch.randn(num_pages * N, 128, generator=gen)
    q = torch.randn(T, HI, 128, generator=gen)
    w = torch.randn(T, HI, generator=gen)
    if relu_ties:  # every even entry gets q·k < 0 for all heads -> score exactly 0 (tied)
        keys[::2] = keys[::2].abs()
        q, w = -q.abs(), w.abs()
    cache = torch.zeros(num_pages, L.indexer_page_bytes(N), dtype=torch.uint8)
    L.write_indexer_fp8(cache, N, torch.arange(num_pages * N), keys)
    page_table = torch.randperm(num_pages, generator=gen)[: R * max_pages].view(R, max_pages)
    page_table = page_table.to(torch.int32)
    req = torch.randint(0, R, (T,), generator=gen)
    valid = torch.randint(0, max_pages * N + 1, (T,), generator=gen, dtype=torch.int32)
    valid[0] = 0
    valid[-1] = max_pages * N
    args = [q, w, cache, N, req, page_table, valid]
    return [a.to(device) if torch.is_tensor(a) else a for a in args]


def naive_indexer_scores(q, w, cache, N, req, page_table, valid):
    T = q.shape[0]
    n_cols = page_table.shape[1] * N
    out = torch.full((T, n_cols), float("-inf"), dtype=torch.float64)
    for t in range(T):
        for j in range(int(valid[t])):
            slot = int(page_table[req[t], j // N]) * N + j % N
            k = L.read_indexer_fp8(cache, N, torch.tensor([slot]))[0].double()
            out[t, j] = (w[t].double() * torch.relu(q[t].double() @ k)).sum()
    return out


def check_selection(sel, scores_ref, valid, topk):
    """sel int32 [T, topk] vs reference scores: right count of −1, unique visible entries, and
    the multiset of selected reference scores equal to the best possible (ties don't matter)."""
    for t in range(sel.shape[0]):
        row = sel[t].tolist()
        n_vis = int(valid[t])
        picked = [j for j in row if j >= 0]
        assert len(picked) == min(topk, n_vis)
        assert row.count(-1) == topk - len(picked)
        assert len(set(picked)) == len(picked) and all(j < n_vis for j in picked)
        got = torch.sort(scores_ref[t, picked].double(), descending=True).values
        best = torch.sort(scores_ref[t, :n_vis].double(), descending=True).values[: len(picked)]
        assert torch.allclose(got, best, rtol=1e-4, atol=1e-4), (t, got, best)


def test_indexer_reference_vs_naive():
    gen = torch.Generator().manual_seed(9)
    args = make_indexer_case(gen, device="cpu")
    got = ix.indexer_scores_torch(*args)
    want = naive_indexer_scores(*args)
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin)
    assert torch.allclose(got[fin].double(), want[fin], rtol=1e-5, atol=1e-5)
    topk = 10
    sel = ix.indexer_topk_torch(*args, topk)
    check_selection(sel, want, args[6], topk)


@triton_ok
@pytest.mark.parametrize("relu_ties,qdtype,topk", [(False, torch.float32, 10),
                                                   (True, torch.float32, 20),
                                                   (False, torch.bfloat16, 30)])
def test_indexer_kernel(relu_ties, qdtype, topk):
    gen = torch.Generator().manual_seed(10)
    q, w, cache, N, req, pt, valid = make_indexer_case(gen, relu_ties=relu_ties)
    q = q.to(qdtype)
    args = (q, w, cache, N, req, pt, valid)
    prec = "ieee" if qdtype == torch.float32 else None   # bf16 q x e4m3 keys: exact products
    got = ix.indexer_scores(*args, block_j=16, precision=prec)
    want = ix.indexer_scores_torch(*args)
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin)
    assert rel_err(got[fin], want[fin]) < 1e-4
    if relu_ties:
        # ties straddle the cut: some row selects only part of its zero-score entries
        n_zero = (want == 0).sum(1)
        n_pos = (want > 0).sum(1)
        assert ((n_pos < topk) & (n_pos + n_zero > topk)).any(), "no tie at the top-k boundary"
    sel = ix.indexer_topk(*args, topk, block_j=16, precision=prec)
    assert sel.dtype == torch.int32 and sel.shape == (q.shape[0], topk)
    check_selection(sel.cpu(), want.cpu(), valid.cpu(), topk)


@triton_ok
def test_indexer_kernel_n_cols_bound():
    """n_cols smaller than the page table's capacity (but ≥ every valid count)."""
    gen = torch.Generator().manual_seed(11)
    q, w, cache, N, req, pt, valid = make_indexer_case(gen)
    valid = torch.clamp(valid, max=13)
    got = ix.indexer_topk(q, w, cache, N, req, pt, valid, 5, n_cols=13, block_j=16)
    want_scores = ix.indexer_scores_torch(q, w, cache, N, req, pt, valid)
    check_selection(got.cpu(), want_scores.cpu(), valid.cpu(), 5)


@triton_ok
@pytest.mark.parametrize("T,n,topk", [(3, 40, 16), (2, 100, 128), (2, 20, 300)])
def test_select_topk_ids_kernel_equals_the_stable_sort(T, n, topk, monkeypatch):
    """The one-program-per-row top-k: the stable descending sort's columns in its order (exact
    ties, +0.0 / -0.0 held equal, -inf rows and picks past the row as the -1 tail), its
    counts, and the global ids mapped through a page table; the torch fallback the same."""
    gen = torch.Generator().manual_seed(12)
    s = torch.randn(T, n, generator=gen)
    s = torch.where(torch.rand(T, n, generator=gen) < 0.4, torch.round(s), s)    # many ties
    s[:, ::5] = 0.0
    s[:, 1::7] = -0.0
    s[0, n // 2:] = float("-inf")
    want = ix._select_topk(s, topk)
    N = 8
    pt = torch.randperm(4 * n, generator=gen)[:2 * ((n + N - 1) // N)].view(2, -1).int()
    req = torch.randint(0, 2, (T,), generator=gen).int()
    j = want.long().clamp(min=0)
    want_global = torch.where(want >= 0, pt.long()[req.long()[:, None], j // N] * N + j % N, -1)
    for kernel in (True, False):             # the kernel, then the torch fallback
        dev = DEV if kernel else "cpu"
        monkeypatch.setattr(ix, "_launchable", lambda t, k=kernel: k)
        ids, counts = ix.select_topk_ids(s.to(dev), topk)
        assert torch.equal(ids.cpu(), want)
        assert torch.equal(counts.cpu(), (want >= 0).sum(1).int())
        assert all((ids.cpu()[t, counts[t]:] == -1).all() for t in range(T))
        gids, gcounts = ix.select_topk_ids(s.to(dev), topk, pt.to(dev), req.to(dev), N)
        assert gids.dtype == torch.int32 and torch.equal(gids.cpu().long(), want_global)
        assert torch.equal(gcounts.cpu(), counts.cpu())


# ---------------------------------------------------------------------------------------------
# GPU-sized comparisons (run on the H200)
# ---------------------------------------------------------------------------------------------

@gpu
@needs_cuda
@pytest.mark.parametrize("T", [64, 256])
def test_gpu_sparse_mqa_fp8_realistic(T):
    """V4-Flash: 64 heads, 128 window keys (SWA cache) + 512 compressed keys, 64-entry pages."""
    gen = torch.Generator().manual_seed(12)
    N, H = 64, 64
    swa_pages, c_pages = 2 * T, 8 * T
    swa, _ = make_fp8_cache(swa_pages, N, gen, device="cuda", spread=False)
    comp, _ = make_fp8_cache(c_pages, N, gen, device="cuda", spread=False)
    q = torch.randn(T, H, 512, generator=gen).to("cuda", torch.bfloat16)
    q = q / q.float().pow(2).mean(-1, keepdim=True).sqrt().to(torch.bfloat16)  # per-head RMS-normed
    sink = torch.randn(H, generator=gen).cuda()
    win = make_indices(T, 128, swa_pages * N, gen, p_masked=0.05).cuda()
    top = make_indices(T, 512, c_pages * N, gen, p_masked=0.1, all_masked_row=3).cuda()
    win[3] = -1
    got = smqa.sparse_mqa_fp8(q, swa, N, win, sink, SCALE, extra_cache=comp, extra_indices=top)
    want = smqa_ref.sparse_mqa_fp8_torch(q, swa, N, win, sink, SCALE, extra_cache=comp,
                                     extra_indices=top)
    assert rel_err(got, want) < 2e-2   # bf16 MMA operands (q, P) vs fp32 reference
    assert torch.all(got[3] == 0)
    got32 = smqa.sparse_mqa_fp8(q.float(), swa, N, win, sink, SCALE, extra_cache=comp,
                                extra_indices=top, precision="ieee")
    assert rel_err(got32, want) < 1e-4
    for cfg in (dict(split_d=2), dict(block_k=32, split_d=1), dict(block_h=32, split_d=4),
                dict(impl="v3", block_k=64), dict(impl="v3", block_k=32, num_stages=2),
                dict(impl="v3", block_k=16, num_stages=2), dict(impl="v3", kv_splits=3),
                dict(impl="v3", num_stages=2, early_decode=True),
                dict(impl="v3", block_k=32, num_stages=2, kv_splits=4, early_decode=True),
                dict(impl="v3", num_stages=2, early_decode=True, precision="fp16"),
                dict(impl="v3", block_k=32, num_stages=2, kv_splits=4, precision="fp16")):
        alt = smqa.sparse_mqa_fp8(q, swa, N, win, sink, SCALE, extra_cache=comp,
                                  extra_indices=top, **cfg)
        assert rel_err(alt, want) < 2e-2, cfg


@gpu
@needs_cuda
def test_gpu_sparse_mqa_dense_realistic():
    gen = torch.Generator().manual_seed(13)
    T, H, E = 128, 64, 20000
    kv = torch.randn(E, 512, generator=gen).to("cuda", torch.bfloat16)
    q = torch.randn(T, H, 512, generator=gen).to("cuda", torch.bfloat16)
    sink = torch.randn(H, generator=gen).cuda()
    idx = make_indices(T, 640, E, gen, p_masked=0.1).cuda()
    got = smqa.sparse_mqa_dense(q, kv, idx, sink, SCALE)
    want = smqa_ref.sparse_mqa_dense_torch(q, kv, idx, sink, SCALE)
    assert rel_err(got, want) < 2e-2


@gpu
@needs_cuda
def test_gpu_indexer_realistic():
    gen = torch.Generator().manual_seed(14)
    q, w, cache, N, req, pt, valid = make_indexer_case(
        gen, T=64, HI=64, N=64, num_pages=200, R=8, max_pages=24, device="cuda")
    q = q.to(torch.bfloat16)  # FP4-fake-quantised q is exact in bf16 in the model
    topk = 512
    sel = ix.indexer_topk(q, w, cache, N, req, pt, valid, topk)
    want = ix.indexer_scores_torch(q, w, cache, N, req, pt, valid)
    got = ix.indexer_scores(q, w, cache, N, req, pt, valid)
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin)
    assert rel_err(got[fin], want[fin]) < 1e-3
    check_selection(sel.cpu(), want.cpu(), valid.cpu(), topk)


@gpu
@needs_cuda
def test_gpu_cache_writes_realistic():
    gen = torch.Generator().manual_seed(15)
    N, P, n = 64, 128, 4096
    x = torch.randn(n, 512, generator=gen) * torch.logspace(-4, 3, n)[:, None]
    slots = torch.randperm(P * N, generator=gen)[:n]
    want = torch.zeros(P, L.fp8_ds_mla_page_bytes(N), dtype=torch.uint8, device="cuda")
    got = want.clone()
    L.write_fp8_ds_mla(want, N, slots.cuda(), x.cuda())
    cw.write_fp8_ds_mla_triton(got, N, slots.cuda(), x.cuda())
    assert torch.equal(got, want)
    want = torch.zeros(P, L.indexer_page_bytes(N), dtype=torch.uint8, device="cuda")
    got = want.clone()
    L.write_indexer_fp8(want, N, slots.cuda(), x[:, :128].cuda())
    cw.write_indexer_fp8_triton(got, N, slots.cuda(), x[:, :128].cuda())
    assert torch.equal(got, want)
