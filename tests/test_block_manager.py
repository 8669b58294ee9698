"""Tests of the paging layer: page tables, prefix sharing, copy-on-write, rollback, slots.

The randomized test drives the manager like an engine would (admit with prefix reuse, verify
rounds that allocate drafts then roll back to the accepted length, deep rollbacks, finish) and
keeps a shadow copy of every physical page's contents. After every step it checks that each
request reads its own tokens through its page table, which catches wrong prefix hits, writes
into shared or registered pages, leaks and double frees.
"""

import random
from collections import Counter

import pytest
import torch

from dspark.kvcache.block_manager import (
    BlockManager,
    CacheFull,
    OutOfPages,
    OutOfSlots,
    SlotPool,
    entries_per_page,
    entry_slots,
)

# ---- basic allocation --------------------------------------------------------------------------


def test_allocate_grows_and_never_shrinks():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.num_free == 8 and bm.usage == 0.0
    bm.allocate("a", 5)  # 2 blocks
    assert len(bm.page_table("a")) == 2 and bm.num_free == 6
    bm.allocate("a", 8)  # still 2
    assert len(bm.page_table("a")) == 2
    bm.allocate("a", 9)
    assert len(bm.page_table("a")) == 3 and bm.usage == pytest.approx(3 / 8)
    bm.allocate("a", 1)  # no shrink
    assert len(bm.page_table("a")) == 3
    bm.allocate("b", 0)
    assert bm.has_request("b") and bm.page_table("b") == []
    assert len(set(bm.page_table("a"))) == 3


def test_out_of_pages_is_atomic_and_informative():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", 12)
    table = bm.page_table("a")
    assert bm.can_allocate("b", 4) and not bm.can_allocate("b", 5) and not bm.can_allocate("a", 17)
    with pytest.raises(OutOfPages) as info:
        bm.allocate("b", 9)
    assert (info.value.needed, info.value.free) == (3, 1)
    assert "needs 3 free page(s), 1 free" in str(info.value)
    assert isinstance(info.value, CacheFull)
    assert not bm.has_request("b") and bm.num_free == 1 and bm.page_table("a") == table


def test_truncate_frees_whole_blocks_and_free_releases_all():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", 13)  # 4 blocks
    table = bm.page_table("a")
    bm.truncate("a", 9)  # keeps 3 blocks (tokens 8 lives in block 2)
    assert bm.page_table("a") == table[:3] and bm.num_free == 5
    bm.truncate("a", 8)
    assert bm.page_table("a") == table[:2]
    bm.truncate("a", 100)  # beyond the table: nothing to free
    assert bm.page_table("a") == table[:2]
    bm.truncate("a", 0)
    assert bm.page_table("a") == [] and bm.num_free == 8
    bm.free("a")
    assert not bm.has_request("a")
    with pytest.raises(KeyError, match="unknown request 'a'"):
        bm.free("a")
    with pytest.raises(ValueError, match="new_len"):
        bm.allocate("x", -1)


def test_constructor_validation():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, block_size=0)
    assert BlockManager(4).block_size == 256


# ---- prefix sharing ----------------------------------------------------------------------------


def admit_and_commit(bm: BlockManager, req, tokens) -> int:
    cached = bm.allocate_with_prefix(req, tokens)
    bm.cache_full_blocks(req, tokens)  # pretend the forward has written positions [cached, len)
    return cached


def test_prefix_hit_shares_full_blocks_only():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(10))  # blocks [0..3], [4..7], partial [8, 9]
    assert admit_and_commit(bm, "a", prompt) == 0
    assert [bm.is_cached(b) for b in bm.page_table("a")] == [True, True, False]
    assert bm.allocate_with_prefix("b", prompt) == 8
    ta, tb = bm.page_table("a"), bm.page_table("b")
    assert tb[:2] == ta[:2] and tb[2] != ta[2]
    assert [bm.ref_count(b) for b in ta] == [2, 2, 1]
    # a prompt of exactly 8 tokens reuses only one block: its last token must be computed
    assert bm.allocate_with_prefix("c", prompt[:8]) == 4
    # chaining: same second block after a different first block is not a hit
    assert bm.allocate_with_prefix("d", [99, 1, 2, 3] + prompt[4:]) == 0
    assert bm.allocate_with_prefix("e", torch.tensor(prompt[:9])) == 8  # tensors accepted
    with pytest.raises(ValueError, match="already has a page table"):
        bm.allocate_with_prefix("a", prompt)


