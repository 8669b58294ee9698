"""DeepSpec DSpark drafter for Qwen3 targets (`Qwen3DSparkModel`, e.g. dspark_qwen3_4b_block7;
dspark.md §2).

Context (KV injection, §2.3): c_i = hidden_norm(fc(concat of target taps at position i)). Every
draft layer turns c_i into its own context key/value (k_proj -> k_norm -> RoPE at i; v_proj) once,
when position i is committed; context never passes through a layer's norms or MLP.
Block (§2.4): [anchor, mask x (γ-1)] at positions P..P+γ-1 through Qwen3 layers whose attention is
fully bidirectional over all committed context 0..P-1 plus the whole block (no causal mask, no
window), then the final norm: h_k (post-norm) -> base logits U_k = lm_head(h_k).
Sequential stage (§2.5-2.6): the Markov head adds a bias from the previous token (vanilla, gated,
or rnn with a state carried along the block); the confidence head scores slot k from
[h_k ; W1[x_{k-1}]] with its bias.

The drafter offers the same duck-typed API as the DeepSeek-V4 `DSparkDrafter`:
`gamma`, `new_state()`, `commit_context`, `block_hidden`, `base_logits`, `markov_step`, `param_name`
(per-request `DraftContext`s: the reference path). The engine uses the batched, tensor-only form
of the same computation: `new_pool`, `commit_rows`, `block_hidden_batched`, `markov_state` +
`head_step`, driven by `Qwen3DraftPass` (dspark_qwen3_pass.py, CUDA graphs on CUDA).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .qwen3 import (CheckpointError, ConfigError, KVState, Qwen3Config, Qwen3DecoderLayer, RMSNorm,
                    apply_rope, attend, check_tensors, load_qwen3, read_config, read_tensors,
                    rope_cos_sin, tensor_headers)

log = logging.getLogger(__name__)

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


@dataclass(frozen=True)
class DSparkQwen3Config(Qwen3Config):
    """The draft `config.json` is the target's config deep-copied and then overridden (§2.1):
    `num_hidden_layers` is the draft depth, `num_target_layers` the target's."""
    block_size: int = 7
    target_layer_ids: tuple = ()
    mask_token_id: int = 0
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    num_target_layers: int | None = None

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> "DSparkQwen3Config":
        if "dflash_config" in raw:
            raise ConfigError(f"{where}: a vllm-project/speculators export (dflash_config); only "
                              f"DeepSpec-format DSpark drafters (Qwen3DSparkModel) are supported")
        missing = [k for k in ("block_size", "target_layer_ids", "mask_token_id") if k not in raw]
        if missing:
            raise ConfigError(f"{where}: not a DeepSpec DSpark drafter config (missing {missing}; "
                              f"architectures={raw.get('architectures')})")
        kw = cls._base_kwargs(raw, where)
        rank = int(raw.get("markov_rank", 0))
        kind = str(raw.get("markov_head_type", "vanilla")).lower()
        conf = bool(raw.get("enable_confidence_head", False))
        kw.update(block_size=int(raw["block_size"]),
                  target_layer_ids=tuple(int(x) for x in raw["target_layer_ids"]),
                  mask_token_id=int(raw["mask_token_id"]), markov_rank=rank, markov_head_type=kind,
                  enable_confidence_head=conf,
                  confidence_head_with_markov=conf and bool(raw.get("confidence_head_with_markov", False)),
                  num_target_layers=raw.get("num_target_layers"))
        cfg = cls(**kw)
        cfg.validate(where)
        return cfg

    def validate(self, where: str = "config.json", target_layers: int | None = None):
        def bad(msg):
            raise ConfigError(f"{where}: {msg}")
        if self.block_size < 1:
            bad(f"block_size={self.block_size}: must be >= 1")
        if self.markov_rank < 0:
            bad(f"markov_rank={self.markov_rank}: must be >= 0 (0 = no Markov head, DFlash)")
        if self.markov_rank and self.markov_head_type not in MARKOV_HEAD_TYPES:
            bad(f"markov_head_type={self.markov_head_type!r}: expected one of {MARKOV_HEAD_TYPES}")
        if self.confidence_head_with_markov and not self.markov_rank:
            bad("confidence_head_with_markov needs a Markov head (markov_rank > 0)")
        # the mask row is inside the padded embedding table; never clamp it to the tokenizer (§8.17)
        if not 0 <= self.mask_token_id < self.vocab_size:
            bad(f"mask_token_id={self.mask_token_id} outside the vocabulary [0, {self.vocab_size})")
        ids, n = self.target_layer_ids, target_layers or self.num_target_layers
        if not ids:
            bad("target_layer_ids is empty")
        if any(b <= a for a, b in zip(ids, ids[1:])):
            bad(f"target_layer_ids={list(ids)} must be strictly increasing")
        if n is not None and any(not (i == -1 or 0 <= i < n) for i in ids):
            bad(f"target_layer_ids={list(ids)}: ids must be -1 (embeddings) or target layers in [0, {n})")


