"""Tensor-parallel execution for the engine: one process per device, rank 0 drives.

    runner = DistributedRunner.launch(path, cfg, world_size=4, device="cuda", dtype=torch.bfloat16,
                                      drafter=True, quant=QuantSim())
    Engine(path, tensor_parallel_size=4)          # the same, from the engine (weights quantized)
    Engine(path, tensor_parallel_size=2, tensor_parallel_drafter="sharded")

Rank 0 lives in the caller's process: it runs the scheduler, sampling and verification exactly as
a single-process engine does, through `DistributedRunner`, a `ModelRunner` over rank 0's shard.
Ranks 1..N-1 are `torch.multiprocessing` spawn children that execute forwards on command.

Decode / verify steps (`configure(..., target_graphs=True)`, on by default where the single
device uses graphs) run on every rank through the single-device fixed-shape step
(models/deepseek_v4/graph.py), the collectives inside it (captured in its CUDA graph on GPU):
rank 0 fills the step's input buffer (token ids, drafts still on its device included, positions,
slots, page tables) and its host plan, and the step begins by broadcasting that buffer to the
other ranks, which compute no plan and read no tokens. So rank 0 sends such a step's requests,
starts and lengths only, and reads nothing back from its device for them. Prefill chunks and
other ragged steps run eagerly on every rank with the token ids in the message.

Drafter (`drafter_mode`): "replicated" (default): rank 0 holds the whole drafter and runs the
draft pass and context writes alone: no message, no collective, the single-device DraftPass
(CUDA graphs included); the other ranks hold none. "sharded": split like the target, every
rank runs the (eager) draft pass on command; for drafters too large for one device.

Protocol (one control message per target forward, and per draft pass of a sharded drafter):
before rank 0 runs a call on its shard it broadcasts the call's inputs with
`comm.broadcast_message` over a gloo control group (host to host: no device sync; one broadcast
for a message of a few KB); every rank then runs the same `ModelRunner` call on its own shard,
and the sharded modules meet in their collectives (tp.py). Per-request state lives in every rank (the replicated KV head and compressor
rows; only the heads differ), keyed by an id that rank 0 assigns in `new_states()` and that
workers create lazily on first use; when rank 0's state objects are garbage collected their ids
ride on the next message and workers drop theirs. A sharded drafter's `commit_context` calls are
queued and sent with the next message, naming rows of the last forward's taps (every rank
computed the same taps), so they cost no extra round trip. Only rank 0 samples, verifies and
schedules; workers never make a decision that could differ from it.

Paged KV cache: `configure(quant, backend)` gives every rank an attention backend over its own
PagedKVCache of the same size (the single KV head is replicated, so each rank stores the same
rows). The scheduler's cache calls on rank 0 (add_request / reserve / truncate / free) are
recorded and replayed on every worker, in order, before its next forward, together with their
outcome (a call that raised on rank 0 must raise the same way on the worker, else the ranks stop
with an error instead of drifting apart). Each rank registers its own scratch request for the
fixed-shape steps before the mirroring starts, so the numbering of slots and pages agrees.
"""
from __future__ import annotations

import atexit
import collections
import itertools
import queue
import sys
import traceback
import weakref
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dspark.request import token_list
from dspark.runner import ModelRunner, QuantSim

from .comm import (TPGroup, broadcast_message, destroy_distributed, init_distributed,
                   local_init_method, rank_device)
from .sharding import check_quantized_split, check_world_size, resolve_weight_format
from .tp import build_full_drafter, build_rank_model, fixed_shape_steps, set_indexer_mode

DRAFTER_MODES = ("replicated", "sharded")



class _MirroredCache:
    """Mixed into rank 0's PagedKVCache (instance class swap): every engine-API mutation is
    executed, then recorded for the workers with its outcome."""

    def _tp_mirror(self, name, *args):
        fn = getattr(super(_MirroredCache, self), name)
        try:
            out = fn(*args)
        except Exception as e:
            self._tp_record(("cache", name, args, type(e).__name__))
            raise
        self._tp_record(("cache", name, args, None))
        return out

    def add_request(self, rid):
        return self._tp_mirror("add_request", rid)

    def reserve(self, rid, new_len):
        return self._tp_mirror("reserve", rid, new_len)

    def truncate(self, rid, committed_len):
        return self._tp_mirror("truncate", rid, committed_len)

    def free(self, rid):
        return self._tp_mirror("free", rid)


