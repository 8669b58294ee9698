"""The drafter's per-round work for many requests as fixed-shape tensor ops, replayed as CUDA graphs.

Draft pass: the parallel block through the stages (reading every request's context ring of the
`DraftContextPool` by slot), base logits, then the Markov head left to right: γ steps of (Markov
bias, `probs_from_logits`, inverse-CDF sample), with the fused backend all in one launch where
the head is small (`kernels/markov_loop.py`). Randomness is `uniforms(seed, position, DRAFT)`
(counter-based), so a replay draws exactly what an eager pass draws.
Context write: the rows committed in a round (anchor + accepted drafts of every request, or a
prefill chunk's last window) projected and written into the pool in one batch.

Nothing is read back from the device and the shapes depend only on the batch size, so on CUDA
each size bucket is captured once and replayed. Batches are padded up to the bucket: draft rows
read the pool's empty slot, context rows are written to its scratch slot; both are dropped
(rows never mix: attention, MoE and sampling are per row).
Which draft buckets are graphs is decided per bucket by the rows the stages' MoE see (bucket x γ,
`DSparkDrafter.moe_graph_blocker`): dense small experts serve any bucket, packed FP4 experts
(QuantMoE) those within their grouped kernels' cap; a bucket past it runs eagerly (counted with
its reason) while the others keep replaying. The context write runs no MoE (main_proj, norm and
each stage's kv projection), so every row bucket up to MAX_GRAPH_CONTEXT_ROWS is a graph.
"""
from __future__ import annotations

import warnings

import torch

from .compile_stats import count_capture, count_fallback
from .cuda.graph_capture import capture, warm_up
from .kernels.invariant_mode import products
from .cuda.transfer import StagedUpload, to_device
from .logit_adjust import LogitAdjust
from .spec.gumbel import gumbel_draws
from .sampling import (Purpose, argmax_rows, filters_used, fused_filters_enabled,
                       fused_sampling_enabled, probs_from_logits,
                       sample_from_probs, uniforms)

TWO_PASS_ARGMAX_MIN_V = 16384         # greedy Markov steps over wider rows use argmax_rows
PAD_INTS = (0, 0, 0, 0, 0)            # slot, anchor, start, seed, top_k: slot 0 = EMPTY_SLOT
PAD_FLOATS = (1.0, 1.0)               # temperature 1, top_p 1 = off
MAX_GRAPH_CONTEXT_ROWS = 1024         # larger context writes (prefill of many requests) run eagerly


def bucket_size(n: int, smallest: int = 1) -> int:
    """Batch sizes are padded to powers of two: few graphs, at most 2x padding rows."""
    return max(smallest, 1 << max(n - 1, 0).bit_length())


