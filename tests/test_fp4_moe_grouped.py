"""Grouped small-batch FP4 MoE (`fp4_moe_grouped`): fixed-shape Triton kernels over a stacked
expert layout, expert ids read on the device. On CPU the kernels run under TRITON_INTERPRET=1 on
small shapes and are compared with the per-expert host loop (`fp4_moe`, exact de-quantize then
F.linear) and a float64 de-quantized reference; no device->host sync; QuantMoE picks the path by
T*k and shares one copy of the weights with it. The CUDA-graph capture test is marked `gpu`.
"""
from triton_env import DEV, needs_cuda, triton_ok  # noqa: F401 (before triton)

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dspark.kernels.fp4_moe as fm  # noqa: E402
from dspark.kernels.fp4_moe import (fp4_moe, fp4_moe_grouped, grouped_applies,  # noqa: E402
                                    stack_fp4_experts)
from dspark.models.deepseek_v4.moe import MoE  # noqa: E402
from dspark.models.qlinear import QuantLinear, QuantMoE, memory_report  # noqa: E402
from dspark.formats.quant import dequant_fp4_experts, quant_fp4  # noqa: E402
from test_host_sync import SyncGuard  # noqa: E402

D, I, E = 64, 96, 8          # I = 96: a partial column tile and 3 scale groups per w2 row


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def same_sums(a, b):
    """The row-x variants load the same activation values and add the same products in the same
    order: bit-identical under the interpreter and in half precision. Compiled for CUDA, fp32
    outputs may differ in the last bit, where ptxas contracts a product into an FMA in one
    layout and not the other."""
    if a.is_cuda and a.dtype == torch.float32:
        return rel_err(a, b) < 1e-6
    return torch.equal(a, b)


