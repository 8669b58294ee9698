"""Fixed-shape decode / verify forward of the DeepSeek-V4 target over a `PagedKVCache`, replayed as
CUDA graphs (the V4 twin of dspark/models/qwen3_graph.py).

An eager V4 step is launch-bound, and its attention plan (dspark/attention/plan.py) has shapes
that depend on the data: which requests complete compressed entries, how many entries are
visible, which ring rows are read. Here a step in which every request feeds the same number q of
tokens (q = 1: decode; q = γ + 1: verify blocks) gets shapes that depend only on the bucket
(B requests, q, P pages per request):

* **inputs** — one static int64 buffer: token ids and positions [B·q], per request its first
  position, state slot and a real/padding flag [B], and page tables [B, P]; filled on the host by
  one copy per step. Padding requests (up to the batch bucket) and every write that has nothing
  to write (a candidate entry that does not complete) go to a *scratch request* that the class
  registers in the cache (one state slot + one page nobody else owns);
* **plan** (computed on the host by `host_plan.host_plan` when the inputs are filled, packed
  behind them in the same buffer and upload, read as views by the graph; `derive_plan` is the
  same plan as device ops, the reference): window index lists, staging and ring rows, and per
  ratio m the ``ceil(q/m)`` candidate entries of each request — entry
  j = start//m + k is written iff it completes in this forward, its pooling rows are gathered
  from the compressor ring (positions before the forward) and this forward's rows with a fixed
  [E, c·m] index, ring rows are read before the forward's rows are persisted (as in the eager
  backend); visible entries of HCA layers are listed up to P·block_size/m (−1 past n_visible);
  the indexer scores P·block_size/4 columns;
* **forward** (`static_forward.py`): the model's own modules with fixed-shape attention, on the
  Triton kernels or their torch twins; on CPU the same path runs eagerly (``capture=False``).

Steps that do not fit (prefill chunks, unequal lengths, too many requests, tokens or pages)
return None from `V4DecodeGraphs.run`, and the caller runs the eager path. Host work that stays
outside the graph: validation (`check_forward`), bookkeeping (`begin_forward`), filling the input
buffer and the plan. Requirement: q ≤ cache.lookahead + 1 (then a forward never reads a ring row it rewrites,
so the warm-up run before a capture and the replay write identical state).
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from dspark.compile_stats import count_capture, count_fallback, target_fallback_reason
from dspark.cuda.graph_capture import capture, pow2_buckets, step_bucket, warm_up
from dspark.request import BlockTokens

from . import host_plan as hp
from .static_forward import StaticInputs, StepKernels, plan_from_views, static_forward

SCRATCH_RID = "__v4_graph_scratch__"


def reserve_scratch(cache, rid=SCRATCH_RID) -> tuple:
    """Register the scratch request (one slot, one page) in ``cache`` if it is not there yet;
    returns (slot, page). Writes of padding rows and of candidate entries that do not complete
    land there; nothing ever reads them."""
    if not cache.has_request(rid):
        cache.add_request(rid)
        cache.reserve(rid, cache.block_size)
    return cache.slot(rid), cache.page_table(rid)[0]


def _plan_key(B: int, q: int, P: int, fields) -> tuple:
    """What a step's host plan is a function of: its bucket and the bytes of its inputs."""
    return (B, q, P) + tuple(f.tobytes() for f in fields)


