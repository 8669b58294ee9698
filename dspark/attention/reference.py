"""Reference backend: plain torch (CPU or GPU), the oracle for the other backends.

Per request it gathers the keys from the paged pools, de-quantizing records with
``dspark.formats.layouts`` (fp8) or reading them as-is (bf16/fp32), lays them out as the dense
reference path does and calls the model's own ``sparse_attention_with_sink`` and
``Indexer.select``; the per-token index lists from the plan decide the mask (and are checked to
name only that request's keys). Result: the paged path reproduces the dense path bit for bit
(with QuantSim for fp8 caches). Deliberately no Triton import.
"""
from __future__ import annotations

import torch

from dspark.formats import layouts as L
from dspark.models.deepseek_v4.attention import sparse_attention_with_sink
from dspark.models.deepseek_v4.indexer import Indexer

from .backend import AttentionBackend


def load_rows(pool: torch.Tensor, per_page: int, ids: torch.Tensor) -> torch.Tensor:
    """fp32 rows at global ids (any shape, -1 -> zero row) -> [*ids.shape, dim]."""
    flat = ids.reshape(-1)
    valid = flat >= 0
    safe = torch.where(valid, flat, 0)
    if pool.dtype != torch.uint8:
        rows = pool[safe].float()
    elif pool.shape[1] == L.fp8_ds_mla_page_bytes(per_page):   # else a 132-B indexer page
        rows = L.read_fp8_ds_mla(pool, per_page, safe)
    else:
        rows = L.read_indexer_fp8(pool, per_page, safe)
    rows = torch.where(valid[:, None], rows, 0.0)
    return rows.view(*ids.shape, rows.shape[-1])


def mask_to_ids(mask: torch.Tensor, width: int) -> torch.Tensor:
    """Boolean choices [L, n] (at most `width` per row) -> int64 [L, width] ids, -1 padded."""
    n = mask.shape[1]
    cols = torch.arange(n, device=mask.device).expand_as(mask)
    ids = torch.where(mask, cols, n).sort(dim=1).values[:, :width]
    ids = torch.where(ids == n, -1, ids)
    if ids.shape[1] < width:
        ids = torch.cat([ids, ids.new_full((mask.shape[0], width - ids.shape[1]), -1)], 1)
    return ids


class ReferenceBackend(AttentionBackend):
    name = "reference"

    def store(self, pool, per_page, ids, x):
        if pool.dtype != torch.uint8:
            pool[ids] = x.to(pool.dtype)
        elif x.shape[1] == L.HEAD_DIM:
            L.write_fp8_ds_mla(pool, per_page, ids, x)
        else:
            L.write_indexer_fp8(pool, per_page, ids, x)

    def select(self, md, layer, q, w, topk):
        pool, N = self.cache.index_keys[layer], self.cache.entries_per_page(4)
        out = torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
        off = 0
        for r, (s, n) in enumerate(zip(md.starts, md.lengths)):
            sl, off, j1 = slice(off, off + n), off + n, (s + n) // 4
            if j1 == 0:
                continue
            j = torch.arange(j1, device=q.device)
            ids = md.page_table[r].long()[j // N] * N + j % N
            keys = load_rows(pool, N, ids)
            chosen = Indexer.select(q[sl], w[sl], keys, md.positions[sl], 4, topk)
            out[sl] = mask_to_ids(chosen, topk)
        return out

    def sparse_mqa(self, md, q, window_pool, capacity, window_ids, entry_pool, per_page, entry_ids,
                   entry_lens, sink, scale):
        # Per request, the keys are laid out exactly as the dense reference lays them out
        # (window positions lo..e-1, then entries 0..j1-1), derived here from the cache's
        # addressing, and the per-token index lists only decide the mask. Same inputs, same
        # function, same shapes: the paged path reproduces the dense path bit for bit, so fp8
        # comparisons against QuantSim are not blurred by FP4/top-k chaos, and every id the plan
        # listed is checked to be one of the request's keys.
        c, dev = self.cache, q.device
        W, C = c.window, c.capacity
        out = torch.empty(q.shape, dtype=torch.float32, device=dev)
        off = 0
        for r, (s, n) in enumerate(zip(md.starts, md.lengths)):
            sl, off, e = slice(off, off + n), off + n, s + n
            p = torch.arange(max(0, s - W + 1), e, device=dev)
            slot = c.slot(md.rids[r])
            ids = torch.where(p >= s, c.stage_base + sl.start + p - s, slot * C + p % C)
            keys = load_rows(window_pool, capacity, ids)
            mask = _membership(ids, window_ids[sl])
            if entry_ids is not None:
                j = torch.arange(e // (c.block_size // per_page), device=dev)
                eids = md.page_table[r].long()[j // per_page] * per_page + j % per_page
                listed = entry_ids[sl]
                if entry_lens is not None:
                    cols = torch.arange(listed.shape[1], device=dev)
                    listed = torch.where(cols < entry_lens[sl, None], listed, -1)
                keys = torch.cat([keys, load_rows(entry_pool, per_page, eids)])
                mask = torch.cat([mask, _membership(eids, listed)], 1)
            out[sl] = sparse_attention_with_sink(q[sl], keys, mask, sink, scale)
        return out


def _membership(keys: torch.Tensor, listed: torch.Tensor) -> torch.Tensor:
    """mask [L, N]: mask[i, k] = keys[k] is in listed[i] (ids, -1 = none). keys [N] distinct."""
    L, N = listed.shape[0], keys.shape[0]
    mask = torch.zeros(L, N + 1, dtype=torch.bool, device=keys.device)
    if N == 0:
        if (listed >= 0).any():
            raise RuntimeError("index list names keys of a request that has none")
        return mask[:, :0]
    order = keys.argsort()
    at = torch.searchsorted(keys[order], listed.clamp_min(0)).clamp_max(N - 1)
    valid = listed >= 0
    if (valid & (keys[order][at] != listed)).any():
        raise RuntimeError("an index list names an id outside its request's keys (plan bug)")
    mask.scatter_(1, torch.where(valid, order[at], N), True)
    return mask[:, :N]
