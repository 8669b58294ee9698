"""Randomized engine-like driver over PagedKVCache + reference backend + tiny model.

Many requests go through admission (can_admit / add_request), chunked prefill, verify rounds
with random acceptance and rollback, finishing and preemption under page pressure
(OutOfPages -> free a victim, which later recomputes from scratch). After every step: no page
leaked or double-owned, every table exactly covers its request's committed length, slots are
consistent. At the end every logits row of every committed position (including rows computed
before a preemption) must equal the row of that request run alone through the dense path.
"""
import random
from collections import Counter, deque

import pytest

from dspark.kvcache.block_manager import OutOfPages
from paged_helpers import dense_logits, load_model, paged_runner, rel_err

LOOKAHEAD, MAX_TOKENS = 4, 40


class Driver:
    def __init__(self, model, seed, num_requests=9, num_blocks=5):
        self.runner, self.cache = paged_runner(model, "fp32", block_size=16, num_blocks=num_blocks,
                                               max_num_seqs=3, lookahead=LOOKAHEAD,
                                               max_batch_tokens=MAX_TOKENS)
        self.rng = rng = random.Random(seed)
        self.vocab = model.cfg.vocab_size
        self.seqs = {r: [rng.randrange(self.vocab) for _ in range(rng.randrange(6, 60))]
                     for r in range(num_requests)}
        self.prompt = {r: rng.randrange(1, len(s) - 2) for r, s in self.seqs.items()}
        self.waiting = deque(self.seqs)
        self.P: dict[int, int] = {}          # running request -> committed length
        self.rows = {r: [] for r in self.seqs}   # (position, logits row) of committed rows
        self.done: set[int] = set()
        self.stats = Counter()

    def admit(self):
        while self.waiting and self.cache.can_admit(self.prompt[self.waiting[0]]):
            r = self.waiting.popleft()
            self.cache.add_request(r)
            self.P[r] = 0
        self.stats["blocked_admissions"] += bool(self.waiting)

    def preempt(self, keep):
        victims = [r for r in self.P if r != keep]
        victim = victims[-1] if victims else keep
        self.cache.free(victim)
        del self.P[victim]
        self.waiting.appendleft(victim)      # recomputed from position 0 when readmitted
        self.stats["preemptions"] += 1
        return victim

    def plan_item(self, r, budget):
        P, seq = self.P[r], self.seqs[r]
        if P < self.prompt[r]:
            n = min(self.rng.choice([1, 2, 5, 11, 17]), self.prompt[r] - P, budget)
            return seq[P:P + n], n
        k = min(self.rng.randrange(LOOKAHEAD + 1), len(seq) - P - 2, budget - 1)
        a = self.rng.randrange(k + 1)
        wrong = [(t + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
                 for t in seq[P + a + 1:P + k + 1]]
        return seq[P:P + a + 1] + wrong, a + 1

    def reserve(self, r, n, planned) -> bool:
        """Pages for n more tokens of r; on OutOfPages preempt the newest other request (its
        planned work this step is dropped) and retry once."""
        for _ in range(2):
            try:
                self.cache.reserve(r, self.P[r] + n)
                return True
            except OutOfPages:
                self.stats["out_of_pages"] += 1
                victim = self.preempt(keep=r)
                planned.pop(victim, None)
                if victim == r:
                    return False
        return False

    def step(self):
        self.admit()
        planned, budget = {}, MAX_TOKENS
        for r in list(self.P):
            if r not in self.P or budget < 1 or self.rng.random() < 0.15:
                continue
            toks, keep = self.plan_item(r, budget)
            if self.reserve(r, len(toks), planned):
                planned[r] = (toks, keep)
                budget -= len(toks)
        if not planned:
            return
        items = [(r, self.P[r], toks) for r, (toks, _) in planned.items()]
        logits, _ = self.runner.target_forward(items)
        off = 0
        for r, s, toks in items:
            keep = planned[r][1]
            self.rows[r] += [(s + i, logits[off + i]) for i in range(keep)]
            off += len(toks)
            self.P[r] = s + keep
            self.cache.truncate(r, self.P[r])
            self.stats["rolled_back"] += len(toks) - keep
            if self.P[r] == len(self.seqs[r]) - 1:       # the last token is the final anchor
                self.cache.free(r)
                del self.P[r]
                self.done.add(r)

    def check(self):
        c = self.cache
        tables = {r: c.page_table(r) for r in self.P}
        owned = [b for t in tables.values() for b in t]
        assert len(owned) == len(set(owned)), "a page is owned by two requests"
        assert c.num_free_pages + len(owned) == c.num_blocks, "page leaked or double-freed"
        assert c.num_free_slots + len(self.P) == c.slots.max_slots
        assert len({c.slot(r) for r in self.P}) == len(self.P)
        for r, t in tables.items():
            assert c.length(r) == self.P[r]
            assert len(t) == c.bm.blocks_needed(self.P[r])


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt)


@pytest.mark.parametrize("seed", range(3))
def test_randomized_admit_verify_rollback_preempt(model, seed):
    d = Driver(model, seed)
    for _ in range(400):
        if len(d.done) == len(d.seqs):
            break
        d.step()
        d.check()
    assert len(d.done) == len(d.seqs), "driver did not finish every request"
    assert d.cache.num_free_pages == d.cache.num_blocks and d.cache.num_free_slots == 3
    for key in ("preemptions", "out_of_pages", "rolled_back", "blocked_admissions"):
        assert d.stats[key] > 0, (key, d.stats)
    for r, rows in d.rows.items():
        ref = dense_logits(model, d.seqs[r][:-1])
        assert {p for p, _ in rows} == set(range(len(d.seqs[r]) - 1))
        for p, row in rows:
            assert rel_err(row, ref[p]) <= 1e-5, (r, p, rel_err(row, ref[p]))