def test_freed_cached_blocks_stay_reusable_until_evicted_lru():
    bm = BlockManager(num_blocks=6, block_size=2)
    admit_and_commit(bm, "a", [1, 2, 3, 4, 5])  # 2 full blocks registered + 1 partial
    admit_and_commit(bm, "b", [7, 8, 9])  # 1 full block registered
    a_blocks, b_blocks = bm.page_table("a"), bm.page_table("b")
    bm.free("a")
    bm.free("b")
    assert bm.num_free == 6
    # reuse after free: refcount goes 0 -> 1, the pages leave the free pool
    assert bm.allocate_with_prefix("c", [1, 2, 3, 4, 0]) == 4
    assert bm.page_table("c")[:2] == a_blocks[:2] and bm.num_free == 3
    bm.free("c")
    # Take 3 pages: the 3 never-registered free blocks go first, cached ones survive.
    bm.allocate("x", 6)
    assert all(bm.is_cached(b) for b in a_blocks[:2] + b_blocks[:1])
    # Next allocation must evict. LRU order: a, b freed first, then c (tail block first), so
    # b's block (freed before c's) is the oldest registered free block.
    bm.allocate("y", 2)
    assert bm.page_table("y") == [b_blocks[0]] and not bm.is_cached(b_blocks[0])
    bm.allocate("z", 2)  # c freed tail first: a's second block is evicted before its first
    assert bm.page_table("z") == [a_blocks[1]]
    for req in ("x", "y", "z"):
        bm.free(req)
    assert bm.allocate_with_prefix("w", [1, 2, 3, 4, 5]) == 2  # only the head block survives


def test_prefix_hit_is_claimed_before_fresh_blocks_evict():
    bm = BlockManager(num_blocks=5, block_size=2)
    admit_and_commit(bm, "a", [1, 2, 3])
    admit_and_commit(bm, "b", [7, 8, 9])
    a0, b0 = bm.page_table("a")[0], bm.page_table("b")[0]
    bm.free("a")  # a0 becomes the least recently freed registered block
    bm.free("b")
    bm.allocate("x", 6)  # uses up every never-registered free block
    assert bm.num_free == 2
    # the hit a0 is also the eviction candidate: the fresh block must come from b0
    assert bm.allocate_with_prefix("w", [1, 2, 5]) == 2
    assert bm.page_table("w") == [a0, b0] and bm.is_cached(a0) and not bm.is_cached(b0)


def test_rewritten_blocks_are_registered_under_their_new_prefix():
    bm = BlockManager(num_blocks=16, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6]
    admit_and_commit(bm, "a", tokens)
    bm.truncate("a", 2)  # roll back to the first block
    bm.allocate("a", 6)  # fresh blocks: no prepare_write needed for them
    tokens[2:] = [9, 9, 5, 6]
    assert bm.cache_full_blocks("a", tokens) == 2
    assert bm.allocate_with_prefix("w", tokens + [7]) == 6
    assert bm.page_table("w")[:3] == bm.page_table("a")
    assert bm.allocate_with_prefix("v", [1, 2, 3, 4, 5, 6, 7]) == 6  # old blocks still cached


def test_duplicate_content_stays_private():
    bm = BlockManager(num_blocks=8, block_size=2)
    prompt = [5, 6, 7, 8, 9]
    assert bm.allocate_with_prefix("a", prompt) == 0
    assert bm.allocate_with_prefix("b", prompt) == 0  # nothing registered yet
    assert bm.cache_full_blocks("a", prompt) == 2
    assert bm.cache_full_blocks("b", prompt) == 0  # same content already registered by "a"
    assert not any(bm.is_cached(b) for b in bm.page_table("b"))
    assert bm.cache_full_blocks("a", prompt) == 0  # idempotent
    assert bm.cache_full_blocks("a", prompt + [1]) == 1  # block 2 is now full
    assert bm.cache_full_blocks("a", prompt + [1, 2, 3]) == 0  # table has only 3 blocks
    bm.allocate("a", 8)
    assert bm.cache_full_blocks("a", prompt + [1, 2, 3]) == 1


