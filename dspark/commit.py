"""The host side of a DSpark round once its acceptance is read back (Engine's mixin): the commit
of what the next round is launched from (`_commit_state`: tokens, stops, draft context, cache
rollback, finishes) and then what nothing of the next round reads (`_outputs`: text, metrics,
RequestOutputs), which Engine.step() builds while the next round runs on the device."""
from __future__ import annotations

import time
from dataclasses import dataclass

from .logprobs import emitted_logprobs
from .outputs import RequestOutput, request_output
from .request import Request, Status
from .spec.verify import FinishReason, accept_greedy_host, emit_and_stop_host


@dataclass
class _Round:
    """A round launched on the device (Engine._launch), not read back yet: the requests that
    emit tokens in it, their acceptance (`dec`, still on the device), the pending copy of its
    table to the host (`host`, complete once `ready` is), the next blocks drafted from it
    (None where they are drafted after the read), and what the commit reads of the forward."""
    reqs: list
    dec: object
    host: object
    ready: object
    blocks: list | None
    taps: object
    first_rows: list
    lengths: list
    anchor_pos: list
    logits: object
    telemetry: dict | None = None      # its entry of Engine.telemetry


class RoundCommit:
    """Engine's methods that commit a read-back round and build its outputs (they use the
    engine's scheduler, cache, runner, drafter, requests and tokenizer)."""

    def _commit(self, reqs, dec, table, taps, first_rows, lengths, anchor_pos,
                in_flight=frozenset(), logits=None, then=None, context_written=False) -> list:
        """_commit_state, then the round's outputs (_outputs)."""
        return self._outputs(self._commit_state(reqs, dec, table, taps, first_rows, lengths,
                                                anchor_pos, in_flight, logits, then,
                                                context_written))

    def _commit_state(self, reqs, dec, table, taps, first_rows, lengths, anchor_pos,
                      in_flight=frozenset(), logits=None, then=None,
                      context_written=False) -> list:
        """The host part of acceptance on the read-back `table` (rows of dec.table()): accept
        (greedy), emitted tokens, stop tokens and token budgets, then every request's state:
        what the next round is scheduled and launched from, and what reads this round's logits
        (logprobs), which the next forward overwrites. Returns (request, emitted tokens, ran a
        verify, ℓ, accepted) per request for `_outputs`.
        `in_flight`: ids of requests whose next position a launched forward already writes (the
        overlapped decode loop), so their cache keeps it (no rollback to the committed length).
        `then(finishing ids)` is called once the committed tokens are final (the draft pass of
        the requests that go on). context_written: the verify rows' draft context is on the
        device already (ModelRunner.draft_ahead)."""
        R, w = len(reqs), dec.head.shape[1]
        host_drafts = [row[w:] for row in table] if dec.verified else [[]] * R
        if dec.greedy:
            accepted, nxt = accept_greedy_host(host_drafts, [row[:w] for row in table], lengths)
        else:
            accepted, nxt = [row[0] for row in table], [row[1] for row in table]
        emitted, finish = emit_and_stop_host(
            host_drafts, accepted, nxt,
            [r.stop_ids for r in reqs],          # user stop ids + EOS, fixed at admission
            [len(r.output_ids) for r in reqs],
            [self._token_limit(r) for r in reqs])

        now = time.perf_counter()
        # first what the next round's draft pass reads: committed tokens, draft context, who runs
        was_running = [req.status == Status.RUNNING for req in reqs]
        verified_drafts = [req.draft for req in reqs]     # `then` drafts the next blocks
        for i, req in enumerate(reqs):
            new = emitted[i]
            if finish[i] == FinishReason.STOP and new and new[-1] in req.params.stop_token_ids:
                req.stop_reason = new[-1]
            if req.detok is not None and req.detok.stop:    # stop strings may end it early
                used, hit = req.detok.push(new)
                if hit is not None:
                    new, finish[i], req.stop_reason = new[:used], FinishReason.STOP, hit
            emitted[i] = new
            if was_running[i] and self.drafter is not None:
                # draft context for the committed verify rows: anchor + accepted drafts
                a = min(accepted[i], len(new))
                f = first_rows[i]
                if context_written:
                    st = req.draft_state
                    st.length = max(st.length, anchor_pos[i] + a + 1)
                else:
                    self.runner.commit_context(req.draft_state, taps[f:f + a + 1], anchor_pos[i])
            elif not was_running[i]:
                self.scheduler.promote(req)
                req.first_token_time = now
            req.output_ids.extend(new)
        if then is not None:
            then({r.request_id for r, f in zip(reqs, finish) if f != FinishReason.NONE})
        work = []
        for i, req in enumerate(reqs):
            new = emitted[i]
            if req.logprobs is not None and logits is not None:
                req.logprobs.extend(emitted_logprobs(logits, first_rows[i], new,
                                                     req.params.logprobs, self.tokenizer))
            if was_running[i] and self.round_log is not None and verified_drafts[i] is not None:
                self.round_log.append((verified_drafts[i].conf_logits.float().cpu(),
                                       lengths[i], accepted[i]))
            if (self.cache is not None and finish[i] == FinishReason.NONE
                    and req.request_id not in in_flight):
                # roll every cache back to the committed tokens (rejected drafts never happened)
                self.cache.truncate(req.request_id, req.num_committed)
            if finish[i] != FinishReason.NONE:
                req.finish_reason = "stop" if finish[i] == FinishReason.STOP else "length"
                req.finish_time = now
                self.scheduler.finish(req)
                self.requests.pop(req.request_id, None)
                self._release(req)
            work.append((req, new, was_running[i], lengths[i], accepted[i]))
        return work

    def _outputs(self, work) -> list:
        """What nothing of the next round reads, per request of a committed round (`work` from
        _commit_state): its text, metrics and RequestOutput."""
        g, outs = self.gamma, []
        # samples of several-sample requests that finished in this round: shown running in the
        # outputs built before their own
        finished = [req for req, *_ in work if req.status == Status.FINISHED]
        ending = [req for req in finished if len(self._groups.get(req.parent, ())) > 1]
        for req, new, verified, length, accepted in work:
            if req.detok is not None and not req.detok.stop:
                req.detok.push(new)
            if verified:
                req.metrics.record_round(proposed=g if self.drafter is not None else 0,
                                         verified=length, accepted=min(accepted, len(new)),
                                         emitted=len(new))
            if ending and ending[0] is req:
                ending.pop(0)
            outs.append(self._output(req, new, ending))
        for req in finished:        # after every sample's output: they all show the group
            group = self._groups.get(req.parent)
            if group is not None and all(r.status == Status.FINISHED for r in group):
                del self._groups[req.parent]
        return outs

    def _output(self, req: Request, new_tokens: list, running=()) -> RequestOutput:
        finished = req.status == Status.FINISHED
        delta = ""
        if req.detok is not None:
            if finished:
                req.detok.finish()
            delta = req.detok.take()
            req.text += delta
        if finished:
            req.metrics.record_timing(ttft=req.first_token_time - req.arrival_time,
                                      decode_time=req.finish_time - req.first_token_time,
                                      decode_tokens=len(req.output_ids) - 1)
        return request_output(self._groups.get(req.parent) or [req], req, new_tokens, delta,
                              running)

    def _release(self, req: Request):
        """Drop every cache the request holds (dense state is freed with the references)."""
        req.target_state = req.draft_state = req.draft = None
