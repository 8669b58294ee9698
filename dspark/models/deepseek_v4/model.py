"""DeepSeek-V4 decoder (reference path): embedding -> mHC blocks -> hc_head -> norm -> head.

A forward takes a flattened ragged batch: several requests, each contributing a contiguous run
of new tokens at any absolute positions (a prefill chunk, one decode token, or a verify block).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .attention import Attention
from .mhc import NextPre, hc_expand, hc_head, hc_post, hc_pre
from .moe import MoE
from .norm import RMSNorm, linear_fp32
from .state import DenseState


@dataclass
class Segment:
    state: DenseState      # the request's cached state
    start: int             # absolute position of the first new token
    length: int            # number of new tokens
    offset: int = 0        # index of the first token on the flat token axis


@dataclass
class Batch:
    token_ids: torch.Tensor            # [T] int64
    positions: torch.Tensor            # [T] int64
    segments: list = field(default_factory=list)
    position_bound: int | None = None  # host int > every position (RoPE sizes its table from it)
    rope_memo: dict = field(default_factory=dict)   # RoPE rows of `positions`, this forward only

    @classmethod
    def build(cls, items, device) -> "Batch":
        """items: list of (state, start, token_ids list). Token ids and positions reach the
        device in one copy (pinned, non-blocking on CUDA)."""
        ids, pos, segs, off = [], [], [], 0
        for state, start, toks in items:
            ids.extend(toks)
            pos.extend(range(start, start + len(toks)))
            segs.append(Segment(state, start, len(toks), off))
            off += len(toks)
        device = torch.device(device)
        host = torch.tensor([ids, pos], dtype=torch.long, pin_memory=device.type == "cuda")
        both = host.to(device, non_blocking=True)
        return cls(both[0], both[1], segs, max(pos, default=-1) + 1)


class Block(nn.Module):
    def __init__(self, cfg, layer_id: int, ratio: int, hash_layer: bool):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        D, n = cfg.hidden_size, cfg.hc_mult
        self.attn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_id, ratio)
        self.ffn = MoE(cfg, hash_layer)
        rows = (2 + n) * n
        for sub in ("attn", "ffn"):
            self.register_parameter(f"hc_{sub}_fn", nn.Parameter(torch.zeros(rows, n * D)))
            self.register_parameter(f"hc_{sub}_base", nn.Parameter(torch.zeros(rows)))
            self.register_parameter(f"hc_{sub}_scale", nn.Parameter(torch.ones(3)))

    def _pre(self, X, sub):
        """(sub-block input: the sub-block's RMSNorm of the collapsed streams, post, comb), from
        the arguments `pre_hint` names (so hc_post's hint always matches this call)."""
        h = self.pre_hint(sub)
        return hc_pre(X, h.fn, h.base, h.scale, self.cfg.hc_mult, self.cfg.hc_sinkhorn_iters,
                      h.hc_eps, h.norm_eps, deferred=True,   # post / comb: hc_post only
                      norm=h.norm)

    def pre_hint(self, sub) -> NextPre:
        """What `_pre(X, sub)` calls hc_pre with: hc_post's hint (mhc.NextPre)."""
        c = self.cfg
        return NextPre(getattr(self, f"hc_{sub}_fn"), getattr(self, f"hc_{sub}_base"),
                       getattr(self, f"hc_{sub}_scale"), getattr(self, f"{sub}_norm"),
                       c.hc_eps, c.rms_norm_eps)

    def forward(self, X, batch, attn_fn=None, quant=None, next_fn=None):
        """X [T, n, D]. `attn_fn(attn_module, x, batch, layer_id)` overrides the attention core.
        next_fn: what reads this block's output next (the next block's `pre_hint("attn")` or
        the model's `head_hint()`; or just that mHC fn), a hint for the fused kernels
        (mhc.hc_post)."""
        x, post, comb = self._pre(X, "attn")
        o = (attn_fn or _dense_attention)(self.attn, x, batch, self.layer_id, quant)
        X = hc_post(o, X, post, comb, self.pre_hint("ffn"))
        x, post, comb = self._pre(X, "ffn")
        o = self.ffn(x, batch.token_ids)
        return hc_post(o, X, post, comb, next_fn)


def _dense_attention(attn, x, batch, layer_id, quant):
    return attn(x, batch, layer_id, quant)


class DeepseekV4Model(nn.Module):
    """Parameter names equal the official checkpoint names (no `model.` prefix)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        D, n = cfg.hidden_size, cfg.hc_mult
        self.embed = nn.Embedding(cfg.vocab_size, D)
        self.layers = nn.ModuleList(
            Block(cfg, i, cfg.compress_ratios[i], cfg.is_hash_layer(i))
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.head = nn.Linear(D, cfg.vocab_size, bias=False)
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * D))
        self.hc_head_base = nn.Parameter(torch.zeros(n))
        self.hc_head_scale = nn.Parameter(torch.ones(1))

    def new_state(self) -> DenseState:
        return DenseState(self.cfg.num_hidden_layers)

    def forward_hidden(self, batch: Batch, attn_fn=None, quant=None, tap_layers=()):
        """Returns (final residual streams X [T, n, D], taps [T, len(tap_layers)*D] or None).

        A tap is the completed residual stream after a layer, averaged over the hc axis.
        """
        hints = [layer.pre_hint("attn") for layer in self.layers] + [self.head_hint()]
        if type(self.embed) is nn.Embedding and self.embed.max_norm is None:
            # the embedding lookup, the n streams and the first collapse: one launch (kernels)
            X = hc_expand(self.embed.weight, self.cfg.hc_mult, hints[0], ids=batch.token_ids)
        else:
            X = hc_expand(self.embed(batch.token_ids), self.cfg.hc_mult, hints[0])
        taps = []
        for i, layer in enumerate(self.layers):
            X = layer(X, batch, attn_fn, quant, hints[i + 1])
            if layer.layer_id in tap_layers:
                taps.append((layer.layer_id, X.float().mean(1)))
        tap = None
        if tap_layers:
            by_id = dict(taps)
            tap = torch.cat([by_id[i] for i in tap_layers], dim=-1)
        return X, tap

    def head_hint(self) -> NextPre:
        """What `logits` calls hc_head with (`head_hidden`): the last hc_post's hint."""
        c = self.cfg
        return NextPre(self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.norm,
                       c.hc_eps, c.rms_norm_eps, head=True)

    def head_hidden(self, X, norm=None) -> torch.Tensor:
        """The final streams X [T, n, D] collapsed to [T, D] (with `norm`: its RMSNorm), with
        the arguments `head_hint` names."""
        h = self.head_hint()
        return hc_head(X, h.fn, h.base, h.scale, h.hc_eps, h.norm_eps, norm=norm)

    def logits(self, X, argmax_out: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [T, V] from final streams X [T, n, D] (in `out` when given), and with
        argmax_out (int64 [T]) their rows' argmax into it (norm.linear_fp32)."""
        return linear_fp32(self.head_hidden(X, norm=self.norm), self.head.weight, head=True,
                           argmax_out=argmax_out, out=out)

    def forward(self, batch: Batch, attn_fn=None, quant=None) -> torch.Tensor:
        X, _ = self.forward_hidden(batch, attn_fn, quant)
        return self.logits(X)
