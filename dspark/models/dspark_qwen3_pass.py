"""Batched, fixed-shape draft pass of the DeepSpec (Qwen3) DSpark drafter, replayed as CUDA graphs.

The same design as the DeepSeek-V4 `DraftPass` (dspark/draft_pass.py), which this subclasses:
- every request's draft context K/V (per draft layer, from the projected target taps) lives in one
  `Qwen3DraftPool`, [slots, rows, Hkv, d] per layer, indexed by (slot, absolute position); the
  DeepSpec context is the full prefix (no window), so rows grow by doubling on demand;
- the block forward runs for all requests at once: each block attends over its slot's rows
  0..C-1 masked to positions < its start, plus the whole block (bidirectional);
- the Markov head (vanilla / gated / rnn, the rnn state carried explicitly) runs γ batched steps;
  randomness is `uniforms(seed, position, DRAFT)`, so eager and replayed passes draw the same;
- nothing is read back from the device; shapes depend on (batch bucket, context bucket C), so on
  CUDA each pair is captured once (warm-up on all-padding inputs) and replayed; padding rows read
  the pool's empty slot at start 0 and write context to its scratch slot;
- a capture failure warns and runs eagerly from then on;
- kernels="triton" (CUDA default) runs the block forward and the context write on fused kernels
  (dspark_qwen3_fused.py), "torch" the drafter's own modules (the reference the fused path is
  tested against on CPU under the Triton interpreter).
"""
from __future__ import annotations

import weakref

import torch

from .. import debug
from ..compile_stats import count_fallback
from ..draft_pass import MAX_GRAPH_CONTEXT_ROWS, DraftPass, bucket_size
from ..logit_adjust import LogitAdjust
from ..sampling import filters_used

MIN_CONTEXT_ROWS = 256        # smallest context bucket (and initial pool rows)
NO_RING = 1 << 62             # the pool keeps every row: `capacity` for the runner's ring trimming


def context_bucket(n: int) -> int:
    return max(MIN_CONTEXT_ROWS, 1 << max(n - 1, 0).bit_length())


class Qwen3DraftPool:
    """Draft context of many requests: per draft layer K and V [slots, rows, Hkv, d] (K after
    k_norm + RoPE). Slot s, row p = the context of position p of the request owning s. Rows past
    a request's committed length are masked by the pass (they may hold a previous owner's rows).
    EMPTY_SLOT is never written (padding rows of a draft bucket read it); SCRATCH_SLOT takes the
    padding rows of a context write and is never read."""

    EMPTY_SLOT, SCRATCH_SLOT = 0, 1
    _RESERVED = 2
    capacity = NO_RING

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype, device, num_slots: int = 8):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.k, self.v, self.rows = [], [], 0
        self._free: list = []
        self._resize(num_slots + self._RESERVED, MIN_CONTEXT_ROWS)
        self.device = self.k[0].device     # with its index ("cuda" -> "cuda:0")

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0] - self._RESERVED

    @property
    def kv(self) -> list:
        return self.k + self.v

    def allocate(self) -> int:
        if not self._free:
            self._resize(2 * self.num_slots + self._RESERVED, self.rows)
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def reserve(self, rows: int) -> None:
        """Room for positions < rows (doubling; reallocation makes captured graphs stale)."""
        if rows > self.rows:
            self._resize(self.k[0].shape[0], context_bucket(rows))

    def _resize(self, n: int, rows: int) -> None:
        old_n, old_rows = (self.k[0].shape[0], self.rows) if self.k else (0, 0)
        with torch.inference_mode(False):
            shape = (n, rows, self.kv_heads, self.head_dim)
            # zeros, never uninitialised: masked rows still meet V in the attention (0 * NaN)
            k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
            v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
            for new, cur in zip(k + v, self.k + self.v):
                new[:old_n, :old_rows] = cur
        self.k, self.v, self.rows = k, v, rows
        self._free.extend(range(n - 1, max(old_n, self._RESERVED) - 1, -1))


class Qwen3DraftState:
    """A request's draft context in a `Qwen3DraftPool`: its slot (taken at the first write, given
    back when the state is collected) and the number of committed positions."""

    def __init__(self, pool: Qwen3DraftPool):
        self.pool, self.slot = pool, None
        self.length = 0

    def take_slot(self) -> int:
        if self.slot is None:
            self.slot = self.pool.allocate()
            weakref.finalize(self, self.pool.release, self.slot)
        return self.slot


