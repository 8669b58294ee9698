"""Continuous batching: which requests run this step and how many tokens each feeds.

Every running request verifies its block (1 + ℓ tokens); the remaining token budget goes to
prompt chunks of waiting requests in arrival order (chunked prefill mixed with verify work).
New requests join as soon as there is a free sequence slot and budget; finished ones leave.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .request import Request, Status


@dataclass
class StepPlan:
    verify: list = field(default_factory=list)     # running requests (verify ℓ drafts, ℓ may be 0)
    prefill: list = field(default_factory=list)    # (request, number of prompt tokens this step)

    @property
    def num_tokens(self) -> int:
        return sum(1 + r.verify_len for r in self.verify) + sum(n for _, n in self.prefill)


class Scheduler:
    def __init__(self, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.max_num_seqs, self.max_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request):
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan(verify=list(self.running))
        budget = self.max_tokens - plan.num_tokens
        active = len(self.running)
        for req in self.waiting:           # prefills in arrival order, possibly partial chunks
            if budget <= 0 or active >= self.max_num_seqs:
                break
            n = min(len(req.prompt_ids) - req.num_prefilled, budget)
            plan.prefill.append((req, n))
            budget -= n
            active += 1
        return plan

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
