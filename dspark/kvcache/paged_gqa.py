"""Paged K/V cache for GQA targets (Qwen3) with the engine-facing API of ``PagedKVCache``.

Storage: per decoder layer one K pool and one V pool ``[num_blocks * block_size, Hkv, d]`` in the
model dtype. A request owns one page table from the ``BlockManager``; position ``p`` lives at
slot ``page_table[p // block_size] * block_size + p % block_size``. Every row is addressed by its
absolute position, so rollback after verification is a length change (``truncate``) that frees
the whole pages past the committed length; stale rows inside the last kept page are overwritten
by the next forward before anything reads them (a forward over [s, e) writes rows s..e-1 first,
then reads 0..e-1). No rings, no fixed-size per-request state.

The attention over these pools is dspark.attention.gqa.PagedGQABackend (the cache holds bytes
and page tables only).
"""
from __future__ import annotations

from collections.abc import Hashable

import torch

from .block_manager import CacheFull, OutOfPages, OutOfSlots  # noqa: F401  (re-exported)
from .requests import CacheTooSmall, PagedRequests  # noqa: F401


class PagedGQACache(PagedRequests):
    """K/V of every running request of a GQA model (``Qwen3Config``-like ``cfg``: reads
    ``num_hidden_layers``, ``num_key_value_heads``, ``head_dim``).

    ``num_blocks`` pages of ``block_size`` tokens; ``max_num_seqs`` request slots (bookkeeping
    only: GQA needs no fixed-size per-request state, but admission mirrors ``PagedKVCache``)."""

    sizing_hint = "raise num_kv_blocks"

    def __init__(self, cfg, device="cpu", dtype=torch.float32, num_blocks: int | None = None,
                 block_size: int = 256, max_num_seqs: int = 64, scratch_rows: int = 0):
        if num_blocks is None or num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1 or max_num_seqs < 1:
            raise ValueError(f"need block_size >= 1 and max_num_seqs >= 1; got {block_size}, "
                             f"{max_num_seqs}")
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.num_slots = max_num_seqs
        self.num_layers = cfg.num_hidden_layers
        super().__init__(num_blocks, block_size, max_num_seqs)
        # `scratch_rows` rows past the last page belong to no request: the fixed-shape decode
        # path (models/qwen3_graph.py) points the K/V writes of its batch-padding rows there
        self.scratch_slot = num_blocks * block_size if scratch_rows else None
        shape = (num_blocks * block_size + scratch_rows, cfg.num_key_value_heads, cfg.head_dim)
        # the eager path writes every row before reading it, but fixed-shape readers gather whole
        # pages and mask the unwritten tail: zeros keep that tail finite (0 * NaN would poison it)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.num_layers)]

    @staticmethod
    def bytes_per_block(cfg, dtype, block_size: int = 256) -> int:
        """Bytes one page costs over all layers (K and V)."""
        return (2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim
                * torch.empty((), dtype=dtype).element_size())

    # ---- for the attention backend (check_forward: PagedRequests) ----------------------------
    def slots_for(self, rid: Hashable, start: int, end: int) -> torch.Tensor:
        """int64 [end - start] global rows of positions start..end-1 (pages must cover them)."""
        pos = torch.arange(start, end)
        table = torch.tensor(self.page_table(rid), dtype=torch.long)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.device)


__all__ = ["PagedGQACache", "CacheTooSmall", "CacheFull", "OutOfPages", "OutOfSlots"]