def test_copy_on_write_after_rollback_into_shared_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(9))
    admit_and_commit(bm, "a", prompt)
    assert bm.allocate_with_prefix("b", prompt) == 8
    shared = bm.page_table("b")[1]
    bm.truncate("b", 6)  # inside the shared block: it stays shared and registered
    assert bm.page_table("b")[1] == shared and bm.ref_count(shared) == 2 and bm.is_cached(shared)
    bm.allocate("b", 8)
    free_before = bm.num_free
    copies = bm.prepare_write("b", 6, 8)
    assert len(copies) == 1 and copies[0][0] == shared
    new = copies[0][1]
    assert bm.page_table("b")[1] == new and bm.page_table("a")[1] == shared
    assert bm.ref_count(shared) == 1 and bm.ref_count(new) == 1 and not bm.is_cached(new)
    assert bm.is_cached(shared) and bm.num_free == free_before - 1
    assert bm.prepare_write("b", 6, 8) == []  # now exclusive


def test_ensure_writable_unregisters_exclusive_block():
    bm = BlockManager(num_blocks=4, block_size=2)
    admit_and_commit(bm, "a", [1, 2, 3])
    block = bm.page_table("a")[0]
    assert bm.is_cached(block)
    assert bm.ensure_writable("a", 0) is None
    assert not bm.is_cached(block)
    assert bm.allocate_with_prefix("b", [1, 2, 3]) == 0
    with pytest.raises(IndexError, match="no block index 5"):
        bm.ensure_writable("a", 5)


def test_truncate_unregisters_exclusive_partial_block():
    bm = BlockManager(num_blocks=4, block_size=2)
    admit_and_commit(bm, "a", [1, 2, 3, 4, 5])
    second = bm.page_table("a")[1]
    bm.truncate("a", 3)  # position 3 of block 1 will be rewritten
    assert not bm.is_cached(second) and bm.is_cached(bm.page_table("a")[0])


def test_prefix_admission_out_of_pages_is_atomic():
    bm = BlockManager(num_blocks=3, block_size=2)
    admit_and_commit(bm, "a", [1, 2, 3, 4, 5])
    with pytest.raises(OutOfPages) as info:
        bm.allocate_with_prefix("b", [1, 2, 3, 4, 9])
    assert (info.value.needed, info.value.free) == (1, 0)
    assert not bm.has_request("b") and [bm.ref_count(b) for b in bm.page_table("a")] == [1, 1, 1]
    # revived (freed but cached) hits count against the free pool as well
    bm.free("a")
    bm.allocate("x", 2)
    with pytest.raises(OutOfPages):
        bm.allocate_with_prefix("b", [1, 2, 3, 4, 9])  # 2 revived + 1 fresh > 2 free
    assert not bm.has_request("b") and bm.num_free == 2


def test_prepare_write_out_of_pages_is_atomic():
    bm = BlockManager(num_blocks=4, block_size=2)
    admit_and_commit(bm, "a", [1, 2, 3, 4, 5])  # 3 blocks
    bm.allocate_with_prefix("b", [1, 2, 3, 4, 5])  # shares 2, takes the last free block
    bm.truncate("b", 3)  # frees b's private third block, keeps both shared ones
    table = bm.page_table("b")
    with pytest.raises(OutOfPages) as info:
        bm.prepare_write("b", 1, 4)  # two shared blocks, one free page
    assert (info.value.needed, info.value.free) == (2, 1)
    assert bm.page_table("b") == table and bm.num_free == 1
    with pytest.raises(ValueError, match="allocate first"):
        bm.prepare_write("b", 0, 5)


# ---- slots helpers -----------------------------------------------------------------------------


