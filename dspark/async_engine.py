"""AsyncEngine: serve one `Engine` to many asyncio coroutines.

The engine is single-threaded and not thread-safe, so every engine call (add_request, step,
abort) happens on ONE background thread that runs the step loop. Coroutines talk to it through a
thread-safe command queue, processed between steps, and get their outputs back through a
per-request asyncio queue on their own event loop:

    async with AsyncEngine(Engine(path)) as ae:
        out = await ae.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=16))
        async for out in ae.stream("def fib(n):", params):    # one RequestOutput per step
            print(out.text_delta, end="")
        rs = await ae.add_request(prompt, params)   # validated now: ValueError for a bad request
        async for out in rs: ...                      # same outputs as stream()
        await ae.abort(rs.request_id)                 # the stream ends with finish_reason "abort"

Cancelling the task that consumes a request (or leaving `stream()` early) aborts the request in
the engine and frees its state. Bad requests (empty or over-long prompt, bad SamplingParams,
duplicate or unknown id) raise ValueError to the caller and never disturb the loop. An
exception raised by `Engine.step()` is delivered, as `EngineError`, to every request that was in
the engine at that step (they are aborted: their state may be half-updated); the loop keeps
serving new requests. If the engine cannot be cleaned up, or `max_consecutive_failures` steps in a
row fail, the loop stops and every waiter (and every later call) gets `EngineDeadError`.

Do not call the wrapped Engine directly while the AsyncEngine is running.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
import queue
import threading
from collections import Counter

import torch

from . import prompts as _prompts
from .engine import Engine, RequestOutput
from .metrics import SpecMetrics
from .sampling import SamplingParams

__all__ = ["AsyncEngine", "RequestStream", "EngineError", "EngineDeadError"]


class EngineError(RuntimeError):
    """`Engine.step()` failed while this request was in the engine; the request was aborted.
    `original` is the exception step() raised (also chained as __cause__)."""

    def __init__(self, message: str, original: BaseException | None = None):
        super().__init__(message)
        self.original = original


class EngineDeadError(RuntimeError):
    """The AsyncEngine is not running (never started, shut down, or stopped by a fatal error)."""


class _Entry:
    """One submitted request as both threads see it. Created on the caller's loop; the engine
    thread only touches it through `loop.call_soon_threadsafe`."""
    __slots__ = ("request_id", "loop", "queue", "ack", "detached")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ack: asyncio.Future = loop.create_future()
        self.detached = False          # the consumer is gone: drop outputs

    # -- run on the caller's loop (scheduled by the engine thread) --
    def _put(self, item):
        if not self.detached:
            self.queue.put_nowait(item)

    def _resolve(self, exc: BaseException | None):
        if not self.ack.done():
            if exc is None or self.detached:   # nobody awaits a detached ack: no stray errors
                self.ack.set_result(None)
            else:
                self.ack.set_exception(exc)


class RequestStream:
    """Async iterator over one request's RequestOutputs (one per step that produced tokens; the
    last one has finished=True). Cancelling the consuming task, `close()`, or leaving an
    `async with` block early aborts the request."""

    def __init__(self, engine: "AsyncEngine", entry: _Entry):
        self._engine, self._entry = engine, entry
        self.request_id = entry.request_id
        self.finished = False
        self.last: RequestOutput | None = None

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._entry.queue.get()
        except BaseException:          # cancelled (or the loop is going away): free the request
            self.close()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.last = item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        """Abort the request if it has not finished; idempotent, never raises."""
        if not self.finished:
            self.finished = True
            self._engine._detach(self.request_id)

    async def abort(self) -> None:
        """Abort the request; the stream then ends with an output whose finish_reason is
        "abort" (unless it finished first)."""
        if not self.finished:
            self._engine._send_abort(self.request_id)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.close()


def _snapshot(out: RequestOutput) -> RequestOutput:
    """A copy the caller may keep: the engine keeps mutating the request's SpecMetrics."""
    return dataclasses.replace(out, metrics=copy.copy(out.metrics))


def _find_cache(engine):
    """The paged KV cache, if the engine has one (anything exposing num_free_pages)."""
    runner = getattr(engine, "runner", None)
    for obj in (getattr(engine, "cache", None), getattr(engine, "kv_cache", None),
                getattr(runner, "cache", None), getattr(runner, "kv_cache", None),
                getattr(getattr(runner, "backend", None), "cache", None)):
        if obj is not None and hasattr(obj, "num_free_pages"):
            return obj
    return None


