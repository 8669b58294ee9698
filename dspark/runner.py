"""Model runner: turns scheduled work into target / drafter forwards on one device.

The target forward takes a flattened ragged batch (prefill chunks, decode tokens and verify
blocks of many requests together) and returns logits for the rows the caller needs plus the
hc-mean taps the drafter's context is built from. The draft pass runs the parallel block for all
requests at once, then the Markov head left to right.

DeepSeek-V4 drafter: every request's draft context lives in one `DraftContextPool`; the context
rows committed during a step are written for all requests at once by the next `draft()`, and the
draft pass is one fixed-shape `DraftPass` (a CUDA graph per batch-size bucket when enabled).
"""
from __future__ import annotations

import contextlib

import torch

from .cuda.transfer import to_device
from .draft_pass import DraftPass
from .kernels.invariant_mode import choices, products
from .models.deepseek_v4.model import Batch, DeepseekV4Model
from .models.drafter import DraftState, DSparkDrafter
from .compile_stats import target_fallback_reason
from .request import DraftBatch, DraftBlock, token_list

# deterministic mode on the graph path: prompt chunks are fed as uniform steps of this many tokens
# per request (the last piece shorter)
DETERMINISTIC_PIECE = 8


class QuantSim:
    """Reproduces the reference's storage rounding in the dense reference path: FP8 (UE8M0 64-tile)
    on the 448 NoPE dims of every cached 512-d kv, Hadamard + FP4 on indexer queries and keys.
    The paged fp8_ds_mla cache applies the same rounding by storing the real records."""

    def kv(self, x):
        """fp8_ds_mla_roundtrip(x) bit for bit, without building the record bytes: about half
        the ops (the drafter runs it three times per draft pass and per context write)."""
        if x.is_cuda and x.shape[-1] == 512:
            # one Triton launch instead of ~30 small kernels (the draft graph runs this a few
            # times per round); bit-identical (tests/test_kernels.py)
            from .kernels.cache_write import fp8_ds_mla_roundtrip_triton
            return fp8_ds_mla_roundtrip_triton(x)
        from .formats.layouts import (FP8_AMAX_FLOOR, FP8_MAX, HEAD_DIM, NOPE_DIM, TILE,
                                      _ceil_log2, _pow2)
        xb = x.reshape(-1, HEAD_DIM).to(torch.bfloat16).float()   # records hold bf16 activations
        tiles = xb[:, :NOPE_DIM].unflatten(-1, (-1, TILE))
        amax = tiles.abs().amax(dim=-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR)
        scale = _pow2(_ceil_log2(amax / FP8_MAX))                  # UE8M0: a power of two
        q = (tiles / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
        return torch.cat([q.flatten(-2), xb[:, NOPE_DIM:]], -1).to(x.dtype).reshape(x.shape)

    def indexer(self, x):
        from .formats.layouts import fp4_roundtrip, hadamard128
        return fp4_roundtrip(hadamard128(x.float()))


def _fp4_moe_routes_on_host(model) -> bool:
    """A QuantMoE without the grouped small-batch kernels loops over experts on the host."""
    from .models.qlinear import QuantMoE
    return any(isinstance(m, QuantMoE) and not m.grouped_max_pairs for m in model.modules())


def _q(req, probs, i):
    """Request i's draft distributions [γ, V], or None: greedy requests keep none (q is the point
    mass on the token), nor does the Gumbel-max draft pass (its drafts are checked by token)."""
    return None if req.params.greedy or probs is None else probs[i]


def _blocks(reqs, toks, probs, confs) -> list:
    """The requests' blocks as rows of one DraftBatch (no per-request tensor op); greedy
    requests keep no distribution (_q)."""
    return DraftBlock.of_batch(DraftBatch(toks, probs, confs), [r.params.greedy for r in reqs])


class ModelRunner:
    def __init__(self, model, drafter=None, device="cpu", quant: QuantSim | None = None,
                 backend=None, cuda_graphs: bool = False, max_num_seqs: int = 8,
                 target_graphs: bool = False, deterministic: bool = False):
        self.model, self.drafter, self.device, self.quant = model, drafter, torch.device(device), quant
        self.max_num_seqs = max_num_seqs
        # deterministic mode (EngineConfig.deterministic): with the target's graphs every forward
        # is a series of uniform graph steps built with batch-invariant kernels
        # (`_invariant_forward`); without them (CPU) it runs one token at a time and the drafter
        # one request (one context row) at a time, so no computation ever sees another row
        self.deterministic = deterministic
        # paged attention (dspark.attention backend over a PagedKVCache) or None: dense states
        self.backend = backend
        self.tap_layers = tuple(model.cfg.dspark_target_layer_ids) if drafter is not None else ()
        self.draft_pool = self.draft_pass = None
        self._pending_context = []          # (draft_state, taps, start) awaiting flush_context
        if isinstance(drafter, DSparkDrafter):
            # with graphs, room for every sequence up front (growing reallocates the pool and
            # recaptures); without, start small and double on demand
            slots = max_num_seqs if cuda_graphs else min(max_num_seqs, 8)
            self.draft_pool = drafter.new_pool(slots, drafter.main_proj.weight.device)
            self.draft_pass = DraftPass(drafter, model.embed, model.head, self.draft_pool,
                                        cuda_graphs, gumbel=deterministic)
        # on by default on CUDA (Engine(target_cuda_graphs=None)): the V4 target's decode /
        # equal-length verify steps as CUDA graphs (fixed-shape plan,
        # dspark/models/deepseek_v4/graph.py), captured lazily per (batch, q, pages) bucket with
        # the Triton kernels; prefill and mixed-length steps run eagerly. Packed FP4 experts only
        # with the grouped small-batch kernels (QuantMoE.grouped_max_pairs > 0, the default): the
        # per-expert loop routes on the host.
        self.target_graphs = None
        if (target_graphs and self.device.type == "cuda" and backend is not None
                and getattr(backend, "name", "") in ("triton", "flashmla")
                and isinstance(model, DeepseekV4Model) and not _fp4_moe_routes_on_host(model)):
            from .models.deepseek_v4.graph import V4DecodeGraphs
            gamma = getattr(drafter, "gamma", 0) if drafter is not None else 0
            # deterministic mode: prompts too are fed as uniform steps, in pieces of up to
            # DETERMINISTIC_PIECE tokens (the cache keeps that many ring rows of lookahead)
            width = max(gamma + 1, DETERMINISTIC_PIECE) if deterministic else gamma + 1
            self.target_graphs = V4DecodeGraphs(model, backend.cache, "triton",
                                                q_lens=range(1, width + 1), max_batch=max_num_seqs,
                                                tap_layers=self.tap_layers)
        if deterministic and target_graphs and self.target_graphs is None:
            raise ValueError("deterministic=True with target graphs needs the DeepSeek-V4 target "
                             "on CUDA with the Triton attention backend and graph-capturable "
                             "experts; set target_cuda_graphs=False (one-token eager forwards)")
        # the token-serial reference: deterministic without target graphs
        self.token_serial = deterministic and self.target_graphs is None

        # the engine pads every verify block of a round to one width where uniform steps replay
        # as graphs (Engine._verify_lengths): a ragged step would run eagerly
        self.uniform_verify = self.target_graphs is not None

    def capture_graphs(self, q_lens, max_position: int, progress: bool = False) -> dict:
        """Capture ahead of traffic every CUDA graph a round can replay: the target's (batch,
        q, page) buckets for q in `q_lens`, the draft pass of every batch bucket and the
        context writes (RoPE bound `max_position`). {"target": n, "draft": n} graphs held."""
        out = {"target": 0, "draft": 0}
        with self._kernels():
            if self.target_graphs is not None:
                out["target"] = self.target_graphs.capture_all(q_lens, progress)
            if self.draft_pass is not None:
                width = len(self.tap_layers) * self.model.cfg.hidden_size
                # taps are fp32 (hc-mean of the streams) in the graph and the eager forward alike
                out["draft"] = self.draft_pass.capture_all(self.max_num_seqs, max_position,
                                                           width, (torch.float32,), self.quant,
                                                           progress)
        return out

    def _kernels(self):
        """The kernel choices of this runner's launches: batch-invariant in deterministic mode
        on the graph path (dspark/kernels/invariant.py), else the fastest per shape. aten's
        products are routed where a step is captured or runs eagerly (`invariant.products()`
        in the graph owners), not around replays."""
        if self.deterministic and self.target_graphs is not None:
            return choices()
        return contextlib.nullcontext()

    @property
    def takes_device_tokens(self) -> bool:
        """Verify items may carry BlockTokens (drafts left on the device): the target graphs
        copy them into their input buffer on the device; other steps read them here."""
        return self.target_graphs is not None

    @property
    def backend_name(self) -> str:
        return getattr(self.backend, "name", "paged") if self.backend is not None else "dense-reference"

    def new_states(self):
        ds = DraftState(self.model.cfg.num_dspark_stages, self.model.cfg.sliding_window,
                        self.draft_pool) if self.drafter is not None else None
        return self.model.new_state(), ds

    @torch.inference_mode()
    def target_forward(self, items, logit_rows=None, snapshot: bool = True):
        """items: list of (target_state, start, token list); with a paged backend the state is
        the request id registered in backend.cache. Returns (logits fp32 [N, V] for the flat
        rows in `logit_rows` (all rows when None), taps [T, taps*D] or None). snapshot=False:
        the logits and taps may be views of the target graphs' output buffers, valid until the
        next forward is queued (StepGraphs.run; queued context rows are flushed before it)."""
        self.flush_context()        # leftovers of a step that drafted nothing
        if self.deterministic:
            if self.token_serial:
                items = [(st, start, token_list(toks)) for st, start, toks in items]
                return self._token_serial_forward(items, logit_rows)
            with self._kernels():
                return self._invariant_forward(items, logit_rows)
        if self.target_graphs is not None:
            out = self.target_graphs.run(items, snapshot)  # None: not a fixed-shape step
            if out is not None:
                logits, taps = out                     # every row, request-major (= flat order)
                if logit_rows is not None:
                    logits = logits[torch.as_tensor(logit_rows, dtype=torch.long,
                                                    device=logits.device)]
                return logits, taps
        items = [(st, start, token_list(toks)) for st, start, toks in items]
        return self._forward(items, logit_rows)

    def _forward(self, items, logit_rows):
        with products():                       # (aten's products routed in the mode)
            return self._eager_forward(items, logit_rows)

    def _eager_forward(self, items, logit_rows):
        batch = Batch.build(items, self.device)
        attn_fn = self.backend.forward_fn(batch) if self.backend is not None else None
        X, taps = self.model.forward_hidden(batch, attn_fn=attn_fn, quant=self.quant,
                                            tap_layers=self.tap_layers)
        if logit_rows is not None:
            rows = list(logit_rows) if not isinstance(logit_rows, torch.Tensor) else None
            if rows and rows == list(range(rows[0], rows[0] + len(rows))) and rows[0] >= 0:
                X = X[rows[0]:rows[0] + len(rows)]       # a contiguous run: a view, no copy
            else:
                X = X[torch.as_tensor(logit_rows, dtype=torch.long, device=self.device)]
        return self.model.logits(X), taps

    def _invariant_forward(self, items, logit_rows):
        """The deterministic forward on the graph path: every request's tokens in pieces of at
        most `qmax` in position order (piece k of every request in step k, one uniform graph step
        per piece length), each step built with batch-invariant kernels. A row then computes the
        same whatever else its step carries, so its logits, taps and cache records are a function
        of its request's tokens alone, as with one-token forwards, without their cost."""
        g = self.target_graphs
        if not items:
            return self._forward(items, logit_rows)
        for st, start, toks in items:     # check every request before any step changes one
            g.cache.check_forward(st, start, start + len(toks))
        lengths = {len(toks) for _, _, toks in items}
        if len(lengths) == 1 and max(lengths) <= g.qmax:
            # one uniform step already (a decode or verify round): its rows are the flat rows
            return self._invariant_step(items, logit_rows)
        pieces, first = [], 0             # per item: [(start, tokens, first flat row)]
        for st, start, toks in items:
            n = len(toks)
            if n <= g.qmax:
                pieces.append([(start, toks, first)])
            else:
                toks = token_list(toks)
                pieces.append([(start + i, toks[i:i + g.qmax], first + i)
                               for i in range(0, n, g.qmax)])
            first += n
        rows = (torch.arange(first) if logit_rows is None
                else torch.as_tensor(logit_rows).long().cpu())
        in_step = torch.full((first,), -1, dtype=torch.long)    # flat row -> row of a step
        logits = taps = None
        for k in range(max(len(p) for p in pieces)):
            by_len: dict = {}
            for st, per in zip((it[0] for it in items), pieces):
                if k < len(per):
                    by_len.setdefault(len(per[k][1]), []).append((st, *per[k]))
            for group in by_len.values():
                step = [(st, start, toks) for st, start, toks, _ in group]
                lg, tp = self._invariant_step(step, None)
                q = len(group[0][2])
                flat = torch.cat([torch.arange(f, f + q) for _, _, _, f in group])
                in_step.fill_(-1)
                in_step[flat] = torch.arange(len(flat))
                src = in_step[rows]                          # (a row asked twice: both get it)
                dst = (src >= 0).nonzero().flatten()
                if logits is None:
                    logits = lg.new_empty(len(rows), lg.shape[1])
                    if tp is not None:
                        taps = tp.new_empty(first, tp.shape[1])
                if dst.numel():
                    logits[dst.to(lg.device)] = lg[src[dst].to(lg.device)]
                if tp is not None:
                    taps[flat.to(tp.device)] = tp
        return logits, taps

    def _invariant_step(self, items, logit_rows):
        """`_invariant_forward` of items that are one uniform graph step (logits and taps may
        view the graphs' output buffers)."""
        out = self.target_graphs.run(items, snapshot=False)
        if out is None:
            raise RuntimeError(
                f"deterministic mode: a step of {len(items)} requests x {len(items[0][2])} "
                f"tokens did not fit the target graphs "
                f"({target_fallback_reason(items, self.target_graphs)}); an eager forward would "
                f"break the batch invariance")
        logits, taps = out
        if logit_rows is not None:
            logits = logits[torch.as_tensor(logit_rows, dtype=torch.long, device=logits.device)]
        return logits, taps

    def _token_serial_forward(self, items, logit_rows):
        """The deterministic forward: the flat batch as one-token forwards, each request's tokens
        in position order (its cache then holds the earlier ones). Every kernel sees one token
        of one request, so each row's logits, taps and cache records are a function of that
        request's tokens alone: the same in any batch, chunking, verify block or decode step."""
        logits, taps = [], []
        for st, start, toks in items:
            for i, tok in enumerate(toks):
                lg, tp = self._forward([(st, start + i, [tok])], None)
                logits.append(lg)
                if tp is not None:
                    taps.append(tp)
        logits = torch.cat(logits)
        if logit_rows is not None:
            logits = logits[torch.as_tensor(logit_rows, dtype=torch.long, device=logits.device)]
        return logits, torch.cat(taps) if taps else None

    @torch.inference_mode()
    def commit_context(self, draft_state, taps, start: int):
        """Draft context rows for committed positions start..start+len(taps)-1. With the pooled
        DeepSeek-V4 context they are queued (taps kept by reference) and written for every
        request at once by the next `flush_context` (called by `draft` and `target_forward`)."""
        n = taps.shape[0]
        if self.draft_pool is None or draft_state.pool is not self.draft_pool:
            pos = torch.arange(start, start + n, device=self.device)
            self.drafter.commit_context(draft_state, taps, pos, self.quant)
            return
        if n:
            draft_state.length = max(draft_state.length, start + n)
            self._pending_context.append((draft_state, taps, start))

    @torch.inference_mode()
    def flush_context(self):
        """Write all queued context rows with one batched projection per stage (a CUDA graph
        replay when graphs are on)."""
        if not self._pending_context:
            return
        pending, self._pending_context = self._pending_context, []
        cap = self.draft_pool.capacity
        end = {}                          # per state: end of its newest queued row
        for st, taps, start in pending:
            end[id(st)] = max(end.get(id(st), 0), start + taps.shape[0])
        rows, slots, positions = [], [], []
        for st, taps, start in pending:
            # rows `capacity` or more behind the state's newest row share ring entries with
            # newer ones and are never read again; two writes to one entry in one index_put
            # would leave either value
            lo = max(start, end[id(st)] - cap)
            hi = start + taps.shape[0]
            if lo < hi:
                rows.append(taps[lo - start:].to(self.draft_pool.device))
                slots += [st.take_slot()] * (hi - lo)
                positions += range(lo, hi)
        if self.token_serial:        # one row per write: a row's projection sees no other row
            flat = torch.cat(rows)
            for i, (slot, pos) in enumerate(zip(slots, positions)):
                self.draft_pass.write_context([slot], [pos], [flat[i:i + 1]], self.quant)
            return
        with self._kernels():
            self.draft_pass.write_context(slots, positions, rows, self.quant)

    @torch.inference_mode()
    def draft(self, reqs) -> list:
        """One DSpark block per request: parallel backbone, then Markov sampling left to right.
        Keeps the exact distributions each draft token was sampled from (q) and the confidences."""
        if not reqs:
            return []
        if self.draft_pass is not None:
            self.flush_context()
            if self.token_serial:     # one request per pass: its drafts depend on it alone
                parts = [self.draft_pass([r], self.quant) for r in reqs]
                return [DraftBlock(t[0], _q(r, q, 0), c[0])
                        for r, (t, q, c) in zip(reqs, parts)]
            with self._kernels():
                return _blocks(reqs, *self.draft_pass(reqs, self.quant))
        raise TypeError(f"{type(self.drafter).__name__} has no batched draft pass: drafters must "
                        "come with one (dspark/draft_pass.py, dspark/models/dspark_qwen3_pass.py)")

    @property
    def drafts_ahead(self) -> bool:
        """Whether `draft_ahead` can draft a round's next blocks from its device-side acceptance
        (the pooled DeepSeek-V4 draft pass; not in the token-serial reference, whose drafts run
        one request at a time)."""
        return type(self.draft_pass) is DraftPass and self.draft_pool is not None \
            and not self.token_serial

    @torch.inference_mode()
    def draft_ahead(self, reqs, accepted, next_tokens, taps, first_rows, anchor_pos,
                    verified) -> list:
        """The next DSpark block of every request of a round, queued before the host reads the
        round's acceptance: accepted a / next token y [R] are device tensors. For the `verified`
        requests (host bools) the context rows of the anchor and its accepted drafts are written
        first: rows f..f+γ of the forward's taps at positions P..P+γ (f = first_rows, P =
        anchor_pos, clamped to the request's block of 1 + feed_len rows), those past a going to the
        scratch slot. The next block is drafted at anchor y, position P + a + 1. Requests that
        turn out to finish have drafted for nothing; their rows are dropped by the caller."""
        with self._kernels():
            return self._draft_ahead(reqs, accepted, next_tokens, taps, first_rows, anchor_pos,
                                     verified)

    def _draft_ahead(self, reqs, accepted, next_tokens, taps, first_rows, anchor_pos, verified):
        g, dp = self.drafter.gamma, self.draft_pass
        self.flush_context()               # prompt chunks of this round (host-known rows)
        dev = accepted.device
        pick = [i for i, v in enumerate(verified) if v]
        if pick:
            slots, positions, rows = [], [], []
            for i in pick:
                slots += [reqs[i].draft_state.take_slot()] * (g + 1)   # its length: _commit
                positions += range(anchor_pos[i], anchor_pos[i] + g + 1)
                last = reqs[i].feed_len if reqs[i].draft is not None else 0   # block's last row
                rows += [first_rows[i] + min(k, last) for k in range(g + 1)]
            n, m = len(rows), len(pick)
            # host lists go up in one pinned, asynchronous copy (a plain copy would wait for the
            # round still running on the device): taps rows, offsets k, picked requests, P + 1
            idx = to_device(rows + list(range(g + 1)) * m + pick + [p + 1 for p in anchor_pos],
                            torch.long, dev)
            a = accepted if m == len(reqs) else accepted[idx[2 * n:2 * n + m]]
            drop = (idx[n:2 * n].view(m, g + 1) > a[:, None]).view(-1)
            dp.write_context(slots, positions, [taps], self.quant, drop=drop, rows=idx[:n])
            after_anchor = idx[2 * n + m:]
        else:
            after_anchor = to_device([p + 1 for p in anchor_pos], torch.long, dev)
        top = max(anchor_pos) + g + 1
        return _blocks(reqs, *dp(reqs, self.quant, on_device=(next_tokens, (after_anchor, accepted),
                                                             top)))

    def draft_blocks_for_profile(self, states, start: int):
        """Draft pass for len(states) synthetic requests anchored at `start` (SPS profiling)."""
        from types import SimpleNamespace
        from .sampling import SamplingParams
        reqs = [SimpleNamespace(anchor=1, num_committed=start, draft_state=ds,
                                params=SamplingParams(temperature=1.0), seed=i)
                for i, (_, ds) in enumerate(states)]
        return self.draft(reqs)
