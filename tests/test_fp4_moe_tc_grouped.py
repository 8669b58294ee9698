"""Tensor-core FP4 MoE with the tokens of one expert in the MMA's columns (`fp4_moe_tc_grouped`):
inline PTX, so CUDA sm_90 runs it. On CPU: the generated PTX names the operands its constraints
declare, and every kernel variant assembles for sm_90 (Triton's own ptxas, no GPU needed). On the
GPU: h against float64 from the de-quantized weights and the output against the per-pair kernels
(`fp4_moe_tc`) for batches where experts repeat, padding blocks and experts not held, the shared
expert's add and the cast, the K splits, and a CUDA-graph replay with new routing == eager.
"""
from triton_env import needs_cuda  # noqa: F401 (before triton)

import inspect  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

import dspark.kernels.fp4_moe_tc as tc  # noqa: E402
import dspark.kernels.fp4_moe_tc_grouped as tcg  # noqa: E402
from dspark.kernels.fp4_moe import fp4_moe_grouped, stack_fp4_experts  # noqa: E402
from test_fp4_moe_grouped import _experts, rel_err  # noqa: E402
from test_fp4_moe_tc import _h_reference, _bf16_close  # noqa: E402

N, D, I = 12, 1024, 512


def test_ptx_operands_match_constraints():
    """pack 4: each tensor and each scalar is 4 registers; the asm reads the first of each
    scalar's, so the highest operand it names is the last scalar's first register."""
    for two in (True, False):
        cons = tcg._constraints(two).split(",")
        for unroll in (1, 2):
            asm = tcg._step_asm(two, unroll)
            used = {int(i) for i in re.findall(r"\$(\d+)", asm)}
            assert max(used) + 4 == len(cons)
            assert asm.count("mma.sync") == (16 if two else 8) * unroll
            assert "%laneid" in asm and "%tid.x" in asm
    src = inspect.getsource(tcg._block_gemm.fn)
    assert src.count("_UP_C") == 2 and src.count("_DOWN_C") == 2


def _ptxas_available() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        try:
            tool = get_ptxas(90)
        except TypeError:          # Triton before 3.7: one ptxas for every arch
            tool = get_ptxas()
        return os.path.exists(tool.path)
    except Exception:   # noqa: BLE001 (a Triton without the NVIDIA backend's binaries)
        return False


_ASSEMBLE = r"""
import inspect, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import dspark.kernels.fp4_moe_tc as tc
import dspark.kernels.fp4_moe_tc_grouped as tcg

cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "cuobjdump")
up = dict(x_ptr="*bf16", table_ptr="*i32", bexp_ptr="*i32", rw_ptr="*fp32", emap_ptr="*i32",
          w_ptr="*u8", s_ptr="*u8", h_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32", limit="fp32")
down = dict(h_ptr="*bf16", table_ptr="*i32", bexp_ptr="*i32", emap_ptr="*i32", w_ptr="*u8",
            s_ptr="*u8", y_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32")
cases = [(tcg._grouped_gate_up_kernel, up, dict(KSPLIT=2, WARPS=1, DT="bf16", UNROLL=2)),
         (tcg._grouped_gate_up_kernel, up, dict(KSPLIT=1, WARPS=2, DT="bf16", UNROLL=1)),
         (tcg._grouped_down_kernel, down, dict(NCH=1, WARPS=1, DT="bf16", UNROLL=2)),
         (tcg._grouped_down_kernel, down, dict(NCH=2, WARPS=1, DT="bf16", UNROLL=1)),
         (tc._tc_gate_up_kernel, dict(up, idx_ptr="*i64"), dict(KSPLIT=4, WARPS=1, DT="bf16",
                                                             UNROLL=2)),
         (tc._tc_down_kernel, dict(down, idx_ptr="*i64", out_ptr="*fp32", add_ptr="*fp32"),
          dict(NCH=2, KS=6, WARPS=1, DT="bf16", HAS_ADD=False, OUT_DT="fp32", UNROLL=2))]
with tempfile.TemporaryDirectory() as tmp:
    for fn, types, constexprs in cases:
        sig = {n: ("constexpr" if n in constexprs else types.get(n, "i32"))
               for n in inspect.signature(fn.fn).parameters}
        k = triton.compile(ASTSource(fn, sig, constexprs=constexprs),
                           target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": constexprs["WARPS"]})
        if os.path.exists(cuobjdump):
            path = os.path.join(tmp, "k.cubin")
            open(path, "wb").write(k.asm["cubin"])
            out = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True,
                                 text=True, check=True).stdout
            print(fn.fn.__name__, constexprs, re.search(r"REG:\d+ .*LOCAL:\d+", out).group(0))
"""


