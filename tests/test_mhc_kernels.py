"""Fused mHC kernels (dspark/kernels/mhc.py) against the torch reference in
dspark/models/deepseek_v4/mhc.py, and the dispatch between them.

Without CUDA the kernels run under TRITON_INTERPRET=1 (set by conftest.py before triton is
imported) at small shapes; GPU-sized cases are marked ``gpu`` and skipped without CUDA.
Mixing math is fp32 in both, so post/comb and fp32 outputs agree to fp32 rounding (~1e-7
relative, 1e-5 asserted); bf16 outputs agree exactly or by one bf16 step where the fp32 value
sits on a rounding boundary.
"""
from triton_env import DEV, gpu, needs_cuda, triton_ok  # noqa: F401 (before triton)

import pytest  # noqa: E402
import torch  # noqa: E402

import dspark.kernels.mhc as kernels  # noqa: E402
import dspark.models.deepseek_v4.mhc as mhc  # noqa: E402
HC_EPS, NORM_EPS, ITERS = 1e-6, 1e-6, 20


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def make_case(T, n, D, dtype, seed=0, device=DEV):
    """Random mHC inputs at the scale of a trained model: |mu| ~ 1, so sigmoids and the comb
    softmax are neither saturated nor uniform."""
    gen = torch.Generator().manual_seed(seed)
    rows = (2 + n) * n
    X = (torch.randn(T, n, D, generator=gen) * 2).to(dtype)
    fn = torch.randn(rows, n * D, generator=gen) / (n * D) ** 0.5
    base = torch.randn(rows, generator=gen) * 0.5
    scale = torch.rand(3, generator=gen) + 0.5
    head_fn = torch.randn(n, n * D, generator=gen) / (n * D) ** 0.5
    o = torch.randn(T, D, generator=gen).to(dtype)
    return [t.to(device) for t in (X, fn, base, scale, head_fn, o)]