def cache_spec(cache) -> dict:
    """PagedKVCache keyword arguments that rebuild a cache of the same geometry."""
    kv = "fp8" if cache.fp8 else {torch.bfloat16: "bf16", torch.float32: "fp32"}[cache.dtype]
    return dict(kv_cache_dtype=kv, block_size=cache.block_size, num_blocks=cache.num_blocks,
                max_num_seqs=cache.num_slots, lookahead=cache.lookahead,
                max_batch_tokens=cache.max_batch_tokens)


@dataclass
class RankSpec:
    """What a worker needs to build its shard and join the group (pickled to the child)."""
    path: str
    cfg: object
    world: int
    init_method: str
    device: str
    dtype: torch.dtype
    drafter: str | None             # "replicated" | "sharded" | None (no drafter)
    quant: bool
    indexer_mode: str
    timeout_s: float
    threads: int
    weight_format: str = "bf16"


def memory_stats(runner) -> dict:
    """Weight bytes this rank holds (by storage format, dspark.models.qlinear.memory_report) and,
    on CUDA, its device's allocated / peak-allocated / reserved bytes."""
    from dspark.models.qlinear import memory_report
    out = {"weights": memory_report(runner.model, runner.drafter)}
    dev = torch.device(runner.device)
    if dev.type == "cuda":
        out.update(cuda_allocated=torch.cuda.memory_allocated(dev),
                   cuda_max_allocated=torch.cuda.max_memory_allocated(dev),
                   cuda_reserved=torch.cuda.memory_reserved(dev))
    return out


# ---- worker side ---------------------------------------------------------------------------

def _worker_main(rank: int, spec: RankSpec, status) -> None:
    try:
        torch.set_num_threads(spec.threads)
        dev = rank_device(spec.device, rank)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        tp = TPGroup(rank, spec.world)
        # drafter="replicated": rank 0 holds the whole drafter and drafts alone
        model, drafter = build_rank_model(spec.path, spec.cfg, tp, spec.dtype, dev,
                                          spec.drafter == "sharded", spec.indexer_mode,
                                          weight_format=spec.weight_format)
    except BaseException:
        status.put(("error", rank, traceback.format_exc()))
        return
    status.put(("ready", rank, None))
    g = init_distributed(rank, spec.world, spec.init_method, spec.device, spec.timeout_s)
    tp.group, tp.cpu_group = g.group, g.cpu_group
    runner = ModelRunner(model, drafter, dev, QuantSim() if spec.quant else None)
    code = 0
    try:
        Worker(runner, tp).serve()
    except BaseException:
        print(f"[dspark tp rank {rank}] worker failed:\n{traceback.format_exc()}", file=sys.stderr,
              flush=True)
        code = 1
    finally:
        destroy_distributed()
    if code:
        sys.exit(code)