@pytest.mark.skipif(not _ptxas_available(), reason="Triton's ptxas is not installed")
def test_kernels_assemble_for_sm90():
    """ptxas accepts the PTX (inline asm included) of the grouped kernels' variants and of the
    per-pair kernels whose step asm they share, and none spills to local memory.
    In a child process: compiling for a GPU target needs Triton's compiler, which the
    interpreter the CPU kernel tests use replaces in this one."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", _ASSEMBLE], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for line in run.stdout.splitlines():
        assert line.endswith("LOCAL:0"), line


@pytest.fixture(scope="module")
def case():
    gen = torch.Generator().manual_seed(3)
    exps = _experts(gen, N, D, I, scale=0.02)
    cu = [tuple(tuple(a.cuda() for a in p) for p in ex) for ex in exps]
    return exps, stack_fp4_experts(cu)


def _batch(T, k, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(N, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen) + 0.1
    return x.cuda(), idx.cuda(), w.cuda()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T,k", [(1, 6), (3, 2), (16, 6), (40, 6)])
@pytest.mark.parametrize("cfg", [dict(), dict(up_split=4, down_split=2), dict(unroll=1),
                                 dict(warps=2, up_split=2)])
def test_grouped_matches_float64_and_the_per_pair_kernels_gpu(case, T, k, cfg):
    """12 experts: at 16 and 40 tokens every expert is chosen by many tokens (blocks of 8 full,
    and a last partial block per expert). h within one bf16 step of float64 from the
    de-quantized weights; the output within bf16 rounding of the per-pair kernels (their fp32
    sums differ in the last bits: the MMA's rounding of a column depends on the block's other
    columns, which the per-pair kernels fill with the same token), and the dispatch runs one of
    the two."""
    exps, st = case
    x, idx, w = _batch(T, k, T * 10 + k)
    got = tcg.fp4_moe_tc_grouped(x, idx, w, st, 0.7, **cfg)
    want = tc.fp4_moe_tc(x, idx, w, st, 0.7)
    assert got.dtype == torch.float32 and rel_err(got, want) < 4e-3
    h = torch.empty(T * k, I, dtype=torch.bfloat16, device="cuda")
    tcg.fp4_moe_tc_grouped(x, idx, w, st, 0.7, h_out=h, **cfg)
    if T <= 16:
        assert _bf16_close(h, _h_reference(x.cpu(), idx.cpu(), w.cpu(), exps, 0.7))
    routed = fp4_moe_grouped(x, idx, w, st, 0.7)       # the default splits
    assert torch.equal(routed, tcg.fp4_moe_tc_grouped(x, idx, w, st, 0.7)
                       if tcg.takes(T * k, N) else want)


@pytest.mark.gpu
@needs_cuda
def test_grouped_not_held_add_cast_and_graph_gpu(case):
    exps, st = case
    T, k = 24, 6
    x, idx, w = _batch(T, k, 7)
    add = torch.randn(T, D, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16).cuda()
    part = st._replace(emap=torch.where(st.emap % 3 == 0, -1, st.emap))
    held = tcg.fp4_moe_tc_grouped(x, idx, w, part, 0.7)
    assert rel_err(held, tc.fp4_moe_tc(x, idx, w, part, 0.7)) < 4e-3
    assert rel_err(held, tcg.fp4_moe_tc_grouped(x, idx, w, st, 0.7)) > 1e-2    # they count
    got = tcg.fp4_moe_tc_grouped(x, idx, w, st, 0.7, add=add, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    full = tcg.fp4_moe_tc_grouped(x, idx, w, st, 0.7)
    assert torch.equal(got, (full + add.float()).to(torch.bfloat16))
    g = torch.cuda.CUDAGraph()
    tcg.fp4_moe_tc_grouped(x, idx, w, st, 0.7)           # compiled before the capture
    with torch.cuda.graph(g):
        static = tcg.fp4_moe_tc_grouped(x, idx, w, st, 0.7)
    for seed in range(3):   # new activations and new routing (other blocks, other padding)
        x2, idx2, w2 = _batch(T, k, 100 + seed)
        x.copy_(x2), idx.copy_(idx2), w.copy_(w2)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, tcg.fp4_moe_tc_grouped(x, idx, w, st, 0.7))