# ---- per-request context --------------------------------------------------------------------------

class DraftContext:
    """Draft context KV of one request: per draft layer, K (post k_norm + RoPE) and V at every
    committed position (full context, no window). Only target-verified rows are written, so
    rejection needs no rollback; a position is simply rewritten if it is committed again."""

    pool = None                       # not pooled (the runner's batched pass uses Qwen3DraftState)

    def __init__(self, num_layers: int):
        self.kv = KVState(num_layers)
        self.length = 0               # positions 0..length-1 have been written

    def write(self, layer: int, start: int, k, v):
        self.kv.write(layer, start, k, v)

    def rows(self, layer: int, P: int):
        if P > self.length:
            raise RuntimeError(f"draft context has a hole: positions {self.length}..{P - 1} were never "
                               f"committed but a block at {P} needs them (dspark.md §2.7)")
        if P == 0:
            return None, None
        return self.kv.read(layer, P)


# ---- heads ----------------------------------------------------------------------------------------

class MarkovHead(nn.Module):
    """W1 = markov_w1 (embedding lookup by token id), W2 = markov_w2 (Linear r -> V). Same shapes,
    different roles (§8.6). Gated adds gate_proj [r, H+r]; rnn adds joint_proj [3r, 2r+H]."""

    def __init__(self, vocab: int, rank: int, hidden: int, kind: str):
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def step(self, h, e, s):
        """(bias [R, V], new rnn state) for hidden h [R, H], e = W1[prev] [R, r], state s."""
        if self.kind == "vanilla":
            return self.markov_w2(e), s
        if self.kind == "gated":
            g = torch.sigmoid(self.gate_proj(torch.cat([h, e], -1)))
            return self.markov_w2(g * e), s
        g, c, o = self.joint_proj(torch.cat([s, e, h], -1)).chunk(3, -1)
        g = torch.sigmoid(g)
        return self.markov_w2(torch.tanh(o)), g * s + (1 - g) * torch.tanh(c)


class ConfidenceHead(nn.Module):
    def __init__(self, in_dim: int):
        super().__init__()
        self.proj = nn.Linear(in_dim, 1)      # DeepSpec keeps the default Linear bias (§8.7)


# ---- drafter --------------------------------------------------------------------------------------

