"""The fixed-shape target step shared by every target model: decode / verify steps in which every
request feeds the same number q of tokens, replayed as one CUDA graph per (batch bucket, q, page
bucket).

A subclass (DeepSeek-V4: deepseek_v4/graph.py, Qwen3: qwen3_graph.py) says how its inputs are
laid out in one static int64 buffer and what its fixed-shape forward is:

* ``_fill_inputs(items, key)``: the step's rows into the host buffer (positions, slots, page
  tables, a plan), padding rows up to the bucket; ``items == []`` is the all-padding step a
  capture ahead of traffic warms up on. Returns False when a request's pages do not cover its
  rows yet;
* ``_words(key)``: how many words of the buffer bucket ``key`` reads (what one step uploads);
* ``_forward(B, q, P)``: the forward on the static buffers, results into ``logits_out`` (fp32),
  ``argmax_out`` (each row's argmax, so a greedy decision launches nothing) and ``taps_out``.

Everything else is here, once: bucketing and its eager-fallback reasons, the checks and cache
bookkeeping of a step before it runs, the token ids (host lists, or drafts and anchors still on
the device: `BlockTokens`), one asynchronous pinned upload per step, lazy or ahead-of-traffic
capture (`capture_all`, what `Engine.warmup()` calls), and a capture failure turning the graphs
off with a warning and a counted fallback. On CPU (``capture=False``) the same path runs eagerly:
the tests check it against the eager forward, the oracle.
"""
from __future__ import annotations

import warnings

import torch

from ..compile_stats import count_capture, count_fallback, target_fallback_reason
from ..cuda.graph_capture import capture, pow2_buckets, step_bucket, warm_up
from ..kernels.invariant_mode import products
from ..request import BlockTokens, stack_field


