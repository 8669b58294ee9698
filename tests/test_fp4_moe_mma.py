"""Tensor-core grouped FP4 MoE (`fp4_moe_mma`: dot_scaled swap-AB kernels, slot sum by the last
arriving pair program). On CPU under TRITON_INTERPRET=1 at small shapes against the per-expert loop
(exact de-quantize + F.linear) and a float64 reference; on the GPU at V4-Flash widths against the
loop and the CUDA-core grouped kernels, eager and CUDA-graph replay."""
from triton_env import DEV, needs_cuda, triton_ok  # noqa: F401 (before triton)

import pytest  # noqa: E402
import torch  # noqa: E402

from dspark.kernels import fp4_moe_mma as mm  # noqa: E402
from dspark.kernels.fp4_moe import fp4_moe, fp4_moe_grouped, stack_fp4_experts  # noqa: E402
from dspark.kernels.fp8_gemm import _arrival_counters  # noqa: E402
from test_fp4_moe_grouped import (D, I, E, _dev, _experts, _mv, _reference, _routing,  # noqa: E402
                                  rel_err)


@pytest.fixture(scope="module")
def experts():
    return _experts(torch.Generator().manual_seed(0))


@triton_ok
@pytest.mark.parametrize("T,k", [(1, 6), (3, 4), (5, 2)])
def test_mma_matches_per_expert_loop(experts, T, k):
    """bf16 x (the only dtype the kernels take): the interpreter multiplies the exact operands,
    so the result equals the per-expert loop's bit for bit; every arrival counter is re-armed
    (a second launch, as a graph replay, gives the same output)."""
    gen = torch.Generator().manual_seed(10 * T + k)
    st = stack_fp4_experts(_mv(experts))
    x = torch.randn(T, D, generator=gen).bfloat16()
    idx, w = _routing(gen, T, k)
    for _ in range(2):
        y = mm.fp4_moe_mma(*_dev(x, idx, w), st, 0.7)
        assert y.shape == (T, D) and y.dtype == torch.float32
        assert int(_arrival_counters(y.device, 1).abs().sum()) == 0
        loop = fp4_moe(x, idx, w, experts, 0.7, backend="torch", grouped=False)
        assert rel_err(y.cpu(), loop) < 1e-2 and (y.cpu() != loop).float().mean() < 0.05
    assert rel_err(y.cpu(), _reference(x.float(), idx, w, experts, 0.7)) < 2e-2


@triton_ok
def test_mma_not_held_experts_and_block_choice(experts):
    held = [ex if e % 3 else None for e, ex in enumerate(experts)]
    st = stack_fp4_experts(_mv(held))
    gen = torch.Generator().manual_seed(5)
    T, k = 3, 4
    x = torch.randn(T, D, generator=gen).bfloat16()
    idx, w = _routing(gen, T, k)
    y = mm.fp4_moe_mma(*_dev(x, idx, w), st, 0.7, block=(32, 32))
    w_held = torch.where(idx % 3 == 0, torch.zeros_like(w), w)
    loop = fp4_moe(x, idx, w_held, experts, 0.7, backend="torch")
    assert rel_err(y.cpu(), loop) < 1e-2
    assert mm._block_k(4096, 2048) == 256 and mm._block_k(64, 96) == 32 and mm._block_k(48, 96) == 0
    assert mm.mma_applies(D, I) and not mm.mma_applies(40, 96)
    with pytest.raises(ValueError, match="multiples of BLOCK_K"):
        mm.fp4_moe_mma(*_dev(x, idx, w), st, 0.7, block=(32, 64))   # I = 96


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 6, 40])
def test_mma_flash_shapes_gpu(T, monkeypatch):
    """V4-Flash widths: == the per-expert loop to bf16 rounding, == the CUDA-core grouped kernels,
    the dispatcher picks it for bf16 under DSPARK_MOE_MMA=1, and a CUDA-graph replay with new inputs == eager."""
    gen = torch.Generator().manual_seed(T)
    n, k, d, inter = 16, 6, 4096, 2048
    exps = _experts(gen, n, d, inter, scale=0.02)
    cu = [tuple(tuple(a.cuda() for a in p) for p in ex) for ex in exps]
    st = stack_fp4_experts(cu)
    x = torch.randn(T, d, generator=gen).bfloat16().cuda()
    idx = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(T)]).cuda()
    w = (torch.rand(T, k, generator=gen) + 0.1).cuda()
    y = mm.fp4_moe_mma(x, idx, w, st, 10.0)
    loop = fp4_moe(x, idx, w, cu, 10.0, grouped=False)
    assert rel_err(y, loop.float()) < 2e-2
    fma = fp4_moe_grouped(x, idx, w, st, 10.0)                      # default: CUDA-core kernels
    assert rel_err(y, fma) < 2e-2
    monkeypatch.setenv("DSPARK_MOE_MMA", "1")
    assert torch.equal(fp4_moe_grouped(x, idx, w, st, 10.0), y)      # opt-in dispatch, deterministic
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ys = mm.fp4_moe_mma(x, idx, w, st, 10.0)
    x.copy_(torch.randn(T, d, generator=gen).bfloat16())
    idx.copy_(torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(T)]))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(ys, mm.fp4_moe_mma(x, idx, w, st, 10.0))
