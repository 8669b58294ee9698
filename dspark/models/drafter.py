"""DeepSeek-V4 DSpark drafter built from the `mtp.*` tensors (dspark.md §3).

Context combiner: main_x = main_norm(main_proj(taps)) per committed target position, where taps
are the hc-mean residual streams after `dspark_target_layer_ids`. Each stage turns main_x into
its own window kv (wkv -> kv_norm -> RoPE), the only way context enters the drafter.
Draft block: [anchor, noise x (γ-1)] at positions P..P+γ-1 through the stages (SWA-only V4 blocks
whose attention is non-causal over ctx[max(0,P-128):P] ∪ the whole block), hc_head, norm, the
target's head -> base logits U; then the Markov head adds W2·W1[prev] left to right and the
confidence head scores each slot from [pre-norm hidden ; W1[prev]].

Serving keeps the context rows of all requests in one `DraftContextPool` (a ring of window rows
per request slot) and runs the block of all requests as one batch of fixed shapes
(`block_hidden_batched`; the stages' attention in draft_block.py): context entries are read in
place by slot and masked by the position they hold, the MoE of small
stages runs dense (packed FP4 stages take QuantMoE's grouped kernels up to their row cap) and the
stages' RoPE (`DraftRope`) takes a host-side position bound, so nothing is read back from the
device and the pass can be replayed as a CUDA graph (dspark/draft_pass.py, per batch bucket:
`moe_graph_blocker`).
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from .deepseek_v4.mhc import hc_expand, hc_head, hc_post
from .deepseek_v4.model import Block
from .deepseek_v4.moe import MoE, clamped_swiglu
from .deepseek_v4.norm import RMSNorm, derived, fp32, fused_backend, linear_fp32
from .deepseek_v4.rope import rotate
from .draft_block import BlockContext, block_attention, context_rows

# Routed experts up to this many bytes per stage run densely (every token through every expert,
# off-route tokens weighted 0): no data-dependent shapes, so the draft pass needs no host sync
# and can be a CUDA graph. Larger MoEs keep the routed loop (reading every expert would cost more
# than the sync it avoids).
DENSE_MOE_MAX_BYTES = 16 << 20


class DraftContextPool:
    """Draft context rows of many requests: per stage one tensor [slots, capacity, head_dim]
    (`kv`: views of one [stages, slots, capacity, head_dim] tensor, so a context write stores
    every stage's rows in one launch), plus the absolute position each ring entry holds
    ([slots, capacity] int64, -1 = empty).

    A request owns one slot (as a request owns pages in the KV cache); its row for position p
    lives at ring entry p % capacity. A draft pass gathers the slots of all its requests and masks
    entries by position, so it has the same shapes whatever the requests' positions are.
    Two slots are never handed out: EMPTY_SLOT stays empty (read by requests without context
    and by the padding rows of a CUDA-graph bucket), SCRATCH_SLOT takes the padding rows of a
    batched context write and is never read.
    """

    EMPTY_SLOT, SCRATCH_SLOT = 0, 1
    _RESERVED = 2

    def __init__(self, num_stages: int, window: int, head_dim: int, dtype, device, num_slots: int = 8):
        self.num_stages, self.window, self.capacity = num_stages, window, window
        self.head_dim, self.dtype, self.device = head_dim, dtype, torch.device(device)
        self.kv, self.pos, self._rows = [], None, None
        self._free: list = []
        self._resize(num_slots + self._RESERVED)
        self.device = self.pos.device      # with its index ("cuda" -> "cuda:0")

    @property
    def num_slots(self) -> int:
        return self.pos.shape[0] - self._RESERVED

    def allocate(self) -> int:
        if not self._free:
            self._resize(2 * self.num_slots + self._RESERVED)
        slot = self._free.pop()
        self.pos[slot] = -1       # the previous owner's rows become invisible (masked by position)
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def _resize(self, n: int) -> None:
        old = self.pos.shape[0] if self.pos is not None else 0
        # normal (not inference-mode) tensors: they are written in and outside inference mode
        with torch.inference_mode(False):
            rows = torch.zeros(self.num_stages, n, self.capacity, self.head_dim, dtype=self.dtype,
                               device=self.device)
            pos = torch.full((n, self.capacity), -1, dtype=torch.long, device=self.device)
            if old:
                rows[:, :old] = self._rows
                pos[:old] = self.pos
            self._stage_index = torch.arange(self.num_stages, device=self.device)[:, None]
        self._rows, self.kv, self.pos = rows, list(rows.unbind(0)), pos
        # pop() hands out low slots first. Tensors read by address (captured CUDA graphs) are
        # stale from here on: users compare `kv` / `pos` by identity.
        self._free.extend(range(n - 1, max(old, self._RESERVED) - 1, -1))

    def write(self, slots: torch.Tensor, ring: torch.Tensor, rows: torch.Tensor,
              positions: torch.Tensor) -> None:
        """Every stage's row of n context positions: entries ring [n] of slots [n] (distinct
        pairs) get rows [n, stages, head_dim] and hold positions [n] from now on."""
        self._rows.index_put_((self._stage_index, slots, ring),
                              rows.to(self.dtype).transpose(0, 1))
        self.pos.index_put_((slots, ring), positions)

    def gather(self, slots: torch.Tensor):
        """(per stage kv [R, capacity, head_dim], positions [R, capacity]) of slots [R]."""
        return [kv[slots] for kv in self.kv], self.pos[slots]


class DraftState:
    """Per-request draft context: per stage, window kv rows keyed by absolute position.

    Only committed (target-verified) rows are ever written, so rejection needs no rollback.
    Rows older than the window are never read; memory is bounded by keeping a ring of
    `capacity` >= window slots addressed by position % capacity. The rows live in a
    `DraftContextPool` slot (the runner's shared pool, or a private one-slot pool when the state
    is made without one), taken at the first write and given back when the state is collected.
    """

    def __init__(self, num_stages: int, window: int, pool: DraftContextPool | None = None):
        if pool is not None and (pool.num_stages, pool.window) != (num_stages, window):
            raise ValueError(f"DraftState({num_stages} stages, window {window}) does not fit a pool "
                             f"of {pool.num_stages} stages, window {pool.window}")
        self.num_stages, self.window, self.capacity = num_stages, window, window
        self.pool, self.slot = pool, None
        self.length = 0                        # number of committed context positions

    def take_slot(self, like: torch.Tensor | None = None) -> int:
        """This state's slot in its pool, taken on first use. `like` (a context row tensor) sets
        head_dim / dtype / device of a private pool when the state has none."""
        if self.slot is None:
            if self.pool is None:
                self.pool = DraftContextPool(self.num_stages, self.window, like.shape[-1],
                                             like.dtype, like.device, num_slots=1)
            self.slot = self.pool.allocate()
            weakref.finalize(self, self.pool.release, self.slot)
        return self.slot

    @property
    def kv(self) -> list:
        """Per stage [capacity, head_dim] ring of this request (None before the first write)."""
        if self.slot is None:
            return [None] * self.num_stages
        return [kv[self.slot] for kv in self.pool.kv]

    def write(self, stage: int, positions: torch.Tensor, rows: torch.Tensor):
        slot = self.take_slot(rows)
        # only the newest `capacity` rows can be read again; writing more in one call would
        # collide in the ring (which of two writes to one slot wins is undefined)
        positions, rows = positions[-self.capacity:], rows[-self.capacity:]
        ring = positions % self.capacity
        self.pool.kv[stage][slot, ring] = rows.to(self.pool.dtype)
        self.pool.pos[slot, ring] = positions

    def window_rows(self, stage: int, P: int) -> torch.Tensor:
        """Context kv for positions max(0, P-W)..P-1 (order irrelevant: attention is non-causal)."""
        lo = max(0, P - self.window)
        if P == 0 or self.slot is None:
            return torch.zeros(0, 0)
        idx = torch.arange(lo, P, device=self.pool.device) % self.capacity
        return self.pool.kv[stage][self.slot][idx]


class DraftRope:
    """RoPE of the drafter stages: the rotation of the stage's `Rope` (same frequencies,
    interleaved pairs on the last rope_dim dims) over tables owned by this drafter alone.

    Inside `bounded(n)` the caller promises positions < n, so `apply` reads nothing back from
    the device (the draft pass is then CUDA-graph capturable) and the tables are not reallocated;
    outside it reads positions.max() and grows the tables like `Rope`. Owning the tables keeps
    the promise local: the target's (shared) RoPE instances are never put in that mode.
    """

    def __init__(self, rope):
        self.rope_dim, self.freqs = rope.rope_dim, rope.freqs
        self.cis = self.conj = None       # complex64 [size, rope_dim/2]: e^{+i p f}, e^{-i p f}
        self._bound = None

    @contextlib.contextmanager
    def bounded(self, n: int, device):
        self.reserve(n, device)
        previous, self._bound = self._bound, n
        try:
            yield
        finally:
            self._bound = previous

    def reserve(self, n: int, device):
        """Tables covering positions < n on `device` (reallocated only to grow or move)."""
        if self.cis is None or self.cis.shape[0] < n or self.cis.device != torch.device(device):
            size = max(n, 2 * (0 if self.cis is None else self.cis.shape[0]), 256)
            ang = torch.arange(size, dtype=torch.float64, device="cpu")[:, None] * self.freqs[None, :]
            cos, sin = ang.cos().float(), ang.sin().float()
            with torch.inference_mode(False):
                self.cis = torch.complex(cos, sin).to(device)
                self.conj = torch.complex(cos, -sin).to(device)

    def table(self, bound: int, device, inverse: bool = False) -> torch.Tensor:
        """complex64 [>= bound, r/2] (Rope.table's contract: fused.norm_rope's kernel gathers
        its rows by position itself)."""
        self.reserve(max(bound, 1), device)
        return self.conj if inverse else self.cis

    def rows(self, positions: torch.Tensor, device, inverse: bool = False,
             bound: int | None = None, memo: dict | None = None) -> torch.Tensor:
        """complex64 [T, r/2] for `positions` (Rope.rows' contract; inside `bounded` nothing is
        read back)."""
        if bound is None:
            bound = self._bound
        if bound is None:
            bound = int(positions.max()) + 1 if positions.numel() else 1
        return self.table(bound, device, inverse)[positions]

    @property
    def bound(self) -> int | None:
        """The host-side position bound of the current `bounded` block, or None."""
        return self._bound

    def apply(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate the last rope_dim dims of x [..., T, (heads,) dim] at positions [T]."""
        return rotate(x, self.rows(positions, x.device, inverse), self.rope_dim)