class DraftPass:
    """`__call__(reqs, quant)` -> (tokens [R, γ] int64, q [R, γ, V] fp32 | None, confidence
    logits [R, γ] fp32) for requests with .draft_state (of `pool`), .anchor, .num_committed,
    .seed and .params. q is None when every request is greedy (their q is a point mass).
    `write_context(...)` writes committed context rows into the pool."""

    def __init__(self, drafter, embed, head, pool, cuda_graphs: bool = False,
                 gumbel: bool = False):
        self.drafter, self.embed, self.head, self.pool = drafter, embed, head, pool
        # deterministic mode: drafts drawn by Gumbel-max with the target's noise (spec/gumbel.py)
        self.gumbel = gumbel
        self.device = pool.device
        self.gamma = drafter.gamma
        # graphs need passes without host syncs: every stage's MoE dense, or FP4 experts on
        # their grouped kernels for at least the smallest bucket (then decided per bucket)
        self.cuda_graphs = (bool(cuda_graphs) and self.device.type == "cuda"
                            and drafter.graphs_possible(self.device))
        self.graphs_wanted = self.cuda_graphs   # stays True after a failed capture (counted)
        self._warned: set = set()      # eager-bucket reasons already warned about
        self.max_position = 0          # bound (exclusive) on positions the stages' RoPE sees
        self._offsets = torch.arange(1, self.gamma + 1, device=self.device)
        # ("draft", bucket, top-k?, top-p?, all greedy?, quantized?) or
        # ("context", rows bucket, taps dtype, quantized?) -> _Captured
        self._graphs: dict = {}
        self._captured_on = None       # tensors the graphs read by address (see _tensors_read)
        self._checked = None           # (bound, pool positions, ropes' tables) last found current
        self._mempool = None
        self._upload = StagedUpload()
        self._adjust = None            # LogitAdjust of the eager pass running now, if any

    # ---- host side -----------------------------------------------------------------------
    def position_bound(self, n: int) -> int:
        """Raise the RoPE bound to cover positions < n (powers of two from 1024: the stages'
        tables, which captured graphs read by address, are reallocated rarely)."""
        if n > self.max_position:
            self.max_position = max(1024, 1 << (n - 1).bit_length())
        return self.max_position

    def to_device(self, rows, dtype) -> torch.Tensor:
        return to_device(rows, dtype, self.device)

    def _fused_sampling(self, greedy: bool, use_top_k: bool, use_top_p: bool, rows: int) -> bool:
        """Whether the Markov steps run through Triton launches instead of torch ops: greedy, or
        sampled without top-k / top-p, the whole loop in one where the head allows it
        (`_sample_block`); else sampled steps draw through one launch each (fused_sample),
        with top-k / top-p where fused_filters_enabled says so for `rows` rows of the
        vocabulary (then filter_logits first: two launches per step), and greedy steps keep
        their argmax. Part of the graph key, so sampling.FUSED_BACKEND switches a captured pass
        too."""
        if not fused_sampling_enabled(self.device):
            return False
        return greedy or not (use_top_k or use_top_p) or fused_filters_enabled(
            self.device, rows, self.head.weight.shape[0])

    def _fill(self, buffer: torch.Tensor, rows, dtype):
        """A graph input from host rows: through its own pinned staging buffer, queued, not
        waited for."""
        self._upload(buffer, rows, dtype)

    def draft_blocker(self, size: int, device=None) -> str | None:
        """Why the draft pass of batch bucket `size` must run eagerly on `device` (default: this
        pass's; its stages' MoE see size x γ rows), or None when it can be a graph."""
        blocker = self.drafter.moe_graph_blocker(size * self.gamma, device or self.device)
        return None if blocker is None else f"batch bucket {size}: {blocker}"

    def graph_buckets(self, max_batch: int) -> dict:
        """{"draft": [batch buckets up to max_batch that are graphs], "eager": {bucket: reason},
        "context": [row buckets that are graphs]} on this pass's device (what `capture_all`
        captures when graphs are on)."""
        draft, eager = [], {}
        for b in sorted({bucket_size(n) for n in range(1, max_batch + 1)}):
            reason = self.draft_blocker(b)
            if reason is None:
                draft.append(b)
            else:
                eager[b] = reason
        context = sorted({bucket_size(n, smallest=8) for n in range(1, MAX_GRAPH_CONTEXT_ROWS + 1)})
        return {"draft": draft, "eager": eager, "context": context}

    def _eager_fallback(self, reason: str, warn: bool = False):
        """Count a pass that could have been a graph but runs eagerly; `warn`: also say so, once
        per reason (an eager bucket costs every round of that batch size its host time)."""
        count_fallback(self, reason)
        if warn and reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"the draft pass runs eagerly for this call ({reason}); the other "
                          f"buckets stay CUDA graphs")

    def _host_inputs(self, reqs, size: int, on_device: bool = False):
        """on_device: anchors and starts are filled on the device afterwards (_device_inputs):
        zeros here (a request finishing its prompt has no anchor on the host yet)."""
        pad = size - len(reqs)
        cols = [(r.draft_state.slot if r.draft_state.slot is not None else self.pool.EMPTY_SLOT,
                 0 if on_device else r.anchor, 0 if on_device else r.num_committed, r.seed,
                 r.params.top_k) for r in reqs]
        fcols = [(float(r.params.temperature), float(r.params.top_p)) for r in reqs]
        # column-major [field][row]; built per field so that reqs == [] (the padding-only
        # inputs a capture warms up on) still gives every field its row of padding
        ints = [[c[j] for c in cols] + [p] * pad for j, p in enumerate(PAD_INTS)]
        floats = [[c[j] for c in fcols] + [p] * pad for j, p in enumerate(PAD_FLOATS)]
        return ints, floats

    def __call__(self, reqs, quant=None, on_device=None):
        """on_device: (anchors [R], (P + 1 [R], a [R]), bound on the starts): device tensors and
        a host int, the requests' next anchors and their positions P + 1 + a when the host has
        not read them yet (a round drafting ahead of its read back); they replace .anchor /
        .num_committed."""
        R = len(reqs)
        if R == 0:
            raise ValueError("draft pass of no requests")
        for r in reqs:
            if r.draft_state.pool is not None and r.draft_state.pool is not self.pool:
                raise ValueError("draft state of another pool: make it with this runner's new_states()")
        top = on_device[2] if on_device is not None else max(r.num_committed for r in reqs)
        bound = self.position_bound(top + self.gamma + 1)
        use_top_k, use_top_p = filters_used([r.params for r in reqs])
        greedy = all(r.params.greedy for r in reqs)
        size = bucket_size(R)
        fused = self._fused_sampling(greedy, use_top_k, use_top_p, size)
        # requests with penalties / logit_bias / min_tokens / min_p adjust every Markov step's
        # logits from their token history: an eager pass (the history is not a graph input)
        adjust = LogitAdjust.build(reqs, self.head.weight.shape[0], self.device)
        graph, reason = None, "capture failed"
        # a bucket whose MoE rows the sync-free path cannot serve: eager for this call only
        blocker = self.draft_blocker(size) if self.cuda_graphs else None
        if self.cuda_graphs and adjust is not None:
            reason = "penalties / logit_bias / min_tokens / min_p"
        elif blocker is not None:
            reason = blocker
        elif self.cuda_graphs:
            graph = self._draft_graph(size, use_top_k, use_top_p, greedy, fused, quant, bound)
        if graph is None:
            if self.graphs_wanted:
                self._eager_fallback(reason, warn=reason is blocker)
            ints, floats = self._host_inputs(reqs, R, on_device is not None)
            self._adjust = adjust
            ints = self.to_device(ints, torch.long)
            self._device_inputs(ints, on_device, R)
            try:
                with products():
                    return self._draft(ints, self.to_device(floats, torch.float32),
                                       use_top_k, use_top_p, greedy, quant, fused)
            finally:
                self._adjust = None
        ints, floats = self._host_inputs(reqs, size, on_device is not None)
        # the same requests round after round: their inputs are on the device already, but
        # for the anchors and starts, which a pass drafting ahead writes there itself
        if graph.filled != (ints, floats) or (graph.anchors_on_device and on_device is None):
            self._fill(graph.inputs[0], ints, torch.long)
            self._fill(graph.inputs[1], floats, torch.float32)
            graph.filled = (ints, floats)
        self._device_inputs(graph.inputs[0], on_device, R)
        graph.anchors_on_device = on_device is not None
        graph.graph.replay()
        # copies: the graph's outputs are overwritten by its next replay
        toks, probs, confs = graph.outputs
        return (toks[:R].clone(), None if greedy or probs is None else probs[:R].clone(),
                confs[:R].clone())

    @staticmethod
    def _device_inputs(ints: torch.Tensor, on_device, R: int) -> None:
        """Anchors and starts (rows 1 and 2 of the int inputs) from device tensors, queued after
        the host fill: device to device, no wait for the round that computes them. Starts come
        as (P + 1, accepted a): the sum is written in place."""
        if on_device is not None:
            ints[1, :R].copy_(on_device[0])
            torch.add(*on_device[1], out=ints[2, :R])

    def _padding_inputs(self, size: int) -> tuple:
        """(ints, floats) device buffers of a draft pass over `size` padding rows: what a capture
        records on, refilled before each replay."""
        ints, floats = self._host_inputs([], size)
        return (torch.tensor(ints, dtype=torch.long, device=self.device),
                torch.tensor(floats, dtype=torch.float32, device=self.device))

    def _draft_graph(self, size, use_top_k, use_top_p, greedy, fused, quant, bound):
        """The captured draft pass of batch bucket `size` with these sampling features."""
        def capture():
            return self._padding_inputs(size), lambda i, f: self._draft(
                i, f, use_top_k, use_top_p, greedy, quant, fused)

        return self._graph(("draft", size, use_top_k, use_top_p, greedy, fused, quant is not None),
                           bound, capture)

    def _context_graph(self, size, dtype, width, quant, bound):
        """The captured context write of `size` rows (padded) of taps [size, width] in `dtype`."""
        d = self.drafter

        def capture():
            # padding rows: scratch slot, position 0, zero taps
            buffers = (torch.tensor([[self.pool.SCRATCH_SLOT] * size, [0] * size],
                                    dtype=torch.long, device=self.device),
                       torch.zeros(size, width, dtype=dtype, device=self.device))
            return buffers, lambda index, rows: d.commit_rows(
                self.pool, index[0], rows, index[1], quant, self.max_position)

        return self._graph(("context", size, dtype, quant is not None), bound, capture)

    # inference mode, as the runner's draft() / flush_context() that capture lazily: the same
    # kernels (the fused ones skip autograd-tracked parameters) and no autograd records in a graph
    @torch.inference_mode()
    def capture_all(self, max_batch: int, max_position: int, taps_width: int, taps_dtypes,
                    quant=None, progress: bool = False) -> int:
        """Capture ahead of traffic the draft pass of every batch bucket up to `max_batch`
        that can be a graph (greedy, and sampled without top-k / top-p; `graph_buckets`: the
        buckets that must stay eager are skipped, not attempted) and the context write of every
        row bucket, with the RoPE bound raised to `max_position` first (a later raise would
        re-capture). Returns how many graphs exist afterwards; 0 when graphs are off."""
        if not self.cuda_graphs:
            return 0
        bound = self.position_bound(max_position)
        plan = self.graph_buckets(max_batch)
        jobs = [("draft", b, greedy) for b in plan["draft"] for greedy in (True, False)]
        jobs += [("context", b, dt) for b in plan["context"] for dt in taps_dtypes]
        from tqdm import tqdm
        for kind, size, arg in tqdm(jobs, desc="capturing draft graphs", unit="graph",
                                    disable=not progress):
            if kind == "draft":
                fused = self._fused_sampling(arg, False, False, size)
                graph = self._draft_graph(size, False, False, arg, fused, quant, bound)
            else:
                graph = self._context_graph(size, arg, taps_width, quant, bound)
            if graph is None:
                return 0
        return len(self._graphs)

    def write_context(self, slots: list, positions: list, taps: list, quant=None,
                      drop: torch.Tensor | None = None, rows: torch.Tensor | None = None):
        """Context rows for committed positions: host lists slots / positions [n] and the taps
        rows as a list of [n_i, taps*D] tensors (n = Σ n_i), or with `rows` (device int64 [n])
        the rows `rows` of taps[0]. (slot, position % capacity) must be distinct over the n
        kept rows. drop: a device bool [n] known only on the device (a round's rejected drafts
        before the host reads them): those rows go to the scratch slot, as if not written."""
        n = len(positions)
        bound = self.position_bound(max(positions) + 1)
        d = self.drafter
        size, dtype = bucket_size(n, smallest=8), taps[0].dtype
        graph = self._context_graph(size, dtype, taps[0].shape[-1], quant, bound) \
            if self.cuda_graphs and n <= MAX_GRAPH_CONTEXT_ROWS else None
        if graph is None:
            if self.graphs_wanted:
                count_fallback(self, "capture failed" if not self.cuda_graphs else
                               "context rows past the largest bucket")
            index = self.to_device([slots, positions], torch.long)
            if drop is not None:
                index[0].masked_fill_(drop, self.pool.SCRATCH_SLOT)
            x = taps[0].index_select(0, rows) if rows is not None else torch.cat(taps)
            with products():
                d.commit_rows(self.pool, index[0], x, index[1], quant, bound)
            return
        self._replay_context(graph, slots, positions, taps, size, drop, rows)

    def _replay_context(self, graph, slots: list, positions: list, taps: list, size: int,
                        drop: torch.Tensor | None = None, rows: torch.Tensor | None = None):
        """Fill a captured context write's inputs (padded to `size` with the scratch slot at
        position 0) and replay it."""
        n, pad = len(positions), size - len(positions)
        self._fill(graph.inputs[0], [slots + [self.pool.SCRATCH_SLOT] * pad, positions + [0] * pad],
                   torch.long)
        if drop is not None:
            graph.inputs[0][0, :n].masked_fill_(drop, self.pool.SCRATCH_SLOT)
        # rows past n keep what an earlier round left there: they land in the scratch slot
        dst = graph.inputs[1][:n]
        if rows is not None:            # gathered straight into the graph's input
            torch.index_select(taps[0], 0, rows, out=dst)
        else:
            dst.copy_(taps[0] if len(taps) == 1 else torch.cat(taps))
        graph.graph.replay()

    # ---- graphs ----------------------------------------------------------------------------
    def _pool_tensor(self) -> torch.Tensor:
        """The first of `_tensors_read`: the pool replaces it with the others when it grows."""
        return self.pool.pos

    def _tensors_read(self, ropes) -> tuple:
        return (self.pool.pos, *self.pool.kv, *[r.cis for r in ropes], *[r.conj for r in ropes])

    def _tensors_same(self, bound: int) -> bool:
        """Whether the last full check (`_graph`) still holds: the same bound, pool tensors and RoPE
        tables (a pass of the same requests round after round; the full check looks the stages'
        ropes up through their modules and builds the tuple of every tensor a graph reads)."""
        checked = self._checked
        return (checked is not None and checked[0] == bound and checked[1] is self._pool_tensor()
                and all(r.cis is cis for r, cis in checked[2]))

    def _graph(self, key, bound: int, capture):
        """The graph for `key`; `capture()` -> (static input buffers, fn(*buffers)) builds it.
        None when capturing failed: graphs are then off for good and the caller runs eagerly."""
        if not self._tensors_same(bound):
            ropes = self.drafter.ropes()
            for rope in ropes:           # grow the RoPE tables now, not inside a capture
                rope.reserve(bound, self.device)
            read = self._tensors_read(ropes)
            if self._captured_on is None or any(a is not b for a, b in zip(self._captured_on, read)):
                self._graphs.clear()    # pool or RoPE tables reallocated: graphs read stale memory
                self._captured_on = read
            self._checked = (bound, read[0], tuple((r, r.cis) for r in ropes))
        if key not in self._graphs:
            buffers, fn = capture()
            try:
                self._graphs[key] = self._capture(buffers, fn)
                count_capture(self)
            except RuntimeError as e:
                warnings.warn(f"capturing the drafter as a CUDA graph failed, running it eagerly "
                              f"from now on (Engine(cuda_graphs=False) skips the attempt): {e}")
                self.cuda_graphs = False
                self._graphs.clear()
                return None
        return self._graphs[key]

    def _capture(self, buffers, fn):
        # warm up on a side stream: lazy initialisation (cuBLAS handles, Triton compiles) must
        # not happen inside the capture. Padding inputs only: the pool's scratch slot is the
        # only thing a warm-up may write.
        with products():        # (deterministic mode: aten's products batch-invariant)
            warm_up(lambda: fn(*buffers), times=2, device=self.device)
            if self._mempool is None:   # one memory pool for all graphs (replays are serial)
                self._mempool = torch.cuda.graph_pool_handle()
            graph, outputs = capture(lambda: fn(*buffers), self._mempool)
        return _Captured(graph, buffers, outputs)

    # ---- device side: no host reads, shapes fixed by the batch size ----------------------
    def _draft(self, ints, floats, use_top_k: bool, use_top_p: bool, greedy: bool, quant,
               fused: bool = False):
        """(tokens [R, γ], q [R, γ, V] or None when `greedy` (every request greedy), confidence
        logits [R, γ])."""
        d = self.drafter
        slots, anchors, starts, seeds, top_k = ints
        temperature, top_p = floats
        top_k, top_p = (top_k if use_top_k else None), (top_p if use_top_p else None)
        # the stages read the pool's rings in place, by slot
        hidden = d.block_hidden_batched(self.embed, anchors, starts, slots, self.pool.kv,
                                        self.pool.pos, quant, self.max_position)
        base = d.base_logits(self.head, hidden)                               # [R, γ, V]
        fp32_hidden = []

        def head_step(k, prev):
            # cast once, not per Markov step (markov_step casts to fp32), and only on this
            # path: the fused loop reads the hidden state in its own dtype
            if not fp32_hidden:
                fp32_hidden.append(hidden.float())
            return d.markov_step(fp32_hidden[0][:, k], prev)
        return self._sample_block(base, anchors, starts, seeds, temperature, top_k, top_p, greedy,
                                  head_step, fused,
                                  (hidden, d.markov_w1, d.markov_w2, d.confidence.weight))

    def _sample_block(self, base, anchors, starts, seeds, temperature, top_k, top_p,
                      greedy: bool, head_step, fused: bool = False, markov=None,
                      head_logits=None):
        """The sequential part of a draft pass: slot k's logits are base[:, k] plus the head's
        bias given the previous token; `head_step(k, prev)` -> (bias [R, V], confidence [R]),
        or, given instead, `head_logits(k, prev)` -> (those logits fp32 [R, V], confidence).
        markov: (hidden [R, γ, D], W1, W2, confidence weight) when the head is
        `markov_step`'s (e = W1[prev], bias = W2 e, confidence = w · [hidden_k ; e]): with
        `fused` and no per-step work in between (top-k / top-p, logit adjustments, Gumbel
        draws where the loop is not fused) the whole loop is one launch where
        markov_loop.supported says so, Gumbel-max draws included."""
        gumbel = (self.gumbel and not greedy) or None      # (all greedy: the argmax below)
        adjust = getattr(self, "_adjust", None)
        if (fused and markov is not None and adjust is None
                and top_k is None and top_p is None
                # the kernel has no backward: autograd keeps the per-step path
                and not (torch.is_grad_enabled() and any(t.requires_grad for t in markov))):
            from .kernels import markov_loop
            hidden, w1, w2, conf_w = markov
            if markov_loop.supported(w2.shape[0], w2.shape[1]):
                if gumbel is not None:
                    return markov_loop.markov_loop(base, anchors, w1, w2, hidden, conf_w,
                                                   temperature, gumbel=(seeds, starts))
                u = None
                if not greedy:
                    from .kernels.sampling import uniforms_triton
                    u = uniforms_triton(seeds[:, None], starts[:, None] + self._offsets,
                                        Purpose.DRAFT)
                return markov_loop.markov_loop(base, anchors, w1, w2, hidden, conf_w,
                                               None if greedy else temperature, u, greedy)
        # fused: one Triton launch per Markov step (softmax, q written, inverse-CDF sample) instead
        # of ~20 small kernels, and the uniforms' hash in one; with top-k / top-p (where
        # fused_filters_enabled says so) filter_logits first, else the torch path's sort
        if fused:
            from .kernels.sampling import fused_sample, uniforms_triton
            from .kernels.sampling_filters import filter_logits
        if not greedy and gumbel is None:
            # the uniform deciding the token at P+k+1, for all k at once (elementwise the same
            # values as one uniforms() call per step)
            u = (uniforms_triton if fused else uniforms)(
                seeds[:, None], starts[:, None] + self._offsets, Purpose.DRAFT)
        prev, toks, probs, confs = anchors, [], [], []
        for k in range(self.gamma):
            if head_logits is not None:
                x, conf = head_logits(k, prev)
            else:
                bias, conf = head_step(k, prev)
                x = base[:, k] + bias
            if adjust is not None:       # the same adjustment the target's row k gets
                x = adjust.apply(x)
            if gumbel is not None:
                # Gumbel-max with the noise of the position each row decides: the target's
                # draw there when the laws agree
                # (no q: acceptance in this mode compares tokens, spec/accept.decide_gumbel)
                prev = gumbel_draws(x, temperature, top_k, top_p, seeds, starts + (k + 1))
            elif greedy:
                # what probs_from_logits + sample_from_probs give at temperature 0: the point
                # mass on the argmax (first index on ties), so that token, without the [R, V] work
                # a large vocabulary: argmax_rows' two short launches, not torch's ~27 us
                # one-pass argmax (V = 129280); a small one keeps the single launch
                prev = argmax_rows(x) if x.shape[1] >= TWO_PASS_ARGMAX_MIN_V else x.argmax(dim=1)
            elif fused:
                t = temperature
                if top_k is not None or top_p is not None:
                    x, t = filter_logits(x, t, top_k, top_p)  # tempered + filtered, at t = 1
                q, prev = fused_sample(x, t, u[:, k])
                probs.append(q)
            else:
                q = probs_from_logits(x, temperature, top_k, top_p)
                prev = sample_from_probs(q, u[:, k])
                probs.append(q)
            if adjust is not None:
                adjust.push(prev)
            toks.append(prev), confs.append(conf)
        return (torch.stack(toks, 1), torch.stack(probs, 1) if probs else None,
                torch.stack(confs, 1))


class _Captured:
    def __init__(self, graph, inputs, outputs):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs
        self.filled = None               # the host rows last uploaded into `inputs` (draft pass)
        self.anchors_on_device = False   # whether its anchors / starts were written on the device