def _spread(rows, cols, gen):
    """Random weights whose magnitude changes per row and per 32-column group (distinct scales)."""
    w = torch.randn(rows, cols, generator=gen)
    mult = torch.exp2(torch.randint(-4, 4, (rows, -(-cols // 32)), generator=gen).float())
    return w * mult.repeat_interleave(32, 1)[:, :cols]


def _experts(gen, n=E, d=D, inter=I, scale=0.1):
    return [(quant_fp4(_spread(inter, d, gen) * scale), quant_fp4(_spread(inter, d, gen) * scale),
             quant_fp4(_spread(d, inter, gen) * scale)) for _ in range(n)]


def _routing(gen, T, k, n=E):
    """Distinct experts per token, expert 0 in every token (at a varying slot), weights != 1."""
    rows = []
    for t in range(T):
        rest = (torch.randperm(n - 1, generator=gen)[:k - 1] + 1).tolist()
        rest.insert(t % k, 0)
        rows.append(rest)
    idx = torch.tensor(rows, dtype=torch.long)
    w = torch.rand(T, k, generator=gen) * 1.5 + 0.1
    return idx, w


def _reference(x, idx, w, experts, limit):
    """Spec §3.8 routed sum per (token, slot), de-quantized experts, float64."""
    deq = {}
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if experts[e] is None:
                continue
            if e not in deq:
                deq[e] = [dequant_fp4_experts(*p).double() for p in experts[e]]
            w1, w3, w2 = deq[e]
            g = w1 @ x[t].double()
            u = w3 @ x[t].double()
            if limit > 0:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            out[t] += w2 @ (F.silu(g) * u * float(w[t, j]))
    return out


def _dev(*ts):
    return [t.to(DEV) for t in ts]


def _mv(experts):
    return [None if ex is None else tuple(tuple(a.to(DEV) for a in p) for p in ex)
            for ex in experts]


@pytest.fixture(scope="module")
def experts():
    return _experts(torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def stack(experts):
    return stack_fp4_experts(_mv(experts))


# ---- kernel vs per-expert loop and float64 reference --------------------------------------

@triton_ok
@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("k", [2, 3, 4, 5, 6])
def test_grouped_matches_per_expert_and_reference(experts, stack, T, k):
    gen = torch.Generator().manual_seed(100 * T + k)
    x = torch.randn(T, D, generator=gen)
    idx, w = _routing(gen, T, k)
    limit = 0.7 if k % 2 else 0.0                  # clamped and unclamped SwiGLU
    y = fp4_moe_grouped(*_dev(x, idx, w), stack, limit)
    assert y.shape == (T, D) and y.dtype == torch.float32
    loop = fp4_moe(x, idx, w, experts, limit, backend="torch", grouped=False)
    assert rel_err(y.cpu(), loop) < 2e-6
    ref = _reference(x, idx, w, experts, limit)
    assert rel_err(y.cpu(), ref) < 1e-5
    assert rel_err(loop, ref) < 1e-5


@triton_ok
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_partial_scale_group(dtype):
    """An expert width that is not a multiple of 32 (the last FP4 scale group of every w2 row is
    partial): the kernels' element-wise masks instead of the whole-group ones."""
    gen = torch.Generator().manual_seed(17)
    exps = _experts(gen, n=4, inter=80)
    st = stack_fp4_experts(_mv(exps))
    x = torch.randn(3, D, generator=gen).to(dtype)
    idx, w = _routing(gen, 3, 2, n=4)
    y = fp4_moe_grouped(*_dev(x, idx, w), st, 0.7)
    loop = fp4_moe(x, idx, w, exps, 0.7, backend="torch", grouped=False)
    assert rel_err(y.cpu(), loop) < (2e-6 if dtype == torch.float32 else 1e-2)


@triton_ok
def test_grouped_repeated_experts_and_clamp_active(experts, stack):
    """Every token routed to the same few experts; clamp well inside the activation range."""
    gen = torch.Generator().manual_seed(7)
    T, k = 8, 3
    x = torch.randn(T, D, generator=gen) * 4
    idx = torch.tensor([[0, 5, 2], [5, 0, 2], [2, 5, 0], [0, 2, 5]] * 2)
    w = torch.rand(T, k, generator=gen) + 0.5
    limit = 0.05
    y = fp4_moe_grouped(*_dev(x, idx, w), stack, limit)
    ref = _reference(x, idx, w, experts, limit)
    assert rel_err(y.cpu(), ref) < 1e-5
    assert rel_err(y.cpu(), fp4_moe(x, idx, w, experts, limit, backend="torch")) < 1e-5
    # the clamp matters here: without it the result differs
    assert rel_err(_reference(x, idx, w, experts, 0.0), ref) > 1e-2


@triton_ok
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_half_precision_rounds_like_per_expert(experts, stack, dtype):
    """g, u, h and each expert's output are rounded to x.dtype as in the per-expert path (bf16
    round-to-nearest-even also under the interpreter)."""
    gen = torch.Generator().manual_seed(11)
    T, k = 3, 4
    x = torch.randn(T, D, generator=gen).to(dtype)
    idx, w = _routing(gen, T, k)
    y = fp4_moe_grouped(*_dev(x, idx, w), stack, 0.7)
    loop = fp4_moe(x, idx, w, experts, 0.7, backend="torch", grouped=False)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3           # a rare 1-ulp flip at most
    assert rel_err(y.cpu(), loop) < tol
    # same roundings: (nearly) every element identical; skipping any x.dtype rounding changes
    # all of them (sums of 4 differently rounded expert outputs)
    assert (y.cpu() != loop).float().mean().item() < 0.05
    assert rel_err(y.cpu(), _reference(x.float(), idx, w, experts, 0.7)) < 4 * tol


def _every_code_case(stack, dtype, seed: int, T: int = 4, k: int = 3):
    """(x, idx, w) of T tokens routed to k experts each, with the stack's weights holding every
    byte value (so every code pair is decoded)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen).to(dtype)
    idx, w = _routing(gen, T, k)
    codes = torch.cat([stack.w13.flatten(), stack.w2.flatten()]).cpu()
    assert torch.unique(codes).numel() == 256
    return x, idx, w


@triton_ok
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pair_decode_is_bit_identical(experts, stack, dtype):
    """Decoding both codes of a byte together (pair_decode) yields the same values in the same
    order: outputs bit-identical to the per-code decode, every byte value included (the spread
    test weights use all 16 codes; the bf16 run takes the int32 activation-pair loads)."""
    x, idx, w = _every_code_case(stack, dtype, seed=13)
    a = fp4_moe_grouped(*_dev(x, idx, w), stack, 0.7, pair_decode=False)
    b = fp4_moe_grouped(*_dev(x, idx, w), stack, 0.7)                 # the default
    assert torch.equal(a, b)


@triton_ok
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_adds_and_rounds_in_the_down_kernel(experts, stack, dtype):
    """add= / out_dtype= (QuantMoE's shared expert output and the final cast): the down kernel's
    result equals out_dtype(fp32 routed + add) of the plain call, bit for bit (same fp32 sum,
    round to nearest even also under the interpreter)."""
    gen = torch.Generator().manual_seed(21)
    T, k = 3, 4
    x = torch.randn(T, D, generator=gen).to(dtype)
    idx, w = _routing(gen, T, k)
    add = torch.randn(T, D, generator=gen).to(dtype)
    routed = fp4_moe_grouped(*_dev(x, idx, w), stack, 0.7)
    want = (routed + add.to(routed.device)).to(dtype)
    got = fp4_moe_grouped(*_dev(x, idx, w), stack, 0.7, add=add.to(routed.device),
                          out_dtype=dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    assert not torch.equal(got, routed.to(dtype))           # the add did something
    with pytest.raises(ValueError, match="add"):
        fp4_moe_grouped(*_dev(x, idx, w), stack, 0.7, add=add[:, :-1].to(routed.device))


@triton_ok
def test_grouped_not_held_experts_contribute_zero(experts):
    """Experts this rank does not hold (None) are left out of the stack; pairs routed to them
    add nothing (another rank adds them), the held ones are unchanged."""
    held = [ex if e % 3 else None for e, ex in enumerate(experts)]      # 0, 3, 6 not held
    st = stack_fp4_experts(_mv(held))
    assert st.w13.shape[0] == E - 3 and st.emap.tolist() == [-1, 0, 1, -1, 2, 3, -1, 4]
    gen = torch.Generator().manual_seed(5)
    T, k = 3, 4
    x = torch.randn(T, D, generator=gen)
    idx, w = _routing(gen, T, k)                       # expert 0 (not held) in every token
    y = fp4_moe_grouped(*_dev(x, idx, w), st, 0.7)
    w_held = torch.where(idx % 3 == 0, torch.zeros_like(w), w)
    loop = fp4_moe(x, idx, w_held, experts, 0.7, backend="torch")
    assert rel_err(y.cpu(), loop) < 2e-6
    assert rel_err(y.cpu(), _reference(x, idx, w, held, 0.7)) < 1e-5
    assert rel_err(y.cpu(), fp4_moe(x, idx, w, experts, 0.7, backend="torch")) > 1e-2


def test_stack_layout_and_checks(experts):
    st = stack_fp4_experts(experts)
    (w1, s1), (w3, s3), (w2, s2) = experts[4]
    assert torch.equal(st.w13[4, :I], w1.view(torch.uint8))
    assert torch.equal(st.w13[4, I:], w3.view(torch.uint8))
    assert torch.equal(st.s13[4, I:], s3.view(torch.uint8))
    assert torch.equal(st.w2[4], w2.view(torch.uint8))
    assert torch.equal(st.s2[4], s2.view(torch.uint8))
    assert st.nbytes == sum(a.nbytes for ex in experts for p in ex for a in p) + 4 * E
    bad = list(experts)
    bad[2] = (experts[2][0], experts[2][1], quant_fp4(torch.randn(D, 2 * I)))
    with pytest.raises(ValueError, match="expert 2"):
        stack_fp4_experts(bad)
    with pytest.raises(ValueError, match="no expert"):
        stack_fp4_experts([None, None])


# ---- dispatch ------------------------------------------------------------------------------

def test_grouped_applies_by_shape_and_backend():
    x, idx = torch.zeros(4, D), torch.zeros(4, 6, dtype=torch.long)
    assert not grouped_applies(x, idx)                               # CPU "auto" -> torch
    assert grouped_applies(x, idx, "triton")
    assert not grouped_applies(x, idx, "torch")
    assert grouped_applies(x, idx, "triton", max_pairs=24)
    assert not grouped_applies(x, idx, "triton", max_pairs=23)
    assert not grouped_applies(torch.zeros(700, D), torch.zeros(700, 6, dtype=torch.long), "triton")
    assert grouped_applies(torch.zeros(128, D), torch.zeros(128, 6, dtype=torch.long), "triton")


@triton_ok
def test_fp4_moe_auto_dispatch(experts, stack, monkeypatch):
    calls = []
    real = fm.fp4_moe_grouped
    monkeypatch.setattr(fm, "fp4_moe_grouped", lambda *a, **k: calls.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, D, generator=gen)
    idx, w = _routing(gen, 2, 2)
    ref = fp4_moe(x, idx, w, experts, 0.7, backend="torch")
    fp4_moe(*_dev(x, idx, w), _mv(experts), 0.7, backend="torch", stack=stack)
    assert calls == []                                              # torch backend: loop
    y = fp4_moe(*_dev(x, idx, w), _mv(experts), 0.7, backend="triton", stack=stack)
    assert calls == [1] and rel_err(y.cpu(), ref) < 2e-6
    fp4_moe(*_dev(x, idx, w), _mv(experts), 0.7, backend="triton")  # no stack: loop
    assert calls == [1]
    y = fp4_moe(*_dev(x, idx, w), _mv(experts), 0.7, backend="triton", grouped=True)  # builds one
    assert calls == [1, 1] and rel_err(y.cpu(), ref) < 2e-6


# ---- QuantMoE --------------------------------------------------------------------------------

def _quant_moe(gen, dtype=torch.float32, backend="triton", d=D, inter=I, n=E, k=4, limit=0.7):
    cfg = SimpleNamespace(hidden_size=d, moe_intermediate_size=inter, n_routed_experts=n,
                          num_experts_per_tok=k, routed_scaling_factor=1.5, vocab_size=16,
                          swiglu_limit=limit, n_shared_experts=1)
    moe = MoE(cfg, hash_layer=False)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(n, d, generator=gen))
        moe.gate.bias.copy_(torch.randn(n, generator=gen) * 0.1)
        for e, trip in zip(moe.experts, _experts(gen, n, d, inter)):
            for name, (wq, sq) in zip(("w1", "w3", "w2"), trip):
                setattr(e, name, QuantLinear.from_tensors(wq, sq, "fp4", dtype, backend))
        moe.shared_experts.to(dtype)
    moe.__class__ = QuantMoE
    moe.grouped_max_pairs = fm.GROUPED_MAX_PAIRS
    return moe.eval()


@triton_ok
def test_quant_moe_grouped_path_shares_weights(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    moe = _quant_moe(gen).to(DEV)
    before = memory_report(moe)["total"]
    x = torch.randn(5, D, generator=gen).to(DEV)
    ids = torch.zeros(5, dtype=torch.long, device=DEV)
    calls = []
    real = fm.fp4_moe_grouped
    import dspark.models.qlinear as ql
    monkeypatch.setattr(ql, "fp4_moe_grouped", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        y = moe(x, ids)                                # 20 pairs: grouped
        assert calls == [1]
        st = moe._fp4_stack
        # the experts' buffers are views of the stack: no extra memory, same bytes
        base = st.w13.untyped_storage().data_ptr()
        e3 = moe.experts[3]
        assert e3.w3.weight.untyped_storage().data_ptr() == base
        assert e3.w2.scale.untyped_storage().data_ptr() == st.s2.untyped_storage().data_ptr()
        assert e3.w1.weight.dtype == torch.int8 and e3.w1.scale.dtype == torch.float8_e8m0fnu
        assert memory_report(moe)["total"] == before
        moe.grouped_max_pairs = 0                      # per-expert loop on the same views
        y_loop = moe(x, ids)
        assert calls == [1]
        # fp32: exact products both ways in the interpreter; on a GPU the per-expert fp4_linear
        # kernel multiplies fp32 in tf32 (its default precision), the grouped kernel in fp32
        tol = 2e-3 if DEV == "cuda" else 2e-6
        assert rel_err(y.cpu(), y_loop.cpu()) < tol
        moe.grouped_max_pairs = 19                     # 20 pairs > 19: loop
        moe(x, ids)
        assert calls == [1]
        moe.grouped_max_pairs = 20
        # a reassigned expert weight is picked up (stack rebuilt), not served stale
        new = quant_fp4(torch.randn(I, D, generator=gen) * 0.3)
        moe.experts[0].w1._buffers["weight"] = new[0].to(DEV)
        moe.experts[0].w1._buffers["scale"] = new[1].to(DEV)
        y2 = moe(x, ids)
        assert moe._fp4_stack is not st and calls == [1, 1]
        moe.grouped_max_pairs = 0
        assert rel_err(y2.cpu(), moe(x, ids).cpu()) < tol
        assert rel_err(y2.cpu(), y.cpu()) > 1e-3


def test_grouped_path_is_the_default():
    from dspark.models.qlinear import QuantMoE
    assert QuantMoE.grouped_max_pairs == fm.GROUPED_MAX_PAIRS


def test_quant_moe_cpu_auto_keeps_loop(monkeypatch):
    """CPU with backend "auto": the per-expert torch loop (bit-exact reference), no stack."""
    import dspark.models.qlinear as ql
    monkeypatch.setattr(ql, "fp4_moe_grouped", lambda *a, **k: pytest.fail("grouped on CPU"))
    gen = torch.Generator().manual_seed(4)
    moe = _quant_moe(gen, backend="auto")
    with torch.no_grad():
        moe(torch.randn(2, D, generator=gen), torch.zeros(2, dtype=torch.long))
    assert getattr(moe, "_fp4_stack", None) is None


# ---- no host sync ------------------------------------------------------------------------------

def _count_syncs(fn, monkeypatch):
    guard = SyncGuard()
    tolist = torch.Tensor.tolist

    def guarded_tolist(self):
        guard.record("Tensor.tolist")
        return tolist(self)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", guarded_tolist)
        with guard:
            guard.armed = True
            fn()
            guard.armed = False
    return guard.hits


@triton_ok
def test_grouped_path_makes_no_host_sync(monkeypatch):
    gen = torch.Generator().manual_seed(6)
    moe = _quant_moe(gen).to(DEV)
    x = torch.randn(3, D, generator=gen).to(DEV)
    ids = torch.zeros(3, dtype=torch.long, device=DEV)
    with torch.no_grad():
        moe.stack_experts()
        assert _count_syncs(lambda: moe(x, ids), monkeypatch) == []
        idx, w = moe.gate(x, ids)
        assert _count_syncs(lambda: fp4_moe_grouped(x, idx, w, moe._fp4_stack, 0.7),
                            monkeypatch) == []
        # the guard does see the per-expert loop's sync (the check can fail)
        moe.grouped_max_pairs = 0
        assert _count_syncs(lambda: moe(x, ids), monkeypatch) != []


# ---- GPU: V4-Flash widths, CUDA graph --------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 4, 32])
def test_grouped_flash_shapes_gpu(T):
    gen = torch.Generator().manual_seed(T)
    n, k, d, inter = 16, 6, 4096, 2048
    exps = _experts(gen, n, d, inter, scale=0.02)
    x = torch.randn(T, d, generator=gen)
    idx = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen) + 0.1
    cu = [tuple(tuple(a.cuda() for a in p) for p in ex) for ex in exps]
    st = stack_fp4_experts(cu)
    ref = fp4_moe(x, idx, w, exps, 10.0, backend="torch")
    y32 = fp4_moe_grouped(x.cuda(), idx.cuda(), w.cuda(), st, 10.0)
    assert rel_err(y32.cpu(), ref) < 1e-5
    xb = x.to(torch.bfloat16)
    yb = fp4_moe_grouped(xb.cuda(), idx.cuda(), w.cuda(), st, 10.0)
    loop = fp4_moe(xb.cuda(), idx.cuda(), w.cuda(), cu, 10.0, grouped=False)
    assert rel_err(yb, loop.float()) < 2e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 7])
def test_quant_moe_cuda_graph_replay_gpu(T):
    gen = torch.Generator().manual_seed(8)
    moe = _quant_moe(gen, torch.bfloat16, "auto", d=512, inter=256, n=16, k=6).cuda()
    x = torch.randn(T, 512, generator=gen).to(torch.bfloat16).cuda()
    ids = torch.zeros(T, dtype=torch.long, device="cuda")
    with torch.inference_mode():
        moe.stack_experts()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                moe(x, ids)                        # warm up: Triton compiles outside capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y_static = moe(x, ids)
        outs = []
        for seed in range(3):
            x.copy_(torch.randn(T, 512, generator=torch.Generator().manual_seed(seed)))
            g.replay()
            torch.cuda.synchronize()
            outs.append(y_static.clone())
            eager = moe(x, ids)
            assert rel_err(y_static.float(), eager.float()) < 5e-3   # (the shared expert's cuBLAS)
            moe.grouped_max_pairs = 0
            loop = moe(x, ids)
            moe.grouped_max_pairs = fm.GROUPED_MAX_PAIRS
            assert rel_err(y_static.float(), loop.float()) < 2e-2
        assert not torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@needs_cuda
def test_grouped_speed_flash_gpu():
    """Timing at V4-Flash width (256 experts, D 4096, I 2048, k 6; random codes): grouped
    kernels vs the per-expert loop, per MoE call. Prints; asserts only that grouped is faster."""
    n, k, d, inter = 256, 6, 4096, 2048
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rnd(r, c):
        w = torch.randint(-128, 128, (r, c // 2), generator=gen, device="cuda", dtype=torch.int16)
        s = torch.randint(118, 124, (r, c // 32), generator=gen, device="cuda", dtype=torch.int16)
        return w.to(torch.int8), s.to(torch.uint8).view(torch.float8_e8m0fnu)
    exps = [(rnd(inter, d), rnd(inter, d), rnd(d, inter)) for _ in range(n)]
    st = stack_fp4_experts(exps)

    def timed(fn, reps=20):
        fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / reps
    for T in (1, 4, 16, 42):
        x = torch.randn(T, d, generator=gen, device="cuda").to(torch.bfloat16)
        idx = torch.rand(T, n, generator=gen, device="cuda").topk(k, dim=-1).indices
        w = torch.rand(T, k, generator=gen, device="cuda")
        tg = timed(lambda: fp4_moe_grouped(x, idx, w, st, 10.0))
        tl_ = timed(lambda: fp4_moe(x, idx, w, exps, 10.0, grouped=False))
        print(f"T={T} k={k}: grouped {tg:.3f} ms, per-expert loop {tl_:.3f} ms")
        assert tg < tl_


def test_autotune_is_opt_in_and_never_interpreted(monkeypatch):
    """fp4_moe.AUTOTUNE (set by bench_decode_v4.py --autotune) turns the autotuned launch on
    for real GPUs only: under the Triton interpreter (no timer) the heuristic blocks stay; the
    config list holds the heuristic's own batch-1 choice (16 columns, 8 groups, 4 warps)."""
    assert not fm.autotune_enabled()
    monkeypatch.setattr(fm, "AUTOTUNE", True)
    assert fm.autotune_enabled() == (not fm.interpreting())
    assert (16, 8, 4, 3) in fm._GEMV_CONFIGS
    assert all(fm._np_bucket(n) == b for n, b in ((1, 1), (6, 8), (36, 64), (10 ** 6, 8192)))