class DSparkDrafter(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        D, n, S = cfg.hidden_size, cfg.hc_mult, cfg.num_dspark_stages
        self.gamma = cfg.dspark_block_size
        self.num_taps = len(cfg.dspark_target_layer_ids)
        # stage s runs as layer num_hidden_layers + s: ratio 0 (SWA), never hash-routed
        self.stages = nn.ModuleList(Block(cfg, cfg.num_hidden_layers + s, 0, False) for s in range(S))
        for stage in self.stages:
            stage.attn.rope = DraftRope(stage.attn.rope)
        self.main_proj = nn.Linear(self.num_taps * D, D, bias=False)
        self.main_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * D))
        self.hc_head_base = nn.Parameter(torch.zeros(n))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        r = cfg.dspark_markov_rank
        self.markov_w1 = nn.Parameter(torch.zeros(cfg.vocab_size, r))   # lookup by token id
        self.markov_w2 = nn.Parameter(torch.zeros(cfg.vocab_size, r))   # projection r -> V
        self.confidence = nn.Linear(D + r, 1, bias=False)

    # checkpoint name <-> parameter name -------------------------------------------------
    _MODEL_LEVEL = {"main_proj.weight": "main_proj.weight", "main_norm.weight": "main_norm.weight",
                    "norm.weight": "norm.weight", "hc_head_fn": "hc_head_fn",
                    "hc_head_base": "hc_head_base", "hc_head_scale": "hc_head_scale",
                    "markov_head.markov_w1.weight": "markov_w1",
                    "markov_head.markov_w2.weight": "markov_w2",
                    "confidence_head.proj.weight": "confidence.weight"}

    @classmethod
    def param_name(cls, ckpt_name: str) -> str:
        """`mtp.{s}.<rest>` -> our parameter name (model-level heads ignore s)."""
        _, s, rest = ckpt_name.split(".", 2)
        if rest in cls._MODEL_LEVEL:
            return cls._MODEL_LEVEL[rest]
        return f"stages.{s}.{rest}"

    def ckpt_names(self) -> dict:
        """our parameter name -> checkpoint name."""
        last = self.cfg.num_dspark_stages - 1
        out = {}
        for name, _ in list(self.named_parameters()) + list(self.named_buffers()):
            if name.startswith("stages."):
                _, s, rest = name.split(".", 2)
                out[name] = f"mtp.{s}.{rest}"
            else:
                rest = {v: k for k, v in self._MODEL_LEVEL.items()}[name]
                s = 0 if rest.startswith("main_") else last
                out[name] = f"mtp.{s}.{rest}"
        return out

    # context --------------------------------------------------------------------------
    def context_dtype(self):
        proj = self.main_proj     # nn.Linear, or a QuantLinear (raw fp8 `.weight`) in quantized mode
        return getattr(proj, "compute_dtype", proj.weight.dtype)

    def new_pool(self, num_slots: int, device) -> DraftContextPool:
        return DraftContextPool(self.cfg.num_dspark_stages, self.cfg.sliding_window,
                                self.stages[0].attn.head_dim, self.context_dtype(), device, num_slots)

    def commit_context(self, state: DraftState, taps: torch.Tensor, positions: torch.Tensor,
                       quant=None):
        """Write draft context rows for committed positions of one request from target taps
        [n, taps*D] (the runner batches many requests through `commit_rows` instead)."""
        if state.pool is None:
            state.pool = self.new_pool(1, taps.device)
        slot = state.take_slot()
        # the newest `capacity` rows only: more would collide in the ring inside one index_put
        taps, positions = taps[-state.capacity:], positions[-state.capacity:]
        top = int(positions.max()) + 1
        self.commit_rows(state.pool, torch.full_like(positions, slot), taps, positions, quant, top)
        state.length = max(state.length, top)

    def commit_rows(self, pool: DraftContextPool, slots: torch.Tensor, taps: torch.Tensor,
                    positions: torch.Tensor, quant=None, max_position: int | None = None):
        """Context rows for n committed positions of any requests at once: taps [n, taps*D],
        slots / positions [n] int64 on the pool's device. (slot, position % capacity) must be
        distinct over the n rows. max_position: a host-side bound (exclusive) on the positions,
        so RoPE needs no device read; None reads it from the device."""
        proj = self.main_proj
        main_x = self.main_norm(proj(taps.to(self.context_dtype())))
        with self.rope_bound(max_position, main_x.device):
            rows = context_rows(self, main_x, positions, quant)         # [n, stages, hd]
        pool.write(slots, positions % pool.capacity, rows, positions)

    def rope_bound(self, max_position: int | None, device):
        """Context in which the stages' RoPE trusts `max_position` instead of a device read."""
        stack = contextlib.ExitStack()
        if max_position is not None:
            for stage in self.stages:
                stack.enter_context(stage.attn.rope.bounded(max_position, device))
        return stack

    def ropes(self) -> list:
        return [stage.attn.rope for stage in self.stages]

    # block ------------------------------------------------------------------------------
    def block_hidden(self, embed: nn.Embedding, anchors: torch.Tensor, starts: list,
                     states: list, quant=None) -> torch.Tensor:
        """Pre-norm head hidden [R, γ, D] for blocks [anchor, noise...] at positions P_r + (0..γ-1)."""
        dev = anchors.device
        pools = {id(st.pool): st.pool for st in states if st.slot is not None}
        starts_t = torch.tensor(starts, dtype=torch.long, device=dev)
        if len(pools) <= 1:            # one shared pool (or no context at all): read in place
            pool = next(iter(pools.values())) if pools else self.new_pool(0, dev)
            slots = [st.slot if st.slot is not None else pool.EMPTY_SLOT for st in states]
            slots_t = torch.tensor(slots, device=pool.device)
            kv, pos = pool.kv, pool.pos
        else:                          # states with private pools: their rows gathered
            parts = [st.pool.gather(torch.tensor([st.slot], device=st.pool.device))
                     if st.slot is not None else self.new_pool(0, dev).gather(
                         torch.zeros(1, dtype=torch.long, device=dev)) for st in states]
            kv = [torch.cat([p[0][s] for p in parts]) for s in range(len(self.stages))]
            pos = torch.cat([p[1] for p in parts])
            slots_t = torch.arange(len(states), device=dev)
        return self.block_hidden_batched(embed, anchors, starts_t, slots_t, kv, pos, quant,
                                         max(starts) + self.gamma)

    def block_hidden_batched(self, embed: nn.Embedding, anchors: torch.Tensor, starts: torch.Tensor,
                             slots: torch.Tensor, ring_kv: list, ring_pos: torch.Tensor,
                             quant=None, max_position: int | None = None) -> torch.Tensor:
        """`block_hidden` from tensors only, for R requests at once with the same shapes whatever
        their positions: anchors / starts / slots [R] int64 (slot: the request's row of the
        rings), per stage the context rings ring_kv [slots, capacity, hd] and the positions
        their entries hold ring_pos [slots, capacity] (-1: empty): a `DraftContextPool`'s .kv
        and .pos (read in place, nothing gathered). max_position: host bound (exclusive) on
        starts + γ, so nothing is read back from the device (CUDA-graph capturable when every
        stage's MoE serves R·γ rows without a host sync, see `moe_graph_blocker`)."""
        R, g = anchors.shape[0], self.gamma
        offsets, first = self._block_constants(anchors.device)
        positions = (starts[:, None] + offsets).flatten()                       # [R*γ]
        ids = torch.where(first, anchors[:, None],
                          self.cfg.dspark_noise_token_id).flatten()             # [anchor, noise...]
        ctx = BlockContext(slots, starts, ring_kv, ring_pos, self.cfg.sliding_window, g)
        # each hc_post / hc_expand is told which collapse reads its streams next (the next
        # sub-block's `pre_hint`: the kernels then start and finish it in their own launch)
        hints = [stage.pre_hint("attn") for stage in self.stages] + [self.hc_head_fn]
        if type(embed) is nn.Embedding and embed.max_norm is None:
            # the embedding lookup, the n streams and the first collapse: one launch (kernels)
            X = hc_expand(embed.weight, self.cfg.hc_mult, hints[0], ids=ids)
        else:
            X = hc_expand(embed(ids), self.cfg.hc_mult, hints[0])
        with self.rope_bound(max_position, X.device):
            for s, stage in enumerate(self.stages):
                X = self._stage_forward(stage, X, ids, positions, ctx, s, quant, hints[s + 1])
        h = hc_head(X, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.cfg.hc_eps,
                    self.cfg.rms_norm_eps)
        return h.view(R, g, -1)

    def _block_constants(self, device):
        """(offsets 0..γ-1, offsets == 0) on `device`, made once (not per pass)."""
        cache = self.__dict__.setdefault("_block_consts", {})
        device = torch.device(device)
        if device not in cache:
            with torch.inference_mode(False):
                offsets = torch.arange(self.gamma, device=device)
                cache[device] = (offsets, offsets == 0)
        return cache[device]

    def _stage_forward(self, stage: Block, X, ids, positions, ctx, s: int, quant, next_fn=None):
        """Block.forward with batched block attention and the sync-free MoE."""
        x, post, comb = stage._pre(X, "attn")       # (x: attn_norm of the collapsed streams)
        o = block_attention(stage.attn, x, positions, ctx, s, quant)
        X = hc_post(o, X, post, comb, stage.pre_hint("ffn"))
        x, post, comb = stage._pre(X, "ffn")
        o = self._moe(stage.ffn, x, ids)
        return hc_post(o, X, post, comb, next_fn)

    # MoE --------------------------------------------------------------------------------
    def moe_graph_blocker(self, rows: int, device) -> str | None:
        """None when every stage's MoE runs `rows` tokens on `device` with no host sync (so a
        pass of that many MoE rows can be a CUDA graph), else why not (the first blocking
        stage). Dense small experts (`_moe`) serve any row count; packed FP4 experts (QuantMoE)
        serve it while rows x top-k fits their grouped kernels (`takes_grouped`); any other
        MoE routes its tokens on the host."""
        for s, stage in enumerate(self.stages):
            ffn = stage.ffn
            if self._dense_moe(ffn):
                continue
            takes_grouped = getattr(ffn, "takes_grouped", None)      # QuantMoE
            if takes_grouped is None:
                return f"stage {s} MoE ({type(ffn).__name__}) routes its tokens on the host"
            if takes_grouped(rows, device):
                continue
            if takes_grouped(1, device):
                pairs = rows * ffn.gate.topk
                return (f"stage {s} MoE: {rows} rows x top-{ffn.gate.topk} = {pairs} "
                        f"(token, expert) pairs exceed the grouped FP4 kernels' cap "
                        f"{ffn.grouped_max_pairs} (QuantMoE.grouped_max_pairs)")
            return (f"stage {s} MoE: packed FP4 experts on the per-expert loop (grouped kernels "
                    f"off or not on {torch.device(device).type})")
        return None

    def graphs_possible(self, device) -> bool:
        """Whether any pass can be a CUDA graph on `device`: the context write runs no MoE, and
        the draft pass needs every stage's MoE to serve at least one block of rows."""
        return self.moe_graph_blocker(self.gamma, device) is None

    @staticmethod
    def _dense_moe(ffn) -> bool:
        # decided once per module (after any tensor-parallel class swap, at first use)
        if getattr(ffn, "_draft_dense", None) is None:
            linears = [lin for e in ffn.experts for lin in (e.w1, e.w2, e.w3)] \
                if isinstance(ffn.experts, nn.ModuleList) else []
            ffn._draft_dense = (type(ffn) is MoE                 # not an expert-parallel shard
                                and all(type(lin) is nn.Linear for lin in linears)  # not quantized
                                and sum(lin.weight.nbytes for lin in linears) <= DENSE_MOE_MAX_BYTES)
        return ffn._draft_dense

    def _moe(self, ffn, x, token_ids):
        if not self._dense_moe(ffn):
            return ffn(x, token_ids)
        # Expert.forward for every expert at once, as two plain GEMMs over the experts' weights
        # laid side by side; the routing weight of an expert a token is not routed to is 0
        # (applied before w2, as the reference does). The shared expert (plain linears with the
        # routed experts' clamp) rides in the same GEMMs with weight 1: its output joins the
        # routed sum in w2's fp32 accumulator instead of in 4 GEMMs, 2 casts, an add and a cast
        # of its own.
        idx, w = ffn.gate(x, token_ids)
        E, T = len(ffn.experts), x.shape[0]
        w13, w2, shared = self._dense_expert_weights(ffn)
        y = F.linear(x, w13)                                       # [T, 2·N], N = E·I (+ shared)
        N = y.shape[1] // 2
        g, u, limit = y[:, :N], y[:, N:], ffn.experts[0].limit
        inter = ffn.experts[0].w1.out_features
        h = None
        if fused_backend(y, w):
            from dspark.kernels import decode_fused as K    # imports triton: only where it runs
            if K.swiglu_supported(g, u):
                # clamp, silu, ·u, ·routing weight (from the gate's pairs) and the cast: one
                # launch instead of 9
                h = K.swiglu(g, u, limit, w, experts=idx, group=inter, routed=E)   # [T, N]
        if h is None:
            route = torch.zeros(T, E, dtype=torch.float32, device=x.device).scatter_(1, idx, w)
            r = E * inter
            h = clamped_swiglu(g[:, :r].float().view(T, E, -1), u[:, :r].float().view(T, E, -1),
                               limit, route).flatten(1)
            if shared:
                h = torch.cat([h, clamped_swiglu(g[:, r:].float(), u[:, r:].float(), limit)], 1)
            h = h.to(x.dtype)
        out = F.linear(h, w2)
        # shared expert apart (not plain linears, or another clamp): x.dtype + x.dtype is the
        # fp32 sum rounded once, as the reference's fp32 accumulation
        return out if shared else out + ffn.shared_experts(x)

    @staticmethod
    def _dense_expert_weights(ffn):
        """(w13 [2·N, D]: every expert's w1 rows then every w3 row, w2 [D, N], shared): N = E·I
        routed columns, then (shared True) the shared expert's I_s, when its linears are plain
        and it clamps as the routed ones do. Built once and kept on the module while the expert
        weights are unchanged (same storage and version counter: `derived`), so a draft pass
        does not copy every expert per call."""
        se = ffn.shared_experts
        shared = (all(type(lin) is nn.Linear for lin in (se.w1, se.w2, se.w3))
                  and se.limit == ffn.experts[0].limit)
        experts = list(ffn.experts) + ([se] if shared else [])
        ws = [e.w1.weight for e in experts] + [e.w3.weight for e in experts] + \
            [e.w2.weight for e in experts]
        n = 2 * len(experts)
        w13, w2 = derived(ffn, "_draft_dense_w", ws,
                          lambda: (torch.cat(ws[:n]), torch.cat(ws[n:], dim=1)))
        return w13, w2, shared

    def base_logits(self, head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
        return linear_fp32(self.norm(hidden), head.weight)

    def markov_step(self, hidden_k: torch.Tensor, prev: torch.Tensor):
        """(Markov bias [R, V] fp32, confidence logit [R] fp32) for slot k given previous tokens."""
        # the rows first, then fp32: at V4-Flash width W1 and W2 ([129280, 256] each) are past
        # fp32()'s cache, and a cast of the whole table per step cost 1 ms of a 2.8 ms draft pass
        rows = self.markov_w1[prev]
        e = rows.float()
        # W2 in its own dtype, products exact, fp32 sums (the vocabulary head's skinny kernel on
        # CUDA: W2 is a [V, r] head)
        bias = linear_fp32(rows, self.markov_w2, head=True) if rows.shape[-1] else \
            rows.new_zeros(rows.shape[0], self.markov_w2.shape[0], dtype=torch.float32)
        conf = F.linear(torch.cat([hidden_k.float(), e], -1), fp32(self.confidence.weight))[:, 0]
        return bias, conf
