"""Fixed-shape decode / verify forward of the DeepSeek-V4 target over a `PagedKVCache`, replayed as
CUDA graphs by `StepGraphs` (models/step_graphs.py, shared with the Qwen3 target).

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

import numpy as np
import torch

from dspark.compile_stats import count_fallback, target_fallback_reason

from ..step_graphs import StepGraphs
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


class V4DecodeGraphs(StepGraphs):
    """Uniform-length steps (every request feeds q ∈ `q_lens` tokens) of the DeepSeek-V4
    target through the fixed-shape forward, captured as one CUDA graph per (batch bucket, q,
    page bucket) on CUDA (``capture``), run eagerly otherwise (the `StepGraphs` machinery).

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
        kind = backend if isinstance(backend, str) else getattr(backend, "name", "reference")
        self.kernels = StepKernels(cache, "triton" if kind == "triton" else "torch")
        qmax, max_batch = max(int(x) for x in q_lens), int(max_batch)
        limits = [cache.capacity] + [cache.comp_ring(m) for m in cache.ratios if m]
        if qmax > cache.lookahead + 1 or qmax > min(limits):
            raise ValueError(f"V4DecodeGraphs: q_lens up to {qmax} need a cache with "
                             f"lookahead >= {qmax - 1} (has {cache.lookahead})")
        if max_batch * qmax > cache.max_batch_tokens:
            raise ValueError(f"V4DecodeGraphs: max_batch * max(q_lens) = "
                             f"{max_batch * qmax} exceeds the cache's max_batch_tokens="
                             f"{cache.max_batch_tokens}")
        if follower and share_inputs is None:
            raise ValueError("V4DecodeGraphs: a follower needs share_inputs (its inputs come "
                             "from the leader)")
        self.scratch_slot, self.scratch_page = reserve_scratch(cache)
        bs = cache.block_size
        top = -(-(model.cfg.max_position_embeddings + qmax) // bs)
        pages = min(cache.num_blocks, top, max_pages or top)
        R = max_batch * qmax
        # the inputs (ids, positions [R]; starts, slots, valid flags [B]; page tables [B, P]),
        # then the plan of the step's bucket (every field grows with B, q and P, so the largest
        # bucket's plan bounds them all)
        self._offs = np.cumsum([0, R, R, max_batch, max_batch, max_batch, max_batch * pages])
        self._layouts: dict = {}
        self._host_views: dict = {}
        self.cache = cache
        words = self._layout(max_batch, qmax, pages).end
        super().__init__(model, cache, q_lens, max_batch, tap_layers, capture, pages, None,
                         words, torch.float32)
        # RoPE tables sized once for every position a graph can see (no growth during capture);
        # the references keep the captured tables alive even if the eager path regrows them
        self.bound = self.max_pages * bs + max(m for m in (1, *cache.ratios) if m) + self.qmax
        wdev = model.embed.weight.device          # (the device RoPE sees: x.device)
        self._keep = [layer.attn.rope._table(self.bound, wdev) for layer in model.layers]
        self._host_parts, self._ints_parts = self._split(self.host), self._split(self.ints)
        self._next_plan = None               # (inputs key, host plan) computed ahead
        self._packed = None                  # (bucket, plan) the host buffer's plan words hold
        self.plans_ahead_used = 0
        self.share_inputs, self.follower = share_inputs, bool(follower)

    # ---- layout ------------------------------------------------------------------------------
    def _reserved(self):
        return (SCRATCH_RID,)

    def _layout(self, B: int, q: int, P: int) -> hp.PlanLayout:
        key = (B, q, P)
        if key not in self._layouts:
            self._layouts[key] = hp.plan_layout(self.cache, B, q, P, int(self._offs[-1]))
        return self._layouts[key]

    def _words(self, key) -> int:
        return self._layout(*key).end

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
        """StepGraphs.run; a follower (tensor parallelism) only does the cache bookkeeping: its
        inputs and plan arrive in the step itself."""
        if not self.follower:
            return super().run(items, snapshot)
        key = self.fits(items)
        if key is None:
            count_fallback(self, target_fallback_reason(items, self))
            return None
        q = key[1]
        for rid, start, _ in items:
            self.cache.check_forward(rid, start, start + q)
        for rid, start, _ in items:
            self.cache.begin_forward(rid, start, start + q)
        return self._launch(key, len(items) * q, snapshot)

    def _fill_inputs(self, items, key) -> bool:
        B, q, P = key
        _, pos, st, sl, va, pt = self._host_parts
        fields = (pos[:B * q], st[:B], sl[:B], va[:B], pt[:B * P].reshape(B, P))
        if not self._fill_positions(items, B, q, P, *fields):
            return False
        if items:
            plan = self._plan(B, q, P, fields)
        else:                                # all padding (a capture ahead of traffic)
            self._next_plan = None
            plan = hp.host_plan(self.cache, B, q, P, *fields, self.scratch_page)
        self._pack(key, plan)
        return True

    def _meanwhile(self, items, q: int):
        return lambda: self._predict_plan(items, q)

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
