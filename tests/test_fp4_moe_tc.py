"""Tensor-core few-token FP4 MoE (`fp4_moe_tc`): inline PTX (mma.sync), so CUDA
sm_90 only; on CPU only the pure-Python parts run. On the GPU: h of the gate/up kernel within one
bf16 step of a float64 computation from the de-quantized weights, the down kernel's output
against float64 from that h, every e2m1 code and several K splits / warps per program, experts
not held, the shared expert's add and the cast, and CUDA graph replay == eager, bit for bit.
"""
from triton_env import DEV, needs_cuda  # noqa: F401 (before triton)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dspark.kernels.fp4_moe_tc as tc  # noqa: E402
from dspark.kernels.fp4_moe import fp4_moe_grouped, stack_fp4_experts  # noqa: E402
from dspark.formats.quant import dequant_fp4_experts  # noqa: E402
from test_fp4_moe_grouped import _experts, rel_err  # noqa: E402

N, D, I = 12, 1024, 512


def test_decode_ptx_covers_each_pair_once():
    """The generated PTX: one MMA per (word, half, matrix), 2 scale multiplies per MMA pair of
    rows, and both step kernels read the lane id from the hardware, not from the operands."""
    up, down = tc._step_asm(True), tc._step_asm(False)
    assert up.count("mma.sync") == 16 and down.count("mma.sync") == 8
    assert up.count("mul.rn.bf16x2") == 64 and down.count("mul.rn.bf16x2") == 32
    for s in (up, down, tc._store_asm(True), tc._store_asm(False)):
        assert "%laneid" in s and "%tid.x" in s
    assert tc._split(4096, 4) == (4, 1024) and tc._split(1280, 4) == (4, 384)
    assert tc._split(256, 8) == (2, 128) and tc._split(4096, 4, 2) == (4, 1024)
    assert tc._split(1280, 4, 2) == (3, 512)
    assert tc._step_asm(True, 2).count("mma.sync") == 32
    assert tc._unroll(1280, 2) == 2 and tc._unroll(1152, 2) == 1 and tc._unroll(1536, 4) == 4
    assert tc._unroll(1280, 4) == 2 and tc._step_asm(False, 4).count("mma.sync") == 32


def test_ptx_operands_match_constraints():
    """Every inline-PTX block names exactly the operands its constraint string declares (pack 2:
    two registers per tensor; each scalar's second copy goes unread)."""
    import re
    cases = [(tc._step_asm(True), tc._STEP_UP_C), (tc._step_asm(False), tc._STEP_DOWN_C)]
    for asm, cons in cases:
        cons = getattr(cons, "value", cons)
        used = {int(i) for i in re.findall(r"\$(\d+)", asm)}
        assert max(used) + 2 == len(cons.split(",")), (max(used), cons)
    import inspect
    src = inspect.getsource(tc._rows_gemv.fn)
    assert src.count(f'"{tc._STEP_UP_C.value}"') == 3 and src.count(f'"{tc._STEP_DOWN_C.value}"') == 3


def test_stack_records_scale_range():
    gen = torch.Generator().manual_seed(0)
    st = stack_fp4_experts(_experts(gen, 2, 64, 96, scale=0.02))
    assert st.emap._dspark_tc_ok
    w, s = _experts(gen, 1, 64, 96)[0][0]
    big = [((w, torch.full_like(s.view(torch.uint8), 129).view(s.dtype)),) + _experts(gen, 1, 64, 96)[0][1:]]
    assert not stack_fp4_experts(big).emap._dspark_tc_ok


def _h_reference(x, idx, w, exps, limit):
    """float64 h per pair from de-quantized weights, rounded to bf16 like the kernels."""
    out = []
    for t in range(idx.shape[0]):
        for j in range(idx.shape[1]):
            e = exps[int(idx[t, j])]
            w1, w3 = (dequant_fp4_experts(*p).double() for p in e[:2])
            g = (w1 @ x[t].double()).to(torch.bfloat16).double()
            u = (w3 @ x[t].double()).to(torch.bfloat16).double()
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            out.append((F.silu(g) * u * float(w[t, j])).to(torch.bfloat16))
    return torch.stack(out)


