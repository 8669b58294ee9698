"""linear_fp32: the fp32 logits of a 16-bit head without an fp32 copy of the head per call."""
import pytest
import torch
import torch.nn.functional as F

from dspark.models.deepseek_v4 import norm
from dspark.models.deepseek_v4.norm import linear_fp32


def test_linear_fp32_cpu_is_the_fp32_reference():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    w = torch.randn(100, 64, generator=gen).bfloat16()
    y = linear_fp32(x, w)
    assert y.dtype == torch.float32 and y.shape == (3, 100)
    assert torch.equal(y, F.linear(x.float(), w.float()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 6, 48])
def test_linear_fp32_cuda_bf16_head_matches_fp32(T):
    """V4-Flash head width: cuBLAS bf16 x bf16 -> fp32 equals the fp32 GEMM of the same values to
    summation order, and the fast path (no fp32 head copy) is the one taken."""
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, 4096, generator=gen).bfloat16().cuda()
    w = (torch.randn(32768, 4096, generator=gen) * 0.02).bfloat16().cuda()
    with torch.no_grad():
        y = linear_fp32(x, w)
        ref = F.linear(x.float(), w.float())
    assert norm._MM_OUT_DTYPE[0], "torch.mm(out_dtype=float32) failed: the head is cast per call"
    assert y.dtype == torch.float32
    assert (y - ref).abs().max().item() <= 1e-5 * ref.abs().max().item() + 1e-6
