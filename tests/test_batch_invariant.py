"""The batch-invariant mode of the deterministic engine on CUDA (dspark/kernels/invariant.py): its
matrix product against an fp64 reference, a row's bits independent of the other rows, aten's
products routed to it inside the mode, and on the GPU the pinned kernel families (FP8 / 16-bit
skinny GEMMs, router, mHC) giving a row the same bits at every token count."""
import triton_env  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch
import torch.nn.functional as F

from dspark.kernels import invariant
from triton_env import DEV, needs_cuda, triton_ok


def _ref(a, b):
    return (a.double() @ b.double())


@triton_ok
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_invariant_bmm_matches_fp64(dtype, tol):
    """Strided operands (a transposed weight view, an expanded batch), K not a multiple of the
    K tile, M and N not multiples of theirs, fp32 output of 16-bit operands."""
    torch.manual_seed(0)
    w = torch.randn(70, 45, device=DEV).to(dtype)
    x = torch.randn(3, 21, 45, device=DEV).to(dtype)
    got = invariant.invariant_bmm(x, w.t().expand(3, 45, 70), torch.float32)
    want = _ref(x, w.t())
    assert got.dtype == torch.float32 and got.shape == (3, 21, 70)
    assert ((got.double() - want).abs() <= tol * (1 + want.abs())).all()
    two_d = invariant.invariant_bmm(x[0], w.t())
    assert two_d.dtype == dtype and two_d.shape == (21, 70)
    assert invariant.invariant_bmm(x[:, :0], w.t().expand(3, 45, 70)).shape == (3, 0, 70)
    empty_k = invariant.invariant_bmm(x[:, :, :0], w.t()[:0].expand(3, 0, 70))
    assert torch.equal(empty_k, torch.zeros_like(empty_k))


@triton_ok
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_keeps_its_bits_whatever_the_other_rows(dtype):
    """Row 0 of x @ w alone, among 4 / 17 / 40 rows, and with the other rows scaled by 100."""
    torch.manual_seed(1)
    w = torch.randn(96, 200, device=DEV).to(dtype)
    x = torch.randn(40, 200, device=DEV).to(dtype)
    alone = invariant.invariant_bmm(x[:1], w.t())
    for m in (4, 17, 40):
        assert torch.equal(invariant.invariant_bmm(x[:m], w.t())[:1], alone), m
    loud = torch.cat([x[:1], x[1:] * 100])
    assert torch.equal(invariant.invariant_bmm(loud, w.t())[:1], alone)


def test_bad_operands_are_named():
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"shapes \(2, 3\) @ \(4, 5\)"):
        invariant.invariant_bmm(a, torch.zeros(4, 5))
    with pytest.raises(ValueError, match="float32 and torch.float16"):
        invariant.invariant_bmm(a, torch.zeros(3, 5, dtype=torch.float16))


@triton_ok
def test_the_mode_routes_atens_products(monkeypatch):
    """F.linear (with and without bias, 2-D and 3-D input), einsum, a broadcast matmul and
    torch.mm(out_dtype=) inside `batch_invariant()` each run `invariant_bmm`, under inference
    mode too, with the values of the plain ops; outside the mode none does."""
    calls = []
    real = invariant.invariant_bmm

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(invariant, "invariant_bmm", counting)
    torch.manual_seed(2)
    x, w, bias = (torch.randn(6, 40, device=DEV), torch.randn(24, 40, device=DEV),
                  torch.randn(24, device=DEV))
    stack, idx = torch.randn(4, 10, 40, device=DEV), torch.tensor([[0, 3]] * 6, device=DEV)
    ops = {
        "linear+bias": lambda: F.linear(x, w, bias),
        "linear 3-D": lambda: F.linear(x.view(2, 3, 40), w),
        "einsum": lambda: torch.einsum("tgi,gri->tgr", x.view(6, 2, 20), w[:, :20].reshape(2, 12, 20)),
        "gathered matmul": lambda: torch.matmul(stack[idx], x[:, None, :, None]).squeeze(-1),
        "mm out_dtype": lambda: torch.mm(x.bfloat16(), w.t().bfloat16(), out_dtype=torch.float32),
    }
    plain_of = {"mm out_dtype": lambda: x.bfloat16().float() @ w.bfloat16().float().t()}
    for name, op in ops.items():
        plain = plain_of.get(name, op)()      # (CPU has no mm(out_dtype=))
        for inference in (False, True):
            calls.clear()
            with torch.inference_mode(inference), invariant.batch_invariant():
                assert invariant.on()
                got = op()
            assert calls, (name, inference)
            assert got.shape == plain.shape and got.dtype == plain.dtype, name
            torch.testing.assert_close(got, plain, rtol=1e-2, atol=1e-2)
    assert not invariant.on()
    calls.clear()
    F.linear(x, w)
    assert not calls


