"""The attention-backend interface over the paged DeepSeek-V4 cache (dspark/kvcache/paged.py).

One forward = one flattened ragged batch: any mix of prefill chunks, single decode tokens and
verify blocks, one contiguous run of new positions per request. Per layer the model calls:

    md = backend.plan(batch)                               # once per forward (host side)
    backend.write_window(md, layer, kv)                    # window kv of every new token
    wins = backend.write_compressor_rows(md, layer, kind, a, z)   # compressor rows; returns the
    backend.write_entries(md, layer, kind, entries)        #   windows to pool, entries go back
    sel = backend.select(md, layer, q_idx, w_idx, topk)    # CSA: indexer top-k (local ids, -1 pad)
    o = backend.attend(md, layer, q, sink, scale, sel)     # sparse MQA + sink, window ∪ entries

(dspark/attention/layer.py is that per-layer sequence; entry emission math stays in the model's
compressor / indexer code.) The metadata is FlashMLA-shaped on purpose: per token a window index
list into the SWA pool ("main cache") and an index list into the layer's compressed-entry pool
("extra cache"), global ids ``page * entries_per_page + row``, -1 = masked, plus the sink. A
FlashMLA MODEL1 sparse-decode backend therefore only implements ``sparse_mqa`` (and ``store`` /
``select`` if it wants its own kernels); the model does not change.

Backends subclass ``AttentionBackend`` and implement three storage hooks: ``store`` (write rows
into a pool), ``select`` and ``sparse_mqa``. (The FlashMLA backend, flashmla.py, reads these
pools in place: its kernels take any entries-per-page, so the ring layout needs no change.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.kvcache.paged import PagedKVCache, copy_rows

from .layer import make_attn_fn
from .plan import AttnMetadata, build_plan


@dataclass
class PoolWindow:
    """Compressor rows that emit entries j0..j1-1 of one request: a, z [(j1-jb)*ratio, c*d]
    hold positions jb*ratio .. j1*ratio-1 in order; pool them with
    Compressor.pool(a, z, j0 - jb, j1 - jb)."""
    j0: int
    j1: int
    jb: int
    a: torch.Tensor
    z: torch.Tensor


def global_ids(local: torch.Tensor, req_index: torch.Tensor, page_table: torch.Tensor,
               per_page: int) -> torch.Tensor:
    """Request-local entry numbers [T, K] (-1 = none) -> global ids page*per_page + row."""
    valid = local >= 0
    j = torch.where(valid, local, 0).long()
    pages = page_table.long()[req_index[:, None], j // per_page]
    return torch.where(valid, pages * per_page + j % per_page, -1)


class AttentionBackend:
    name = "base"

    def __init__(self, cache: PagedKVCache):
        self.cache = cache

    # ---- storage hooks (per backend) --------------------------------------------------------
    def store(self, pool: torch.Tensor, per_page: int, ids: torch.Tensor, x: torch.Tensor):
        """Write rows x [n, 512] (kv / entries) or [n, 128] (indexer keys) at global ids [n]."""
        raise NotImplementedError

    def select(self, md: AttnMetadata, layer: int, q: torch.Tensor, w: torch.Tensor,
               topk: int) -> torch.Tensor:
        """Indexer top-k: q [T, H_I, 128], w [T, H_I] -> int64 [T, topk] request-local entry
        ids among j < n_visible[t], -1 padded, order unspecified."""
        raise NotImplementedError

    def sparse_mqa(self, md, q, window_pool, capacity, window_ids, entry_pool, per_page,
                   entry_ids, entry_lens, sink, scale) -> torch.Tensor:
        """o [T, H, 512] fp32 = softmax-with-sink attention of q [T, H, 512] over the rows at
        window_ids [T, W] of window_pool and entry_ids [T, K] (first entry_lens[t] only, when
        given) of entry_pool; -1 ids are masked. entry_pool is None for SWA-only layers."""
        raise NotImplementedError

    # ---- the interface the model's layer function calls ------------------------------------
    def forward_fn(self, batch):
        """plan(batch) and return the ``attn_fn`` hook for DeepseekV4Model.forward_hidden."""
        return make_attn_fn(self, self.plan(batch))

    def plan(self, batch) -> AttnMetadata:
        """Validate the batch against the cache, advance each request's length, build the
        per-forward metadata (plan.py)."""
        return build_plan(self.cache, batch)

    def write_window(self, md: AttnMetadata, layer: int, kv: torch.Tensor) -> None:
        """Store the window kv [T, 512] of this forward's tokens (staging; attend moves them
        into the rings)."""
        self.store(self.cache.swa[layer], self.cache.capacity, md.stage_ids, kv)

    def write_compressor_rows(self, md: AttnMetadata, layer: int, kind: str, a: torch.Tensor,
                              z: torch.Tensor) -> list:
        """Store compressor rows a, z [T, c*d] (fp32, z incl. ape) of kind 'main' / 'indexer'
        and return one PoolWindow per request that completes entries in this forward."""
        rp = md.ratios[self.cache.ratios[layer]]
        ring_a, ring_z = self.cache.comp_rows[layer, kind]
        wins = []
        if rp.emits:             # (most decode steps complete no entry: no gather at all)
            old_a, old_z = ring_a[rp.ring_read], ring_z[rp.ring_read]  # read before overwriting
            wins = [PoolWindow(e.j0, e.j1, e.jb,
                               torch.cat([old_a[slice(*e.ring)], a[slice(*e.toks)]]),
                               torch.cat([old_z[slice(*e.ring)], z[slice(*e.toks)]]))
                    for e in rp.emits]
        ring_a[rp.persist_dst] = a[rp.persist_src]
        ring_z[rp.persist_dst] = z[rp.persist_src]
        return wins

    def write_entries(self, md: AttnMetadata, layer: int, kind: str, entries: torch.Tensor):
        """Store freshly emitted entries [E, 512] ('main') or indexer keys [E, 128], in the
        order of write_compressor_rows' windows."""
        rp = md.ratios[self.cache.ratios[layer]]
        pool = self.cache.entries[layer] if kind == "main" else self.cache.index_keys[layer]
        self.store(pool, rp.per_page, rp.emit_slots, entries)

    def attend(self, md: AttnMetadata, layer: int, q: torch.Tensor, sink: torch.Tensor,
               scale: float, selected: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, 512] over window ∪ compressed entries (CSA: ``selected`` local ids from
        select; HCA: all visible) -> fp32 [T, H, 512]. Afterwards this forward's window rows
        join the rings: only now has every query read the ring rows they replace."""
        c = self.cache
        o = self.sparse_mqa(md, q, c.swa[layer], c.capacity, md.window_ids,
                            *self.entry_lists(md, layer, selected), sink, scale)
        copy_rows(c.swa[layer], c.capacity, md.ring_src, md.ring_dst, md.ring_split)
        return o

    def entry_lists(self, md: AttnMetadata, layer: int, selected=None):
        """(entry pool, entries per page, global ids [T, K], lengths [T] or None) of the
        compressed entries each token attends to; all None / 0 for SWA-only layers."""
        m = self.cache.ratios[layer]
        if not m:
            return None, 0, None, None
        rp = md.ratios[m]
        if selected is None:      # HCA: every visible entry, global ids built with the plan
            ids = rp.all_visible_ids
        else:
            ids = global_ids(selected, md.req_index, md.page_table, rp.per_page)
        return (self.cache.entries[layer], rp.per_page, ids,
                rp.n_visible if selected is None else None)
