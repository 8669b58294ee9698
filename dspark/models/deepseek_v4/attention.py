"""DeepSeek-V4 attention for every layer type (spec §3.4, §3.7), reference path.

Single shared 512-d KV head (K = V), per-head unweighted q RMSNorm, interleaved RoPE on the last
64 dims, sparse softmax over window ∪ compressed entries with a per-head sink logit, inverse RoPE
on the output, grouped low-rank output projection. Window kv, compressor rows, compressed entries
and indexer keys are written into each request's position-indexed state before being read.
"""
from __future__ import annotations

import torch
from torch import nn

from .compressor import Compressor
from .fused import norm_rope
from .indexer import Indexer
from .norm import RMSNorm
from .rope import rope_for_layer
from .state import DenseState


class Attention(nn.Module):
    def __init__(self, cfg, layer_id: int, ratio: int):
        super().__init__()
        self.cfg, self.ratio = cfg, ratio
        d, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.n_heads, self.head_dim, self.window = H, hd, cfg.sliding_window
        self.wq_a = nn.Linear(d, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, H * hd, bias=False)
        self.wkv = nn.Linear(d, hd, bias=False)
        self.kv_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.wo_a = nn.Linear(H * hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, d, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(H))
        self.rope = rope_for_layer(cfg, ratio)
        if ratio:
            self.compressor = Compressor(d, hd, ratio, cfg.rms_norm_eps)
        if ratio == 4:
            self.indexer = Indexer(cfg)

    # ---- projections shared by every backend --------------------------------------------
    # ``bound`` (optional, here and below): a host-side int > every position, so RoPE needs no
    # device->host sync to size its table; ``memo``: the forward's RoPE-row memo (Rope.rows).
    # Norm + RoPE chains go through fused.norm_rope (one kernel on CUDA).

    def fused_rows(self, x):
        """(xq, xkv): x's wq_a and wkv rows from one GEMM when quantized weights were row-stacked
        at load (qlinear.fuse_same_input_linears); (None, None) otherwise."""
        fused = self.__dict__.get("_fused_rows")
        if fused is None:
            return None, None
        return fused(x).split((self.wq_a.out_features, self.wkv.out_features), dim=-1)

    def query_latent(self, x, xq=None):
        """cq = q_norm(wq_a x) (xq: wq_a x when already computed)."""
        return self.q_norm(self.wq_a(x) if xq is None else xq)

    def queries_from_latent(self, cq, positions, dtype, bound=None, memo=None):
        """Per-head normalised, rotated queries [T, H, hd] in dtype from the latent cq."""
        q = self.wq_b(cq).view(-1, self.n_heads, self.head_dim)
        return norm_rope(q, self.rope, positions, "unweighted", self.cfg.rms_norm_eps,
                         bound=bound, memo=memo, dtype=dtype)

    def project_q(self, x, positions, bound=None, memo=None, xq=None):
        cq = self.query_latent(x, xq)
        return cq, self.queries_from_latent(cq, positions, x.dtype, bound, memo)

    def project_kv(self, x, positions, quant, bound=None, memo=None, xkv=None):
        kv = norm_rope(self.wkv(x) if xkv is None else xkv, self.rope, positions, self.kv_norm,
                       bound=bound, memo=memo, dtype=x.dtype)
        return kv if quant is None else quant.kv(kv)

    def project_q_kv(self, x, positions, quant, bound=None, memo=None):
        """(cq, q, kv): project_q and project_kv of the same x; with quantized weights row-stacked
        at load (qlinear.fuse_same_input_linears) wq_a and wkv run as one GEMM."""
        xq, xkv = self.fused_rows(x)
        cq, q = self.project_q(x, positions, bound, memo, xq)
        return cq, q, self.project_kv(x, positions, quant, bound, memo, xkv)

    def finish_entries(self, pooled, j0: int, comp: Compressor, dtype, quant, indexer: bool):
        """norm -> RoPE at position j*ratio -> quantisation of freshly pooled entries j0, j0+1..."""
        n = pooled.shape[0]
        pos = torch.arange(j0, j0 + n, device=pooled.device) * self.ratio
        return self.finish_entries_at(pooled, pos, (j0 + n) * self.ratio, comp, dtype, quant,
                                      indexer)

    def finish_entries_at(self, pooled, positions, bound: int, comp: Compressor, dtype, quant,
                          indexer: bool):
        """The same for entries at any `positions` (j*ratio each; host int `bound` > all)."""
        e = norm_rope(pooled, self.rope, positions, comp.norm, bound=bound, dtype=dtype)
        if quant is not None:
            e = quant.indexer(e).to(dtype) if indexer else quant.kv(e)
        return e

    def output(self, o, positions, dtype, bound=None, memo=None, rotated=False):
        """Inverse RoPE, then the grouped low-rank projection. o [T, H, hd] -> [T, D].
        rotated: o is already inversely rotated and in dtype (the attention kernels did it)."""
        if not rotated:
            o = norm_rope(o, self.rope, positions, inverse=True, bound=bound, memo=memo,
                          dtype=dtype)
        G = self.cfg.o_groups
        if hasattr(self.wo_a, "grouped"):      # quantized weights (dspark.models.qlinear)
            z = self.wo_a.grouped(o.reshape(o.shape[0], G, -1), G)
        else:
            wa = self.wo_a.weight.view(G, self.cfg.o_lora_rank, -1)
            z = torch.einsum("tgi,gri->tgr", o.reshape(o.shape[0], G, -1), wa)
        return self.wo_b(z.flatten(1))

    # ---- reference forward over dense per-request state ---------------------------------
    def forward(self, x, batch, layer_id: int, quant=None):
        pos = batch.positions
        bound, memo = getattr(batch, "position_bound", None), getattr(batch, "rope_memo", None)
        cq, q, kv = self.project_q_kv(x, pos, quant, bound, memo)
        if self.ratio:
            a, z = self.compressor.rows(x, pos)
        if self.ratio == 4:
            qi, wi = self.indexer.queries(x, cq, pos, self.rope, quant, bound, memo)
            ia, iz = self.indexer.compressor.rows(x, pos)
        out = torch.empty(q.shape, dtype=torch.float32, device=x.device)
        for seg in batch.segments:
            sl = slice(seg.offset, seg.offset + seg.length)
            s, e = seg.start, seg.start + seg.length
            st = seg.state.layers[layer_id]
            DenseState.write(st, "kv", s, kv[sl])
            keys, mask = self._window(st, pos[sl], s, e)
            if self.ratio:
                m = self.ratio
                DenseState.write(st, "comp_a", s, a[sl])
                DenseState.write(st, "comp_z", s, z[sl], fill=float("-inf"))
                j0, j1 = s // m, e // m
                if j1 > j0:
                    pooled = self.compressor.pool(st.comp_a, st.comp_z, j0, j1)
                    DenseState.write(st, "entries", j0, self.finish_entries(
                        pooled, j0, self.compressor, x.dtype, quant, indexer=False))
                ents = st.entries[:j1] if j1 else kv.new_zeros(0, self.head_dim)
                if self.ratio == 4:
                    DenseState.write(st, "idx_a", s, ia[sl])
                    DenseState.write(st, "idx_z", s, iz[sl], fill=float("-inf"))
                    if j1 > j0:
                        pooled = self.indexer.compressor.pool(st.idx_a, st.idx_z, j0, j1)
                        DenseState.write(st, "idx_keys", j0, self.finish_entries(
                            pooled, j0, self.indexer.compressor, x.dtype, quant, indexer=True))
                    ikeys = st.idx_keys[:j1] if j1 else qi.new_zeros(0, qi.shape[-1])
                    cmask = self.indexer.select(qi[sl], wi[sl], ikeys, pos[sl], 4, self.indexer.topk)
                else:
                    cmask = torch.arange(j1, device=x.device)[None, :] < ((pos[sl] + 1) // m)[:, None]
                keys = torch.cat([keys, ents.to(keys.dtype)], 0)
                mask = torch.cat([mask, cmask], 1)
            out[sl] = sparse_attention_with_sink(q[sl], keys, mask, self.attn_sink,
                                                 self.head_dim ** -0.5)
        return self.output(out, pos, x.dtype, bound, memo)

    def _window(self, st, qpos, s: int, e: int):
        """Window keys for queries at qpos (inside [s, e)): positions max(0,p-W+1)..p."""
        lo = max(0, s - self.window + 1)
        keys = st.kv[lo:e]
        kpos = torch.arange(lo, e, device=qpos.device)
        mask = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - self.window)
        return keys, mask


def sparse_attention_with_sink(q, keys, mask, sink, scale):
    """o_h = sum_j e^{l_hj} k_j / (sum_j e^{l_hj} + e^{sink_h}), l = scale * q.k over mask.

    q [L, H, d], keys [N, d] (K = V), mask [L, N] bool, sink [H]. Returns fp32 [L, H, d].
    """
    logits = torch.einsum("lhd,nd->lhn", q.float(), keys.float()) * scale
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    sink_col = sink.float()[None, :, None].expand(q.shape[0], -1, 1)
    probs = torch.softmax(torch.cat([logits, sink_col], -1), dim=-1)[..., :-1]
    return torch.einsum("lhn,nd->lhd", probs, keys.float())
