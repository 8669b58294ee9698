"""Fixed-shape decode / verify forward of a Qwen3 target over a `PagedGQACache`, replayed as
CUDA graphs.

At batch 1 an eager decode step is launch-bound (hundreds of small kernels per layer issued from
Python). A step in which every request feeds the same number q of tokens (q = 1: plain decode;
q = 1 + γ: DSpark verify blocks) has a shape that only depends on (batch, q), so it is captured
once per (batch bucket, q, page bucket) and replayed:

* inputs live in one static int64 device buffer — token ids, positions, write slots [Bmax·qmax]
  and block tables [Bmax, Pmax] — filled by a single host→device copy per step; requests are
  padded up to the batch bucket with rows that read page 0 and write the cache's scratch row;
* `decode_forward` is the shape-static forward: RoPE tables once per step, K/V written with
  `index_copy_` at the slot list, attention by `paged_gqa_attention` (keys 0..pos read through
  the padded block table on the device) — no host syncs, no data-dependent shapes;
* logits, their rows' argmax and the drafter's taps land in static output buffers; capture,
  replay and fallbacks are `StepGraphs`' (models/step_graphs.py, shared with the DeepSeek-V4
  target): every bucket is captured ahead of traffic by `Engine.warmup()`, or on first use.

`kernels="triton"` (CUDA default) fuses RMSNorm and q/k-norm + RoPE (dspark.kernels.qwen3_norm);
`kernels="torch"` calls the model's own modules plus the torch twin of the attention, so on CPU
(`capture=False`) the same fixed-shape path runs eagerly and is checked against the eager paged
path in tests. Steps that do not fit (mixed prefill, unequal block lengths, too many requests or
pages) return None and the caller runs the eager path.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..kernels.paged_gqa_decode import paged_gqa_attention_torch
from ..sampling import argmax_rows
from .qwen3 import apply_rope, rope_cos_sin
from .step_graphs import StepGraphs


def decode_forward(model, cache, token_ids, positions, slots, block_tables, q_len: int,
                   tap_layers=(), kernels: str = "torch"):
    """Fixed-shape forward of B requests × q_len rows (T = B·q_len, request-major).

    token_ids / positions / slots int64 [T]: what each row feeds, its absolute position and the
    pool row its K/V go to; block_tables int [B, P] covering positions 0..max(positions) of each
    request (padding entries may be anything valid). Returns (logits fp32 [T, V], taps
    [T, len(tap_layers)·D] or None) with `Qwen3Model.forward_hidden`'s tap convention."""
    fused = kernels == "triton"
    if fused:
        from ..kernels.paged_gqa_decode import paged_gqa_attention as attention
        from ..kernels.qwen3_norm import head_norm_rope, rms_norm
        norm = lambda mod, x: rms_norm(x, mod.weight, mod.eps)                   # noqa: E731
        norm_rope = lambda mod, x, c, s: head_norm_rope(x, mod.weight, mod.eps, c, s)  # noqa: E731
    else:
        attention = paged_gqa_attention_torch
        norm = lambda mod, x: mod(x)                                              # noqa: E731
        norm_rope = lambda mod, x, c, s: apply_rope(mod(x), c, s)                 # noqa: E731
    cfg = model.cfg
    T, d, bs = token_ids.shape[0], cfg.head_dim, cache.block_size
    h = model.embed(token_ids)
    # one RoPE table per step (the eager path builds it per projection), cast once
    cos, sin = (t.to(h.dtype) for t in rope_cos_sin(positions, d, cfg.rope_theta))
    want, taps, last = set(tap_layers), {}, cfg.num_hidden_layers - 1
    if -1 in want:
        taps[-1] = h
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        x = norm(layer.input_layernorm, h)
        q = norm_rope(a.q_norm, a.q_proj(x).view(T, a.nq, d), cos, sin)
        k = norm_rope(a.k_norm, a.k_proj(x).view(T, a.nkv, d), cos, sin)
        v = a.v_proj(x).view(T, a.nkv, d)
        K, V = cache.k[i], cache.v[i]
        K.index_copy_(0, slots, k.to(K.dtype))
        V.index_copy_(0, slots, v.to(V.dtype))
        o = attention(q, K, V, block_tables, positions, q_len, bs)
        h = h + a.o_proj(o.reshape(T, -1))
        h = h + layer.mlp(norm(layer.post_attention_layernorm, h))
        if i in want:
            taps[i] = norm(model.norm, h) if i == last else h
    logits = F.linear(norm(model.norm, h), model.head.weight).float()
    return logits, (torch.cat([taps[i] for i in tap_layers], -1) if tap_layers else None)


