"""Paged K/V cache for GQA targets (Qwen3) with the engine-facing API of ``PagedKVCache``.

Storage: per decoder layer one K pool and one V pool ``[num_blocks * block_size, Hkv, d]`` in the
model dtype. A request owns one page table from the ``BlockManager``; position ``p`` lives at
slot ``page_table[p // block_size] * block_size + p % block_size``. Every row is addressed by its
absolute position, so rollback after verification is a length change (``truncate``) that frees
the whole pages past the committed length; stale rows inside the last kept page are overwritten
by the next forward before anything reads them (a forward over [s, e) writes rows s..e-1 first,
then reads 0..e-1). No rings, no fixed-size per-request state.

``PagedGQABackend`` is the attention hook: ``forward_fn(batch)`` validates the batch against the
cache (contiguous positions, pages reserved), advances each request's length, and returns the
``attn_fn(attn, x, batch, layer_id, quant)`` that ``Qwen3Model.forward_hidden`` accepts. It is
the reference torch path: scatter the batch's K/V into their slots, gather each request's rows
0..end-1 and run the same causal GQA ``attend`` as the dense path (identical numerics).
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

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


@dataclass
class _SegPlan:
    rows: slice            # this segment's rows in the flat batch
    start: int
    end: int
    read: torch.Tensor     # int64 [end] slots of positions 0..end-1
    mask: torch.Tensor     # bool [end - start, end] causal visibility


class PagedGQABackend:
    """Reference torch attention over a ``PagedGQACache`` (see the module docstring)."""

    name = "paged-gqa-reference"

    def __init__(self, cache: PagedGQACache):
        self.cache = cache

    def plan(self, batch) -> tuple[torch.Tensor, list]:
        """Check every segment, then advance lengths; (write slots [T], per-segment plans)."""
        c, seen = self.cache, set()
        for s in batch.segments:
            if s.state in seen:
                raise ValueError(f"request {s.state!r} appears twice in one forward")
            seen.add(s.state)
            c.check_forward(s.state, s.start, s.start + s.length)
        writes, segs = [], []
        dev = c.device
        for s in batch.segments:
            end = s.start + s.length
            c.begin_forward(s.state, s.start, end)
            read = c.slots_for(s.state, 0, end)
            writes.append(read[s.start:])
            qpos = torch.arange(s.start, end, device=dev)
            mask = torch.arange(end, device=dev)[None, :] <= qpos[:, None]
            segs.append(_SegPlan(slice(s.offset, s.offset + s.length), s.start, end, read, mask))
        write = torch.cat(writes) if writes else torch.zeros(0, dtype=torch.long, device=dev)
        return write, segs

    def forward_fn(self, batch):
        from ..models.qwen3 import attend
        write, segs = self.plan(batch)
        c = self.cache

        def attn_fn(attn, x, batch, layer_id, quant=None):
            q = attn.project_q(x, batch.positions)
            k, v = attn.project_kv(x, batch.positions)
            K, V = c.k[layer_id], c.v[layer_id]
            K[write], V[write] = k.to(K.dtype), v.to(V.dtype)
            out = torch.empty_like(q)
            for sp in segs:
                out[sp.rows] = attend(q[sp.rows], K[sp.read], V[sp.read], sp.mask)
            return attn.output(out)

        return attn_fn


__all__ = ["PagedGQACache", "PagedGQABackend", "CacheTooSmall", "CacheFull", "OutOfPages",
           "OutOfSlots"]