class Worker:
    """Executes rank 0's commands on this rank's shard until told to stop."""

    def __init__(self, runner: ModelRunner, tp: TPGroup):
        self.runner, self.tp = runner, tp
        self.states: dict = {}
        self.last_taps = None

    def _state(self, ref):
        if not (isinstance(ref, tuple) and len(ref) == 2 and ref[0] == "tp-state"):
            return ref                      # an id the backend understands (passed through)
        if ref[1] not in self.states:        # created on first use; only the half asked for
            t, d = self.runner.new_states()
            self.states[ref[1]] = t if ref[1][1] == "t" else d
        return self.states[ref[1]]

    def stats(self) -> dict:
        cache = getattr(self.runner.backend, "cache", None)
        return {"rank": self.tp.rank, "states": len(self.states),
                "cache_requests": None if cache is None else len(cache._reqs),
                "cache_free_pages": None if cache is None else cache.num_free_pages,
                "fixed_steps": getattr(self.runner.target_graphs, "num_replays", None),
                **memory_stats(self.runner)}

    def serve(self) -> None:
        while True:
            threads, ops = broadcast_message(None, self.tp.cpu_group, self.tp.rank)
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            for op in ops:
                if self.execute(op) == "stop":
                    return

    @torch.inference_mode()
    def execute(self, op):
        kind = op[0]
        if kind == "free":
            for key in op[1]:
                self.states.pop(key, None)
        elif kind == "fwd":
            _, items, logit_rows = op
            # an int: that many tokens, which the fixed-shape step receives from rank 0 itself
            if any(isinstance(toks, int) for _, _, toks in items):
                graphs = self.runner.target_graphs
                items = [(self._state(ref), start, [0] * toks) for ref, start, toks in items]
                self.runner.flush_context()
                out = graphs.run(items) if graphs is not None else None
                if out is None:
                    raise RuntimeError(f"rank {self.tp.rank}: a step rank 0 ran fixed-shape does "
                                       f"not fit this rank's fixed-shape path")
                self.last_taps = out[1]
            else:
                items = [(self._state(ref), start, toks) for ref, start, toks in items]
                _, self.last_taps = self.runner.target_forward(items, logit_rows)
        elif kind == "ctx":
            _, ref, rows, start = op
            taps = self.last_taps[rows[0]:rows[1]] if isinstance(rows, tuple) else rows.to(
                self.runner.device)
            self.runner.commit_context(self._state(ref), taps, start)
        elif kind == "draft":
            reqs = [SimpleNamespace(anchor=a, num_committed=n, draft_state=self._state(ref),
                                    params=p, seed=s) for a, n, ref, p, s in op[1]]
            self.runner.draft(reqs)
        elif kind == "cache":
            _, name, args, expected = op
            try:
                getattr(self.runner.backend.cache, name)(*args)
                got = None
            except Exception as e:
                got = type(e).__name__
            if got != expected:
                raise RuntimeError(f"rank {self.tp.rank}: KV cache {name}{args} gave "
                                   f"{got or 'success'} here but {expected or 'success'} on rank 0")
        elif kind == "configure":
            _, quant, backend_cls, spec, steps = op
            self.runner.quant = quant
            self.runner.backend = None
            self.runner.target_graphs = None
            if backend_cls is not None:
                from dspark.kvcache.paged import PagedKVCache
                cache = PagedKVCache(self.runner.model.cfg, device=self.runner.device, **spec)
                self.runner.backend = backend_cls(cache)
            for m in (self.runner.model, self.runner.drafter):
                if m is not None:
                    set_indexer_mode(m, "auto", paged=backend_cls is not None)
            if steps is not None:
                self.runner.target_graphs = fixed_shape_steps(self.runner, self.tp, **steps)
                if self.runner.target_graphs is None:
                    raise RuntimeError(f"rank {self.tp.rank}: rank 0 runs fixed-shape steps, but "
                                       f"this rank's experts cannot")
        elif kind == "capture":
            if self.runner.target_graphs is not None:
                self.runner.target_graphs.capture_all(op[1])
        elif kind == "commbench":
            from .comm_profile import time_collectives
            time_collectives(self.tp, *op[1:])
        elif kind == "stats":
            dist.gather_object(self.stats(), None, dst=0, group=self.tp.cpu_group)
        elif kind == "stop":
            return "stop"
        else:
            raise ValueError(f"unknown command {kind!r}")


# ---- driver side ---------------------------------------------------------------------------

def _wait_ready(procs, status, timeout_s: float | None) -> None:
    """Block until every worker reported its shard loaded; raise with the worker's traceback
    (or exit code) as soon as one fails."""
    pending, waited = {p_rank for p_rank, _ in procs}, 0.0
    while pending:
        try:
            kind, rank, info = status.get(timeout=0.5)
        except queue.Empty:
            waited += 0.5
            for r, p in procs:
                if r in pending and not p.is_alive():
                    raise RuntimeError(
                        f"tensor-parallel rank {r} exited with code {p.exitcode} before loading its "
                        f"shard (its error is printed above). Workers are started with 'spawn', "
                        f"which re-imports the main script: a script that creates the engine at "
                        f"top level needs an `if __name__ == \"__main__\":` guard")
            if timeout_s is not None and waited > timeout_s:
                raise TimeoutError(f"tensor-parallel ranks {sorted(pending)} did not load their "
                                   f"shards within {timeout_s} s")
            continue
        if kind == "error":
            raise RuntimeError(f"tensor-parallel rank {rank} failed while loading its shard:\n{info}")
        pending.discard(rank)


