"""Lightning indexer (spec §3.6): picks the top-k compressed entries for every query of a
ratio-4 (CSA) layer: score(p, j) = sum_h w_h * relu(q_h . K_j) over visible entries j."""
import torch
import torch.nn.functional as F
from torch import nn

from .compressor import Compressor
from .fused import norm_rope


def topk_lowest_ties(scores: torch.Tensor, k: int):
    """(values, column ids) of the k largest scores per row, equal scores taken lowest column
    first. torch.topk breaks ties in an order that depends on the row length and the device, so
    the same visible entries scored over a padded row (a CUDA-graph bucket, another backend)
    could select a different set than the unpadded row; a stable descending sort makes the
    choice a function of the scores alone (ReLU-summed indexer scores do tie exactly, e.g. at 0)."""
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


class Indexer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(cfg.hidden_size, self.head_dim, 4, cfg.rms_norm_eps)

    def queries(self, x, cq, positions, rope, quant, bound=None, memo=None):
        """Index queries [T, Hi, d] (fp32) and head weights [T, Hi] (fp32). ``bound``, ``memo``:
        see Rope.rows."""
        return (self.index_queries(cq, positions, rope, quant, bound, memo),
                self.head_weights(x))

    def index_queries(self, cq, positions, rope, quant, bound=None, memo=None):
        """The index queries [T, Hi, d] (fp32) from the query latent cq."""
        q = self.wq_b(cq).view(-1, self.n_heads, self.head_dim)
        q = norm_rope(q, rope, positions, bound=bound, memo=memo, out_dtype=torch.float32)
        return q if quant is None else quant.indexer(q)

    def head_weights(self, x):
        """The per-head score weights [T, Hi] (fp32) from the layer input x (no cq needed)."""
        return F.linear(x, self.weights_proj.weight).float() * (self.head_dim * self.n_heads) ** -0.5

    @staticmethod
    def select(q, w, keys, positions, ratio: int, topk: int) -> torch.Tensor:
        """Boolean mask [L, n_entries] of the entries each query attends to.

        q [L, Hi, d], w [L, Hi], keys [n_entries, d], positions [L]. Entry j is visible to p iff
        (j+1)*ratio - 1 <= p; among visible entries keep the top-k scores (all of them if fewer).
        """
        n = keys.shape[0]
        visible = torch.arange(n, device=q.device)[None, :] < ((positions + 1) // ratio)[:, None]
        if n == 0:
            return visible
        scores = (torch.einsum("lhd,jd->lhj", q, keys.float()).relu() * w[:, :, None]).sum(1)
        scores = scores.masked_fill(~visible, float("-inf"))
        k = min(topk, n)
        top = topk_lowest_ties(scores, k)[1]
        chosen = torch.zeros_like(visible).scatter_(1, top, True)
        return chosen & visible
