"""The attention sub-block of the drafter stages over a batch of draft blocks (dspark.md §3):
R requests' γ queries each, non-causal over the request's context ring ∪ its whole block; and
the stages' context rows (`context_rows`: every stage's window kv of committed positions).

`block_attention` runs one stage's: the q / kv projections (wq_a and wkv as one GEMM), the
attention with sink, the inverse RoPE, the grouped output projection. With the fused kernels
(norm.fused_backend: CUDA) the attention is `kernels.draft_attention` (one launch per stage
reading the pool's ring in place, its mask made from the positions the ring entries hold, the
inverse RoPE in the same launch); else the torch composition: the rings gathered by slot, the
mask built once per round (`BlockContext.mask`), `attention_with_sink_batched`, `norm_rope`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .deepseek_v4.attention import Attention
from .deepseek_v4.fused import norm_rope
from .deepseek_v4.norm import RMSNorm, derived, fp32, fused_backend, fused_kernels

# the grouped wo_a as one GEMM over its block-diagonal weight up to this many bytes (the
# einsum's batched GEMM leaves [groups, T, r] to reorder: a copy launch); larger stays grouped
BLOCK_DIAG_MAX_BYTES = 4 << 20


class BlockContext:
    """What every stage's attention of one draft pass reads: the requests' ring slots and block
    positions (starts) [R], per stage the rings [slots, capacity, hd] and the positions their
    entries hold [slots, capacity], the window W and γ. The torch path's gathered positions and
    mask are made at the first stage that needs them and shared by the others."""

    def __init__(self, slots, starts, ring_kv: list, ring_pos, window: int, gamma: int):
        self.slots, self.starts, self.ring_kv, self.ring_pos = slots, starts, ring_kv, ring_pos
        self.window, self.gamma = window, gamma
        self._mask = None

    def mask(self) -> torch.Tensor:
        """bool [R, capacity + γ]: a query block at P sees the ring entries holding positions
        max(0, P-W)..P-1 (older rows and -1 = never written are masked out) and its whole block
        (non-causal)."""
        if self._mask is None:
            pos, P = self.ring_pos[self.slots], self.starts[:, None]
            visible = (pos >= 0) & (pos >= P - self.window) & (pos < P)
            self._mask = torch.cat([visible, visible.new_ones(visible.shape[0], self.gamma)], 1)
        return self._mask


def attention_with_sink_batched(q, keys, mask, sink, scale):
    """`sparse_attention_with_sink` for R requests at once, each with its own keys.

    q [R, L, H, d], keys [R, N, d] (K = V), mask [R, N] bool (the same for the L queries of a
    request: block attention is non-causal), sink [H]. Returns fp32 [R, L, H, d]."""
    keys = keys.float()                                    # one cast for both products
    logits = torch.einsum("rlhd,rnd->rlhn", q.float(), keys) * scale
    logits = logits.masked_fill(~mask[:, None, None, :], float("-inf"))
    R, L, H, _ = q.shape
    sink_col = sink.float()[None, None, :, None].expand(R, L, H, 1)
    probs = torch.softmax(torch.cat([logits, sink_col], -1), dim=-1)[..., :-1]
    return torch.einsum("rlhn,rnd->rlhd", probs, keys)


def block_attention(attn, x, positions, ctx: BlockContext, s: int, quant):
    """Stage s's attention output [R·γ, D] for its input x [R·γ, D] at positions [R·γ]."""
    q, kv = _project(attn, x, positions, quant)                 # [R·γ, H, hd], [R·γ, hd]
    ring, rope = ctx.ring_kv[s], attn.rope
    bound = getattr(rope, "bound", None)
    o = None
    if bound is not None and fused_backend(q):
        from dspark.kernels import draft_attention as K   # imports triton: only where it runs
        if K.supported(q, ring, kv):
            o = K.draft_attention(q, ring, ctx.slots, ctx.ring_pos, ctx.starts, kv,
                                  fp32(attn.attn_sink), attn.head_dim ** -0.5, ctx.window,
                                  rope.table(bound, q.device, inverse=True), rope.rope_dim,
                                  x.dtype)
    if o is None:
        R = ctx.slots.shape[0]
        keys = torch.cat([ring[ctx.slots].to(kv.dtype), kv.view(R, -1, kv.shape[-1])], 1)
        o = attention_with_sink_batched(q.view(R, -1, *q.shape[1:]), keys, ctx.mask(),
                                        attn.attn_sink, attn.head_dim ** -0.5)
        o = norm_rope(o.flatten(0, 1), rope, positions, inverse=True, dtype=x.dtype)
    return _output(attn, o)