class V4DecodeGraphs:
    """Runs uniform-length steps (every request feeds q ∈ `q_lens` tokens) of the DeepSeek-V4
    target through the fixed-shape forward, captured as one CUDA graph per (batch bucket, q,
    page bucket) on CUDA (``capture``), run eagerly otherwise.

    backend: the engine's AttentionBackend (its ``name`` picks the kernels: 'triton' -> Triton,
    else the torch twins) or a kernels string. Registers the scratch request in the cache (one
    state slot and one page): build the cache with one slot and one block more than the engine
    needs."""

    def __init__(self, model, cache, backend="triton", q_lens=(1,), max_batch: int = 8,
                 tap_layers=(), capture: bool | None = None, max_pages: int | None = None,
                 share_inputs=None, follower: bool = False):
        """share_inputs(t): an in-place device broadcast from a leader (tensor parallelism): the
        step's input buffer (token ids, positions, slots, page tables and the host plan) is
        sent at the start of the step, inside the graph. follower: this copy receives them,
        so its host neither reads the tokens nor computes a plan (only the cache
        bookkeeping)."""
        dev = cache.device
        kind = backend if isinstance(backend, str) else getattr(backend, "name", "reference")
        self.kernels = StepKernels(cache, "triton" if kind == "triton" else "torch")
        self.model, self.cache, self.tap_layers = model, cache, tuple(tap_layers)
        self.capture = dev.type == "cuda" if capture is None else capture
        self.q_lens = frozenset(int(x) for x in q_lens)
        self.qmax, self.max_batch = max(self.q_lens), int(max_batch)
        limits = [cache.capacity] + [cache.comp_ring(m) for m in cache.ratios if m]
        if self.qmax > cache.lookahead + 1 or self.qmax > min(limits):
            raise ValueError(f"V4DecodeGraphs: q_lens up to {self.qmax} need a cache with "
                             f"lookahead >= {self.qmax - 1} (has {cache.lookahead})")
        if self.max_batch * self.qmax > cache.max_batch_tokens:
            raise ValueError(f"V4DecodeGraphs: max_batch * max(q_lens) = "
                             f"{self.max_batch * self.qmax} exceeds the cache's max_batch_tokens="
                             f"{cache.max_batch_tokens}")
        self.scratch_slot, self.scratch_page = reserve_scratch(cache)
        bs = cache.block_size
        top = -(-(model.cfg.max_position_embeddings + self.qmax) // bs)
        self.max_pages = min(cache.num_blocks, top, max_pages or top)
        self.batch_buckets = pow2_buckets(self.max_batch)
        self.page_buckets = pow2_buckets(self.max_pages)
        # RoPE tables sized once for every position a graph can see (no growth during capture);
        # the references keep the captured tables alive even if the eager path regrows them
        self.bound = self.max_pages * bs + max(m for m in (1, *cache.ratios) if m) + self.qmax
        wdev = model.embed.weight.device          # (the device RoPE sees: x.device)
        self._keep = [layer.attn.rope._table(self.bound, wdev) for layer in model.layers]
        R, Pm = self.max_batch * self.qmax, self.max_pages
        self.rows = R
        self._offs = np.cumsum([0, R, R, self.max_batch, self.max_batch, self.max_batch,
                                self.max_batch * Pm])
        # the inputs, then the plan of the step's bucket (every field grows with B, q and P, so
        # the largest bucket's plan bounds them all)
        self._layouts: dict = {}
        self._host_views: dict = {}
        words = self._layout(self.max_batch, self.qmax, self.max_pages).end
        self.ints = torch.zeros(words, dtype=torch.long, device=dev)
        # pinned on CUDA, so the per-step upload is asynchronous (a pageable copy would wait for
        # all queued GPU work, e.g. the draft pass); `_uploaded` guards its reuse
        self._host_t = torch.zeros(words, dtype=torch.long, pin_memory=dev.type == "cuda")
        self.host = self._host_t.numpy()
        self._host_parts, self._ints_parts = self._split(self.host), self._split(self.ints)
        self._uploaded = None
        D, V = model.cfg.hidden_size, model.cfg.vocab_size
        self.logits_out = torch.zeros(R, V, dtype=torch.float32, device=dev)
        # each row's argmax, computed in the graph too: a greedy step's decision then costs the
        # host no argmax launches (sampling.argmax_rows' ~5 ops: ~0.1 ms of host per step)
        self.argmax_out = torch.zeros(R, dtype=torch.long, device=dev)
        self.taps_out = (torch.zeros(R, len(self.tap_layers) * D, dtype=torch.float32,
                                     device=dev) if self.tap_layers else None)
        self.graphs: dict = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.disabled = False
        self.num_replays = 0
        self._next_plan = None               # (inputs key, host plan) computed ahead
        self._packed = None                  # (bucket, plan) the host buffer's plan words hold
        self.plans_ahead_used = 0
        if follower and share_inputs is None:
            raise ValueError("V4DecodeGraphs: a follower needs share_inputs (its inputs come "
                             "from the leader)")
        self.share_inputs, self.follower = share_inputs, bool(follower)

    # ---- shapes ------------------------------------------------------------------------------
    def bucket(self, items):
        """(batch bucket, q, page bucket) for [(request id, start, tokens)], or None when the step
        has to run eagerly."""
        if self.disabled:
            return None
        return step_bucket(items, self.q_lens, self.batch_buckets, self.page_buckets,
                           self.cache.block_size)

    def fits(self, items):
        """The bucket `run(items)` would use, or None when it would return None (a function of
        the requests, their starts and lengths, and the cache's page tables only)."""
        key = self.bucket(items)
        rids = [rid for rid, _, _ in items]
        if key is None or len(set(rids)) != len(rids) or SCRATCH_RID in rids:
            return None
        return key

    def _layout(self, B: int, q: int, P: int) -> hp.PlanLayout:
        key = (B, q, P)
        if key not in self._layouts:
            self._layouts[key] = hp.plan_layout(self.cache, B, q, P, int(self._offs[-1]))
        return self._layouts[key]

    def _host_plan_views(self, B: int, q: int, P: int) -> dict:
        key = (B, q, P)
        if key not in self._host_views:
            self._host_views[key] = hp.host_views(self._layout(B, q, P), self.host)
        return self._host_views[key]

    def _split(self, buf):
        o = self._offs
        return [buf[o[k]:o[k + 1]] for k in range(len(o) - 1)]

    def inputs(self, B: int, q: int, P: int) -> StaticInputs:
        ids, pos, st, sl, va, pt = self._ints_parts
        return StaticInputs(B, q, P, ids[:B * q], pos[:B * q], st[:B], sl[:B], va[:B],
                            pt[:B * P].view(B, P))

    def _forward(self, B: int, q: int, P: int):
        """The fixed-shape forward on the static buffers, results into the static outputs."""
        if self.share_inputs is not None:        # the leader's inputs and plan, device to device
            self.share_inputs(self.ints[:self._layout(B, q, P).end])
        inp = self.inputs(B, q, P)
        sp = plan_from_views(self.cache, hp.views(self._layout(B, q, P), self.ints), inp,
                             self.bound)
        X, taps = static_forward(self.model, self.kernels, sp, inp.token_ids, self.tap_layers)
        # the logits straight into the static output (the head's skinny kernel; else a copy), the
        # rows' argmax with them (its first pass in the head's launch there)
        self.model.logits(X, argmax_out=self.argmax_out[:B * q], out=self.logits_out[:B * q])
        if taps is not None:
            self.taps_out[:B * q].copy_(taps)

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, items, snapshot: bool = True):
        """(logits fp32 [R·q, V], taps [R·q, len(tap_layers)·D] or None) for items =
        [(request id, start, tokens)] in flat (request-major) row order, with the cache checks
        and bookkeeping of the eager plan; None if the step does not fit (nothing changed).
        The logits carry their rows' argmax (sampling.argmax_rows, computed in the same graph)
        as `logits.row_argmax` (int64 [R·q]), which spec.accept.decide reads instead of
        launching its own. snapshot=False: the logits and their row argmax are views of the
        graph's output buffers, valid until the next step is queued (for a caller that queues
        its reads of them at once, as decide and the overlapped decode's read back and next
        anchors do: no 0.5 MB copy per step for a 129k vocabulary, no copy launch between two
        decode steps for the argmax). The taps too: the draft context rows taken from them
        are queued before the next forward (ModelRunner.target_forward flushes them first)."""
        key = self.fits(items)
        if key is None:
            count_fallback(self, target_fallback_reason(items, self))
            return None
        B, q, P = key
        c, R = self.cache, len(items)
        for rid, start, _ in items:          # check every request before changing any
            c.check_forward(rid, start, start + q)
        if self.follower:                    # inputs and plan arrive in the step itself
            for rid, start, _ in items:
                c.begin_forward(rid, start, start + q)
            return self._launch(key, R * q, snapshot)
        if self._uploaded is not None:       # the previous upload has left the host buffer
            self._uploaded.synchronize()
        ids, pos, st, sl, va, pt = self._host_parts
        on_device = []                       # (first row, drafts still on the device)
        anchors = []                         # anchors still on the device (overlapped decode)
        for i, (rid, start, toks) in enumerate(items):
            rows = slice(i * q, (i + 1) * q)
            if isinstance(toks, BlockTokens):
                ids[rows] = 0
                if isinstance(toks.anchor, torch.Tensor):
                    anchors.append(toks.anchor.view(1))
                else:
                    ids[i * q] = toks.anchor
                if toks.drafts.shape[0]:
                    on_device.append((i * q + 1, toks.drafts))
            else:
                ids[rows] = toks
        if anchors and len(anchors) != R:
            raise ValueError("V4DecodeGraphs: either every item's anchor is on the device or none is")
        ids[R * q:B * q] = 0                 # padding: token 0 at positions 0..q-1 of the scratch
        fields = (pos[:B * q], st[:B], sl[:B], va[:B], pt[:B * P].reshape(B, P))
        if not self._fill_positions(items, B, q, P, *fields):
            raise ValueError(f"V4DecodeGraphs: a request's pages do not cover its rows "
                             f"{[(rid, start, start + q) for rid, start, _ in items]}; reserve "
                             "them before the step")
        self._pack((B, q, P), self._plan(B, q, P, fields))
        for rid, start, _ in items:
            c.begin_forward(rid, start, start + q)
        # one copy: the inputs and this bucket's plan (the words past it belong to larger buckets)
        end = self._layout(B, q, P).end
        dst, src = self.ints[:end], self._host_t[:end]
        if self._host_t.is_pinned():
            dst.copy_(src, non_blocking=True)
            self._uploaded = torch.cuda.Event()
            self._uploaded.record(torch.cuda.current_stream(dst.device.index))   # (see overlap.py)
        else:
            dst.copy_(src)
        ids_dev = self._ints_parts[0]
        # device to device: no wait for the draft pass; one copy when every block carries q - 1
        # drafts (uniform verify steps), else one per block
        if len(on_device) == R > 1 and all(d.shape[0] == q - 1 for _, d in on_device):
            ids_dev[:R * q].view(R, q)[:, 1:].copy_(torch.stack([d for _, d in on_device]))
        else:
            for row, drafts in on_device:
                ids_dev[row:row + drafts.shape[0]].copy_(drafts, non_blocking=True)
        if anchors:                          # all of the items (checked above): one copy
            src = anchors[0] if R == 1 else torch.cat(anchors)
            ids_dev[:R * q].view(R, q)[:, 0].copy_(src, non_blocking=True)
        return self._launch(key, R * q, snapshot, lambda: self._predict_plan(items, q))

    def _launch(self, key, T: int, snapshot: bool, meanwhile=None):
        """Run (or replay) bucket `key`'s step on the filled inputs; its first T rows' outputs.
        `meanwhile()`: host work while the device runs the step (the next plan, predicted)."""
        if not self.capture:
            self._forward(*key)
        else:
            g = self._graph(key)
            if g is not None:
                g.replay()
        if meanwhile is not None:
            meanwhile()
        self.num_replays += 1
        taps = self.taps_out[:T] if self.taps_out is not None else None
        if snapshot and taps is not None:
            taps = taps.clone()
        logits = self.logits_out[:T].clone() if snapshot else self.logits_out[:T]
        logits.row_argmax = self.argmax_out[:T].clone() if snapshot else self.argmax_out[:T]
        return logits, taps

    # ---- capturing ahead of traffic -------------------------------------------------------------
    @torch.inference_mode()
    def capture_bucket(self, B: int, q: int, P: int) -> bool:
        """Capture bucket (B, q, P) now on padding rows alone (every row the scratch request's,
        so no other request's state is touched), and no step of traffic pays the capture; True
        when its graph exists afterwards (False: capturing failed and the graphs are off, or
        not capturing: then that forward runs eagerly once)."""
        key = (B, q, P)
        if key in self.graphs or self.disabled:
            return key in self.graphs
        if self._uploaded is not None:
            self._uploaded.synchronize()
        ids, pos, st, sl, va, pt = self._host_parts
        ids[:B * q] = 0
        fields = (pos[:B * q], st[:B], sl[:B], va[:B], pt[:B * P].reshape(B, P))
        self._fill_positions([], B, q, P, *fields)
        self._pack((B, q, P), hp.host_plan(self.cache, B, q, P, *fields, self.scratch_page))
        end = self._layout(B, q, P).end
        self.ints[:end].copy_(self._host_t[:end])
        self._next_plan = None
        if not self.capture:                 # eagerly what a capture's warm-up runs (tests)
            self._forward(B, q, P)
            return False
        return self._graph(key) is not None

    def capture_all(self, q_lens=None, progress: bool = False) -> int:
        """Capture every (batch bucket, q, page bucket) for q in `q_lens` (default: all this
        runner serves); returns how many graphs exist afterwards."""
        qs = sorted(self.q_lens if q_lens is None else set(q_lens) & self.q_lens)
        keys = [(B, q, P) for q in qs for B in self.batch_buckets for P in self.page_buckets]
        from tqdm import tqdm
        for key in tqdm(keys, desc="capturing target graphs", unit="graph", disable=not progress):
            if not self.capture_bucket(*key):
                break
        return len(self.graphs)

    # ---- the step's plan, and the next decode step's computed ahead ----------------------------
    def _fill_positions(self, items, B, q, P, pos, st, sl, va, pt) -> bool:
        """Write the plan's inputs for `items` padded to bucket (B, q, P) into the arrays (views
        of the host buffer, or private ones for a prediction): positions, request starts, slots,
        valid flags, page tables. False (arrays partly written) if a request's pages do not
        cover its rows yet (only a prediction meets that: run() checks first)."""
        c, R, bs = self.cache, len(items), self.cache.block_size
        pt[:] = self.scratch_page
        for i, (rid, start, _) in enumerate(items):
            pos[i * q:(i + 1) * q] = np.arange(start, start + q)
            st[i], sl[i], va[i] = start, c.slot(rid), 1
            need = -(-(start + q) // bs)
            table = c.page_table(rid)
            if len(table) < need:
                return False
            pt[i, :need] = table[:need]
        if B > R:                            # padding rows (np.tile costs ~15 us even for none)
            pos[R * q:B * q] = np.tile(np.arange(q), B - R)
            st[R:B], sl[R:B], va[R:B] = 0, self.scratch_slot, 0
        return True

    def _pack(self, key, plan: dict) -> None:
        """Write bucket `key`'s plan into the host buffer; the fields the last one packed there
        (the buckets share one region) holds with the same arrays are not rewritten."""
        last = self._packed
        hp.pack(self._host_plan_views(*key), plan,
                last[1] if last is not None and last[0] == key else None)
        self._packed = (key, plan)

    def _plan(self, B, q, P, fields) -> dict:
        """host_plan for these inputs: the one computed ahead during the previous step when its
        inputs are identical (the usual decode step: every request one position further, same
        pages), else computed now (tens of microseconds of numpy on the step's critical path)."""
        ahead, self._next_plan = self._next_plan, None
        if ahead is not None and ahead[0] == _plan_key(B, q, P, fields):
            self.plans_ahead_used += 1
            return ahead[1]
        return hp.host_plan(self.cache, B, q, P, *fields, self.scratch_page)

    def _predict_plan(self, items, q: int) -> None:
        """After launching a decode step (q == 1): the plan of the step that moves every request
        one position on, while the device is busy (a wrong guess only costs this host time)."""
        self._next_plan = None
        if q != 1:
            return
        nxt = [(rid, start + q, toks) for rid, start, toks in items]
        key = self.bucket(nxt)
        if key is None:
            return
        B, q2, P = key
        fields = (np.empty(B * q2, np.int64), np.empty(B, np.int64), np.empty(B, np.int64),
                  np.empty(B, np.int64), np.empty((B, P), np.int64))
        if self._fill_positions(nxt, B, q2, P, *fields):
            self._next_plan = (_plan_key(B, q2, P, fields),
                               hp.host_plan(self.cache, B, q2, P, *fields, self.scratch_page))

    def _graph(self, key):
        g = self.graphs.get(key)
        if g is None:
            # warm up outside the capture (Triton JIT, cuBLAS workspaces) on a side stream, with
            # this step's inputs in place: its cache writes are the replay's writes (q <=
            # lookahead + 1: a forward never reads a ring row it rewrites)
            warm_up(lambda: self._forward(*key))
            try:
                g, _ = capture(lambda: self._forward(*key), self.pool)
            except Exception as e:          # e.g. a host sync in a weight format's MoE path
                warnings.warn(f"V4DecodeGraphs: capturing {key} failed ({e}); the V4 target "
                              "runs eagerly from now on")
                self.disabled = True
                count_fallback(self, "capture failed")
                return None                 # the warm-up already produced this step's outputs
            self.graphs[key] = g
            count_capture(self)
        return g