def _reap(procs, timeout_s: float = 30.0) -> None:
    for _, p in procs:
        p.join(timeout_s)
    for _, p in procs:
        if p.is_alive():
            p.terminate()
            p.join(5)


def _close_at_exit(ref) -> None:
    runner = ref()
    if runner is not None:
        runner.shutdown()


class DistributedRunner(ModelRunner):
    """Rank 0 of a tensor-parallel group, with the ModelRunner API the engine uses."""

    def __init__(self, model, drafter, device, quant, tp: TPGroup, procs,
                 drafter_mode: str = "replicated", cuda_graphs: bool = False,
                 max_num_seqs: int = 8):
        # a replicated drafter runs on rank 0 alone, collective-free: its draft pass is the
        # single-device one (CUDA graphs included)
        super().__init__(model, drafter, device, quant, cuda_graphs=cuda_graphs and
                         drafter_mode == "replicated", max_num_seqs=max_num_seqs)
        self.tp, self._procs = tp, procs
        self.drafter_mode = drafter_mode if drafter is not None else None
        self._keys = itertools.count()
        self._freed = collections.deque()      # state refs whose rank-0 objects were collected
        self._queued: list = []                # commit_context ops awaiting the next message
        self._last_taps = None
        self._closed = self._broken = False
        atexit.register(_close_at_exit, weakref.ref(self))

    @property
    def world_size(self) -> int:
        return self.tp.world

    @classmethod
    def launch(cls, path: str, cfg, world_size: int, device="cpu", dtype=torch.float32,
               drafter: bool = True, quant: QuantSim | None = None, indexer_mode: str = "auto",
               progress: bool = False, timeout_s: float = 1800.0,
               start_timeout_s: float | None = None, threads: int | None = None,
               weight_format: str = "auto", drafter_mode: str = "replicated",
               cuda_graphs: bool | None = None, max_num_seqs: int = 8):
        """Spawn ranks 1..N-1, load rank 0's shard here, wait for every shard, form the group.
        weight_format: "quantized" (FP8 / FP4 slices stay quantized on every rank, QuantLinear),
        "bf16" (de-quantized at load) or "auto" (quantized for an FP8 / FP4 checkpoint whose
        splits fall on its scale blocks). drafter_mode: "replicated" (rank 0 holds the whole
        drafter and drafts alone, no collectives; the default) or "sharded" (split like the
        target, every rank runs the draft pass). cuda_graphs: the replicated draft pass as CUDA
        graphs (default: on CUDA)."""
        check_world_size(cfg, world_size)
        if drafter_mode not in DRAFTER_MODES:
            raise ValueError(f"drafter={drafter_mode!r}: use one of {DRAFTER_MODES}")
        sharded_draft = drafter and drafter_mode == "sharded"
        include = None if sharded_draft else lambda n: not n.startswith("mtp.")
        weight_format = resolve_weight_format(cfg, world_size, weight_format, include)
        if weight_format == "quantized":        # fail before spawning anything
            check_quantized_split(cfg, world_size, include)
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process: one "
                               "tensor-parallel engine per process (close() the other one first)")
        device = str(device)
        if torch.device(device).type == "cuda" and torch.cuda.device_count() < (
                (torch.device(device).index or 0) + world_size):
            raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} GPUs from "
                             f"{device}; {torch.cuda.device_count()} visible")
        spec = RankSpec(path, cfg, world_size, local_init_method(), device, dtype,
                        drafter_mode if drafter else None, quant is not None, indexer_mode, timeout_s,
                        threads or torch.get_num_threads(), weight_format)
        ctx = mp.get_context("spawn")
        status = ctx.Queue()
        procs = []
        try:
            for r in range(1, world_size):
                p = ctx.Process(target=_worker_main, args=(r, spec, status), daemon=True,
                                name=f"dspark-tp-rank{r}")
                p.start()
                procs.append((r, p))
            tp = TPGroup(0, world_size)
            dev = rank_device(device, 0)
            model, draft = build_rank_model(path, cfg, tp, dtype, dev, sharded_draft,
                                            indexer_mode, progress=progress,
                                            weight_format=weight_format)
            if drafter and not sharded_draft:
                draft = build_full_drafter(path, cfg, dtype, dev, weight_format, progress)
            _wait_ready(procs, status, start_timeout_s)
            g = init_distributed(0, world_size, spec.init_method, device, timeout_s)
            tp.group, tp.cpu_group = g.group, g.cpu_group
        except BaseException:
            for _, p in procs:
                if p.is_alive():
                    p.terminate()
            _reap(procs, 5)
            destroy_distributed()
            raise
        if cuda_graphs is None:
            cuda_graphs = dev.type == "cuda"
        return cls(model, draft, dev, quant, tp, procs, drafter_mode, cuda_graphs, max_num_seqs)

    def configure(self, quant: QuantSim | None = None, backend=None,
                  target_graphs: bool = False) -> "DistributedRunner":
        """Set the KV rounding and the attention backend (None: dense per-request state) on
        every rank. Rank 0 keeps `backend` itself; workers build the same backend class over a
        PagedKVCache of the same geometry, and rank 0's cache calls are mirrored to them.
        target_graphs (paged backends): decode / verify steps on the fixed-shape path on every
        rank (dspark/models/deepseek_v4/graph.py: captured as CUDA graphs with the collectives
        inside on CUDA, run eagerly on CPU); the cache needs one slot and one page more than
        the scheduler hands out (the scratch request)."""
        self.quant, self.backend = quant, backend
        self.target_graphs = None
        spec = steps = None
        if backend is not None:
            cache = backend.cache
            spec = cache_spec(cache)
            if target_graphs:
                # before the cache calls are mirrored: every rank registers its own scratch
                gamma = getattr(self.drafter, "gamma", 0) if self.drafter is not None else 0
                steps = dict(q_lens=tuple(range(1, gamma + 2)), max_batch=self.max_num_seqs,
                             capture=self.device.type == "cuda")
                self.target_graphs = fixed_shape_steps(self, self.tp, **steps)
                if self.target_graphs is None:     # (rank 0 decides for every rank)
                    steps = None
            if not isinstance(cache, _MirroredCache):
                cache.__class__ = type(f"Mirrored{type(cache).__name__}",
                                       (_MirroredCache, type(cache)), {})
            cache._tp_record = self._queued_append
        for m in (self.model, self.drafter):
            if m is not None:
                set_indexer_mode(m, "auto", paged=backend is not None)
        self.uniform_verify = self.target_graphs is not None
        self._queued.append(("configure", quant, None if backend is None else type(backend), spec,
                             steps))
        return self

    def _queued_append(self, op) -> None:
        self._queued.append(op)

    # ---- control plane ---------------------------------------------------------------
    def _ref(self, state, which: str):
        """The id workers know `state` by (tagged on first use; its collection frees it)."""
        if state is None:
            return None
        ref = getattr(state, "_tp_ref", None)
        if ref is None:
            ref = (next(self._keys), which)
            try:
                state._tp_ref = ref
            except AttributeError:
                return state                   # e.g. a paged-cache request id: sent as is
            weakref.finalize(state, self._freed.append, ref).atexit = False
        return ("tp-state", ref)

    def _send(self, *ops) -> None:
        if self._closed:
            raise RuntimeError("this tensor-parallel engine is closed")
        if self._broken:
            raise RuntimeError("a previous tensor-parallel step failed part-way, so the ranks are "
                               "out of step; close() this engine and create a new one")
        frees = []
        while True:
            try:
                frees.append(self._freed.popleft())
            except IndexError:
                break
        # queued ops may name states collected since: they run before those states are freed
        msg = self._queued + ([("free", frees)] if frees else []) + list(ops)
        self._queued = []
        if self.tp.world == 1:                 # no workers to tell
            return
        broadcast_message((torch.get_num_threads(), msg), self.tp.cpu_group, 0)

    def _run(self, ops, fn):
        try:
            self._send(*ops)
            return fn()
        except BaseException:
            self._broken = True
            raise

    def _rows_of_last_taps(self, taps):
        """(lo, hi) when `taps` is taps_last[lo:hi] of the last forward, else None."""
        base = self._last_taps
        if base is None or taps is None or taps.dim() != 2 or taps.shape[1] != base.shape[1]:
            return None
        if taps.untyped_storage().data_ptr() != base.untyped_storage().data_ptr() or \
                taps.stride() != base.stride():
            return None
        off = taps.storage_offset() - base.storage_offset()
        lo, rem = divmod(off, base.stride(0))
        if rem or lo < 0 or lo + taps.shape[0] > base.shape[0]:
            return None
        return lo, lo + taps.shape[0]

    # ---- ModelRunner API -------------------------------------------------------------
    def new_states(self):
        t, d = super().new_states()
        key = next(self._keys)
        for obj, which in ((t, "t"), (d, "d")):
            if obj is not None:
                obj._tp_ref = (key, which)
                weakref.finalize(obj, self._freed.append, (key, which)).atexit = False
        return t, d

    def target_forward(self, items, logit_rows=None, snapshot: bool = True):
        items = list(items)
        if self.target_graphs is not None and self.target_graphs.fits(items) is not None:
            # a fixed-shape step: the workers receive the token ids (drafts still on this
            # device included) and the plan in the step itself; no read of the device here
            msg = [(self._ref(st, "t"), int(start), len(toks)) for st, start, toks in items]
        else:
            msg = [(self._ref(st, "t"), int(start), [int(t) for t in token_list(toks)])
                   for st, start, toks in items]
        rows = None if logit_rows is None else [int(r) for r in logit_rows]
        logits, taps = self._run([("fwd", msg, rows)],
                                 lambda: ModelRunner.target_forward(self, items, logit_rows,
                                                                    snapshot))
        self._last_taps = taps
        return logits, taps

    def commit_context(self, draft_state, taps, start: int):
        super().commit_context(draft_state, taps, start)
        if self.drafter_mode != "sharded":       # the drafter lives on rank 0 alone
            return
        rows = self._rows_of_last_taps(taps)
        self._queued.append(("ctx", self._ref(draft_state, "d"),
                             rows if rows is not None else taps.detach().cpu(), int(start)))

    @property
    def drafts_ahead(self) -> bool:
        """A replicated drafter (rank 0 alone) drafts ahead of the read back as on one device; a
        sharded one needs the host's anchors for its ranks' messages."""
        return self.drafter_mode != "sharded" and ModelRunner.drafts_ahead.fget(self)

    def draft(self, reqs) -> list:
        reqs = list(reqs)
        if self.drafter_mode != "sharded":       # rank 0's whole drafter: no message, no wait
            return ModelRunner.draft(self, reqs)
        msg = [(int(r.anchor), int(r.num_committed), self._ref(r.draft_state, "d"), r.params,
                int(r.seed)) for r in reqs]
        return self._run([("draft", msg)], lambda: ModelRunner.draft(self, reqs))

    def capture_graphs(self, q_lens, max_position: int, progress: bool = False) -> dict:
        """ModelRunner.capture_graphs on every rank together: the target's buckets (their
        collectives meet rank by rank), the replicated draft pass on rank 0 alone."""
        return self._run([("capture", tuple(q_lens))],
                         lambda: ModelRunner.capture_graphs(self, q_lens, max_position, progress))

    def collective_time(self, shapes, iters: int = 20) -> float:
        """Seconds one round of `shapes` [(kind, shape, dtype)] costs on this group (every rank
        runs them; rank 0 times them): the communication of a step (comm_profile.py)."""
        from .comm_profile import time_collectives
        return self._run([("commbench", list(shapes), iters)],
                         lambda: time_collectives(self.tp, list(shapes), iters))

    def worker_stats(self) -> list[dict]:
        """Per-rank bookkeeping (live request states, KV cache requests and free pages, weight
        bytes, CUDA memory), rank 0 first; flushes pending frees and cache calls. For tests,
        benchmarks and debugging."""
        cache = getattr(self.backend, "cache", None)
        mine = {"rank": 0, "states": None,
                "cache_requests": None if cache is None else len(cache._reqs),
                "cache_free_pages": None if cache is None else cache.num_free_pages,
                "fixed_steps": getattr(self.target_graphs, "num_replays", None),
                **memory_stats(self)}
        out = [None] * self.tp.world

        def gather():
            dist.gather_object(mine, out, dst=0, group=self.tp.cpu_group)
            return out
        return self._run([("stats",)], gather)

    # ---- lifecycle -------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if self._closed:
            return
        try:
            if not self._broken and dist.is_initialized():
                self._send(("stop",))
        except Exception:
            pass
        self._closed = True
        destroy_distributed()
        _reap(self._procs, timeout_s)
