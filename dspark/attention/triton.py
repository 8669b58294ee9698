"""Triton backend: the kernels of dspark/kernels on the paged cache.

fp8 caches: fused quantize-and-write (cache_write), lightning-indexer scores + top-k over the
132-B key pages (indexer), sparse MQA with sink de-quantizing 584-B records in the kernel, window
list over the SWA pool and compressed list over the entry pool in one softmax (sparse_mqa).
bf16/fp32 caches: sparse_mqa_dense; there is no Triton indexer for plain rows, so index
selection falls back to the reference (torch) scorer.
"""
from __future__ import annotations

import torch

from dspark.kernels.cache_write import write_fp8_ds_mla_triton, write_indexer_fp8_triton
from dspark.kernels.indexer import indexer_topk
from dspark.kernels.sparse_mqa import sparse_mqa_dense, sparse_mqa_fp8
from dspark.formats.layouts import HEAD_DIM

from .reference import ReferenceBackend


class TritonBackend(ReferenceBackend):
    name = "triton"

    def store(self, pool, per_page, ids, x):
        if pool.dtype != torch.uint8:
            pool.index_copy_(0, ids, x.to(pool.dtype))
        elif x.shape[1] == HEAD_DIM:
            write_fp8_ds_mla_triton(pool, per_page, ids, x)
        else:
            write_indexer_fp8_triton(pool, per_page, ids, x)

    def select(self, md, layer, q, w, topk):
        if not self.cache.fp8:
            return super().select(md, layer, q, w, topk)
        rp = md.ratios[4]
        return indexer_topk(q, w, self.cache.index_keys[layer], rp.per_page,
                            _i32(md.req_index_i32, md.req_index), md.page_table,
                            _i32(rp.n_visible_i32, rp.n_visible), topk,
                            n_cols=max(1, rp.max_visible)).long()

    def sparse_mqa(self, md, q, window_pool, capacity, window_ids, entry_pool, per_page, entry_ids,
                   entry_lens, sink, scale):
        # the plan's int32 copies of its own lists (the kernels take int32: no cast per layer)
        if window_ids is md.window_ids:
            window_ids = _i32(md.window_ids_i32, window_ids)
        for rp in md.ratios.values():
            if entry_ids is not None and entry_ids is rp.all_visible_ids:
                entry_ids = _i32(rp.all_visible_ids_i32, entry_ids)
            if entry_lens is not None and entry_lens is rp.n_visible:
                entry_lens = _i32(rp.n_visible_i32, entry_lens)
        extra = {}
        if entry_ids is not None:
            extra = dict(extra_indices=entry_ids, extra_lengths=entry_lens)
        if self.cache.fp8:
            if entry_ids is not None:
                extra.update(extra_cache=entry_pool, extra_entries_per_page=per_page)
            return sparse_mqa_fp8(q, window_pool, capacity, window_ids, sink, scale, **extra)
        if entry_ids is not None:
            extra.update(extra_kv=entry_pool)
        return sparse_mqa_dense(q, window_pool, window_ids, sink, scale, **extra)


def _i32(copy, orig):
    """The plan's int32 copy of ``orig`` when it has one, else ``orig`` (the kernel casts)."""
    return orig if copy is None else copy