def assert_out_close(got, want):
    """fp32: 1e-5 relative; bf16: at most one bf16 step anywhere, where an element that
    cancels to near zero may also differ by the fp32 summation-order noise (1e-5 of the scale:
    at GPU sizes, T*D ~ 1e5 elements, a few of them land there)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.bfloat16:
        diff = (got.double() - want.double()).abs()
        atol = 1e-5 * float(want.double().abs().max()) + 1e-30
        assert torch.all(diff <= want.double().abs() * 2 ** -7 + atol), diff.max()
        assert (diff > 0).double().mean() < 0.01       # rounding ties only, not a systematic error
    else:
        assert rel_err(got, want) < 1e-5


def check_all(T, n, D, dtype, seed=0):
    X, fn, base, scale, head_fn, o = make_case(T, n, D, dtype, seed)
    u, post, comb = kernels.hc_pre(X, fn, base, scale, n, ITERS, HC_EPS, NORM_EPS)
    u_ref, post_ref, comb_ref = mhc.hc_pre_reference(X, fn, base, scale, n, ITERS, HC_EPS, NORM_EPS)
    assert post.dtype == comb.dtype == torch.float32
    assert post.shape == (T, n) and comb.shape == (T, n, n)
    assert_out_close(u, u_ref)
    assert rel_err(post, post_ref) < 1e-5
    assert rel_err(comb, comb_ref) < 1e-5
    # hc_post from the same (reference) mixes, so only the kernel's own arithmetic is compared
    assert_out_close(kernels.hc_post(o, X, post_ref, comb_ref),
                     mhc.hc_post_reference(o, X, post_ref, comb_ref))
    assert_out_close(kernels.hc_head(X, head_fn, base[:n], scale[:1], HC_EPS, NORM_EPS),
                     mhc.hc_head_reference(X, head_fn, base[:n], scale[:1], HC_EPS, NORM_EPS))


@triton_ok
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,D", [(1, 64), (3, 192), (17, 64)])
def test_kernels_match_reference(T, D, dtype):
    check_all(T, 4, D, dtype)


@triton_ok
def test_kernels_padded_streams_and_ragged_width():
    """n = 3 (padded to 4 lanes: the padding must not leak into softmax / Sinkhorn sums) and a
    width that is not a power of two nor a multiple of the K tile."""
    check_all(5, 3, 40, torch.float32, seed=3)


@triton_ok
def test_kernels_sinkhorn_makes_comb_doubly_stochastic():
    X, fn, base, scale, _, _ = make_case(3, 4, 64, torch.float32, seed=4)
    _, _, comb = kernels.hc_pre(X, fn, base, scale, 4, ITERS, HC_EPS, NORM_EPS)
    ones = torch.ones(3, 4, device=comb.device)
    assert torch.allclose(comb.sum(-2), ones, atol=1e-5)    # last step normalises columns
    assert torch.allclose(comb.sum(-1), ones, atol=1e-3)


@triton_ok
def test_kernels_empty_batch():
    X, fn, base, scale, head_fn, o = make_case(0, 4, 64, torch.float32)
    u, post, comb = kernels.hc_pre(X, fn, base, scale, 4, ITERS, HC_EPS, NORM_EPS)
    assert u.shape == (0, 64) and post.shape == (0, 4) and comb.shape == (0, 4, 4)
    assert kernels.hc_post(o, X, post, comb).shape == (0, 4, 64)
    assert kernels.hc_head(X, head_fn, base[:4], scale[:1], HC_EPS, NORM_EPS).shape == (0, 64)


@triton_ok
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,D", [(1, 64), (3, 192), (17, 64)])
def test_expand_leaves_first_partials(T, D, dtype):
    """hc_expand: n copies of h, bit for bit, with (few tokens) the first hc_pre's partials left
    on them, which that hc_pre then uses and still matches the reference."""
    n = 4
    X, fn, base, scale, head_fn, o = make_case(T, n, D, dtype, seed=T + 3)
    Y = kernels.hc_expand(o, n, fn)
    assert torch.equal(Y, o.unsqueeze(1).expand(-1, n, -1)) and Y.is_contiguous()
    assert (kernels._partials_left_on(Y, fn) is not None) == (T <= kernels.POST_NEXT_MAX_T)
    assert torch.equal(kernels.hc_expand(o, n), Y)
    got = kernels.hc_pre(Y, fn, base, scale, n, ITERS, HC_EPS, NORM_EPS)
    want = mhc.hc_pre_reference(Y, fn, base, scale, n, ITERS, HC_EPS, NORM_EPS)
    assert_out_close(got[0], want[0])
    for g, w in zip(got[1:], want[1:]):
        assert rel_err(g, w) < 1e-5


def check_post_then_pre(T, n, D, dtype, seed=0):
    """hc_post(..., next_fn) leaves the next projection's partials on its output: the hc_pre /
    hc_head that reads it then skips `_mix_partials` and still matches the reference (on the
    stored output), and equals the same kernels without the hint up to fp32 summation order."""
    X, fn, base, scale, head_fn, o = make_case(T, n, D, dtype, seed)
    _, post, comb = mhc.hc_pre_reference(X, fn, base, scale, n, ITERS, HC_EPS, NORM_EPS)
    plain = kernels.hc_post(o, X, post, comb)
    for nxt, run, ref in (
            (fn, lambda Y: kernels.hc_pre(Y, fn, base, scale, n, ITERS, HC_EPS, NORM_EPS),
             lambda Y: mhc.hc_pre_reference(Y, fn, base, scale, n, ITERS, HC_EPS, NORM_EPS)),
            (head_fn, lambda Y: (kernels.hc_head(Y, head_fn, base[:n], scale[:1], HC_EPS,
                                                 NORM_EPS),),
             lambda Y: (mhc.hc_head_reference(Y, head_fn, base[:n], scale[:1], HC_EPS,
                                              NORM_EPS),))):
        Y = kernels.hc_post(o, X, post, comb, next_fn=nxt)
        assert torch.equal(Y, plain)                          # the streams are unchanged
        left = getattr(Y, kernels._LEFT, None)
        assert (left is not None) == (T <= kernels.POST_NEXT_MAX_T)
        got, want, unhinted = run(Y), ref(Y), run(plain)
        assert_out_close(got[0], want[0])
        assert_out_close(got[0], unhinted[0])
        for g, w in zip(got[1:], want[1:]):
            assert rel_err(g, w) < 1e-5
    # partials left for another fn are not used for this one
    Y = kernels.hc_post(o, X, post, comb, next_fn=fn.clone())
    assert kernels._partials_left_on(Y, fn) is None


@triton_ok
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,D", [(1, 64), (3, 192), (17, 64)])
def test_post_leaves_partials_for_next_pre(T, D, dtype):
    check_post_then_pre(T, 4, D, dtype, seed=T)


@triton_ok
@pytest.mark.parametrize("T,D", [(1, 64), (20, 64)])
def test_deferred_sinkhorn_launch_gives_the_same_streams(T, D):
    """hc_pre(deferred=True): post / comb come from a launch on a side
    stream (CUDA; inline here) that hc_post joins. The hc_post result is bit-identical to the
    plain path, also when main-stream allocations right after hc_pre reuse freed memory (T > 16:
    the partials come from _mix_partials, not from a previous hc_post), and the side record
    is dropped after the join."""
    X, fn, base, scale, _, o = make_case(T, 4, D, torch.bfloat16, seed=T)
    u0, post0, comb0 = kernels.hc_pre(X, fn, base, scale, 4, ITERS, HC_EPS, NORM_EPS)
    want = kernels.hc_post(o, X, post0, comb0)
    u, post, comb = kernels.hc_pre(X, fn, base, scale, 4, ITERS, HC_EPS, NORM_EPS, deferred=True)
    scratch = [torch.full((T, 64), 7.0, device=X.device) for _ in range(8)]   # reuse pressure
    got = kernels.hc_post(o, X, post, comb)
    assert torch.equal(u, u0) and torch.equal(got, want) and len(scratch) == 8
    assert getattr(post, kernels._SIDE, None) is None


@triton_ok
@pytest.mark.parametrize("T,D,dtype", [(1, 64, torch.bfloat16), (3, 200, torch.float32),
                                       (20, 64, torch.bfloat16)])
def test_norm_in_the_u_launch(T, D, dtype):
    """hc_pre(deferred) / hc_head given the RMSNorm that reads u: for few tokens the u launch
    applies it, within one rounding step of norm(u) (only the sum-of-squares order differs);
    without the norm (its own launch after) and for many tokens they give norm(u) exactly."""
    from dspark.models.deepseek_v4.norm import RMSNorm
    X, fn, base, scale, head_fn, o = make_case(T, 4, D, dtype, seed=D)
    norm = RMSNorm(D, 1e-6).to(X.device)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(D, generator=torch.Generator().manual_seed(1)))
        u, post0, comb0 = kernels.hc_pre(X, fn, base, scale, 4, ITERS, HC_EPS, NORM_EPS)
        h = kernels.hc_head(X, head_fn, base[:4], scale[:1], HC_EPS, NORM_EPS)
        want, want_h = norm(u), norm(h)
        outs = {}
        assert kernels.norm_fusable(X, norm) == (T <= kernels.POST_NEXT_MAX_T)
        for flag in ("1", "0"):         # "0": the norm as its own launch after the u launch
            given = norm if flag == "1" else None
            x, post, comb = kernels.hc_pre(X, fn, base, scale, 4, ITERS, HC_EPS, NORM_EPS,
                                           deferred=True, norm=given)
            assert torch.equal(kernels.hc_post(o, X, post, comb), kernels.hc_post(o, X, post0,
                                                                                   comb0))
            hx = kernels.hc_head(X, head_fn, base[:4], scale[:1], HC_EPS, NORM_EPS, norm=given)
            outs[flag] = (x, hx) if given is not None else (norm(x), norm(hx))
    assert torch.equal(outs["0"][0], want) and torch.equal(outs["0"][1], want_h)
    assert_out_close(outs["1"][0], want)
    assert_out_close(outs["1"][1], want_h)
    if T > kernels.POST_NEXT_MAX_T:                       # not fused: the same launches
        assert torch.equal(outs["1"][0], want) and torch.equal(outs["1"][1], want_h)


def check_post_finishes_next(T, D, dtype, seed=0):
    """hc_post / hc_expand given a `NextPre` hint (the next hc_pre with its RMSNorm, or hc_head
    with the final norm): the launch's last program per token finishes that collapse, the
    hc_pre / hc_head then launches nothing for u and returns it, bit-equal to the same kernels
    given the plain fn instead of the hint (its partials only) and within one rounding step of
    the reference;
    post / comb (the side launch) unchanged. A hint for other arguments is not used."""
    from dspark.models.deepseek_v4.norm import RMSNorm
    n = 4
    X, fn, base, scale, head_fn, o = make_case(T, n, D, dtype, seed=seed)
    norm = RMSNorm(D, 1e-5).to(X.device)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(D, generator=torch.Generator().manual_seed(2)))
    hb, hs = base[:n].clone(), scale[:1].clone()
    _, post0, comb0 = mhc.hc_pre_reference(X, fn, base, scale, n, ITERS, HC_EPS, NORM_EPS)
    table = torch.randn(50, D, generator=torch.Generator().manual_seed(3)).to(dtype).to(X.device)
    ids = torch.randint(0, 50, (T,), generator=torch.Generator().manual_seed(4)).to(X.device)
    pre_hint = mhc.NextPre(fn, base, scale, norm, HC_EPS, NORM_EPS)
    head_hint = mhc.NextPre(head_fn, hb, hs, norm, HC_EPS, NORM_EPS, head=True)
    unhinted = []
    with torch.no_grad():
        for make in (lambda h: kernels.hc_post(o, X, post0, comb0, h),
                     lambda h: kernels.hc_expand(table, n, h, ids=ids)):
            got = {}
            for flag in ("1", "0"):     # "0": the plain fn, the finish left to the hc_pre
                hinted = flag == "1"
                Y = make(pre_hint if hinted else pre_hint.fn)
                finished = kernels._finished_left_on(Y, fn, base, scale, norm, False)
                assert (finished is not None) == (flag == "1" and T <= kernels.POST_NEXT_MAX_T)
                x, post, comb = kernels.hc_pre(Y, fn, base, scale, n, ITERS, HC_EPS, NORM_EPS,
                                               deferred=True, norm=norm)
                assert finished is None or x is finished
                Z = make(head_hint if hinted else head_hint.fn)
                assert kernels._finished_left_on(Z, head_fn, hb, hs, norm, True) is not None \
                    or flag == "0" or T > kernels.POST_NEXT_MAX_T
                h = kernels.hc_head(Z, head_fn, hb, hs, HC_EPS, NORM_EPS, norm=norm)
                # post / comb are deferred (a side stream on CUDA): read through hc_post
                got[flag] = Y, x, kernels.hc_post(o, Y, post, comb), Z, h
            Y, x, _, Z, h = got["1"]
            for a, b in zip(got["1"], got["0"]):
                # the same tiles and reductions; on the GPU the compiler may order the sums
                # differently in the two kernels: then within a rounding step
                if X.is_cuda and not torch.equal(a, b):
                    assert_out_close(a, b)
                else:
                    assert torch.equal(a, b)
            unhinted.append(got["0"][1])
            assert torch.equal(Z, Y)
            want_u = mhc.hc_pre_reference(Y, fn, base, scale, n, ITERS, HC_EPS, NORM_EPS)[0]
            assert_out_close(x, norm(want_u))
            want_h = mhc.hc_head_reference(Z, head_fn, hb, hs, HC_EPS, NORM_EPS)
            assert_out_close(h, norm(want_h))
        # the expanded streams are the table's rows
        assert torch.equal(kernels.hc_expand(table, n, None, ids=ids),
                           table[ids].unsqueeze(1).expand(-1, n, -1))
        # a hint for another norm / base is ignored: the hc_pre computes its own
        other = RMSNorm(D, 1e-5).to(X.device)
        Y = kernels.hc_post(o, X, post0, comb0, mhc.NextPre(fn, base, scale, other, HC_EPS,
                                                             NORM_EPS))
        assert kernels._finished_left_on(Y, fn, base, scale, norm, False) is None
        assert kernels._finished_left_on(Y, fn, base.clone(), scale, other, False) is None
        x = kernels.hc_pre(Y, fn, base, scale, n, ITERS, HC_EPS, NORM_EPS, deferred=True,
                           norm=norm)[0]
        if not torch.equal(x, unhinted[0]):         # (the GPU may order the sums apart)
            assert X.is_cuda
            assert_out_close(x, unhinted[0])


@triton_ok
@pytest.mark.parametrize("T,D,dtype", [(1, 64, torch.bfloat16), (3, 200, torch.float32),
                                       (20, 64, torch.bfloat16)])
def test_post_finishes_the_next_collapse(T, D, dtype):
    check_post_finishes_next(T, D, dtype, seed=T)


@triton_ok
def test_post_partials_padded_streams_and_ragged_width():
    check_post_then_pre(2, 3, 40, torch.float32, seed=5)


# ---- dispatch ----------------------------------------------------------------------------------

@pytest.fixture
def backend():
    """Set dspark.models.deepseek_v4.mhc.BACKEND for one test, restored afterwards."""
    saved = mhc.BACKEND
    yield lambda name: setattr(mhc, "BACKEND", name)
    mhc.BACKEND = saved


def test_dispatch_reference_on_cpu_and_for_gradients(backend):
    X, fn, base, scale, _, o = make_case(2, 4, 64, torch.float32, device="cpu")
    backend("auto")
    assert mhc._kernels(X, fn) is None                       # CPU tensors: torch reference
    backend("triton")
    fn.requires_grad_(True)
    u, post, comb = mhc.hc_pre(X, fn, base, scale, 4, ITERS, HC_EPS, NORM_EPS)
    assert u.grad_fn is not None                             # kernels have no backward
    backend("reference")
    assert mhc._kernels(X.to(DEV)) is None
    backend("fast")
    with pytest.raises(ValueError, match="mHC backend 'fast'"):
        mhc.hc_post(o, X, post, comb)


@triton_ok
def test_dispatch_triton_runs_kernels(backend):
    X, fn, base, scale, head_fn, o = make_case(2, 4, 64, torch.bfloat16)
    backend("triton")
    assert mhc._kernels(X, fn) is kernels
    with torch.no_grad():
        u, post, comb = mhc.hc_pre(X, fn, base, scale, 4, ITERS, HC_EPS, NORM_EPS)
        assert torch.equal(u, kernels.hc_pre(X, fn, base, scale, 4, ITERS, HC_EPS, NORM_EPS)[0])
        assert torch.equal(mhc.hc_post(o, X, post, comb), kernels.hc_post(o, X, post, comb))


@pytest.fixture(scope="module")
def tiny_engine(tiny_ckpt):
    from dspark import Engine
    return Engine(tiny_ckpt, device=DEV, dtype="fp32", kv_cache_dtype="fp32", speculative="none",
                  kv_layout="dense")


@triton_ok
def test_model_logits_with_kernels_match_reference(tiny_engine, backend):
    """The whole tiny model (a 6-token prompt) with every mHC call on the kernels."""
    eng = tiny_engine
    ids = [5, 17, 3, 99, 42, 7]
    logits = {}
    calls = []
    real = kernels._mixes
    kernels._mixes = lambda *a: calls.append(1) or real(*a)
    try:
        for name in ("reference", "triton"):
            backend(name)
            logits[name] = eng.score(ids)
    finally:
        kernels._mixes = real
    assert rel_err(logits["triton"], logits["reference"]) < 1e-4
    # every hc_pre / hc_head found the partials its hc_post (the first: hc_expand) left
    assert len(calls) == 0


# ---- GPU-sized cases (H200) --------------------------------------------------------------------

@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 2, 6, 64, 300])
@pytest.mark.parametrize("D", [4096, 7168])
def test_gpu_kernels_realistic(T, D):
    check_all(T, 4, D, torch.bfloat16, seed=T)
    check_all(T, 4, D, torch.float32, seed=T + 1)
    check_post_then_pre(T, 4, D, torch.bfloat16, seed=T + 2)


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 4, 16])
def test_gpu_post_finishes_the_next_collapse(T):
    check_post_finishes_next(T, 4096, torch.bfloat16, seed=T)
