"""Per-request page bookkeeping shared by the paged caches (DeepSeek-V4 MLA and GQA).

A request owns a state slot (``SlotPool``) and a page table (``BlockManager``); positions are
addressed absolutely, so rollback is a length change. Subclasses own the storage and add their
own rules (e.g. ring lookahead limits) on top of these engine-facing calls.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from .block_manager import BlockManager, SlotPool


class CacheTooSmall(ValueError):
    """A single request can never fit, even with every other request preempted."""


@dataclass
class RequestPages:
    slot: int
    length: int = 0        # positions 0..length-1 hold valid (committed or in-flight) state
    max_written: int = 0   # highest position + 1 ever written (ring caches bound rollback by it)


class PagedRequests:
    sizing_hint = "raise num_blocks / memory_bytes"

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int):
        self.block_size = block_size
        self.bm = BlockManager(num_blocks, block_size)
        self.slots = SlotPool(max_num_seqs)
        self._reqs: dict[Hashable, RequestPages] = {}

    @property
    def num_blocks(self) -> int:
        return self.bm.num_blocks

    @property
    def num_free_pages(self) -> int:
        return self.bm.num_free

    @property
    def num_free_slots(self) -> int:
        return self.slots.num_free

    def has_request(self, rid: Hashable) -> bool:
        return rid in self._reqs

    def length(self, rid: Hashable) -> int:
        return self._req(rid).length

    def can_admit(self, prompt_len: int) -> bool:
        """Whether a new request with this prompt gets a state slot and pages for the whole
        prompt now. Raises CacheTooSmall if it could never fit."""
        self._check_fits(prompt_len, "a prompt")
        return self.slots.num_free > 0 and self.bm.blocks_needed(prompt_len) <= self.bm.num_free

    def add_request(self, rid: Hashable) -> None:
        """Register a request and give it a state slot (raises OutOfSlots when all are taken).
        Pages come with ``reserve``."""
        if rid in self._reqs:
            raise ValueError(f"request {rid!r} is already in the KV cache")
        self._reqs[rid] = RequestPages(self.slots.acquire())

    def reserve(self, rid: Hashable, new_len: int) -> None:
        """Make sure pages cover positions [0, new_len) before a forward writes them.
        Raises OutOfPages with nothing changed (queue or preempt, then retry), CacheTooSmall
        if new_len can never fit."""
        self._req(rid)
        self._check_fits(new_len, f"request {rid!r}")
        self.bm.allocate(rid, new_len)

    def truncate(self, rid: Hashable, committed_len: int) -> None:
        """Roll back to ``committed_len`` positions (after acceptance); frees whole pages past it."""
        r = self._req(rid)
        if not 0 <= committed_len <= r.length:
            raise ValueError(f"truncate({rid!r}, {committed_len}): the request holds {r.length} "
                             f"positions; committed_len must be in [0, {r.length}]")
        r.length = committed_len
        if self.bm.has_request(rid):
            self.bm.truncate(rid, committed_len)

    def free(self, rid: Hashable) -> None:
        """Release the request's pages and slot (finished or preempted)."""
        r = self._reqs.pop(rid, None)
        if r is None:
            raise KeyError(f"unknown request {rid!r} (never added or already freed)")
        if self.bm.has_request(rid):
            self.bm.free(rid)
        self.slots.release(r.slot)

    def slot(self, rid: Hashable) -> int:
        return self._req(rid).slot

    def page_table(self, rid: Hashable) -> list[int]:
        return self.bm.page_table(rid) if self.bm.has_request(rid) else []

    def begin_forward(self, rid: Hashable, start: int, end: int) -> None:
        """Record a (checked) forward over [start, end): those positions now hold state."""
        r = self._req(rid)
        r.length, r.max_written = end, max(r.max_written, end)

    # pages back every position (False: a cache whose state is all fixed-size rings)
    pages_hold_state = True

    def check_forward(self, rid: Hashable, start: int, end: int) -> None:
        """Raise if a forward over positions [start, end) of ``rid`` may not run now."""
        r = self._req(rid)
        if start != r.length:
            raise ValueError(f"request {rid!r}: forward starts at position {start} but its cache "
                             f"holds {r.length} positions; positions must be fed contiguously "
                             f"(after acceptance call truncate({rid!r}, committed_len) first)")
        have = len(self.page_table(rid)) * self.block_size
        if end > have and self.pages_hold_state:
            raise ValueError(f"request {rid!r}: forward writes up to position {end - 1} but pages "
                             f"cover {have} positions; call reserve({rid!r}, {end}) first")

    def _req(self, rid: Hashable) -> RequestPages:
        try:
            return self._reqs[rid]
        except KeyError:
            raise KeyError(f"unknown request {rid!r}: call add_request({rid!r}) first") from None

    def _check_fits(self, num_tokens: int, what: str) -> None:
        need = self.bm.blocks_needed(num_tokens)
        if need > self.bm.num_blocks:
            raise CacheTooSmall(
                f"{what} of {num_tokens} tokens needs {need} pages of {self.block_size} tokens but "
                f"the whole KV cache has {self.bm.num_blocks}; {self.sizing_hint} or limit "
                f"prompts to {self.bm.num_blocks * self.block_size} tokens")