@triton_ok
def test_products_are_routed_where_steps_are_built_not_around_replays(monkeypatch):
    """`choices()` (what the engine holds around graph replays) routes no aten op; `products()`
    inside it (graph capture, eager steps) does; outside the mode `products()` is nothing."""
    calls = []
    real = invariant.invariant_bmm
    monkeypatch.setattr(invariant, "invariant_bmm",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x, w = torch.randn(3, 16, device=DEV), torch.randn(8, 16, device=DEV)
    with invariant.choices():
        assert invariant.on()
        F.linear(x, w)
        assert not calls
        with invariant.products():
            F.linear(x, w)
        assert len(calls) == 1
    with invariant.products():
        F.linear(x, w)
    assert len(calls) == 1 and not invariant.on()


def test_sparse_mqa_takes_one_configuration_for_every_token_count():
    """The attention kernel's launch configuration in the mode is the same for 1..1024 query
    tokens (64 heads, 16-bit operands: the DEFAULT_CONFIGS rows; 4 heads: the heuristic), while
    outside it the rows change with the token count."""
    from dspark.kernels.sparse_mqa import _resolve_config
    for H, prec in ((64, "bf16"), (64, "fp16"), (128, "bf16"), (4, "bf16"), (64, "tf32")):
        with invariant.choices():
            cfgs = {tuple(sorted(_resolve_config(T, H, prec, {}).items()))
                    for T in (1, 2, 8, 9, 16, 33, 64, 128, 1024)}
        assert len(cfgs) == 1, (H, prec, cfgs)
    outside = {tuple(sorted(_resolve_config(T, 64, "bf16", {}).items())) for T in (1, 16, 64)}
    assert len(outside) == 3


# ---- the pinned kernel families on the GPU ------------------------------------------------

SIZES = (1, 2, 7, 9, 16, 17, 33, 64, 65, 130, 384)


def _row0_is_fixed(fn, x):
    """fn(x[:T])[0] has the same bits for every T in SIZES (inside the mode)."""
    with torch.inference_mode(), invariant.batch_invariant():
        first = fn(x[:1])
        for T in SIZES[1:]:
            got = fn(x[:T])
            got = got[0] if not isinstance(got, tuple) else tuple(g[0] for g in got)
            want = first[0] if not isinstance(first, tuple) else tuple(f[0] for f in first)
            assert (torch.equal(got, want) if not isinstance(got, tuple)
                    else all(torch.equal(g, f) for g, f in zip(got, want))), T


@needs_cuda
@pytest.mark.gpu
def test_pinned_gemms_keep_a_rows_bits_at_every_token_count():
    """FP8 linear (GEMV / skinny / tiled below and above 8 / 64 tokens by default), its grouped
    form (wo_a), the 16-bit skinny fp32 head and compressor GEMMs, and a bf16 F.linear
    (cuBLAS outside the mode), at V4-Flash shapes."""
    from dspark.formats.quant import quant_fp8_blocks
    from dspark.kernels.fp8_gemm import fp8_linear, fp8_linear_grouped
    from dspark.models.deepseek_v4.norm import linear_fp32
    torch.manual_seed(3)
    x = torch.randn(384, 4096, device="cuda", dtype=torch.bfloat16)
    w, s = quant_fp8_blocks(torch.randn(1024, 4096, device="cuda") * 0.02)
    _row0_is_fixed(lambda t: fp8_linear(t, w, s), x)
    xg = torch.randn(384, 2, 2048, device="cuda", dtype=torch.bfloat16)
    wg, sg = quant_fp8_blocks(torch.randn(2048, 2048, device="cuda") * 0.02)
    _row0_is_fixed(lambda t: fp8_linear_grouped(t, wg, sg, 2), xg)
    head = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    _row0_is_fixed(lambda t: linear_fp32(t, head, head=True), x)
    _row0_is_fixed(lambda t: linear_fp32(t, head[:512], skinny=True), x)
    _row0_is_fixed(lambda t: F.linear(t, head[:1024]), x)


@needs_cuda
@pytest.mark.gpu
def test_pinned_router_and_mhc_keep_a_rows_bits_at_every_token_count():
    """The router (gate_route up to 16 tokens by default) and hc_pre / hc_post (per-token
    launches up to 16 tokens by default) at V4-Flash widths."""
    from dspark.kernels import mhc
    from dspark.models.deepseek_v4.moe import Gate
    torch.manual_seed(4)
    gate = Gate(4096, 256, 6, 2.5).cuda().to(torch.bfloat16)
    gate.weight.data.normal_(0, 0.02)
    x = torch.randn(384, 4096, device="cuda", dtype=torch.bfloat16)
    tok = torch.zeros(384, dtype=torch.long, device="cuda")
    _row0_is_fixed(lambda t: gate(t, tok[:t.shape[0]]), x)
    X = torch.randn(384, 4, 4096, device="cuda", dtype=torch.bfloat16)
    fn = torch.randn(24, 4 * 4096, device="cuda") * 0.01
    base, scale = torch.zeros(24, device="cuda"), torch.ones(3, device="cuda")
    _row0_is_fixed(lambda t: mhc.hc_pre(t, fn, base, scale, 4, 20, 1e-6, 1e-6), X)
    o = torch.randn(384, 4096, device="cuda", dtype=torch.bfloat16)
    post, comb = torch.rand(384, 4, device="cuda"), torch.rand(384, 4, 4, device="cuda")
    _row0_is_fixed(lambda t: mhc.hc_post(o[:t.shape[0]], t, post[:t.shape[0]],
                                         comb[:t.shape[0]], next_fn=fn), X)