def _project(attn, x, positions, quant):
    """(q, kv) of `Attention.project_q_kv`; plain wq_a and wkv multiply x in one GEMM of their
    stacked rows (kept while the weights are unchanged: `derived`)."""
    if type(attn.wq_a) is not nn.Linear or type(attn.wkv) is not nn.Linear:
        return attn.project_q_kv(x, positions, quant)[1:]
    wa, wkv = attn.wq_a.weight, attn.wkv.weight
    w = derived(attn, "_draft_wq_a_wkv", (wa, wkv), lambda: torch.cat([wa, wkv]))
    xq, xkv = F.linear(x, w).split((wa.shape[0], wkv.shape[0]), dim=-1)
    return attn.project_q(x, positions, xq=xq)[1], attn.project_kv(x, positions, quant, xkv=xkv)


def _output(attn, o):
    """`attn.output` of o [T, H, hd], already inversely rotated and in x.dtype. Where that is
    Attention's own (not a subclass adding e.g. a tensor-parallel reduction) and wo_a a plain
    linear of few bytes: one GEMM of its block-diagonal weight (the groups' products and sums
    as in the grouped einsum, plus exact zeros)."""
    wa, G = attn.wo_a.weight, attn.cfg.o_groups
    if (type(attn).output is not Attention.output or type(attn.wo_a) is not nn.Linear
            or wa.numel() * G * wa.element_size() > BLOCK_DIAG_MAX_BYTES):
        return attn.output(o, None, o.dtype, rotated=True)
    r = attn.cfg.o_lora_rank
    w = derived(attn, "_draft_wo_a_diag", (wa,),
                lambda: torch.block_diag(*wa.view(G, r, -1).unbind(0)))
    return attn.wo_b(F.linear(o.flatten(1), w))


def context_rows(holder, main_x, positions, quant):
    """Every stage's context row (`Attention.project_kv`) of main_x [n, D] at positions [n]:
    [n, stages, hd]. Plain wkv linears: one GEMM of their stacked rows; with the fused kernels
    every stage's kv_norm + RoPE in one launch (per-stage norm weights, one RoPE table: the
    stages' RoPE share their frequencies) and the storage rounding once over all rows.
    `holder` keeps the stacked weights (`derived`)."""
    attns = [stage.attn for stage in holder.stages]
    if not all(type(a.wkv) is nn.Linear for a in attns):
        return torch.stack([a.project_kv(main_x, positions, quant) for a in attns], 1)
    ws = [a.wkv.weight for a in attns]
    y = F.linear(main_x, derived(holder, "_draft_wkv_stack", ws, lambda: torch.cat(ws)))
    y = y.view(main_x.shape[0], len(attns), -1)                      # [n, stages, hd]
    rows = _norms_ropes(holder, attns, y, positions, main_x.dtype)
    if rows is None:
        rows = torch.stack([norm_rope(y[:, s], a.rope, positions, a.kv_norm, dtype=main_x.dtype)
                            for s, a in enumerate(attns)], 1)
    return rows if quant is None else quant.kv(rows)


def _norms_ropes(holder, attns, y, positions, dtype):
    """`norm_rope(y[:, s], rope_s, positions, kv_norm_s)` of every stage s in one launch, or
    None where that launch does not apply (no kernels here, norms of other kinds or epsilons,
    RoPE of other frequencies, no host-side position bound)."""
    norms, ropes = [a.kv_norm for a in attns], [a.rope for a in attns]
    r0 = ropes[0]
    bound = getattr(r0, "bound", None)
    if (bound is None or not hasattr(r0, "table")
            or any(type(n) is not RMSNorm or n.eps != norms[0].eps for n in norms)
            or any(r.rope_dim != r0.rope_dim or not (r.freqs is r0.freqs or torch.equal(
                r.freqs, r0.freqs)) for r in ropes)):
        return None
    ws = [n.weight for n in norms]
    k = fused_kernels(y, dtype, dtype, *ws)
    if k is None:
        return None
    w = derived(holder, "_draft_kv_norm_stack", ws, lambda: torch.stack(ws))
    return k.norm_rope(y, w, norms[0].eps, r0.table(bound, y.device), r0.rope_dim, dtype,
                       positions=positions)
