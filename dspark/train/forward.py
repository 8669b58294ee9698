"""Batched full-sequence training forwards over [B, L] token blocks (positions 0..L-1, causal).

They run the SAME modules as the reference decoder (`DeepseekV4Model.forward_hidden`,
`Block.forward`, mHC, MoE, projections, compressors, RoPE) and replace only the attention core,
which the reference evaluates request by request over dense per-request state:

* `target_attention`: window attention (128 keys incl. self) with the per-head sink, plus the
  compressed entries of the layer: HCA (all visible entries) or CSA (overlapping ratio-4 pooling,
  lightning-indexer top-k selection; the selection itself is not differentiable). Entry j is
  visible to query p iff (j+1)*ratio-1 <= p, exactly as in the reference.
* `drafter_forward`: the DSpark draft path for many anchors at once: context kv of every position
  from the target taps (`commit_context`), blocks [token at P, noise x (γ-1)] at P..P+γ-1 whose
  queries all see ctx[max(0,P-W):P] ∪ the whole block (`block_hidden`), hc_head, base logits and
  the Markov bias / confidence with the teacher-forced previous token (`markov_step`).

`tests/test_train.py` checks both against the reference path in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark.models.deepseek_v4.mhc import hc_head

NEG_INF = float("-inf")


class TrainBatch:
    """Duck-types `deepseek_v4.model.Batch` for `forward_hidden` / `Block.forward`."""

    def __init__(self, tokens: torch.Tensor, indexer_aux: bool = False):
        self.B, self.L = tokens.shape
        self.token_ids = tokens.reshape(-1)
        self.positions = torch.arange(self.L, device=tokens.device).repeat(self.B)
        self.indexer_aux = indexer_aux
        self.aux_losses = []          # indexer KL terms, one per CSA layer


# ---- compressed entries ---------------------------------------------------------------------
def pool_entries(comp, a: torch.Tensor, z: torch.Tensor, nj: int) -> torch.Tensor:
    """`Compressor.pool(a, z, 0, nj)` for every sequence at once. a, z [B, L, c*d] -> [B, nj, d]."""
    m, d = comp.ratio, comp.out_dim
    B = a.shape[0]
    av = a[:, :nj * m].reshape(B, nj, m, -1)
    zv = z[:, :nj * m].reshape(B, nj, m, -1)
    if not comp.overlap:
        return (torch.softmax(zv, dim=2) * av).sum(2)
    # entry j pools the A-halves of window j-1 and the B-halves of window j; entry 0 has no
    # previous window (kv 0, score -inf)
    av = torch.cat([av.new_zeros(B, 1, m, 2 * d), av], 1)
    zv = torch.cat([zv.new_full((B, 1, m, 2 * d), NEG_INF), zv], 1)
    a_slots = torch.cat([av[:, :-1, :, :d], av[:, 1:, :, d:]], dim=2)     # [B, nj, 2m, d]
    z_slots = torch.cat([zv[:, :-1, :, :d], zv[:, 1:, :, d:]], dim=2)
    return (torch.softmax(z_slots, dim=2) * a_slots).sum(2)


def _entries(attn, comp, x, pos, B, L, nj, quant, indexer: bool):
    """Rows -> pooled -> norm -> RoPE at j*ratio -> quantisation (`Attention.finish_entries`)."""
    a, z = comp.rows(x, pos)
    pooled = pool_entries(comp, a.view(B, L, -1), z.view(B, L, -1), nj)
    e = comp.norm(pooled.to(x.dtype)).reshape(B * nj, -1)
    epos = (torch.arange(nj, device=x.device) * attn.ratio).repeat(B)
    e = attn.rope.apply(e, epos)
    if quant is not None:
        e = quant.indexer(e).to(x.dtype) if indexer else quant.kv(e)
    return e.view(B, nj, -1)


def _indexer_select(attn, x, cq, pos, B, L, nj, visible, quant):
    """Top-k entry mask [B, L, nj] (`Indexer.select`) and the masked index scores (for the aux loss).
    The indexer reads detached inputs: its own training signal is the aux loss only."""
    ix = attn.indexer
    xd, cqd = x.detach(), cq.detach()
    qi, wi = ix.queries(xd, cqd, pos, attn.rope, quant)                  # [T, Hi, dI], [T, Hi]
    keys = _entries(attn, ix.compressor, xd, pos, B, L, nj, quant, indexer=True)
    Hi = qi.shape[1]
    scores = torch.einsum("blhd,bjd->blhj", qi.view(B, L, Hi, -1).float(), keys.float()).relu()
    scores = (scores * wi.view(B, L, Hi, 1).float()).sum(2)             # [B, L, nj]
    scores = scores.masked_fill(~visible, NEG_INF)
    k = min(ix.topk, nj)
    top = scores.detach().topk(k, dim=-1).indices
    chosen = torch.zeros(scores.shape, dtype=torch.bool, device=x.device).scatter_(-1, top, True)
    return chosen & visible, scores


def _indexer_kl(scores, comp_logits, visible):
    """KL(main attention mass over visible entries || indexer softmax), the dense-target indexer
    loss (main attention logits detached; averaged over heads and over queries with >=1 entry)."""
    has = visible.any(-1)                                                 # [1 or B, L]
    if not bool(has.any()):
        return scores.new_zeros(())
    vis = visible.unsqueeze(2)                                            # [.., L, 1, nj]
    t = torch.softmax(comp_logits.masked_fill(~vis, NEG_INF), -1).nan_to_num(0.0).mean(2)
    # rows without any visible entry would be all -inf (NaN in backward): neutralise them
    logp = torch.log_softmax(torch.where(has.unsqueeze(-1), scores, 0.0), -1)
    kl = (t * (torch.log(t.clamp_min(1e-20)) - logp.masked_fill(~visible, 0.0))).sum(-1)
    has = has.expand_as(kl)
    return kl[has].mean()


# ---- target ---------------------------------------------------------------------------------
def target_attention(attn, x, batch, layer_id, quant=None):
    """Attention core for a TrainBatch: x [B*L, D] (attn-normed) -> [B*L, D]."""
    B, L = batch.B, batch.L
    H, hd = attn.n_heads, attn.head_dim
    pos = batch.positions
    dev = x.device
    cq, q, kv = attn.project_q_kv(x, pos, quant)                          # [T, H, hd], [T, hd]
    qp = torch.arange(L, device=dev)
    mask = (qp[None, :] <= qp[:, None]) & (qp[None, :] > qp[:, None] - attn.window)   # [L, L]
    keys = kv.view(B, L, hd)
    mask = mask.unsqueeze(0).expand(B, L, L)
    nj = L // attn.ratio if attn.ratio else 0
    scores = visible = None
    if nj:
        m = attn.ratio
        ents = _entries(attn, attn.compressor, x, pos, B, L, nj, quant, indexer=False)
        visible = (((torch.arange(nj, device=dev) + 1) * m - 1)[None, :] <= qp[:, None])  # [L, nj]
        visible = visible.unsqueeze(0)
        if m == 4:
            cmask, scores = _indexer_select(attn, x, cq, pos, B, L, nj, visible, quant)
        else:
            cmask = visible.expand(B, L, nj)
        keys = torch.cat([keys, ents.to(keys.dtype)], 1)
        mask = torch.cat([mask, cmask], -1)
    N = keys.shape[1]
    logits = torch.bmm(q.reshape(B, L * H, hd), keys.transpose(1, 2).to(q.dtype) if not
                       torch.is_autocast_enabled() else keys.transpose(1, 2))
    logits = logits.float().view(B, L, H, N) * hd ** -0.5
    if scores is not None and batch.indexer_aux:
        batch.aux_losses.append(_indexer_kl(scores, logits[..., L:].detach(), visible))
    logits = logits.masked_fill(~mask.unsqueeze(2), NEG_INF)
    sink = attn.attn_sink.float().view(1, 1, H, 1).expand(B, L, H, 1)
    probs = torch.softmax(torch.cat([logits, sink], -1), dim=-1)[..., :N]
    out = torch.bmm(probs.reshape(B, L * H, N).to(keys.dtype), keys)    # [B, L*H, hd]
    return attn.output(out.view(B * L, H, hd).float(), pos, x.dtype)


def target_forward(model, tokens: torch.Tensor, quant=None, tap_layers=(), indexer_aux=False):
    """(final streams X [B*L, n, D], taps [B*L, taps*D] or None, batch) for tokens [B, L]."""
    batch = TrainBatch(tokens, indexer_aux)
    X, taps = model.forward_hidden(batch, attn_fn=target_attention, quant=quant,
                                   tap_layers=tuple(tap_layers))
    return X, taps, batch


# ---- drafter --------------------------------------------------------------------------------
class DraftBatch:
    def __init__(self, ids, positions, B, A, g, ctx_mask, ctx):
        self.token_ids, self.positions = ids, positions
        self.B, self.A, self.g = B, A, g
        self.ctx_mask, self.ctx = ctx_mask, ctx     # [B, A, L] bool, per stage [B, L, hd]
        self.stage = 0


def block_attention(attn, x, batch, layer_id, quant=None):
    """Non-causal block attention: every query of a block sees its context window and the block."""
    B, A, g = batch.B, batch.A, batch.g
    H, hd = attn.n_heads, attn.head_dim
    pos = batch.positions
    _, q, kv = attn.project_q_kv(x, pos, quant)                 # [B*A*g, H, hd], [B*A*g, hd]
    ctx = batch.ctx[batch.stage]                                          # [B, L, hd]
    L = ctx.shape[1]
    cast = (lambda t: t) if torch.is_autocast_enabled() else (lambda t: t.to(q.dtype))
    scale = hd ** -0.5
    lc = torch.bmm(q.reshape(B, A * g * H, hd), cast(ctx.transpose(1, 2)))
    lc = lc.float().view(B, A, g, H, L) * scale
    lc = lc.masked_fill(~batch.ctx_mask[:, :, None, None, :], NEG_INF)
    kvb = kv.view(B * A, g, hd)
    lb = torch.bmm(q.reshape(B * A, g * H, hd), cast(kvb.transpose(1, 2)))
    lb = lb.float().view(B, A, g, H, g) * scale
    sink = attn.attn_sink.float().view(1, 1, 1, H, 1).expand(B, A, g, H, 1)
    p = torch.softmax(torch.cat([lc, lb, sink], -1), dim=-1)
    pc = p[..., :L].reshape(B, A * g * H, L)
    pb = p[..., L:L + g].reshape(B * A, g * H, g)
    out = torch.bmm(pc.to(ctx.dtype), ctx).view(B * A, g * H, hd).float() + \
        torch.bmm(pb.to(kvb.dtype), kvb).float()
    return attn.output(out.view(B * A * g, H, hd), pos, x.dtype)


def context_kv(drafter, taps: torch.Tensor, B: int, L: int, quant=None) -> list:
    """Per stage context kv [B, L, hd] of every position (`commit_context`)."""
    pos = torch.arange(L, device=taps.device).repeat(B)
    t = taps.reshape(B * L, -1)
    main_x = drafter.main_norm(F.linear(t.to(drafter.main_proj.weight.dtype), drafter.main_proj.weight))
    return [st.attn.project_kv(main_x, pos, quant).view(B, L, -1) for st in drafter.stages]


def drafter_hidden(drafter, embed, tokens: torch.Tensor, anchors: torch.Tensor, ctx: list,
                   quant=None) -> torch.Tensor:
    """Pre-norm head hidden [B, A, γ, D] for blocks anchored at `anchors` [B, A] (positions P with
    the anchor token tokens[b, P]); ctx from `context_kv` (only positions < P are attended)."""
    cfg = drafter.cfg
    B, L = tokens.shape
    A, g = anchors.shape[1], drafter.gamma
    dev = tokens.device
    bpos = anchors[..., None] + torch.arange(g, device=dev)                # [B, A, g]
    ids = torch.full((B, A, g), cfg.dspark_noise_token_id, dtype=torch.long, device=dev)
    ids[..., 0] = tokens.gather(1, anchors)
    kpos = torch.arange(L, device=dev)
    P = anchors[..., None]
    ctx_mask = (kpos < P) & (kpos >= P - cfg.sliding_window)               # [B, A, L]
    batch = DraftBatch(ids.reshape(-1), bpos.reshape(-1), B, A, g, ctx_mask, ctx)
    X = embed(batch.token_ids)
    X = X.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
    for s, stage in enumerate(drafter.stages):
        batch.stage = s
        X = stage(X, batch, attn_fn=block_attention, quant=quant)
    h = hc_head(X, drafter.hc_head_fn, drafter.hc_head_base, drafter.hc_head_scale, cfg.hc_eps,
                cfg.rms_norm_eps)
    return h.view(B, A, g, -1)


def drafter_forward(drafter, embed, head, taps, tokens, anchors, quant=None, markov: bool = True):
    """Teacher-forced draft logits for training / parity tests.

    Returns (z [B, A, γ, V] fp32 corrected logits (base + Markov bias of the ground-truth previous
    token tokens[P+k-1]), confidence logits [B, A, γ] fp32, hidden [B, A, γ, D]).
    """
    B, L = tokens.shape
    ctx = context_kv(drafter, taps, B, L, quant)
    h = drafter_hidden(drafter, embed, tokens, anchors, ctx, quant)
    A, g = h.shape[1], h.shape[2]
    hf = h.reshape(B * A * g, -1)
    z = drafter.base_logits(head, hf)
    bpos = anchors[..., None] + torch.arange(g, device=tokens.device)
    prev = tokens.gather(1, bpos.reshape(B, A * g)).reshape(-1)
    bias, conf = drafter.markov_step(hf, prev)
    if markov:
        z = z + bias
    return z.view(B, A, g, -1), conf.view(B, A, g), h
