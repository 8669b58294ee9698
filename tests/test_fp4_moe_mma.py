"""Expert-grouped tensor-core FP4 MoE (`fp4_moe_mma`: pairs sorted into one-expert blocks by
`align_pairs`, dot_scaled swap-AB kernels). On CPU under TRITON_INTERPRET=1 at small shapes against
the per-expert loop (exact de-quantize + F.linear) and a float64 reference; on the GPU at V4-Flash
widths against the loop and the CUDA-core grouped kernels, eager and CUDA-graph replay."""
from triton_env import DEV, needs_cuda, triton_ok  # noqa: F401 (before triton)

import pytest  # noqa: E402
import torch  # noqa: E402

from dspark.kernels import fp4_moe_mma as mm  # noqa: E402
from dspark.kernels.fp4_moe import fp4_moe, fp4_moe_grouped, stack_fp4_experts  # noqa: E402
from dspark.formats.quant import quant_fp4  # noqa: E402
from test_fp4_moe_grouped import (D, I, _dev, _experts, _mv, _reference, _routing,  # noqa: E402
                                  _spread, rel_err)


@pytest.fixture(scope="module")
def experts():
    return _experts(torch.Generator().manual_seed(0))


def test_align_pairs_blocks_by_expert():
    idx = torch.tensor([[3, 1], [1, 0], [3, 3], [1, 4]])
    table, bexp = mm.align_pairs(idx, 6, block_t=2)
    # every pair exactly once, each block one expert, pairs of an expert in pair order
    got = {}
    for b, e in enumerate(bexp.tolist()):
        ps = [p for p in table[2 * b:2 * b + 2].tolist() if p >= 0]
        if e < 0:
            assert ps == []
            continue
        assert ps and all(int(idx.flatten()[p]) == e for p in ps)
        got.setdefault(e, []).extend(ps)
    assert got == {0: [3], 1: [1, 2, 6], 3: [0, 4, 5], 4: [7]}
    assert table.numel() == 2 * bexp.numel() >= 8 and table.dtype == torch.int32


@triton_ok
@pytest.mark.parametrize("T,k", [(1, 6), (3, 4), (9, 2)])
def test_mma_matches_per_expert_loop(experts, T, k):
    """bf16 x (the only dtype the kernels take): the interpreter multiplies the exact operands, so
    the result equals the per-expert loop's up to the fp32 sum of the k slots."""
    gen = torch.Generator().manual_seed(10 * T + k)
    st = stack_fp4_experts(_mv(experts))
    x = torch.randn(T, D, generator=gen).bfloat16()
    idx, w = _routing(gen, T, k)                     # expert 0 shared by every token
    y = mm.fp4_moe_mma(*_dev(x, idx, w), st, 0.7)
    assert y.shape == (T, D) and y.dtype == torch.float32
    loop = fp4_moe(x, idx, w, experts, 0.7, backend="torch", grouped=False)
    assert rel_err(y.cpu(), loop) < 1e-5
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
    assert rel_err(y.cpu(), loop) < 1e-5
    assert mm._block_k(4096, 2048) == 256 and mm._block_k(64, 96) == 32 and mm._block_k(48, 96) == 0
    assert mm.mma_applies(D, I) and not mm.mma_applies(40, 96)
    with pytest.raises(ValueError, match="multiples of BLOCK_K"):
        mm.fp4_moe_mma(*_dev(x, idx, w), st, 0.7, block=(32, 64))   # I = 96


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 6, 40])
def test_mma_flash_shapes_gpu(T):
    """V4-Flash widths: == the per-expert loop to bf16 rounding, == the CUDA-core grouped kernels
    (a given block: fp4_moe_grouped's CUDA-core path), fp4_moe_grouped dispatches to it where
    mma_takes says so, and a CUDA-graph replay with new inputs == eager."""
    gen = torch.Generator().manual_seed(T)
    n, k, d, inter = 8, 6, 4096, 2048
    # quantized on the GPU (the CPU quantization of flash-width experts takes most of a minute)
    cu = [tuple(quant_fp4((_spread(r, c, gen) * 0.02).cuda()) for r, c in
                ((inter, d), (inter, d), (d, inter))) for _ in range(n)]
    st = stack_fp4_experts(cu)
    x = torch.randn(T, d, generator=gen).bfloat16().cuda()
    idx = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(T)]).cuda()
    w = (torch.rand(T, k, generator=gen) + 0.1).cuda()
    y = mm.fp4_moe_mma(x, idx, w, st, 10.0)
    loop = fp4_moe(x, idx, w, cu, 10.0, grouped=False)
    assert rel_err(y, loop.float()) < 2e-2
    fma = fp4_moe_grouped(x, idx, w, st, 10.0, block=(4, 32))
    assert rel_err(y, fma) < 2e-2
    from dspark.kernels.fp4_moe_tc import tc_applies
    if mm.mma_takes(T) and not tc_applies(x, st, k):
        assert torch.equal(fp4_moe_grouped(x, idx, w, st, 10.0), y)   # dispatch, deterministic
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        mm.fp4_moe_mma(x, idx, w, st, 10.0)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ys = mm.fp4_moe_mma(x, idx, w, st, 10.0)
    x.copy_(torch.randn(T, d, generator=gen).bfloat16())
    idx.copy_(torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(T)]))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(ys, mm.fp4_moe_mma(x, idx, w, st, 10.0))


def test_mma_takes_over_from_the_cuda_core_kernels_by_tokens():
    """Where the tensor-core decode kernels do not apply, the expert-grouped path starts at
    MMA_MIN_TOKENS tokens; the tensor-core kernels group by expert from
    MIN_PAIRS_PER_EXPERT pairs per expert (V4-Flash: 256 experts, 6 slots: 26 tokens)."""
    from dspark.kernels import fp4_moe_tc_grouped as tcg
    assert not mm.mma_takes(mm.MMA_MIN_TOKENS - 1) and mm.mma_takes(mm.MMA_MIN_TOKENS)
    first = next(t for t in range(1, 512) if tcg.takes(6 * t, 256))
    assert first == 26 and not tcg.takes(6 * 25, 256)