def test_entry_slots_maps_through_the_page_table():
    per_page = entries_per_page(256, 4)
    assert per_page == 64 and entries_per_page(256, 128) == 2
    table = torch.tensor([7, 3, 5])
    idx = torch.tensor([0, 63, 64, 130, -1])
    assert entry_slots(table, idx, per_page).tolist() == [7 * 64, 7 * 64 + 63, 3 * 64, 5 * 64 + 2, -1]
    batched = entry_slots(torch.tensor([[7, 3], [1, 2]]), torch.tensor([[1, 65], [-1, 2]]), 64)
    assert batched.tolist() == [[7 * 64 + 1, 3 * 64 + 1], [-1, 1 * 64 + 2]]
    with pytest.raises(ValueError, match="multiple of ratio"):
        entries_per_page(256, 3)


def test_slot_pool():
    pool = SlotPool(3)
    assert [pool.acquire() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(OutOfSlots, match="all 3 state slots"):
        pool.acquire()
    pool.release(1)
    pool.release(0)
    assert (pool.num_free, pool.num_used) == (2, 1)
    assert pool.acquire() == 0  # lowest first
    with pytest.raises(ValueError, match="slot 1 is not in use"):
        pool.release(1)
    with pytest.raises(ValueError, match="not in use"):
        pool.release(7)
    with pytest.raises(ValueError):
        SlotPool(0)


# ---- randomized stress test --------------------------------------------------------------------


class ShadowEngine:
    """Drives a BlockManager like the engine and mirrors page contents in ``pages``."""

    def __init__(self, num_blocks: int, block_size: int, seed: int):
        self.bm = BlockManager(num_blocks, block_size)
        self.bs = block_size
        self.rng = random.Random(seed)
        self.pages = [[None] * block_size for _ in range(num_blocks)]  # token written per slot
        self.tokens: dict[int, list[int]] = {}  # live request -> tokens with written entries
        self.next_id = 0
        self.prefixes = [[self.rng.randrange(5) for _ in range(3 * block_size)] for _ in range(3)]
        self.stats = Counter()

    # -- helpers --
    def snapshot(self):
        bm = self.bm
        tables = {r: bm.page_table(r) for r in self.tokens}
        return (tables, bm.num_free, [bm.ref_count(b) for b in range(bm.num_blocks)],
                [bm.is_cached(b) for b in range(bm.num_blocks)])

    def expect_atomic_failure(self, fn, *args):
        before = self.snapshot()
        try:
            fn(*args)
        except OutOfPages:
            assert self.snapshot() == before, f"{fn.__name__} changed state before raising"
            self.stats["out_of_pages"] += 1
            return False
        return True

    def write(self, req, start, toks):
        copies = self.bm.prepare_write(req, start, start + len(toks))
        for old, new in copies:
            self.pages[new] = list(self.pages[old])
            self.stats["cow"] += 1
        table = self.bm.page_table(req)
        for pos, tok in enumerate(toks, start):
            block = table[pos // self.bs]
            assert self.bm.ref_count(block) == 1 and not self.bm.is_cached(block), "unsafe write"
            self.pages[block][pos % self.bs] = tok

    # -- operations --
    def admit(self):
        base = self.rng.choice(self.prefixes + [list(t) for t in self.tokens.values() if t])
        prompt = base[: self.rng.randrange(1, len(base) + 1)] + [
            self.rng.randrange(5) for _ in range(self.rng.randrange(0, 2 * self.bs))
        ]
        if not prompt:
            prompt = [1]
        req = self.next_id
        before = self.snapshot()
        try:
            cached = self.bm.allocate_with_prefix(req, prompt)
        except OutOfPages:
            assert self.snapshot() == before
            self.stats["out_of_pages"] += 1
            return
        self.next_id += 1
        assert cached % self.bs == 0 and cached <= len(prompt) - 1
        table = self.bm.page_table(req)
        for pos in range(cached):  # the hit pages hold exactly this prompt's prefix
            assert self.pages[table[pos // self.bs]][pos % self.bs] == prompt[pos]
        self.stats["hit_tokens"] += cached
        self.tokens[req] = list(prompt)
        self.write(req, cached, prompt[cached:])
        self.bm.cache_full_blocks(req, prompt)

    def verify_round(self, req):
        """Write k draft positions, accept a <= k of them, roll back the rest."""
        toks = self.tokens[req]
        k = self.rng.randrange(1, 2 * self.bs)
        if not self.expect_atomic_failure(self.bm.allocate, req, len(toks) + k):
            return
        drafts = [self.rng.randrange(5) for _ in range(k)]
        if not self.expect_atomic_failure(self.write, req, len(toks), drafts):
            self.bm.truncate(req, len(toks))
            return
        accepted = self.rng.randrange(0, k + 1)
        self.bm.truncate(req, len(toks) + accepted)
        toks.extend(drafts[:accepted])
        self.bm.cache_full_blocks(req, toks)

    def deep_rollback(self, req):
        """Truncate into earlier (maybe shared, registered) blocks, then rewrite from there."""
        toks = self.tokens[req]
        new_len = self.rng.randrange(0, len(toks) + 1)
        self.bm.truncate(req, new_len)
        del toks[new_len:]
        self.stats["rollback"] += 1
        rewrite = [self.rng.randrange(5) for _ in range(self.rng.randrange(1, self.bs + 1))]
        if self.expect_atomic_failure(self.bm.allocate, req, new_len + len(rewrite)):
            if self.expect_atomic_failure(self.write, req, new_len, rewrite):
                toks.extend(rewrite)
                self.bm.cache_full_blocks(req, toks)
            else:
                self.bm.truncate(req, new_len)

    def finish(self, req):
        self.bm.free(req)
        del self.tokens[req]

    def step(self):
        live = list(self.tokens)
        op = self.rng.random()
        if not live or op < 0.25:
            self.admit()
        elif op < 0.75:
            self.verify_round(self.rng.choice(live))
        elif op < 0.85:
            self.deep_rollback(self.rng.choice(live))
        else:
            self.finish(self.rng.choice(live))

    # -- invariants --
    def check(self):
        bm = self.bm
        # count evictions: a registered free block that got reused without its registration
        now = [(bm.ref_count(b), bm.is_cached(b)) for b in range(bm.num_blocks)]
        for (ref0, cached0), (ref1, cached1) in zip(getattr(self, "_last", now), now):
            self.stats["evictions"] += ref0 == 0 and cached0 and ref1 > 0 and not cached1
        self._last = now
        tables = {r: bm.page_table(r) for r in self.tokens}
        refs = Counter(b for t in tables.values() for b in t)
        for b in range(bm.num_blocks):
            assert bm.ref_count(b) == refs.get(b, 0), f"block {b}: refcount != number of tables"
        assert bm.num_free + len(refs) == bm.num_blocks, "page leaked or double-freed"
        assert bm.usage == pytest.approx(len(refs) / bm.num_blocks)
        owners: dict[int, set[int]] = {}
        for req, table in tables.items():
            toks = self.tokens[req]
            assert len(table) == bm.blocks_needed(len(toks))
            assert len(set(table)) == len(table)
            for pos, tok in enumerate(toks):  # every request reads back its own tokens
                assert self.pages[table[pos // self.bs]][pos % self.bs] == tok, (req, pos)
            for i, b in enumerate(table):
                owners.setdefault(b, set()).add(i)
        for b, indices in owners.items():
            if refs[b] > 1:  # shared: a registered, fully written prefix block at one index
                assert bm.is_cached(b) and len(indices) == 1 and None not in self.pages[b]
                self.stats["shared_checks"] += 1


@pytest.mark.parametrize("seed", range(6))
def test_randomized_engine_stress(seed):
    sim = ShadowEngine(num_blocks=20 + 4 * seed, block_size=4, seed=seed)
    for _ in range(1500):
        sim.step()
        sim.check()
    for req in list(sim.tokens):
        sim.finish(req)
        sim.check()
    assert sim.bm.num_free == sim.bm.num_blocks
    # the run must actually have exercised the interesting paths
    for key in ("hit_tokens", "cow", "out_of_pages", "rollback", "shared_checks", "evictions"):
        assert sim.stats[key] > 0, (key, sim.stats)