class Qwen3DecodeGraphs(StepGraphs):
    """Uniform-length steps (every request feeds q ∈ `q_lens` tokens) through `decode_forward`,
    captured as one CUDA graph per (batch bucket, q, page bucket) (the `StepGraphs`
    machinery). Input words: token ids, positions and write slots [rows], block tables
    [max_batch, max_pages]."""

    def __init__(self, model, cache, q_lens=(1,), max_batch: int = 32, tap_layers=(),
                 capture: bool | None = None, kernels: str | None = None):
        if cache.scratch_slot is None:
            raise ValueError("Qwen3DecodeGraphs needs a PagedGQACache with scratch_rows >= 1 "
                             "(the write target of batch-padding rows)")
        kernels = kernels or ("triton" if cache.device.type == "cuda" else "torch")
        if kernels not in ("triton", "torch"):
            raise ValueError(f"kernels={kernels!r}: use 'triton' or 'torch'")
        self.kernels = kernels
        qmax = max(int(x) for x in q_lens)
        pages = min(cache.num_blocks,
                    -(-(model.cfg.max_position_embeddings + qmax) // cache.block_size))
        # the Triton attention reads only keys 0..pos whatever the table width, so one width
        # serves every context; the torch twin gathers all P pages, so it gets page buckets
        page_buckets = [pages] if kernels == "triton" else None
        rows = max_batch * qmax
        super().__init__(model, cache, q_lens, max_batch, tap_layers, capture, pages,
                         page_buckets, 3 * rows + max_batch * pages, model.embed.weight.dtype)

    def _words(self, key) -> int:
        return 3 * self.rows + key[0] * self.max_pages

    def _views(self, buf, B: int, q: int, P: int):
        T, N = B * q, self.rows
        bt = buf[3 * N:3 * N + B * self.max_pages].reshape(B, self.max_pages)[:, :P]
        return buf[N:N + T], buf[2 * N:2 * N + T], bt

    def _forward(self, B: int, q: int, P: int):
        """The fixed-shape forward on the static buffers, results into the static outputs."""
        T = B * q
        pos, slots, bt = self._views(self.ints, B, q, P)
        logits, taps = decode_forward(self.model, self.cache, self.ints[:T], pos, slots, bt, q,
                                      self.tap_layers, self.kernels)
        self.logits_out[:T].copy_(logits)
        argmax_rows(self.logits_out[:T], out=self.argmax_out[:T])
        if taps is not None:
            self.taps_out[:T].copy_(taps)

    def _fill_inputs(self, items, key) -> bool:
        """Positions, write slots and block tables; padding rows: position 0, reading page 0
        (finite: the cache is zeroed) and writing the scratch row that no request owns."""
        B, q, P = key
        c, R, bs = self.cache, len(items), self.cache.block_size
        pos, slots, bt = self._views(self.host, B, q, self.max_pages)
        for i, (rid, start, _) in enumerate(items):
            table = c.page_table(rid)
            need = -(-(start + q) // bs)
            if len(table) < need:
                return False
            p = np.arange(start, start + q)
            rows = slice(i * q, (i + 1) * q)
            pos[rows] = p
            slots[rows] = np.asarray(table)[p // bs] * bs + p % bs
            bt[i, :need] = table[:need]
        pos[R * q:], slots[R * q:] = 0, c.scratch_slot
        bt[R:] = 0
        return True