class Qwen3DSparkDrafter(nn.Module):
    """Parameter names equal the DeepSpec checkpoint names (no `model.` prefix)."""

    def __init__(self, cfg: DSparkQwen3Config, own_embed: bool = False, own_head: bool = False,
                 confidence: bool | None = None):
        super().__init__()
        self.cfg, D = cfg, cfg.hidden_size
        self.gamma = cfg.block_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * D, D, bias=False)
        self.hidden_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        r = cfg.markov_rank
        self.markov_head = MarkovHead(cfg.vocab_size, r, D, cfg.markov_head_type) if r else None
        confidence = cfg.enable_confidence_head if confidence is None else confidence
        self.confidence_head = ConfidenceHead(D + (r if cfg.confidence_head_with_markov else 0)) \
            if confidence else None
        # the checkpoint's frozen copies of the target embedding / lm_head, kept only when they
        # differ from the target's (load_qwen3_pair aliases equal copies away)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, D) if own_embed else None
        self.lm_head = nn.Linear(D, cfg.vocab_size, bias=False) if own_head else None
        self._rnn = None              # (state [R, r], steps taken) of the block being sampled

    @staticmethod
    def param_name(ckpt_name: str) -> str:
        return ckpt_name              # parameter names are the checkpoint names

    def expected_tensors(self) -> dict:
        return {n: tuple(p.shape) for n, p in self.named_parameters()}

    def new_state(self) -> DraftContext:
        return DraftContext(self.cfg.num_hidden_layers)

    # context --------------------------------------------------------------------------------
    def commit_context(self, state: DraftContext, taps: torch.Tensor, positions: torch.Tensor,
                       quant=None):
        """Write context K/V of every draft layer for committed positions (contiguous) from the
        target taps [n, Lt*H]. `quant` is unused (no storage rounding for Qwen3)."""
        n = taps.shape[0]
        if n == 0:
            return
        start = int(positions[0])
        if not torch.equal(positions.cpu(), torch.arange(start, start + n)):
            raise ValueError("commit_context: positions must be contiguous and increasing")
        c = self.hidden_norm(self.fc(taps.to(self.fc.weight.dtype)))
        for j, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(c, positions)
            state.write(j, start, k, v)
        state.length = max(state.length, start + n)

    # block ----------------------------------------------------------------------------------
    def block_hidden(self, embed: nn.Embedding, anchors: torch.Tensor, starts: list, states: list,
                     quant=None) -> torch.Tensor:
        """Post-norm hidden [R, γ, H] for blocks [anchor, mask...] at positions P_r + (0..γ-1).
        Also starts a new block for the sequential stage (resets the rnn state)."""
        R, g, dev = anchors.shape[0], self.gamma, anchors.device
        ids = torch.full((R, g), self.cfg.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = anchors
        pos = (torch.as_tensor(starts, dtype=torch.long, device=dev)[:, None] +
               torch.arange(g, device=dev)).flatten()
        h = (self.embed_tokens or embed)(ids.flatten())

        def block_attention(j):
            def fn(attn, u):
                q, (k, v) = attn.project_q(u, pos), attn.project_kv(u, pos)
                out = torch.empty_like(q)
                for r, (st, P) in enumerate(zip(states, starts)):
                    sl = slice(r * g, (r + 1) * g)
                    ck, cv = st.rows(j, P)
                    K, V = (k[sl], v[sl]) if ck is None else (torch.cat([ck, k[sl]]), torch.cat([cv, v[sl]]))
                    out[sl] = attend(q[sl], K, V)          # no mask: bidirectional over ctx + block
                return attn.output(out)
            return fn

        for j, layer in enumerate(self.layers):
            h = layer(h, block_attention(j))
        if self.markov_head is not None and self.markov_head.kind == "rnn":
            self._rnn = (h.new_zeros(R, self.cfg.markov_rank, dtype=self.markov_head.markov_w1.weight.dtype), 0)
        return self.norm(h).view(R, g, -1)

    def base_logits(self, head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
        """U [R, γ, V] fp32 from the post-norm hidden (no further norm: Qwen3 hidden is post-norm)."""
        w = (self.lm_head or head).weight
        return F.linear(hidden.to(w.dtype), w).float()

    def markov_step(self, hidden_k: torch.Tensor, prev: torch.Tensor):
        """(Markov bias [R, V] fp32, confidence logit [R] fp32) for the next slot of the block
        started by the last `block_hidden`, given the previous tokens `prev` (the anchor first).

        The rnn head carries its state s across the γ calls of one block (s = 0 at every block);
        calls must therefore come in slot order, once per slot, after block_hidden. No confidence
        head -> +inf (survival 1: verify everything, as vLLM does for such checkpoints)."""
        R = prev.shape[0]
        s = None
        if self.markov_head is not None and self.markov_head.kind == "rnn":
            if self._rnn is None or self._rnn[0].shape[0] != R or self._rnn[1] >= self.gamma:
                raise RuntimeError("rnn Markov head: call block_hidden before the γ markov_step "
                                   "calls of a block (the state s is carried along the block)")
            s = self._rnn[0]
        bias, conf, s = self.head_step(hidden_k, prev, s)
        if s is not None:
            self._rnn = (s, self._rnn[1] + 1)
        return bias, conf

    def markov_state(self, R: int, like: torch.Tensor):
        """The sequential stage's state at the start of a block: zeros [R, r] for the rnn head,
        None otherwise."""
        mh = self.markov_head
        if mh is None or mh.kind != "rnn":
            return None
        return like.new_zeros(R, self.cfg.markov_rank, dtype=mh.markov_w1.weight.dtype)

    def head_step(self, hidden_k: torch.Tensor, prev: torch.Tensor, s):
        """`markov_step` with the rnn state passed explicitly: (bias [R, V] fp32, confidence
        logit [R] fp32, next state). Tensor ops only (the batched draft pass and its graphs)."""
        R = prev.shape[0]
        mh, ch = self.markov_head, self.confidence_head
        if mh is None:
            bias = torch.zeros(R, self.cfg.vocab_size, device=prev.device)
            e = None
        else:
            e = mh.markov_w1(prev)
            # the head runs in the weight dtype, as DeepSpec trained it; the bias is upcast
            b, s = mh.step(hidden_k.to(e.dtype), e, s)
            bias = b.float()
        if ch is None:
            conf = torch.full((R,), float("inf"), device=prev.device)
        else:
            x = hidden_k.float()
            if self.cfg.confidence_head_with_markov:
                x = torch.cat([x, e.float()], -1)
            conf = F.linear(x, ch.proj.weight.float(), ch.proj.bias.float())[:, 0]   # fp32 (§2.6)
        return bias, conf, s

    # pooled, batched (dspark_qwen3_pass.py) -------------------------------------------------
    def new_pool(self, num_slots: int, device=None):
        from .dspark_qwen3_pass import Qwen3DraftPool
        a = self.layers[0].self_attn
        w = self.fc.weight
        return Qwen3DraftPool(len(self.layers), a.nkv, a.head_dim, w.dtype,
                              w.device if device is None else device, num_slots)

    def ropes(self) -> tuple:
        return ()                     # RoPE is computed from the position tensors (no tables)

    def _rope(self, positions):
        a = self.layers[0].self_attn
        return rope_cos_sin(positions, a.head_dim, a.theta)

    def graphs_possible(self, device) -> bool:
        """The draft pass can be a CUDA graph: it has no data-dependent shapes (dense MLPs)."""
        return True

    def commit_rows(self, pool, slots: torch.Tensor, taps: torch.Tensor, positions: torch.Tensor):
        """Context K/V of every draft layer for rows (slots[i], positions[i]) from taps [n, Lt*H],
        all requests at once. (slot, position) pairs must be distinct; pool rows must exist."""
        c = self.hidden_norm(self.fc(taps.to(self.fc.weight.dtype)))
        cos, sin = self._rope(positions)            # once for all layers
        for j, layer in enumerate(self.layers):
            k, v = _project_kv(layer.self_attn, c, cos, sin)
            pool.k[j][slots, positions] = k.to(pool.dtype)
            pool.v[j][slots, positions] = v.to(pool.dtype)

    def block_hidden_batched(self, embed: nn.Embedding, anchors: torch.Tensor, starts: torch.Tensor,
                             slots: torch.Tensor, pool, ctx_len: int) -> torch.Tensor:
        """`block_hidden` for R requests from device tensors: anchors / starts / pool slots [R];
        each block attends over its slot's pool rows 0..ctx_len-1 masked to positions < start
        (ctx_len >= every start) plus the whole block. Post-norm hidden [R, γ, H]."""
        R, g, dev = anchors.shape[0], self.gamma, anchors.device
        ar = torch.arange(g, device=dev)
        ids = torch.where(ar[None] == 0, anchors[:, None], self.cfg.mask_token_id)
        pos = (starts[:, None] + ar).flatten()
        h = (self.embed_tokens or embed)(ids.flatten())
        visible = torch.cat([torch.arange(ctx_len, device=dev)[None] < starts[:, None],
                             torch.ones(R, g, dtype=torch.bool, device=dev)], 1)[:, None, None]

        cos, sin = self._rope(pos)                  # once for all layers

        def block_attention(j):
            def fn(attn, u):
                q = apply_rope(attn.q_norm(attn.q_proj(u).view(-1, attn.nq, attn.head_dim)), cos, sin)
                k, v = _project_kv(attn, u, cos, sin)
                ck = pool.k[j][:, :ctx_len].index_select(0, slots).to(k.dtype)
                cv = pool.v[j][:, :ctx_len].index_select(0, slots).to(v.dtype)
                K, V = (_gqa(torch.cat([c, x.view(R, g, *x.shape[1:])], 1), attn.nq)
                        for c, x in ((ck, k), (cv, v)))
                Q = q.view(R, g, *q.shape[1:]).transpose(1, 2)
                o = F.scaled_dot_product_attention(Q, K, V, attn_mask=visible)
                return attn.output(o.transpose(1, 2).reshape(R * g, *q.shape[1:]))
            return fn

        for j, layer in enumerate(self.layers):
            h = layer(h, block_attention(j))
        return self.norm(h).view(R, g, -1)


def _gqa(x, heads: int):
    """[R, S, Hkv, d] -> [R, heads, S, d], query head h reading kv head h // (heads / Hkv): what
    SDPA's enable_gqa does, spelled out so that every SDPA backend (and torch version) takes it."""
    R, S, Hkv, d = x.shape
    x = x.transpose(1, 2)
    return x[:, :, None].expand(R, Hkv, heads // Hkv, S, d).reshape(R, heads, S, d)


def _project_kv(attn, x, cos, sin):
    """`Qwen3Attention.project_kv` with the RoPE tables given (shared by the draft layers)."""
    k = apply_rope(attn.k_norm(attn.k_proj(x).view(-1, attn.nkv, attn.head_dim)), cos, sin)
    return k, attn.v_proj(x).view(-1, attn.nkv, attn.head_dim)


# ---- loading --------------------------------------------------------------------------------------

def load_qwen3_pair(target_path: str, draft_path: str, dtype=torch.float32, device="cpu"):
    """(target Qwen3Model, Qwen3DSparkDrafter, target cfg) with strict name/shape checks.

    The target cfg carries `dspark_block_size` / `dspark_target_layer_ids` from the drafter (the
    runner taps those layers). The drafter's embed_tokens / lm_head copies, when present, are
    checked against the target's and aliased away when equal (saves 2 x V x H)."""
    tcfg = Qwen3Config.from_path(target_path)
    dcfg = DSparkQwen3Config.from_dict(read_config(draft_path), f"{draft_path}/config.json")
    where = f"{draft_path}: drafter does not fit target {target_path}"
    if dcfg.num_target_layers is not None and dcfg.num_target_layers != tcfg.num_hidden_layers:
        raise ConfigError(f"{where}: num_target_layers={dcfg.num_target_layers} but the target has "
                          f"{tcfg.num_hidden_layers} layers")
    dcfg.validate(f"{draft_path}/config.json", target_layers=tcfg.num_hidden_layers)
    for key in ("hidden_size", "vocab_size"):
        if getattr(dcfg, key) != getattr(tcfg, key):
            raise ConfigError(f"{where}: {key} {getattr(dcfg, key)} != target {getattr(tcfg, key)}")

    found = tensor_headers(draft_path)
    has_conf = any(n.startswith("confidence_head.") for n in found)
    if dcfg.enable_confidence_head and not has_conf:
        log.warning("%s: enable_confidence_head but no confidence_head.* tensors; confidence "
                    "scheduling is disabled for this drafter (every draft is verified)", draft_path)
    with torch.device("meta"):
        drafter = Qwen3DSparkDrafter(dcfg, "embed_tokens.weight" in found, "lm_head.weight" in found,
                                     confidence=dcfg.enable_confidence_head and has_conf)
    expected = drafter.expected_tensors()
    check_tensors(draft_path, found, expected, optional=("confidence_head.proj.bias",))

    target = load_qwen3(target_path, dtype, device, tcfg)
    weights = read_tensors(draft_path, found, expected.keys() & found.keys(), dtype, device)
    if drafter.confidence_head is not None and "confidence_head.proj.bias" not in weights:
        weights["confidence_head.proj.bias"] = torch.zeros(1, dtype=dtype, device=device)
    for name, mine in (("embed_tokens.weight", target.embed.weight), ("lm_head.weight", target.head.weight)):
        if name in weights:
            if torch.equal(weights[name], mine):
                del weights[name]
                setattr(drafter, name.split(".")[0], None)
            else:
                log.warning("%s: %s differs from the target's; the drafter uses its own copy",
                            draft_path, name)
    drafter.load_state_dict(weights, strict=True, assign=True)
    cfg = tcfg.replace(dspark_block_size=dcfg.block_size, dspark_target_layer_ids=dcfg.target_layer_ids)
    target.cfg = cfg
    return target, drafter.eval(), cfg


__all__ = ["DSparkQwen3Config", "Qwen3DSparkDrafter", "DraftContext", "MarkovHead", "load_qwen3_pair",
           "CheckpointError", "ConfigError"]