class AsyncEngine:
    def __init__(self, engine: Engine, *, max_consecutive_failures: int = 3,
                 name: str = "dspark-engine-loop"):
        if max_consecutive_failures < 1:
            raise ValueError("max_consecutive_failures must be >= 1")
        self.engine = engine
        self.max_consecutive_failures = max_consecutive_failures
        self._name = name
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()          # guards everything below that both threads touch
        self._active: dict[str, _Entry] = {}
        self._pending_adds = 0
        self._state = "new"                    # new -> running -> stopped
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._failures = 0
        # statistics (written on the engine thread under the lock; read by stats())
        self._finished = Counter()
        self._spec = SpecMetrics()
        drafter = getattr(engine, "drafter", None)
        self.gamma = int(getattr(drafter, "gamma", 0) or 0) if drafter is not None else 0
        self._budget_le = [float(i) for i in range(self.gamma + 1)]
        self._budget_buckets = [0] * (len(self._budget_le) + 1)   # last: +Inf
        self._budget_sum = 0.0
        self._budget_count = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._steps = 0
        self._step_errors = 0
        self._gauges = {"waiting": 0, "running": 0, "pages_in_use": None, "pages_total": None}
        self._publish_gauges()

    @classmethod
    def from_path(cls, path: str | None = None, *, max_consecutive_failures: int = 3,
                  **engine_kwargs) -> "AsyncEngine":
        return cls(Engine(path, **engine_kwargs), max_consecutive_failures=max_consecutive_failures)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> "AsyncEngine":
        with self._lock:
            if self._state == "running":
                return self
            if self._state != "new":
                raise EngineDeadError("this AsyncEngine was shut down; create a new one")
            self._state = "running"
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._state == "running"

    @property
    def error(self) -> BaseException | None:
        """The fatal error that stopped the loop, if any."""
        return self._error

    def close(self, drain: bool = False, timeout: float | None = None) -> None:
        """Synchronous shutdown: stop the loop thread. drain=False aborts unfinished requests
        (their streams end with finish_reason "abort"); drain=True lets them finish first.
        New submissions are refused from now on."""
        with self._lock:
            if self._state == "new":
                self._state = "stopped"
                return
            if self._state == "running":
                self._state = "stopping"
                self._cmds.put(("stop", drain))
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    async def shutdown(self, drain: bool = False, timeout: float | None = None) -> None:
        """Async version of close(): does not block the event loop while the thread stops."""
        await asyncio.get_running_loop().run_in_executor(None, self.close, drain, timeout)

    async def __aenter__(self) -> "AsyncEngine":
        return self.start()

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    # ---- submission --------------------------------------------------------------------------
    async def add_request(self, prompt, params: SamplingParams | None = None,
                          request_id=None) -> RequestStream:
        """Submit one request and wait until the engine accepted it. Raises ValueError for a bad
        request (the engine's own checks), EngineDeadError when not running."""
        # the engine's own checks, here on the caller's side: the same messages as
        # Engine.add_request, before anything is queued
        if params is not None and not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}: "
                             f"pass SamplingParams(...)")
        vocab = getattr(getattr(self.engine, "cfg", None), "vocab_size", None)
        if isinstance(prompt, (list, tuple, torch.Tensor)) or type(prompt).__module__ == "numpy":
            prompt = _prompts.token_ids(prompt, vocab) if vocab else list(prompt)
        elif not isinstance(prompt, (str, dict)):
            raise ValueError(f"prompt must be {_prompts.ACCEPTED}; got {type(prompt).__name__}")
        if self._state == "new":
            self.start()
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._state != "running":
                raise self._dead_error()
            if request_id is None:
                rid = f"req-{next(self._ids)}"
                while rid in self._active:
                    rid = f"req-{next(self._ids)}"
            else:
                rid = str(request_id)
                if rid in self._active:
                    raise ValueError(f"request_id {rid!r} is already in use")
            entry = _Entry(rid, loop)
            self._active[rid] = entry
            self._pending_adds += 1
            self._cmds.put(("add", entry, prompt, params))
        try:
            await asyncio.shield(entry.ack)
        except asyncio.CancelledError:
            self._detach(rid)
            raise
        return RequestStream(self, entry)

    async def generate(self, prompt, params: SamplingParams | None = None,
                       request_id=None) -> RequestOutput:
        """Run one request to the end and return its final RequestOutput (finish_reason "abort"
        if it was aborted). Cancelling the awaiting task aborts the request."""
        rs = await self.add_request(prompt, params, request_id)
        try:
            async for _ in rs:
                pass
        finally:
            rs.close()
        return rs.last

    async def stream(self, prompt, params: SamplingParams | None = None, request_id=None):
        """Async generator of RequestOutputs with per-step `new_token_ids` / `text_delta`.
        Leaving the loop early or cancelling the consumer aborts the request."""
        rs = await self.add_request(prompt, params, request_id)
        try:
            async for out in rs:
                yield out
        finally:
            rs.close()

    async def abort(self, request_id) -> None:
        """Abort a running request. Its stream (if any) ends with finish_reason "abort".
        ValueError if no such request is running (unknown or already finished)."""
        rid = str(request_id)
        with self._lock:
            if rid not in self._active:
                raise ValueError(f"unknown request id {rid!r}: not submitted to this engine or "
                                 f"already finished")
        self._send_abort(rid)

    # ---- introspection -------------------------------------------------------------------------
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._active)

    def active_request_ids(self) -> list:
        with self._lock:
            return list(self._active)

    def stats(self) -> dict:
        """Snapshot for monitoring (safe from any thread)."""
        with self._lock:
            return {
                "running": self._state == "running",
                "error": None if self._error is None else repr(self._error),
                "gamma": self.gamma,
                "requests_total": dict(self._finished),
                "spec": copy.deepcopy(self._spec),
                "verify_budget": {"le": list(self._budget_le),
                                  "buckets": list(self._budget_buckets),
                                  "sum": self._budget_sum, "count": self._budget_count},
                "prompt_tokens_total": self._prompt_tokens,
                "generation_tokens_total": self._generation_tokens,
                "steps_total": self._steps,
                "step_errors_total": self._step_errors,
                "active_requests": len(self._active),
                "queue_depth": self._gauges["waiting"] + self._pending_adds,
                "running_requests": self._gauges["running"],
                "pages_in_use": self._gauges["pages_in_use"],
                "pages_total": self._gauges["pages_total"],
                "compile": self.engine.compile_stats(),
            }

    # ---- caller-side helpers ---------------------------------------------------------------------
    def _dead_error(self) -> EngineDeadError:
        if self._error is not None:
            err = EngineDeadError(f"the engine loop stopped after an unrecoverable error: "
                                  f"{self._error!r}")
            err.__cause__ = self._error
            return err
        return EngineDeadError("the AsyncEngine is not running (not started or shut down)")

    def _detach(self, rid: str) -> None:
        """The consumer is gone: drop its outputs and abort the request in the engine."""
        with self._lock:
            entry = self._active.get(rid)
            if entry is None:
                return
            entry.detached = True
        self._send_abort(rid)

    def _send_abort(self, rid: str) -> None:
        self._cmds.put(("abort", rid))

    # ---- engine thread ---------------------------------------------------------------------------
    def _deliver(self, entry: _Entry, item) -> None:
        if entry.detached:
            return
        try:
            entry.loop.call_soon_threadsafe(entry._put, item)
        except RuntimeError:           # the caller's event loop is closed: nobody is listening
            entry.detached = True
            self._cmds.put(("abort", entry.request_id))

    def _ack(self, entry: _Entry, exc: BaseException | None) -> None:
        try:
            entry.loop.call_soon_threadsafe(entry._resolve, exc)
        except RuntimeError:
            entry.detached = True

    def _run(self) -> None:
        stop, drain = False, False
        try:
            while True:
                busy = self.engine.has_unfinished()
                for cmd in self._take_commands(block=not busy and not stop):
                    if cmd[0] == "stop":
                        stop, drain = True, cmd[1]
                    elif cmd[0] == "add":
                        self._do_add(*cmd[1:], refuse=stop)
                    elif cmd[0] == "abort":
                        self._do_abort(cmd[1])
                if stop and not drain:
                    break
                if self.engine.has_unfinished():
                    self._step()
                elif stop:
                    break
                self._publish_gauges()
        except BaseException as e:   # noqa: BLE001 - fatal: report to everyone below
            with self._lock:
                self._error = e
        finally:
            self._teardown()

    def _take_commands(self, block: bool) -> list:
        cmds = []
        if block:
            cmds.append(self._cmds.get())
        while True:
            try:
                cmds.append(self._cmds.get_nowait())
            except queue.Empty:
                return cmds

    def _do_add(self, entry: _Entry, prompt, params, refuse: bool = False) -> None:
        err: BaseException | None = None
        req = None
        if refuse:
            err = EngineDeadError("the AsyncEngine is shutting down")
        elif not entry.detached:
            try:
                self.engine.add_request(prompt, params, request_id=entry.request_id)
                req = (self.engine._groups.get(entry.request_id) or [None])[0]
            except Exception as e:  # noqa: BLE001 - a bad request: tell its caller only
                err = e if isinstance(e, ValueError) or not isinstance(
                    e, (TypeError, OverflowError)) else ValueError(f"bad request: {e}")
        with self._lock:
            self._pending_adds -= 1
            if req is None:
                self._active.pop(entry.request_id, None)
            else:
                self._prompt_tokens += len(req.prompt_ids)
        self._publish_gauges()
        self._ack(entry, err)

    def _do_abort(self, rid: str) -> None:
        out = self.engine.abort_request(rid)
        with self._lock:
            entry = self._active.pop(rid, None)
        if out is not None:
            self._record_finished(out)
        self._publish_gauges()
        if out is not None and entry is not None:
            self._deliver(entry, out)

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:      # noqa: BLE001
            self._on_step_error(e)
            return
        self._failures = 0
        with self._lock:
            self._steps += 1
        self._publish_gauges()
        for out in outs:
            if out.finished:
                with self._lock:
                    entry = self._active.pop(out.request_id, None)
                self._record_finished(out)
            else:
                with self._lock:
                    entry = self._active.get(out.request_id)
            if entry is not None:
                self._deliver(entry, _snapshot(out))

    def _on_step_error(self, exc: Exception) -> None:
        """Every request in the engine took part in (or may have been touched by) the failed
        step: abort them all and fail their waiters; the loop keeps serving."""
        self._failures += 1
        with self._lock:
            self._step_errors += 1
        failed = []
        for rid in self.engine.request_ids():
            out = self.engine.abort_request(rid)   # raising here is fatal (out of _run)
            with self._lock:
                entry = self._active.pop(rid, None)
                self._finished["error"] += 1
                if out is not None:
                    self._generation_tokens += sum(len(o.token_ids) for o in out.outputs)
            if entry is not None:
                failed.append(entry)
        self._publish_gauges()
        for entry in failed:
            err = EngineError(f"engine step failed, request {entry.request_id!r} was aborted: "
                              f"{exc!r}", exc)
            err.__cause__ = exc
            self._deliver(entry, err)
        if self.engine.has_unfinished():
            raise RuntimeError("the engine still holds requests after aborting every request of "
                               "a failed step; cannot continue") from exc
        if self._failures >= self.max_consecutive_failures:
            raise RuntimeError(f"{self._failures} engine steps failed in a row; last error: "
                               f"{exc!r}") from exc

    def _record_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        with self._lock:
            self._finished[out.finish_reason or "unknown"] += 1
            self._generation_tokens += sum(len(o.token_ids) for o in out.outputs)
            if m is not None:
                self._spec = self._spec.merge(m)
                if m.rounds:
                    budget = m.verified / m.rounds
                    self._budget_sum += budget
                    self._budget_count += 1
                    for i, le in enumerate(self._budget_le):
                        if budget <= le:
                            self._budget_buckets[i] += 1
                            break
                    else:
                        self._budget_buckets[-1] += 1

    def _publish_gauges(self) -> None:
        sch = getattr(self.engine, "scheduler", None)
        waiting = len(getattr(sch, "waiting", ())) if sch is not None else 0
        running = len(getattr(sch, "running", ())) if sch is not None else 0
        in_use = total = None
        cache = _find_cache(self.engine)
        if cache is not None:
            try:
                free = int(cache.num_free_pages)
                total = getattr(cache, "num_blocks", None)
                if total is None:
                    total = getattr(cache, "num_pages", None)
                total = int(total) if total is not None else None
                in_use = total - free if total is not None else None
            except Exception:       # noqa: BLE001 - monitoring must never break serving
                in_use = total = None
        with self._lock:
            self._gauges = {"waiting": waiting, "running": running,
                            "pages_in_use": in_use, "pages_total": total}

    def _teardown(self) -> None:
        """Loop exit (shutdown or fatal error): abort what is left, answer every waiter, and
        refuse everything still queued."""
        fatal = self._error
        with self._lock:
            self._state = "stopped"      # from here no command can be enqueued
        for rid in self.engine.request_ids():
            try:
                if fatal is None:
                    self._do_abort(rid)
                else:
                    self.engine.abort(rid)
            except BaseException:        # noqa: BLE001 - best effort while going down
                pass
        while True:                      # commands that raced with the stop
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                with self._lock:
                    self._pending_adds -= 1
        with self._lock:
            leftover = list(self._active.values())
            self._active.clear()
        for entry in leftover:
            err = self._dead_error()
            self._ack(entry, err)
            self._deliver(entry, err)
        self._publish_gauges()
