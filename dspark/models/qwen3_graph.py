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
* logits (and the drafter's taps) land in static output buffers; all graphs share one memory
  pool, and are captured lazily the first time their shape is needed, with the step's real
  inputs (the warm-up run's K/V writes are the same values the replay writes).

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

from ..compile_stats import count_capture, count_fallback, target_fallback_reason
from ..cuda.graph_capture import capture, pow2_buckets, step_bucket, warm_up
from ..kernels.paged_gqa_decode import paged_gqa_attention_torch
from .qwen3 import apply_rope, rope_cos_sin


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


class DecodeGraphs:
    """Runs uniform-length steps (every request feeds q ∈ `q_lens` tokens) through
    `decode_forward`, captured as one CUDA graph per (batch bucket, q, page bucket)."""

    def __init__(self, model, cache, q_lens=(1,), max_batch: int = 32, tap_layers=(),
                 capture: bool | None = None, kernels: str | None = None):
        if cache.scratch_slot is None:
            raise ValueError("DecodeGraphs needs a PagedGQACache with scratch_rows >= 1 (the "
                             "write target of batch-padding rows)")
        dev = cache.device
        self.model, self.cache, self.tap_layers = model, cache, tuple(tap_layers)
        self.capture = dev.type == "cuda" if capture is None else capture
        self.kernels = kernels or ("triton" if dev.type == "cuda" else "torch")
        if self.kernels not in ("triton", "torch"):
            raise ValueError(f"kernels={self.kernels!r}: use 'triton' or 'torch'")
        self.q_lens = frozenset(q_lens)
        self.qmax, self.max_batch = max(self.q_lens), max_batch
        self.batch_buckets = pow2_buckets(max_batch)
        bs = cache.block_size
        self.max_pages = min(cache.num_blocks, -(-(model.cfg.max_position_embeddings + self.qmax) // bs))
        # the Triton attention reads only keys 0..pos whatever the table width, so one width
        # serves every context; the torch twin gathers all P pages, so it gets page buckets
        self.page_buckets = [self.max_pages] if self.kernels == "triton" else pow2_buckets(self.max_pages)
        self.rows = max_batch * self.qmax
        n_int = 3 * self.rows + max_batch * self.max_pages
        self.ints = torch.zeros(n_int, dtype=torch.long, device=dev)
        self.host = np.zeros(n_int, dtype=np.int64)
        D, V = model.cfg.hidden_size, model.cfg.vocab_size
        self.logits_out = torch.zeros(self.rows, V, dtype=torch.float32, device=dev)
        self.taps_out = (torch.zeros(self.rows, len(self.tap_layers) * D, dtype=model.embed.weight.dtype,
                                     device=dev) if self.tap_layers else None)
        self.graphs: dict = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.num_replays = 0        # steps served by this path (graph replays or static eager runs)

    # ---- shapes ------------------------------------------------------------------------------
    def bucket(self, items):
        """(batch bucket, q, page bucket) for a list of (request id, start, tokens), or None when
        the step has to run eagerly."""
        return step_bucket(items, self.q_lens, self.batch_buckets, self.page_buckets,
                           self.cache.block_size)

    def _views(self, B: int, q: int, P: int):
        T, N = B * q, self.rows
        bt = self.ints[3 * N:3 * N + B * self.max_pages].view(B, self.max_pages)[:, :P]
        return self.ints[:T], self.ints[N:N + T], self.ints[2 * N:2 * N + T], bt

    def _forward(self, B: int, q: int, P: int):
        """The fixed-shape forward on the static buffers, results into the static outputs."""
        ids, pos, slots, bt = self._views(B, q, P)
        logits, taps = decode_forward(self.model, self.cache, ids, pos, slots, bt, q,
                                      self.tap_layers, self.kernels)
        self.logits_out[:B * q].copy_(logits)
        if taps is not None:
            self.taps_out[:B * q].copy_(taps)

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, items):
        """(logits fp32 [R·q, V], taps or None) for items = [(request id, start, tokens)], with
        the same cache bookkeeping and checks as `PagedGQABackend`; None if the step does not
        fit the fixed shapes (nothing is changed then)."""
        key = self.bucket(items)
        if key is None or len({rid for rid, _, _ in items}) != len(items):
            count_fallback(self, target_fallback_reason(items, self))
            return None                      # duplicates: let the eager path raise its error
        B, q, P = key
        c, R, N, bs = self.cache, len(items), self.rows, self.cache.block_size
        for rid, start, _ in items:          # check every request before changing any
            c.check_forward(rid, start, start + q)
        h = self.host
        ids, pos, slots = h[:N], h[N:2 * N], h[2 * N:3 * N]
        bt = h[3 * N:].reshape(self.max_batch, self.max_pages)
        for i, (rid, start, toks) in enumerate(items):
            table = c.page_table(rid)
            p = np.arange(start, start + q)
            rows = slice(i * q, (i + 1) * q)
            ids[rows], pos[rows] = toks, p
            slots[rows] = np.asarray(table)[p // bs] * bs + p % bs
            need = -(-(start + q) // bs)
            bt[i, :need] = table[:need]
        # padding rows: token 0 at position 0, reading page 0 (finite: the cache is zeroed) and
        # writing the scratch row that no request owns
        ids[R * q:B * q], pos[R * q:B * q], slots[R * q:B * q] = 0, 0, c.scratch_slot
        bt[R:B] = 0
        for rid, start, _ in items:
            c.begin_forward(rid, start, start + q)
        # one synchronous copy: pageable host memory may be rewritten as soon as it returns
        used = 3 * N + B * self.max_pages
        self.ints[:used].copy_(torch.from_numpy(h[:used]))
        if not self.capture:
            self._forward(B, q, P)
        else:
            self._graph(key).replay()
        self.num_replays += 1
        T = R * q
        taps = self.taps_out[:T].clone() if self.taps_out is not None else None
        return self.logits_out[:T].clone(), taps

    def _graph(self, key) -> torch.cuda.CUDAGraph:
        g = self.graphs.get(key)
        if g is None:
            # warm up outside the capture (Triton JIT, cuBLAS workspaces) on a side stream, with
            # this step's inputs already in place: its cache writes are the replay's writes
            warm_up(lambda: self._forward(*key))
            g, _ = capture(lambda: self._forward(*key), self.pool)
            self.graphs[key] = g
            count_capture(self)
        return g