def _bf16_close(a, b):
    """Within one bf16 step of b (plus an absolute floor for values near zero)."""
    a, b = a.double().cpu(), b.double().cpu()
    return bool(((a - b).abs() <= b.abs() * 2 ** -7 + 1e-6 * b.abs().max()).all())


@pytest.fixture(scope="module")
def case():
    gen = torch.Generator().manual_seed(3)
    exps = _experts(gen, N, D, I, scale=0.02)
    cu = [tuple(tuple(a.cuda() for a in p) for p in ex) for ex in exps]
    return exps, stack_fp4_experts(cu)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T,k", [(1, 6), (3, 2), (8, 6)])
@pytest.mark.parametrize("split,warps,unroll", [
    ((1, 1), 1, 1), ((4, 2), 1, 1), ((3, 4), 2, 2), ((8, 1), 4, 1), ((4, 2), 1, 2), ((2, 1), 1, 4)])
def test_tc_gate_up_and_down_gpu(case, T, k, split, warps, unroll):
    exps, st = case
    gen = torch.Generator().manual_seed(T * 10 + k)
    x = torch.randn(T, D, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(N, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen) + 0.1
    h = tc.fp4_moe_tc_gate_up(x.cuda(), idx.cuda(), w.cuda(), st, 0.7, up_split=split[0],
                              warps=warps, unroll=unroll)
    assert _bf16_close(h, _h_reference(x, idx, w, exps, 0.7))
    y = tc.fp4_moe_tc_down(h, idx.cuda(), st, torch.bfloat16, down_split=split[1], warps=warps,
                           unroll=unroll)
    want = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            w2 = dequant_fp4_experts(*exps[int(idx[t, j])][2]).double()
            want[t] += (w2 @ h[t * k + j].double().cpu()).to(torch.bfloat16).double()
    assert rel_err(y.cpu(), want) < 4e-3
    # the whole call through fp4_moe_grouped (its tensor-core dispatch) vs this kernel
    grouped = fp4_moe_grouped(x.cuda(), idx.cuda(), w.cuda(), st, 0.7)
    assert rel_err(y.cpu(), grouped.cpu()) < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_tc_not_held_add_cast_and_graph_gpu(case):
    """Experts not held, the shared expert's add and the cast in the down launch, a graph
    replay: against the CUDA-core kernels (fp4_moe_grouped with a given block)."""
    exps, st = case
    gen = torch.Generator().manual_seed(5)
    T, k = 2, 6
    x = torch.randn(T, D, generator=gen).to(torch.bfloat16).cuda()
    idx = torch.stack([torch.randperm(N, generator=gen)[:k] for _ in range(T)]).cuda()
    w = (torch.rand(T, k, generator=gen) + 0.1).cuda()
    add = torch.randn(T, D, generator=gen).to(torch.bfloat16).cuda()
    assert tc.tc_applies(x, st, k)
    full = fp4_moe_grouped(x, idx, w, st, 0.7)
    part = st._replace(emap=torch.where(st.emap % 2 == 0, st.emap, -1))
    y = fp4_moe_grouped(x, idx, w, part, 0.7)
    cuda_core = dict(block=(4, 32))
    assert rel_err(y.cpu(), fp4_moe_grouped(x, idx, w, part, 0.7, **cuda_core).cpu()) < 1e-2
    assert not torch.equal(y, full)
    ycast = fp4_moe_grouped(x, idx, w, st, 0.7, add=add, out_dtype=torch.bfloat16, **cuda_core)
    got = fp4_moe_grouped(x, idx, w, st, 0.7, add=add, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and rel_err(got.cpu(), ycast.cpu()) < 1e-2
    assert torch.equal(got, (full + add.float()).to(torch.bfloat16))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = fp4_moe_grouped(x, idx, w, st, 0.7)
    for seed in range(2):
        x.copy_(torch.randn(T, D, generator=torch.Generator().manual_seed(seed)))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, fp4_moe_grouped(x, idx, w, st, 0.7))
