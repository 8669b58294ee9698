"""Overlapped decode: launch round n+1 before reading round n back.

A plain decode step (no drafter, every running request feeding its one anchor token) spends
~0.5-0.7 ms of host time per step on an H200 (plan, graph launch, acceptance bookkeeping) while the
device waits, and the device then waits for the host's read back. Here the next round is launched
first, its input tokens taken from the previous round's device-side results (never read by the
host before the launch), and only then is the previous round read back and committed on the host,
while the device runs the new round. Each `step()` still commits exactly one round.

What the host does not know at launch it assumes and repairs afterwards:
  * every request continues: a request whose read-back token turns out to be a stop token is
    finished as usual; the row the device computes for it in the round already launched is
    dropped (its cache is freed with the request, the write landed past its committed tokens);
  * a request that reaches its token budget with the round being read back is known on the host
    (budgets are counts) and is never launched again.
Tokens are identical to the step-by-step loop: the same forward on the same inputs (sampled
requests draw from counter-based randomness keyed by seed and position, not by call order).

Used by `Engine.step()` when it applies (`applies()`); anything else (a waiting prompt, a drafter,
pages running out) drains the round in flight first and takes the ordinary path.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .cuda.transfer import PinnedReader
from .kvcache.block_manager import CacheFull
from .request import BlockTokens, Status
from .spec.accept import Decision, decide


@dataclass
class InFlight:
    """A launched round: its requests, the device results and their pending copy to the host."""
    reqs: list
    starts: list              # each request's position of the fed token (its anchor position)
    decision: Decision        # on the device
    host: torch.Tensor        # the decision's table, copied (or being copied) to the host
    ready: object             # torch.cuda.Event recorded after the copy, or None on CPU
    telemetry: dict           # its entry of Engine.telemetry


class OverlappedDecode:
    def __init__(self, engine):
        self.engine = engine
        self.in_flight: InFlight | None = None
        self._reader = PinnedReader()      # round n and n + 1 in alternate pinned buffers
        self.rounds = 0                    # rounds launched ahead of their predecessor's read back
        self.refused = 0                   # launches refused for pages (ordinary round instead)
        # seconds the host waited for read backs: a step's wall time minus its wait is the host's
        # own work, which must stay below the device's for the overlap to hide it
        self.wait_s = 0.0

    def applies(self) -> bool:
        """Every running request decodes one token, no prompt waits, no drafts to verify."""
        eng = self.engine
        # requests whose logits depend on their history or that report logprobs take the
        # ordinary round (the token in flight is not in their history yet)
        return eng.drafter is None and not eng.scheduler.waiting and bool(eng.scheduler.running) \
            and not any(r.params.adjusts_logits or r.params.logprobs is not None
                        for r in eng.scheduler.running)

    def step(self) -> list | None:
        """Launch the next round, then commit the one in flight. None when nothing could be
        launched and nothing was in flight (pages short: the caller takes the ordinary path)."""
        eng = self.engine
        if self.in_flight is None:
            self.in_flight = self._launch(list(eng.scheduler.running), None)
            if self.in_flight is None:
                return None
        prev = self.in_flight
        # rows of requests that may emit another token after the one being computed
        rows = [i for i, r in enumerate(prev.reqs)
                if r.status == Status.RUNNING and len(r.output_ids) + 2 <= eng._token_limit(r)]
        self.in_flight = self._launch([prev.reqs[i] for i in rows], prev, rows) if rows else None
        if self.in_flight is not None:
            self.rounds += 1
        return self._commit(prev, self.in_flight)

    def drain(self) -> list:
        """Commit the round in flight, if any (before an ordinary step)."""
        prev, self.in_flight = self.in_flight, None
        return self._commit(prev, None) if prev is not None else []

    # ---- internals ---------------------------------------------------------------------------
    def _launch(self, reqs, prev: InFlight | None, rows=None) -> InFlight | None:
        """One decode forward for `reqs`: fed their host anchors (prev None) or the tokens `prev`
        computes on the device (reqs = prev.reqs[i] for i in rows). None (nothing launched) if
        their pages cannot be reserved."""
        eng = self.engine
        if prev is None:
            starts = [r.num_committed for r in reqs]
            toks = [[r.anchor] for r in reqs]
        else:
            nxt = prev.decision.next_tokens()
            starts = [r.num_committed + 1 for r in reqs]
            none = nxt[:0]                  # no drafts: one empty view for every request
            toks = [BlockTokens(nxt[i], none) for i in rows]
        if eng.cache is not None:
            try:
                for r, s in zip(reqs, starts):
                    eng.cache.reserve(r.request_id, s + 1)
            except CacheFull:
                self.refused += 1
                return None
        items = [(r.target_state, s, t) for r, s, t in zip(reqs, starts, toks)]
        # decide queues its reads of the logits right away: no snapshot copy of them needed
        logits, _ = eng.runner.target_forward(items, snapshot=False)
        tel = {"batch_tokens": len(reqs), "num_verify": len(reqs),
               "verify_tokens": [0] * len(reqs), "prefill_tokens": 0}
        eng.telemetry.append(tel)
        R = len(reqs)
        dec = decide(reqs, logits, list(range(R)), [0] * R, starts, eng.gamma,
                     deterministic=eng.config.deterministic)
        # the table may view the runner's output buffers (target_forward(snapshot=False)), which
        # the next round overwrites: copied now (on CUDA to the host, queued before that round)
        host, ready = self._reader.read(dec.table())
        return InFlight(reqs, starts, dec, host, ready, tel)

    def _commit(self, prev: InFlight, launched: InFlight | None) -> list:
        """Read `prev` back and commit it for the requests still running (an abort or a finish
        while it was in flight drops its row); `launched` is the round now running after it."""
        if prev.ready is not None:
            t0 = time.perf_counter()
            prev.ready.synchronize()           # this round only, not the one launched after it
            self.wait_s += time.perf_counter() - t0
        table = prev.host.tolist()
        self.engine.landed_telemetry = prev.telemetry
        keep = [i for i, r in enumerate(prev.reqs) if r.status == Status.RUNNING]
        if not keep:
            return []
        reqs = [prev.reqs[i] for i in keep]
        ahead = frozenset(r.request_id for r in launched.reqs) if launched is not None else ()
        return self.engine._commit(reqs, prev.decision, [table[i] for i in keep], None,
                                   list(range(len(reqs))), [0] * len(reqs),
                                   [prev.starts[i] for i in keep], in_flight=ahead)
