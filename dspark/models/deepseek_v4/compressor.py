"""KV compressor (spec §3.5): gated softmax pooling of `ratio` token rows into one entry.

Rows (a_t, z_t + ape[t mod ratio]) are stored per position; an entry j is (re)computed whenever
its last token (j+1)*ratio-1 is in the forward, from rows that are all <= that token. Ratio 4
uses the overlapping form: each entry pools the A-halves of the previous window and the
B-halves of its own window (8 slots).
"""
import torch
import torch.nn.functional as F
from torch import nn

from .norm import RMSNorm, derived, fp32, linear_fp32


def gated_pool(a: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """sum_s softmax_s(z) * a over the slot axis 1 of a, z [n, slots, d] -> [n, d].

    The softmax runs over the *last* dim of the transposed view: CUDA's softmax over a middle
    dim (cunn_SpatialSoftMaxForward) takes ~24 us for one decode step's [1, 8, 512] here, the
    last-dim kernel on a contiguous copy a few us. Same per-(n, d) formula, same values up to
    the order of the 8-term sums."""
    w = torch.softmax(z.transpose(1, 2), dim=-1)          # [n, d, slots]
    return (w * a.transpose(1, 2)).sum(-1)


class Compressor(nn.Module):
    def __init__(self, dim: int, out_dim: int, ratio: int, eps: float):
        super().__init__()
        self.ratio, self.out_dim = ratio, out_dim
        self.overlap = ratio == 4
        c = 2 if self.overlap else 1
        self.wkv = nn.Linear(dim, c * out_dim, bias=False)
        self.wgate = nn.Linear(dim, c * out_dim, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, c * out_dim))
        self.norm = RMSNorm(out_dim, eps)

    def rows(self, x: torch.Tensor, positions: torch.Tensor):
        """Per-token rows (a [T, c*d], z [T, c*d]) in fp32: `rows_raw` plus the position term
        ape[t mod ratio] on z."""
        a, z = self.rows_raw(x)
        return a, z + fp32(self.ape)[positions % self.ratio]

    def rows_raw(self, x: torch.Tensor):
        """(a, z) rows without the ape term (the fixed-shape step's fused pool adds it).

        fp32 x·Wᵀ of both projections in one GEMM over the stacked [wkv; wgate] weight (kept
        while both are unchanged, `derived`); on CUDA that GEMM multiplies the bf16 values with
        fp32 accumulation and output (`linear_fp32`): the products are exact either way, so only
        the summation order differs from F.linear(x.float(), w.float()), without an fp32 copy
        of the weights or a cast of x."""
        wkv, wgate = self.wkv.weight, self.wgate.weight
        if type(self.wkv) is nn.Linear and type(self.wgate) is nn.Linear:
            w = derived(self, "_wcat", (wkv, wgate), lambda: torch.cat([wkv, wgate]))
            a, z = linear_fp32(x, w, skinny=True).split(wkv.shape[0], dim=-1)
        else:                                   # e.g. sharded / quantized projections
            xf = x.float()
            a, z = F.linear(xf, fp32(wkv)), F.linear(xf, fp32(wgate))
        return a, z

    def pool(self, a: torch.Tensor, z: torch.Tensor, j0: int, j1: int) -> torch.Tensor:
        """Pooled (un-normalised) entries j0..j1-1 from position-indexed rows a, z [>= j1*ratio, c*d]."""
        m, d = self.ratio, self.out_dim
        if not self.overlap:
            av = a[j0 * m: j1 * m].view(j1 - j0, m, d)
            zv = z[j0 * m: j1 * m].view(j1 - j0, m, d)
            return gated_pool(av, zv)
        lo = max(j0 - 1, 0) * m                    # A-halves come from the previous window
        av = a[lo: j1 * m].view(-1, m, 2 * d)
        zv = z[lo: j1 * m].view(-1, m, 2 * d)
        if j0 == 0:                                # entry 0 has no previous window: empty A-slots
            av = torch.cat([torch.zeros_like(av[:1]), av], 0)
            zv = torch.cat([torch.full_like(zv[:1], float("-inf")), zv], 0)
        a_slots = torch.cat([av[:-1, :, :d], av[1:, :, d:]], dim=1)   # [n, 8, d]
        z_slots = torch.cat([zv[:-1, :, :d], zv[1:, :, d:]], dim=1)
        return gated_pool(a_slots, z_slots)