class Qwen3DraftPass(DraftPass):
    """`__call__(reqs, quant)` -> (tokens [R, γ], q [R, γ, V] | None when all greedy, confidence
    logits [R, γ]) for requests with .draft_state (a `Qwen3DraftState` of `pool`), .anchor,
    .num_committed, .seed, .params; `write_context(slots, positions, taps)` as in `DraftPass`.
    kernels: "triton" | "torch" (module doc); None: triton on CUDA (unless
    debug.REFERENCE_KERNELS or the drafter has projection biases)."""

    def __init__(self, drafter, embed, head, pool, cuda_graphs: bool = False,
                 gumbel: bool = False, kernels: str | None = None):
        super().__init__(drafter, embed, head, pool, cuda_graphs, gumbel)
        from . import dspark_qwen3_fused as fused
        if kernels is None:
            kernels = "triton" if (self.device.type == "cuda" and not debug.REFERENCE_KERNELS
                                   and fused.fusable(drafter)) else "torch"
        if kernels not in ("triton", "torch"):
            raise ValueError(f"kernels={kernels!r}: use 'triton' or 'torch'")
        self.kernels = kernels
        if kernels == "triton":    # the stacked projections exist before any graph is captured
            fused.stack_projections(drafter)
        self._conf_fp32 = None     # (confidence weight, its fp32 row, fp32 bias): _conf_weights

    def _commit_rows(self, slots, taps, positions):
        if self.kernels == "triton":
            from .dspark_qwen3_fused import commit_rows_fused
            return commit_rows_fused(self.drafter, self.pool, slots, taps, positions)
        return self.drafter.commit_rows(self.pool, slots, taps, positions)

    def _pool_tensor(self) -> torch.Tensor:
        return self.pool.k[0]

    def _tensors_read(self, ropes) -> tuple:
        return tuple(self.pool.kv)        # (no RoPE tables: angles from the positions)

    def __call__(self, reqs, quant=None):
        R = len(reqs)
        if R == 0:
            raise ValueError("draft pass of no requests")
        for r in reqs:
            st = r.draft_state
            if getattr(st, "pool", None) is not self.pool:
                raise ValueError("draft state of another pool: make it with this runner's new_states()")
            if r.num_committed > st.length:
                raise RuntimeError(f"draft context has a hole: positions {st.length}..{r.num_committed - 1} "
                                   f"were never committed but a block at {r.num_committed} needs them "
                                   f"(dspark.md §2.7)")
        use_top_k, use_top_p = filters_used([r.params for r in reqs])
        greedy = all(r.params.greedy for r in reqs)
        fused = self._fused_sampling(greedy, use_top_k, use_top_p, bucket_size(R))
        longest = max(r.num_committed for r in reqs)
        # penalties / logit_bias / min_tokens / min_p: eager, history-dependent (DraftPass)
        adjust = LogitAdjust.build(reqs, self.head.weight.shape[0], self.device)
        if self.cuda_graphs and adjust is None:
            size, ctx = bucket_size(R), context_bucket(longest)
            self.pool.reserve(ctx)

            def capture():
                return self._padding_inputs(size), lambda i, f: self._draft(
                    i, f, ctx, use_top_k, use_top_p, greedy, fused)

            graph = self._graph(("draft", size, ctx, use_top_k, use_top_p, greedy, fused), 0,
                                capture)
            if graph is not None:
                ints, floats = self._host_inputs(reqs, size)
                self._fill(graph.inputs[0], ints, torch.long)
                self._fill(graph.inputs[1], floats, torch.float32)
                graph.graph.replay()
                toks, probs, confs = graph.outputs   # overwritten by the next replay: copy
                return toks[:R].clone(), None if greedy else probs[:R].clone(), confs[:R].clone()
        if self.graphs_wanted:
            count_fallback(self, "capture failed")
        ints, floats = self._host_inputs(reqs, R)
        self._adjust = adjust
        try:
            return self._draft(self.to_device(ints, torch.long),
                               self.to_device(floats, torch.float32),
                               longest, use_top_k, use_top_p, greedy, fused)
        finally:
            self._adjust = None

    def write_context(self, slots: list, positions: list, taps: list, quant=None):
        """Context rows for committed positions: host lists slots / positions [n] (distinct
        pairs) and the taps rows as a list of [n_i, taps*D] tensors (n = Σ n_i)."""
        n = len(positions)
        self.pool.reserve(max(positions) + 1)
        size, dtype = bucket_size(n, smallest=8), taps[0].dtype

        def capture():
            buffers = (torch.tensor([[self.pool.SCRATCH_SLOT] * size, [0] * size],
                                    dtype=torch.long, device=self.device),
                       torch.zeros(size, taps[0].shape[-1], dtype=dtype, device=self.device))
            return buffers, lambda index, rows: self._commit_rows(index[0], rows, index[1])

        graph = self._graph(("context", size, dtype), 0, capture) \
            if self.cuda_graphs and n <= MAX_GRAPH_CONTEXT_ROWS else None
        if graph is None:
            if self.graphs_wanted:
                count_fallback(self, "capture failed" if not self.cuda_graphs else
                               "context rows past the largest bucket")
            index = self.to_device([slots, positions], torch.long)
            self._commit_rows(index[0], torch.cat(taps).to(self.device), index[1])
            return
        self._replay_context(graph, slots, positions, taps, size)

    # ---- device side: no host reads, shapes fixed by (batch size, ctx) -----------------------
    def _draft(self, ints, floats, ctx: int, use_top_k: bool, use_top_p: bool, greedy: bool,
               fused: bool = False):
        d = self.drafter
        slots, anchors, starts, seeds, top_k = ints
        temperature, top_p = floats
        top_k, top_p = (top_k if use_top_k else None), (top_p if use_top_p else None)
        if self.kernels == "triton":
            from .dspark_qwen3_fused import block_hidden_fused
            hidden = block_hidden_fused(d, self.embed, anchors, starts, slots, self.pool)
        else:
            hidden = d.block_hidden_batched(self.embed, anchors, starts, slots, self.pool, ctx)
        base = d.base_logits(self.head, hidden)                               # [R, γ, V]
        state = [d.markov_state(anchors.shape[0], hidden)]      # the RNN head's carry (or None)

        def head_step(k, prev):
            bias, conf, state[0] = d.head_step(hidden[:, k], prev, state[0])
            return bias, conf
        # no one-launch Markov loop (kernels/markov_loop.py): this head is not markov_step's
        # math (W2 runs in the weight dtype, so a bf16 bias; the confidence has a bias and reads
        # W1[prev] only with confidence_head_with_markov; gated / rnn heads add a gate or a
        # carried state), and Qwen3's 151936-token vocabulary is past the kernel's width. The
        # vanilla head on the fused kernels: one launch per step (kernels/qwen3_markov.py)
        head_logits = self._vanilla_head_logits(base, hidden) \
            if self.kernels == "triton" else None
        return self._sample_block(base, anchors, starts, seeds, temperature, top_k, top_p, greedy,
                                  head_step, fused, head_logits=head_logits)

    def _vanilla_head_logits(self, base, hidden):
        """head_logits(k, prev) for `_sample_block` when the drafter's head is vanilla (else
        None): the confidences' hidden part for all γ slots in one GEMM, then per step one
        launch for the corrected logits and the confidence's W1[prev] part."""
        d = self.drafter
        mh, ch = d.markov_head, d.confidence_head
        if mh is None or mh.kind != "vanilla":
            return None
        from ..kernels.qwen3_markov import markov_step
        R, g, H = hidden.shape
        if ch is None:
            conf_base, w_e = torch.full((R, g), float("inf"), device=hidden.device), None
        else:
            w, b = self._conf_weights(ch)
            conf_base = torch.addmm(b, hidden.reshape(R * g, H).float(), w[:H, None]).view(R, g)
            w_e = w[H:] if d.cfg.confidence_head_with_markov else None
        w1, w2 = mh.markov_w1.weight, mh.markov_w2.weight

        def head_logits(k, prev):
            return markov_step(base[:, k], prev, w1, w2, conf_base[:, k], w_e)
        return head_logits

    def _conf_weights(self, ch):
        """(weight [H (+ r)], bias [1]) of the confidence head in fp32, cast once (§2.6: fp32)."""
        cached = self._conf_fp32
        if cached is None or cached[0] is not ch.proj.weight:
            cached = (ch.proj.weight, ch.proj.weight.float()[0].contiguous(), ch.proj.bias.float())
            self._conf_fp32 = cached
        return cached[1:]


__all__ = ["Qwen3DraftPool", "Qwen3DraftState", "Qwen3DraftPass", "context_bucket"]
