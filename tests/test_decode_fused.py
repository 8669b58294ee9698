"""Small fused decode kernels (dspark/kernels/decode_fused.py) against their torch definitions:
the shared expert's SwiGLU (moe.clamped_swiglu + cast) and the compressor's candidate-entry
gather + gated pool of the fixed-shape V4 step (graph._gather_pool_torch); CPU runs the kernels in
the Triton interpreter."""
import triton_env  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch
from types import SimpleNamespace

from dspark.models.deepseek_v4 import norm as N
from dspark.models.deepseek_v4.moe import Expert, clamped_swiglu
from triton_env import DEV, needs_cuda, triton_ok


def close(got, want, ulp):
    """Equal up to one rounding step of the output dtype (the exp implementations differ by
    fp32 ulps), and equal on most elements when that dtype is bf16."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.double(), want.double()
    assert torch.isfinite(g).all()
    assert ((g - w).abs() <= ulp * w.abs() + 1e-6).all(), (g - w).abs().max()
    assert (g != w).double().mean() <= (0.02 if want.dtype == torch.bfloat16 else 1.0)


@triton_ok
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("limit", [7.0, 0.0])
def test_swiglu(dtype, limit):
    from dspark.kernels.decode_fused import swiglu
    torch.manual_seed(0)
    gu = (torch.randn(3, 2 * 1100) * 6).to(dtype).to(DEV)
    g, u = gu.split(1100, dim=-1)                  # strided rows, as views of one GEMM output
    want = clamped_swiglu(g.float(), u.float(), limit).to(dtype)
    close(swiglu(g, u, limit), want, 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5)


@triton_ok
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_with_routing_weights(dtype):
    """The dense draft MoE's form: [T, E·I] columns of E experts, each row's expert group scaled
    by its routing weight (0 off the route) before the cast, as clamped_swiglu over [T, E, I]."""
    from dspark.kernels.decode_fused import swiglu
    torch.manual_seed(2)
    T, E, I = 5, 8, 160                              # E·I = 1280: two column blocks
    gu = (torch.randn(T, 2 * E * I) * 6).to(dtype).to(DEV)
    g, u = gu[:, :E * I], gu[:, E * I:]
    route = torch.zeros(T, E, device=DEV).scatter_(1, torch.randint(0, E, (T, 2), device=DEV),
                                                   torch.rand(T, 2, device=DEV) + 0.1)
    want = clamped_swiglu(g.float().view(T, E, I), u.float().view(T, E, I), 7.0,
                          route).to(dtype).flatten(1)
    got = swiglu(g, u, 7.0, route)
    close(got, want, 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5)
    assert torch.equal(got == 0, want == 0)          # off-route experts give exact zeros
    assert (want != 0).any(1).all()


@triton_ok
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_with_expert_pairs_and_shared_columns(dtype):
    """The merged draft MoE's form: [T, E·I + S] columns (E routed experts of I, then S shared
    columns), the routing given as the gate's (expert, weight) pairs: a routed expert's columns
    scaled by its pair's weight (0 where the row does not route to it), the shared ones by 1;
    against clamped_swiglu over the weights scattered into [T, E] and the unweighted shared
    part."""
    from dspark.kernels.decode_fused import swiglu
    torch.manual_seed(3)
    T, E, I, S, k = 6, 8, 160, 96, 2                 # 1376 columns: two column blocks
    N = E * I + S
    gu = (torch.randn(T, 2 * N) * 6).to(dtype).to(DEV)
    g, u = gu[:, :N], gu[:, N:]
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(DEV)
    w = (torch.rand(T, k) + 0.1).to(DEV)
    route = torch.zeros(T, E, device=DEV).scatter_(1, idx, w)
    routed = clamped_swiglu(g[:, :E * I].float().view(T, E, I), u[:, :E * I].float().view(T, E, I),
                            7.0, route).flatten(1)
    shared = clamped_swiglu(g[:, E * I:].float(), u[:, E * I:].float(), 7.0)
    want = torch.cat([routed, shared], 1).to(dtype)
    got = swiglu(g, u, 7.0, w, experts=idx, group=I, routed=E)
    close(got, want, 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5)
    assert torch.equal(got == 0, want == 0)          # off-route experts give exact zeros
    assert (got[:, :E * I].view(T, E, I) != 0).any(2).sum(1).eq(k).all()    # k experts per row
    assert (got[:, E * I:] != 0).any(1).all()        # the shared columns are never dropped
    # the same columns through the dense weights (no shared part): the same values
    dense = swiglu(g[:, :E * I], u[:, :E * I], 7.0, route)
    assert torch.equal(got[:, :E * I], dense)


@triton_ok
def test_expert_module_fused_equals_reference():
    torch.manual_seed(1)
    e = Expert(64, 96, 7.0).to(torch.bfloat16).to(DEV)
    x = torch.randn(2, 64).to(torch.bfloat16).to(DEV)
    old = N.NORM_BACKEND
    try:
        with torch.no_grad():
            N.NORM_BACKEND = "reference"
            want = e(x)
            N.NORM_BACKEND = "triton"
            got = e(x)
    finally:
        N.NORM_BACKEND = old
    close(got, want, 2.0 ** -6)


def _pool_plan(E, S, T, ring_rows_below):
    """RatioStatic-like pooling fields of E = 5 candidates x S slots: random ring / fresh rows,
    entry 0's empty A-half, candidate 2 unused with nothing before it."""
    rp = SimpleNamespace(
        from_ring=torch.rand(E, S, device=DEV) < 0.5,
        ring_rows=torch.randint(0, ring_rows_below, (E, S), device=DEV),
        fresh_rows=torch.randint(0, T, (E, S), device=DEV),
        before_zero=torch.zeros(E, S, dtype=torch.bool, device=DEV),
        emit_valid=torch.tensor([True, True, False, True, True], device=DEV))
    rp.before_zero[0, :S // 2] = True              # entry 0's empty A-half
    rp.before_zero[2, :] = True                    # an unused candidate with nothing before it
    return rp


@triton_ok
@pytest.mark.parametrize("ratio,overlap", [(4, True), (16, False), (4, False), (128, False)])
def test_gather_pool(ratio, overlap):
    from dspark.kernels.decode_fused import gather_pool
    from dspark.models.deepseek_v4.static_forward import _gather_pool_torch
    torch.manual_seed(ratio + overlap)
    d, c = 40, 2 if overlap else 1
    S, E, T, R = c * ratio, 5, 6, 3 * ratio
    full = torch.randn(T, 2 * c * d, device=DEV)
    a = full[:, :c * d]                            # a view with row stride 2·c·d, as comp.rows
    z = torch.randn(T, c * d, device=DEV) * 2
    ring_a = torch.randn(R, c * d, device=DEV)
    ring_z = torch.randn(R, c * d, device=DEV) * 2
    rp = _pool_plan(E, S, T, R)
    comp = SimpleNamespace(ratio=ratio, out_dim=d, overlap=overlap)
    want = _gather_pool_torch(comp, ring_a, ring_z, a, z, rp)
    got = gather_pool(ring_a, ring_z, a, z, rp.from_ring, rp.ring_rows, rp.fresh_rows,
                      rp.before_zero, rp.emit_valid, ratio, d)
    assert got.shape == want.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@triton_ok
@pytest.mark.parametrize("ratio", [4, 128])
def test_gather_pool_ape_and_persist(ratio):
    """The fused form of graph._emit: z rows without their ape term (Compressor.rows_raw), the
    kernel adds ape[pos % m] to the rows it reads from this forward and writes every token row
    into the rings, as `rows` + the pool + two index_copy_ (ring rows read and written are
    disjoint, as the plan guarantees)."""
    from dspark.kernels.decode_fused import gather_pool
    from dspark.models.deepseek_v4.static_forward import _gather_pool_torch
    torch.manual_seed(100 + ratio)
    overlap = ratio == 4
    d, c = 40, 2 if overlap else 1
    S, E, T, R = c * ratio, 5, 6, 3 * ratio
    full = torch.randn(T, 2 * c * d, device=DEV)
    a, z_raw = full.split(c * d, dim=-1)           # strided views of one GEMM output, as rows_raw
    ape = torch.randn(ratio, c * d, device=DEV).to(torch.bfloat16).float()
    positions = torch.tensor([0, 3, ratio - 1, ratio, 5 * ratio + 2, 7], device=DEV)
    persist_dst = torch.randperm(T, device=DEV) + (R - T)     # the last T ring rows
    ring_a0 = torch.randn(R, c * d, device=DEV)
    ring_z0 = torch.randn(R, c * d, device=DEV) * 2
    rp = _pool_plan(E, S, T, R - T)                 # ring rows read: never a persisted row
    comp = SimpleNamespace(ratio=ratio, out_dim=d, overlap=overlap)
    z = z_raw + ape[positions % ratio]             # Compressor.rows
    want = _gather_pool_torch(comp, ring_a0, ring_z0, a, z, rp)
    want_a = ring_a0.clone().index_copy_(0, persist_dst, a)
    want_z = ring_z0.clone().index_copy_(0, persist_dst, z)
    ring_a, ring_z = ring_a0.clone(), ring_z0.clone()
    args = (rp.from_ring, rp.ring_rows, rp.fresh_rows, rp.before_zero, rp.emit_valid, ratio, d)
    got = gather_pool(ring_a, ring_z, a, z_raw, *args, ape=ape, positions=positions,
                      persist_dst=persist_dst)
    assert got.shape == want.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the in-kernel ape add is the same single fp32 add: bit-identical to pooling rows() output
    assert torch.equal(got, gather_pool(ring_a0, ring_z0, a, z, *args))
    assert torch.equal(ring_a, want_a) and torch.equal(ring_z, want_z)


@triton_ok
@pytest.mark.parametrize("n,scale", [(3, 1.0), (37, 1e-3), (20, 300.0),
                                     pytest.param(5001, 1.0, marks=needs_cuda)])  # 4-row blocks
def test_hadamard_fp4(n, scale):
    from dspark.kernels.decode_fused import hadamard_fp4
    from dspark.formats.layouts import fp4_roundtrip, hadamard128
    torch.manual_seed(n)
    x = torch.randn(n, 2, 128, device=DEV) * scale
    x[0, 0] = 0.0                                  # an all-zero row: the amax floor
    x[1, 1, :32] *= 1e-30                          # a tiny block
    want = fp4_roundtrip(hadamard128(x.float()))
    got = hadamard_fp4(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    # only the order of the Hadamard sums differs: a value on a rounding boundary may move one
    # FP4 step; nearly all are equal
    assert (got != want).double().mean() <= 0.01
    assert (got - want).abs().max() <= (want.abs().amax() / 4 + 1e-30)


@triton_ok
def test_hadamard_fp4_exact_on_grid():
    """Inputs whose Hadamard sums are exact in any order (quarters): the transform differs
    only by the one shared 1/sqrt(128) multiply, so the FP4 round trip (ties included) must be
    identical. (H g / sqrt(128) inputs are not: they are rounded, and ties then fall either way.)"""
    from dspark.kernels.decode_fused import hadamard_fp4
    from dspark.formats.layouts import fp4_roundtrip, hadamard128
    torch.manual_seed(3)
    x = torch.randint(-12, 13, (9, 128), device=DEV).float() * 0.25
    want = fp4_roundtrip(hadamard128(x))
    assert torch.equal(hadamard_fp4(x), want)


@triton_ok
@pytest.mark.parametrize("hashed", [False, True])
def test_gate_route(hashed):
    from dspark.models.deepseek_v4.moe import Gate
    torch.manual_seed(5 + hashed)
    g = Gate(64, 48, 6, 2.5, hash_vocab=100 if hashed else 0).to(DEV)
    with torch.no_grad():
        g.weight.copy_(torch.randn(48, 64) * 0.5)
        if hashed:
            g.tid2eid.copy_(torch.stack([torch.randperm(48)[:6] for _ in range(100)]))
        else:
            g.bias.copy_(torch.randn(48) * 0.1)
    x = (torch.randn(5, 64) * 3).to(DEV)
    x[0] *= 20                                     # logits past the softplus threshold
    tok = torch.randint(0, 100, (5,), device=DEV)
    old = N.NORM_BACKEND
    try:
        with torch.no_grad():
            N.NORM_BACKEND = "reference"
            want_i, want_w = g(x, tok)
            N.NORM_BACKEND = "triton"
            got_i, got_w = g(x, tok)
    finally:
        N.NORM_BACKEND = old
    assert got_i.dtype == torch.long and torch.equal(got_i, want_i)
    torch.testing.assert_close(got_w, want_w, rtol=2e-6, atol=1e-7)


@triton_ok
def test_copy_records():
    from dspark.kernels.decode_fused import copy_records
    from dspark.formats.layouts import DATA_ROW_BYTES, SCALE_ROW_BYTES
    from dspark.kvcache.paged import copy_rows
    per_page, pages = 4, 6
    page_bytes = per_page * (DATA_ROW_BYTES + SCALE_ROW_BYTES) + 32      # padded pages
    torch.manual_seed(7)
    pool = torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8, device=DEV)
    src = torch.tensor([0, 1, 2], device=DEV)            # staging rows (page 0)
    dst = torch.tensor([13, 22, 7], device=DEV)          # ring rows elsewhere
    split = torch.stack([src // per_page, src % per_page, dst // per_page, dst % per_page])
    want = pool.clone()
    copy_rows(want, per_page, src, dst, split)
    copy_records(pool, per_page, split)
    assert torch.equal(pool, want)
