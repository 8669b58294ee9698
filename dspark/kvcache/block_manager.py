"""Paging for the growing KV-cache groups, with prefix sharing and copy-on-write.

One logical block covers ``block_size`` raw tokens (default 256). Every request owns one page
table (a list of block ids). Each growing cache group (compressed KV of every CSA/HCA layer,
indexer keys, ...) is its own physical pool indexed by the *same* block id and holds
``block_size // ratio`` entries of that group per page; so one free list serves all groups and
``slot = block_id * entries_per_page + row`` addresses an entry in any of them
(see ``entry_slots``). The SWA ring and compressor state are fixed-size per request and live in
``SlotPool`` slots instead.

Prefix sharing (as in nano-vllm): a full block is identified by a chained key
``(hash of the previous block's key, its token ids)``. ``cache_full_blocks`` registers a
request's full blocks once their pages have been written; ``allocate_with_prefix`` reuses
registered blocks (refcount + 1). A freed registered block stays reusable until a later
allocation evicts it (least recently freed first). Registered blocks are immutable: before
writing a block call ``prepare_write`` / ``ensure_writable``, which copies it on write when it is
shared and unregisters it when it is not.

Rollback after speculative decoding is ``truncate(req_id, accepted_len)``: all caches are
position-indexed (dspark.md §5.3), so dropping whole blocks past the accepted length is all
that is needed; stale rows inside the last kept block are overwritten by the next round.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence

import torch

_ROOT_HASH = 0  # "previous block hash" of block 0


class CacheFull(RuntimeError):
    """Base class for "no room in a KV-cache pool"; the scheduler can catch this one."""


class OutOfPages(CacheFull):
    """Not enough free pages. Raised before any state changes, so the caller may retry later."""

    def __init__(self, needed: int, free: int, what: str):
        self.needed = needed
        self.free = free
        super().__init__(f"out of KV-cache pages: {what} needs {needed} free page(s), {free} free")


class OutOfSlots(CacheFull):
    """All slots of a SlotPool are taken."""


def _as_int_list(token_ids: Sequence[int] | torch.Tensor) -> list[int]:
    # Tensors hash by identity, so normalise to Python ints before building block keys.
    if isinstance(token_ids, torch.Tensor):
        return [int(t) for t in token_ids.reshape(-1).tolist()]
    return [int(t) for t in token_ids]


class BlockManager:
    """Page tables for ``num_blocks`` physical blocks of ``block_size`` tokens each.

    Invariants (checked by tests after every operation):
    * refcount(b) == number of page tables that contain b; free blocks have refcount 0;
      ``num_free + #blocks with refcount > 0 == num_blocks``.
    * A block appears in two tables only if it is a registered (hashed) full prefix block,
      at the same index in both.
    """

    def __init__(self, num_blocks: int, block_size: int = 256):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._key: list[tuple | None] = [None] * num_blocks  # registered key of each block
        self._cached: dict[tuple, int] = {}  # key -> block, for every registered block
        self._free: deque[int] = deque(range(num_blocks))  # refcount 0, not registered
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount 0, registered; LRU first
        self._tables: dict[Hashable, list[int]] = {}
        # Per request: chained hashes of its first len(chain) full blocks (for registering more).
        self._chains: dict[Hashable, list[int]] = {}

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages that an allocation can take (never used + registered-but-unreferenced)."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of pages referenced by some request, in [0, 1]."""
        return 1.0 - self.num_free / self.num_blocks

    def page_table(self, req_id: Hashable) -> list[int]:
        """The request's block ids (a copy); block i covers tokens [i*block_size, (i+1)*block_size)."""
        return list(self._table(req_id))

    def has_request(self, req_id: Hashable) -> bool:
        return req_id in self._tables

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def is_cached(self, block_id: int) -> bool:
        """True if the block is registered for prefix reuse (its contents must not change)."""
        return self._key[block_id] is not None

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, req_id: Hashable, new_len: int) -> bool:
        """Whether ``allocate(req_id, new_len)`` would succeed (new or existing request)."""
        return self._growth(req_id, new_len) <= self.num_free

    # ---- allocation ------------------------------------------------------------------------
    def allocate(self, req_id: Hashable, new_len: int) -> None:
        """Grow (or create) the request's table so it covers ``new_len`` tokens.

        Never shrinks (use ``truncate``). Raises OutOfPages with no state change if the free
        list is too short.
        """
        need = self._growth(req_id, new_len)
        if need > self.num_free:
            raise OutOfPages(need, self.num_free, f"request {req_id!r} growing to {new_len} tokens")
        table = self._tables.setdefault(req_id, [])
        self._chains.setdefault(req_id, [])
        for _ in range(need):
            table.append(self._take_free_block())

    def allocate_with_prefix(self, req_id: Hashable, token_ids: Sequence[int] | torch.Tensor) -> int:
        """Admit a new request with prompt ``token_ids``: reuse registered full blocks of its
        longest cached prefix, allocate fresh blocks for the rest. Returns the number of cached
        tokens H (a multiple of block_size); the caller computes positions [H, len) only.

        At most ``len - 1`` tokens are served from the cache: the last prompt token must run
        through the model to produce logits. Raises OutOfPages with no state change.
        """
        if req_id in self._tables:
            raise ValueError(
                f"request {req_id!r} already has a page table; prefix reuse is for admission only"
            )
        tokens = _as_int_list(token_ids)
        bs = self.block_size
        hits: list[int] = []
        chain: list[int] = []
        prev = _ROOT_HASH
        for i in range(max(len(tokens) - 1, 0) // bs):
            key = (prev, tuple(tokens[i * bs : (i + 1) * bs]))
            block = self._cached.get(key)  # dict lookup compares the full key: no false hits
            if block is None:
                break
            hits.append(block)
            prev = hash(key)
            chain.append(prev)
        fresh = self.blocks_needed(len(tokens)) - len(hits)
        revived = sum(1 for b in hits if self._ref[b] == 0)  # cached but free: leaves the free pool
        if fresh + revived > self.num_free:
            what = f"admitting request {req_id!r} ({len(tokens)} tokens)"
            raise OutOfPages(fresh + revived, self.num_free, what)
        # Claim the hits before taking fresh blocks so an eviction cannot pick one of them.
        for b in hits:
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1
        table = hits + [self._take_free_block() for _ in range(fresh)]
        self._tables[req_id] = table
        self._chains[req_id] = chain
        return len(hits) * bs

    def cache_full_blocks(self, req_id: Hashable, token_ids: Sequence[int] | torch.Tensor) -> int:
        """Register the request's full blocks for prefix reuse.

        ``token_ids`` are the request's tokens whose cache entries are written and final
        (committed; never unverified drafts). Blocks already registered are skipped; a block
        whose content is already registered under another block stays private. Returns the
        number of newly registered blocks.
        """
        table = self._table(req_id)
        chain = self._chains[req_id]
        tokens = _as_int_list(token_ids)
        bs = self.block_size
        registered = 0
        prev = chain[-1] if chain else _ROOT_HASH
        for i in range(len(chain), min(len(tokens) // bs, len(table))):
            key = (prev, tuple(tokens[i * bs : (i + 1) * bs]))
            block = table[i]
            if self._key[block] is None and key not in self._cached:
                self._key[block] = key
                self._cached[key] = block
                registered += 1
            prev = hash(key)
            chain.append(prev)
        return registered

    # ---- writes: copy-on-write -----------------------------------------------------------------
    def ensure_writable(self, req_id: Hashable, block_index: int) -> tuple[int, int] | None:
        """Make block ``block_index`` of the request safe to write.

        Shared (refcount > 1): swap in a fresh block and return ``(old, new)``; the caller must
        copy page ``old`` to page ``new`` in every cache group before writing. Exclusive but
        registered: unregister it (its content is about to change) and return None.
        Raises OutOfPages (no state change) if a copy is needed and no page is free.
        """
        table = self._table(req_id)
        if not 0 <= block_index < len(table):
            raise IndexError(f"request {req_id!r} has {len(table)} blocks, no block index {block_index}")
        old = table[block_index]
        if self._ref[old] > 1 and self.num_free < 1:
            raise OutOfPages(1, 0, f"copy-on-write of shared block {old} for request {req_id!r}")
        del self._chains[req_id][block_index:]  # hashes from this block on no longer describe it
        if self._ref[old] == 1:
            self._unregister(old)
            return None
        new = self._take_free_block()
        self._ref[old] -= 1  # still >= 1: another table holds it
        table[block_index] = new
        return old, new

    def prepare_write(self, req_id: Hashable, start: int, end: int) -> list[tuple[int, int]]:
        """``ensure_writable`` for every block overlapping token positions [start, end), all or
        nothing. Returns the (old, new) page copies the caller must perform before writing."""
        table = self._table(req_id)
        if not 0 <= start <= end <= len(table) * self.block_size:
            raise ValueError(
                f"request {req_id!r}: write range [{start}, {end}) outside its "
                f"{len(table) * self.block_size} allocated token positions (allocate first)"
            )
        indices = range(start // self.block_size, self.blocks_needed(end))
        copies_needed = sum(1 for i in indices if self._ref[table[i]] > 1)
        if copies_needed > self.num_free:
            raise OutOfPages(copies_needed, self.num_free, f"copy-on-write for request {req_id!r}")
        copies = [self.ensure_writable(req_id, i) for i in indices]
        return [c for c in copies if c is not None]

    # ---- release -------------------------------------------------------------------------------
    def truncate(self, req_id: Hashable, new_len: int) -> None:
        """Shrink the request to ``new_len`` tokens: free whole blocks past it (rollback)."""
        if new_len < 0:
            raise ValueError(f"new_len must be >= 0, got {new_len}")
        table = self._table(req_id)
        keep = self.blocks_needed(new_len)
        for block in reversed(table[keep:]):  # tail first: it becomes the first to be evicted
            self._release(block)
        del table[keep:]
        del self._chains[req_id][new_len // self.block_size :]
        # The kept partial block will be rewritten from new_len on; if nobody else reads it,
        # drop its registration now (a shared one is copied by ensure_writable instead).
        if new_len % self.block_size and keep <= len(table) and self._ref[table[keep - 1]] == 1:
            self._unregister(table[keep - 1])

    def free(self, req_id: Hashable) -> None:
        """Release all blocks of a finished (or preempted) request. Registered blocks stay
        reusable until evicted."""
        table = self._table(req_id)
        for block in reversed(table):  # tail first: a prefix hit needs the head blocks more
            self._release(block)
        del self._tables[req_id]
        del self._chains[req_id]

    # ---- internals -------------------------------------------------------------------------
    def _table(self, req_id: Hashable) -> list[int]:
        try:
            return self._tables[req_id]
        except KeyError:
            raise KeyError(f"unknown request {req_id!r} (not allocated or already freed)") from None

    def _growth(self, req_id: Hashable, new_len: int) -> int:
        if new_len < 0:
            raise ValueError(f"new_len must be >= 0, got {new_len}")
        have = len(self._tables.get(req_id, ()))
        return max(0, self.blocks_needed(new_len) - have)

    def _take_free_block(self) -> int:
        """Pop a free block (refcount -> 1): never-registered ones first, then evict the LRU
        registered one. Callers check ``num_free`` beforehand."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._unregister(block)
        self._ref[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if self._key[block] is not None:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def _unregister(self, block: int) -> None:
        key = self._key[block]
        if key is not None:
            del self._cached[key]
            self._key[block] = None


def entries_per_page(block_size: int, ratio: int) -> int:
    """Entries of a cache group with compression ``ratio`` in one page of a ``block_size`` block."""
    if ratio < 1 or block_size % ratio:
        raise ValueError(f"block_size {block_size} must be a positive multiple of ratio {ratio}")
    return block_size // ratio


def entry_slots(block_table: torch.Tensor, entry_idx: torch.Tensor, per_page: int) -> torch.Tensor:
    """Map per-request entry indices to global slots ``block * per_page + row`` of a cache group.

    block_table: int [..., max_blocks] (one row per request); entry_idx: int [..., n] with the
    same leading dims; returns int64 [..., n]. Negative entry indices (-1 = masked) stay -1.
    """
    entry_idx = entry_idx.to(torch.int64)
    valid = entry_idx >= 0
    safe = torch.where(valid, entry_idx, torch.zeros_like(entry_idx))
    blocks = torch.gather(block_table.to(torch.int64), -1, safe // per_page)
    slots = blocks * per_page + safe % per_page
    return torch.where(valid, slots, torch.full_like(slots, -1))


class SlotPool:
    """Fixed-size per-request state rows (SWA ring, compressor state): slot ids 0..max_slots-1.

    ``acquire`` hands out the lowest free slot, which keeps the live rows of the state tensors
    packed at the front.
    """

    def __init__(self, max_slots: int):
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        self.max_slots = max_slots
        self._free = list(range(max_slots))  # a heap (sorted list is a valid heap)
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def acquire(self) -> int:
        if not self._free:
            raise OutOfSlots(
                f"all {self.max_slots} state slots are in use; finish or preempt a request first"
            )
        slot = heapq.heappop(self._free)
        self._used.add(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(
                f"slot {slot} is not in use (valid range 0..{self.max_slots - 1}); double release?"
            )
        self._used.remove(slot)
        heapq.heappush(self._free, slot)
