"""Paged per-request DeepSeek-V4 attention state on one device (spec §4.1, §4.5, §6).

What a request owns
-------------------
* **Growing state, paged** (one page table per request from the ``BlockManager``; a logical
  block covers ``block_size`` tokens): for every compressed layer a pool of compressed entries
  (``block_size // ratio`` per page) and, for ratio-4 layers, a pool of indexer keys
  (``block_size // 4`` per page). All pools are indexed by the same block ids, so one free list
  serves them all and ``global id = block * entries_per_page + row``.
* **Fixed-size state, one ``SlotPool`` slot**: per layer an SWA ring of ``window + lookahead``
  kv rows (slot ``p % capacity``) and, per compressed layer, fp32 compressor rows ``(a, z)`` for
  the main and the indexer compressor in a ring of ``c*ratio + lookahead`` rows.

Record formats (``kv_cache_dtype``): ``"fp8"`` stores 584-B ``fp8_ds_mla`` records and 132-B FP8
indexer rows (``layouts.py``) in uint8 pages ``[pages, page_bytes]``; ``"bf16"`` / ``"fp32"``
store plain rows ``[pages * entries_per_page, 512 (or 128)]`` with the same page structure, and
then reproduce the dense reference path exactly. Compressor rows are always fp32.

Rollback
--------
Everything is addressed by absolute position (entries by ``j = p // ratio``), so rolling a
request back to ``n`` tokens is ``truncate(rid, n)``: a length change plus freeing whole blocks
past ``n``. Entries/keys emitted by rejected boundary tokens are rewritten when the accepted
token at that position arrives, before anything reads them. The rings are the only storage that
a rejected write can damage; see ``_ring_capacity`` for why ``lookahead`` extra rows make that
impossible for rollbacks of up to ``lookahead + 1`` tokens.

Forward-local staging: the window rows of the tokens of one forward are written to a staging
area behind the rings (ids ``num_slots*capacity + flat token index``) and copied into the rings
only after that layer's attention has read the old rows — a prefill chunk longer than
``lookahead`` would otherwise overwrite ring rows its own first queries still need.
"""
from __future__ import annotations

import math
from collections.abc import Hashable

import torch

from .block_manager import OutOfPages  # noqa: F401  (re-exported for callers)
from .requests import CacheTooSmall, PagedRequests  # noqa: F401
from ..formats.layouts import (DATA_ROW_BYTES, HEAD_DIM, INDEXER_DIM, SCALE_ROW_BYTES,
                      fp8_ds_mla_page_bytes, indexer_page_bytes)

KV_DTYPES = {"fp8": torch.uint8, "auto": torch.uint8, "bf16": torch.bfloat16,
             "fp32": torch.float32}


def _ring_capacity(window: int, lookahead: int) -> int:
    # Why not a ring of exactly `window`: after a verify step writes positions n..e-1 and only
    # the prefix up to n is accepted, the next query (position n) still needs positions
    # n-window+1..n-1. A rejected row at position q' >= n lands on the slot of q' - capacity;
    # with capacity == window, q' = n+1 already destroys position n+1-window, which is inside
    # that window (spec §4.5). With capacity = window + lookahead the earliest clobbered
    # position is e-1-capacity < n-window+1 whenever e - n <= lookahead + 1, i.e. a rollback
    # of up to lookahead + 1 tokens is always safe. Without speculation lookahead = 0 and the
    # ring is exactly `window` rows (a 1-token "rollback" is the no-op commit).
    return window + lookahead