class StepGraphs:
    """Uniform-length steps (every request feeds q ∈ `q_lens` tokens) of a target model through
    its fixed-shape forward; see the module doc for what a subclass supplies.

    `run(items, snapshot)` -> (logits fp32 [R·q, V] carrying `.row_argmax`, taps or None), or
    None when the step does not fit (nothing changed); the caller then runs the eager path."""

    name = "target"

    def __init__(self, model, cache, q_lens, max_batch: int, tap_layers, capture: bool | None,
                 max_pages: int, page_buckets: list | None, words: int, taps_dtype):
        dev = cache.device
        self.model, self.cache, self.tap_layers = model, cache, tuple(tap_layers)
        self.capture = dev.type == "cuda" if capture is None else capture
        self.q_lens = frozenset(int(x) for x in q_lens)
        self.qmax, self.max_batch = max(self.q_lens), int(max_batch)
        self.max_pages = max_pages
        self.batch_buckets = pow2_buckets(self.max_batch)
        self.page_buckets = page_buckets or pow2_buckets(self.max_pages)
        self.rows = R = self.max_batch * self.qmax
        # the static inputs: token ids first ([rows]), then what the subclass lays out. Pinned on
        # CUDA, so the per-step upload is asynchronous (a pageable copy would wait for all queued
        # GPU work, e.g. the draft pass); `_uploaded` guards the host buffer's reuse
        self.ints = torch.zeros(words, dtype=torch.long, device=dev)
        self._host_t = torch.zeros(words, dtype=torch.long, pin_memory=dev.type == "cuda")
        self.host = self._host_t.numpy()
        self._uploaded = None
        D, V = model.cfg.hidden_size, model.cfg.vocab_size
        self.logits_out = torch.zeros(R, V, dtype=torch.float32, device=dev)
        self.argmax_out = torch.zeros(R, dtype=torch.long, device=dev)
        self.taps_out = (torch.zeros(R, len(self.tap_layers) * D, dtype=taps_dtype, device=dev)
                         if self.tap_layers else None)
        self.graphs: dict = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.disabled = False
        self.num_replays = 0        # steps served by this path (graph replays or static eager runs)

    # ---- what a subclass supplies --------------------------------------------------------------
    def _fill_inputs(self, items, key) -> bool:
        raise NotImplementedError

    def _words(self, key) -> int:
        raise NotImplementedError

    def _forward(self, B: int, q: int, P: int) -> None:
        raise NotImplementedError

    def _reserved(self):
        """Request ids a step may not carry (a scratch request the subclass registered)."""
        return ()

    def _meanwhile(self, items, q: int):
        """Host work to do while the device runs the step just launched (None: nothing)."""
        return None

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
        if key is None or len(set(rids)) != len(rids) or set(rids) & set(self._reserved()):
            return None
        return key

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, items, snapshot: bool = True):
        """(logits fp32 [R·q, V], taps [R·q, len(tap_layers)·D] or None) for items =
        [(request id, start, tokens)] in flat (request-major) row order, with the cache checks
        and bookkeeping of the eager path; None if the step does not fit (nothing changed).
        Tokens are host lists or `BlockTokens` (anchor and drafts may stay on the device). The
        logits carry their rows' argmax as `logits.row_argmax` (int64 [R·q], computed in the
        same graph), which spec.accept.decide reads instead of launching its own.
        snapshot=False: logits, row argmax and taps are views of the output buffers, valid until
        the next step is queued (for a caller that queues its reads of them at once)."""
        key = self.fits(items)
        if key is None:
            count_fallback(self, target_fallback_reason(items, self))
            return None
        B, q, P = key
        c, R = self.cache, len(items)
        for rid, start, _ in items:          # check every request before changing any
            c.check_forward(rid, start, start + q)
        self._wait_upload()
        on_device, anchors = self._fill_tokens(items, B, q)
        if not self._fill_inputs(items, key):
            raise ValueError(f"{type(self).__name__}: a request's pages do not cover its rows "
                             f"{[(rid, start, start + q) for rid, start, _ in items]}; reserve "
                             "them before the step")
        for rid, start, _ in items:
            c.begin_forward(rid, start, start + q)
        self._upload(self._words(key))
        self._copy_device_tokens(on_device, anchors, R, q)
        return self._launch(key, R * q, snapshot, self._meanwhile(items, q))

    def _wait_upload(self) -> None:
        if self._uploaded is not None:       # the previous upload has left the host buffer
            self._uploaded.synchronize()

    def _fill_tokens(self, items, B: int, q: int):
        """Host token ids of the step into the buffer's first words; (on-device drafts as
        (first row, tensor), on-device anchors) to copy after the upload."""
        ids = self.host[:self.rows]
        on_device, anchors = [], []
        for i, (rid, start, toks) in enumerate(items):
            rows = slice(i * q, (i + 1) * q)
            if isinstance(toks, BlockTokens):
                ids[rows] = 0
                if isinstance(toks.anchor, torch.Tensor):
                    anchors.append(toks.anchor.view(1))
                else:
                    ids[i * q] = toks.anchor
                if toks.n:
                    on_device.append((i * q + 1, toks))
            else:
                ids[rows] = toks
        if anchors and len(anchors) != len(items):
            raise ValueError(f"{type(self).__name__}: either every item's anchor is on the "
                             "device or none is")
        ids[len(items) * q:B * q] = 0        # padding rows feed token 0
        return on_device, anchors

    def _upload(self, words: int) -> None:
        """One copy: the inputs and the bucket's plan (the words past it belong to larger
        buckets), asynchronous from pinned memory."""
        dst, src = self.ints[:words], self._host_t[:words]
        if self._host_t.is_pinned():
            dst.copy_(src, non_blocking=True)
            self._uploaded = torch.cuda.Event()
            self._uploaded.record(torch.cuda.current_stream(dst.device.index))   # (see overlap.py)
        else:
            dst.copy_(src)

    def _copy_device_tokens(self, on_device, anchors, R: int, q: int) -> None:
        """Device to device, no wait for the draft pass: one copy when every block carries q - 1
        drafts (uniform verify steps: a slice of the draft pass's batch where the blocks are its
        rows in order), else one per block; the anchors in one copy."""
        ids = self.ints[:self.rows]
        if len(on_device) == R > 1 and all(t.n == q - 1 for _, t in on_device):
            blocks = [t.block for _, t in on_device]
            src = (stack_field(blocks, "tokens", q - 1) if None not in blocks
                   else torch.stack([t.drafts for _, t in on_device]))
            ids[:R * q].view(R, q)[:, 1:].copy_(src)
        else:
            for row, toks in on_device:
                ids[row:row + toks.n].copy_(toks.drafts, non_blocking=True)
        if anchors:
            src = anchors[0] if R == 1 else torch.cat(anchors)
            ids[:R * q].view(R, q)[:, 0].copy_(src, non_blocking=True)

    def _launch(self, key, T: int, snapshot: bool, meanwhile=None):
        """Run (or replay) bucket `key`'s step on the filled inputs; its first T rows' outputs.
        `meanwhile()`: host work while the device runs the step."""
        if not self.capture:
            with products():
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
        """Capture bucket (B, q, P) now on padding rows alone (no request's state is touched), so
        no step of traffic pays the capture; True when its graph exists afterwards (False:
        capturing failed and the graphs are off, or not capturing: then that forward runs
        eagerly once)."""
        key = (B, q, P)
        if key in self.graphs or self.disabled:
            return key in self.graphs
        self._wait_upload()
        self.host[:B * q] = 0
        self._fill_inputs([], key)
        words = self._words(key)
        self.ints[:words].copy_(self._host_t[:words])
        if not self.capture:                 # eagerly what a capture's warm-up runs (tests)
            self._forward(B, q, P)
            return False
        return self._graph(key) is not None

    def capture_keys(self, q_lens=None) -> list:
        """Every (batch bucket, q, page bucket) for q in `q_lens` (default: all this runs)."""
        qs = sorted(self.q_lens if q_lens is None else set(q_lens) & self.q_lens)
        return [(B, q, P) for q in qs for B in self.batch_buckets for P in self.page_buckets]

    def capture_all(self, q_lens=None, progress: bool = False) -> int:
        """Capture every bucket of `capture_keys(q_lens)`; how many graphs exist afterwards."""
        from tqdm import tqdm
        for key in tqdm(self.capture_keys(q_lens), desc="capturing target graphs", unit="graph",
                        disable=not progress):
            if not self.capture_bucket(*key):
                break
        return len(self.graphs)

    def _graph(self, key):
        g = self.graphs.get(key)
        if g is None:
            # warm up outside the capture (Triton JIT, cuBLAS workspaces) on a side stream, with
            # this step's inputs in place: its cache writes are the replay's writes
            with products():
                warm_up(lambda: self._forward(*key))
            try:
                with products():
                    g, _ = capture(lambda: self._forward(*key), self.pool)
            except Exception as e:          # e.g. a host sync in a weight format's path
                warnings.warn(f"{type(self).__name__}: capturing {key} failed ({e}); the "
                              "target runs eagerly from now on")
                self.disabled = True
                count_fallback(self, "capture failed")
                return None                 # the warm-up already produced this step's outputs
            self.graphs[key] = g
            count_capture(self)
        return g

