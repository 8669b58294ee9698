"""Continuous batching: which requests run this step and how many tokens each feeds.

Every running request verifies its block (1 + ℓ tokens); the remaining token budget goes to
prompt chunks of waiting requests in arrival order (chunked prefill mixed with verify work).
With a paged KV cache, pages are reserved here before the forward: a running request that
cannot get pages preempts the most recently admitted one (its cache is freed and it is
recomputed later from its committed tokens, which reproduces the same output because sampling
is keyed by position), and prefills wait while pages or state slots are short.

Where the runner replays uniform steps as CUDA graphs (every request feeds the same number of
tokens), `schedule(prefill_width=q)` feeds a short prompt q tokens per step, its last chunk
padded to q, next to the verify blocks of width q: the step stays one graph replay instead of an
eager forward that stalls every running request (the padding rows are rolled back like rejected
drafts). Prompts longer than `graph_prefill_tokens` are chunked by the token budget as before.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .kvcache.block_manager import CacheFull
from .request import Request, Status


@dataclass
class StepPlan:
    verify: list = field(default_factory=list)     # running requests (feed 1 + feed_len tokens)
    prefill: list = field(default_factory=list)    # (request, prompt tokens this step); the
    # forward feeds req.chunk_feed >= that many (padded to the step's width)
    preempted: list = field(default_factory=list)  # requests whose cache was freed this step

    @property
    def num_tokens(self) -> int:
        return sum(1 + r.feed_len for r in self.verify) + sum(r.chunk_feed for r, _ in self.prefill)


class Scheduler:
    def __init__(self, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, cache=None,
                 graph_prefill_tokens: int = 0, max_model_len: int | None = None):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.max_num_seqs, self.max_tokens = max_num_seqs, max_num_batched_tokens
        self.cache = cache                 # PagedKVCache or None (dense state, unbounded)
        # prompts with at most this many tokens left are fed in step-width chunks (0: never)
        self.graph_prefill_tokens = graph_prefill_tokens
        self.max_model_len = max_model_len  # padded chunks never reach past it
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request):
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, prefill_width: int = 0) -> StepPlan:
        """The step's verify blocks and prompt chunks. prefill_width > 0: the width of the
        step's verify blocks (module docstring: short prompts are fed in chunks of it)."""
        plan = StepPlan()
        for req in list(self.running):                 # oldest first keep their pages
            if req.status != Status.RUNNING:
                continue                               # preempted earlier in this loop
            if self._reserve_or_preempt(req, req.num_committed + 1 + req.feed_len, plan):
                plan.verify.append(req)
        budget = self.max_tokens - plan.num_tokens
        active = len(self.running)
        for req in list(self.waiting):                 # prefills in arrival order, chunked
            if budget <= 0 or active >= self.max_num_seqs:
                break
            left = len(req.prefill_ids) - req.num_prefilled
            start = req.num_prefilled
            if self._padded_chunk(start, left, prefill_width, budget):
                n, feed = min(left, prefill_width), prefill_width
            else:
                n = feed = min(left, budget)
            if not self._reserve_prefill(req, start + feed):
                break                                  # no pages / slots: wait for finishes
            req.chunk_feed = feed
            plan.prefill.append((req, n))
            budget -= feed
            active += 1
        return plan

    def _padded_chunk(self, start: int, left: int, width: int, budget: int) -> bool:
        """Whether a prompt with `left` tokens to go from `start` is fed `width` tokens (padded):
        short enough, within the step's budget and the model length, and a cache to roll the
        padding back in (the dense layout feeds prompts whole)."""
        return (width > 1 and self.cache is not None and left <= self.graph_prefill_tokens
                and width <= budget
                and (self.max_model_len is None or start + width <= self.max_model_len))

    def _reserve_or_preempt(self, req, new_len: int, plan: StepPlan) -> bool:
        if self.cache is None:
            return True
        while True:
            try:
                self.cache.reserve(req.request_id, new_len)
                return True
            except CacheFull:
                # newest admission gives way first: partially prefilled waiting requests, then
                # running ones (possibly req itself)
                partial = [r for r in self.waiting if self.cache.has_request(r.request_id)]
                victim = partial[-1] if partial else self.running[-1]
                self.preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    return False

    def _reserve_prefill(self, req, new_len: int) -> bool:
        if self.cache is None:
            return True
        rid = req.request_id
        while True:
            fresh = not self.cache.has_request(rid)
            try:
                if fresh:
                    self.cache.add_request(rid)
                self.cache.reserve(rid, new_len)
                return True
            except CacheFull:
                if fresh and self.cache.has_request(rid):
                    self.cache.free(rid)
                # later arrivals that hold pages from earlier chunks give them back, so the
                # queue head can always make progress (no deadlock between partial prefills)
                later = list(self.waiting)[list(self.waiting).index(req) + 1:]
                holders = [r for r in later if self.cache.has_request(r.request_id)]
                if not holders:
                    return False
                self.preempt(holders[-1])

    def preempt(self, req: Request):
        """Free the request's cache; it is recomputed later from its committed tokens (running
        requests are queued first, partially prefilled ones keep their place)."""
        if self.cache is not None and self.cache.has_request(req.request_id):
            self.cache.free(req.request_id)
        if req.status == Status.RUNNING:
            self.running.remove(req)
            self.waiting.appendleft(req)
        req.status, req.num_prefilled, req.draft = Status.WAITING, 0, None
        req.preempted = True
        self.num_preemptions += 1

    def promote(self, req: Request):
        """Prompt fully prefilled: the request now drafts and verifies every step."""
        self.waiting.remove(req)
        req.status = Status.RUNNING
        self.running.append(req)

    def finish(self, req: Request):
        req.status = Status.FINISHED
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.cache is not None and self.cache.has_request(req.request_id):
            self.cache.free(req.request_id)