class PagedKVCache(PagedRequests):
    """All attention state of every running request; see the module docstring.

    cfg: ModelConfig. Sizing: ``num_blocks`` explicitly, or ``memory_bytes`` (total budget for
    pages + per-slot state + staging). ``block_size``: tokens per logical block (default: 256
    rounded up to a multiple of every ratio). ``max_num_seqs``: state slots.
    ``lookahead``: extra ring rows; ``truncate`` may then drop up to lookahead + 1 written
    positions. A DSpark verify block [anchor, d_1..d_γ] always keeps the anchor, so it drops at
    most γ (lookahead >= γ - 1); the verify width γ + 1 is the safe choice; 0 without
    speculation. ``max_batch_tokens``: most tokens in one forward (size of the staging area).
    """

    def __init__(self, cfg, *, device="cpu", kv_cache_dtype: str = "fp8",
                 block_size: int | None = None, num_blocks: int | None = None,
                 memory_bytes: int | None = None, max_num_seqs: int = 64, lookahead: int = 0,
                 max_batch_tokens: int = 2048):
        if kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: use 'fp8' (fp8_ds_mla records) "
                             f"or 'bf16'/'fp32' (unquantized rows)")
        if lookahead < 0 or max_num_seqs < 1 or max_batch_tokens < 1:
            raise ValueError(f"need lookahead >= 0, max_num_seqs >= 1, max_batch_tokens >= 1; got "
                             f"{lookahead}, {max_num_seqs}, {max_batch_tokens}")
        self.cfg, self.device = cfg, torch.device(device)
        self.fp8 = KV_DTYPES[kv_cache_dtype] == torch.uint8
        self.dtype = KV_DTYPES[kv_cache_dtype]
        self.ratios = tuple(cfg.compress_ratios[:cfg.num_hidden_layers])
        used = sorted({m for m in self.ratios if m})
        lcm = math.lcm(*used) if used else 1
        self.block_size = block_size or lcm * -(-256 // lcm)
        if any(self.block_size % m for m in used):
            raise ValueError(f"block_size={self.block_size} must be a multiple of every "
                             f"compression ratio {used}; e.g. {lcm * -(-256 // lcm)}")
        self.window, self.lookahead = cfg.sliding_window, lookahead
        self.capacity = _ring_capacity(self.window, lookahead)
        self.num_slots, self.max_batch_tokens = max_num_seqs, max_batch_tokens
        self.stage_base = max_num_seqs * self.capacity          # first staging id in a SWA pool
        self._stage_pages = -(-max_batch_tokens // self.capacity)

        per_block, fixed = self._bytes_per_block(), self._fixed_bytes()
        if num_blocks is None:
            if memory_bytes is None:
                raise ValueError("size the cache with num_blocks=... or memory_bytes=...")
            num_blocks = (memory_bytes - fixed) // per_block if per_block else 1 << 20
            if num_blocks < 1:
                raise ValueError(
                    f"memory_bytes={memory_bytes} is too small: per-request state for "
                    f"max_num_seqs={max_num_seqs} plus staging needs {fixed} B and one block of "
                    f"{self.block_size} tokens needs {per_block} B; give at least "
                    f"{fixed + per_block} B or lower max_num_seqs / max_batch_tokens")
        super().__init__(num_blocks, self.block_size, max_num_seqs)
        self._allocate(num_blocks)

    # ---- sizing -----------------------------------------------------------------------------
    def entries_per_page(self, ratio: int) -> int:
        return self.block_size // ratio

    def comp_ring(self, ratio: int) -> int:
        """Rows of a compressor ring: c*ratio rows feed the next entry (c = 2 for the
        overlapping ratio-4 compressor), plus lookahead for rejected rows (same argument as
        _ring_capacity)."""
        return (2 if ratio == 4 else 1) * ratio + self.lookahead

    def _kv_bytes(self, n: int, dim: int) -> int:
        if not self.fp8:
            return n * dim * self.dtype.itemsize
        return fp8_ds_mla_page_bytes(n) if dim == HEAD_DIM else indexer_page_bytes(n)

    def _bytes_per_block(self) -> int:
        total = 0
        for m in self.ratios:
            if m:
                total += self._kv_bytes(self.entries_per_page(m), HEAD_DIM)
            if m == 4:
                total += self._kv_bytes(self.entries_per_page(4), INDEXER_DIM)
        return total

    def _fixed_bytes(self) -> int:
        pages = self.num_slots + self._stage_pages
        total = len(self.ratios) * pages * self._kv_bytes(self.capacity, HEAD_DIM)
        for m in self.ratios:
            c = 2 if m == 4 else 1
            if m:
                total += 2 * 4 * self.num_slots * self.comp_ring(m) * c * HEAD_DIM
            if m == 4:
                total += 2 * 4 * self.num_slots * self.comp_ring(4) * 2 * INDEXER_DIM
        return total

    def _pool(self, pages: int, per_page: int, dim: int) -> torch.Tensor:
        if self.fp8:
            nbytes = self._kv_bytes(per_page, dim)
            return torch.zeros(pages, nbytes, dtype=torch.uint8, device=self.device)
        return torch.zeros(pages * per_page, dim, dtype=self.dtype, device=self.device)

    def _allocate(self, num_blocks: int):
        S, cap = self.num_slots, self.capacity
        self.swa, self.entries, self.index_keys, self.comp_rows = {}, {}, {}, {}
        for layer, m in enumerate(self.ratios):
            self.swa[layer] = self._pool(S + self._stage_pages, cap, HEAD_DIM)
            if not m:
                continue
            self.entries[layer] = self._pool(num_blocks, self.entries_per_page(m), HEAD_DIM)
            c = 2 if m == 4 else 1
            rows = S * self.comp_ring(m)
            self.comp_rows[layer, "main"] = tuple(
                torch.zeros(rows, c * HEAD_DIM, device=self.device) for _ in range(2))
            if m == 4:
                self.index_keys[layer] = self._pool(num_blocks, self.entries_per_page(4),
                                                    INDEXER_DIM)
                self.comp_rows[layer, "indexer"] = tuple(
                    torch.zeros(rows, 2 * INDEXER_DIM, device=self.device) for _ in range(2))

    # ---- engine API -------------------------------------------------------------------------
    def truncate(self, rid: Hashable, committed_len: int) -> None:
        """Roll back to ``committed_len`` positions (after acceptance): every cache then reads
        as if the later tokens had never been fed. Frees whole blocks past it."""
        r = self._req(rid)
        if 0 <= committed_len and r.max_written - committed_len > self.lookahead + 1:
            raise ValueError(
                f"truncate({rid!r}, {committed_len}) drops {r.max_written - committed_len} written "
                f"positions but the rings only survive rollbacks of lookahead + 1 = "
                f"{self.lookahead + 1}; build PagedKVCache(lookahead=...) from the largest verify "
                f"block, or free() the request and recompute it")
        super().truncate(rid, committed_len)

    @property
    def pages_hold_state(self) -> bool:
        """Only compressed layers keep per-position state in pages (SWA-only: rings alone)."""
        return any(self.ratios)


def copy_rows(pool: torch.Tensor, per_page: int, src: torch.Tensor, dst: torch.Tensor,
              split: torch.Tensor | None = None) -> None:
    """Copy stored rows (records or plain rows) between global ids of one pool, bytes as-is.

    pool: fp8_ds_mla uint8 [pages, page_bytes] or plain [pages * per_page, dim]; src/dst int64 [n]
    (distinct dst). Used to move staged window rows into the rings without re-quantizing.
    split: optional int64 [4, n] = (src // per_page, src % per_page, dst // per_page,
    dst % per_page), precomputed once per forward (the attention plan) instead of per call.
    """
    if pool.dtype != torch.uint8:
        pool[dst] = pool[src]
        return
    pages = pool.shape[0]
    data = pool[:, :per_page * DATA_ROW_BYTES].view(pages, per_page, DATA_ROW_BYTES)
    scales = pool[:, per_page * DATA_ROW_BYTES:per_page * (DATA_ROW_BYTES + SCALE_ROW_BYTES)]
    scales = scales.view(pages, per_page, SCALE_ROW_BYTES)
    if split is None:
        split = (src // per_page, src % per_page, dst // per_page, dst % per_page)
    sp, sr, dp, dr = split
    data[dp, dr] = data[sp, sr]
    scales[dp, dr] = scales[sp, sr]


__all__ = ["PagedKVCache", "CacheTooSmall", "OutOfPages", "copy_rows"]
