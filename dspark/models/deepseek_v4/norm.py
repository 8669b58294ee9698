"""RMSNorm computed in fp32 (weights may be stored bf16).

`F.rms_norm` on fp32 input is one aten op (fused on recent CUDA builds) instead of six, with the
same formula x·rsqrt(mean(x²) + eps)·w. The input is cast to fp32 first so the weight multiply
also happens in fp32 and the result is rounded to x.dtype once, as the reference does.
"""
import torch
import torch.nn.functional as F
from torch import nn


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMS normalisation in fp32 (used per query head and inside mHC)."""
    x = x.float()
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)
