"""Lossless verification of draft blocks (spec §5.2), batched over R requests padded to γ.

Layout per request r with anchor position P_r and draft tokens x_1..x_γ at positions P_r+1..P_r+γ:
  target_probs[r, i] = target distribution for position P_r+i+1 (i.e. for draft x_{i+1}); row γ
  exists so that a fully accepted block of length γ has its bonus row.
  draft_probs[r, i]  = the exact distribution x_{i+1} was sampled from.
Only the first ℓ_r drafts are tested; rows past ℓ_r (target) or past the rejection (draft) are
never used, so a varlen verify can scatter its 1+ℓ_r rows into an uninitialised padded buffer.
Everything is tensor ops on the inputs' device; nothing here reads device values on the host
(pass every input on that device: a CPU input would be copied, and such a copy synchronises).

RNG keys are absolute positions, so a later round re-tests positions an earlier round drafted
past its first rejection. That is safe: whether round t stops at a depends only on uniforms at
positions <= P+a+1, so the later positions' uniforms were never used and are still fresh (a
stopping-time argument; it needs the policy to decide ℓ without looking past each position, which
every shipped policy does).
"""
from __future__ import annotations

import enum
from typing import NamedTuple, Sequence

import torch

from dspark.formats.sampling import Q_FLOOR, RESIDUAL_EPS, VerifyResult, _check  # noqa: F401
from dspark.sampling import Purpose, sample_from_probs, uniforms

def verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
           lengths: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> VerifyResult:
    """Rejection sampling (spec §5.2). Shapes: draft_tokens int64 [R, γ]; draft_probs [R, γ, V] or
    None for greedy (point-mass) drafts; target_probs [R, γ+1, V] from `probs_from_logits` (one-hot
    rows for greedy targets, which makes this exact for them too); lengths int [R] in 0..γ; seeds
    int64 [R]; positions int64 [R] = anchor positions P_r. Uniforms: accept test of x_i keyed
    (seed, P+i, ACCEPT), the extra token keyed (seed, P+a+1, RESIDUAL)."""
    _check(draft_tokens, target_probs, lengths)
    r, g = draft_tokens.shape
    dev = target_probs.device
    x = draft_tokens.to(dev).long()
    lengths = lengths.to(dev).long()
    seeds, positions = seeds.to(dev).long(), positions.to(dev).long()
    offs = torch.arange(g, device=dev)

    p = target_probs.float()
    q = None if draft_probs is None else draft_probs.to(dev).float()
    if q is not None and q.shape != (r, g, p.shape[2]):
        raise ValueError(f"draft_probs must be [R, γ, V] = [{r}, {g}, {p.shape[2]}], got {tuple(q.shape)}")
    px = p[:, :g].gather(2, x.unsqueeze(2)).squeeze(2)                     # [R, γ]
    if q is None:
        qx = torch.ones_like(px)
    else:
        qx = q.gather(2, x.unsqueeze(2)).squeeze(2).clamp_min(Q_FLOOR)
    u = uniforms(seeds.unsqueeze(1), positions.unsqueeze(1) + 1 + offs, Purpose.ACCEPT)
    # u < min(1, p/q) <=> u*q < p since u < 1 (multiplication avoids dividing by tiny q).
    ok = (u * qx < px) & (offs < lengths.unsqueeze(1))
    a = ok.long().cumprod(dim=1).sum(dim=1)                                 # leading run only

    rows = torch.arange(r, device=dev)
    p_row = p[rows, a]                                                       # row a: corrected or bonus
    qi = a.clamp(max=g - 1)  # q row of the rejected draft (unused when a = ℓ)
    if q is None:
        q_row = torch.zeros_like(p_row).scatter_(1, x.gather(1, qi.unsqueeze(1)), 1.0)
    else:
        q_row = q[rows, qi]
    resid = (p_row - q_row).clamp_min(0)
    use_resid = (a < lengths) & (resid.sum(dim=1) > RESIDUAL_EPS)
    dist = torch.where(use_resid.unsqueeze(1), resid, p_row)  # sample_from_probs renormalises
    y = sample_from_probs(dist, uniforms(seeds, positions + a + 1, Purpose.RESIDUAL))
    return VerifyResult(a, y)


def verify_greedy(draft_tokens: torch.Tensor, target_argmax: torch.Tensor,
                  lengths: torch.Tensor) -> VerifyResult:
    """Greedy-target fast path: accept iff x_i == argmax of row i-1; next token = argmax of row a.
    target_argmax int64 [R, γ+1] (argmax of the target logits; no softmax over V needed)."""
    _check(draft_tokens, target_argmax, lengths)
    g = draft_tokens.shape[1]
    dev = target_argmax.device
    lengths = lengths.to(dev).long()
    ok = (draft_tokens.to(dev).long() == target_argmax[:, :g]) & \
        (torch.arange(g, device=dev) < lengths.unsqueeze(1))
    a = ok.long().cumprod(dim=1).sum(dim=1)
    return VerifyResult(a, target_argmax.gather(1, a.unsqueeze(1)).squeeze(1))


def emitted_tokens(draft_tokens: torch.Tensor, result: VerifyResult, pad: int = -1):
    """(tokens int64 [R, γ+1], counts [R]): x_1..x_a then y at column a, `pad` after it."""
    a, y = result
    r, g = draft_tokens.shape
    col = torch.arange(g + 1, device=a.device)
    padded = torch.cat([draft_tokens.to(a.device).long(),
                        torch.full((r, 1), pad, dtype=torch.long, device=a.device)], dim=1)
    out = torch.where(col < a.unsqueeze(1), padded, torch.full_like(padded, pad))
    out = torch.where(col == a.unsqueeze(1), y.unsqueeze(1), out)
    return out, a + 1


class FinishReason(enum.IntEnum):
    NONE = 0
    STOP = 1    # a stop/EOS token was emitted (it is kept as the last token)
    LENGTH = 2  # max_tokens reached


class StopResult(NamedTuple):
    num_emit: torch.Tensor  # int64 [R]: tokens of `tokens` to emit (prefix length)
    finish: torch.Tensor    # int64 [R]: FinishReason values


def stop_table(stop_ids: Sequence[Sequence[int]], device=None) -> torch.Tensor:
    """Pad per-request stop id lists to int64 [R, max(1, S)] with -1 (never a token id)."""
    width = max([1] + [len(s) for s in stop_ids])
    table = torch.full((len(stop_ids), width), -1, dtype=torch.long)
    for i, s in enumerate(stop_ids):
        table[i, :len(s)] = torch.tensor(list(s), dtype=torch.long)
    return table.to(device)


def clip_lengths(lengths: torch.Tensor, draft_tokens: torch.Tensor | None = None,
                 stops: torch.Tensor | None = None, remaining: torch.Tensor | None = None) -> torch.Tensor:
    """Drop verify work that can never be emitted, before building the verify batch: drafts after
    the first drafted stop token (the stop itself is still verified), and drafts beyond
    remaining - 1 (a round emits at most ℓ + 1 tokens; remaining = max_tokens - generated).
    Lossless: the cut at position j depends only on drafts before j and on host-known counts."""
    out = lengths.long()
    if draft_tokens is not None and stops is not None:
        g = draft_tokens.shape[1]
        hit = (draft_tokens.unsqueeze(2) == stops.to(draft_tokens.device).unsqueeze(1)).any(dim=2)
        first = torch.where(hit, torch.arange(1, g + 1, device=hit.device), g).amin(dim=1)
        out = torch.minimum(out, first.to(out.device))
    if remaining is not None:
        out = torch.minimum(out, (remaining.to(out.device).long() - 1).clamp_min(0))
    return out


def apply_stops(tokens: torch.Tensor, counts: torch.Tensor, stops: torch.Tensor,
                num_generated: torch.Tensor, max_tokens: torch.Tensor) -> StopResult:
    """Truncate each request's emitted tokens [R, γ+1] (first `counts` valid) at the first stop
    token (kept; a stop among accepted drafts means no bonus: spec §5.2) or where max_tokens is
    reached (num_generated tokens already emitted before this round). A stop landing exactly on
    the last allowed token reports STOP."""
    dev = tokens.device
    counts = counts.to(dev).long()
    col = torch.arange(tokens.shape[1], device=dev)
    hit = (tokens.unsqueeze(2) == stops.to(dev).unsqueeze(1)).any(dim=2) & (col < counts.unsqueeze(1))
    big = tokens.shape[1] + 1
    n_stop = torch.where(hit, col + 1, big).amin(dim=1)          # 1-based count through the stop
    budget = (max_tokens.to(dev).long() - num_generated.to(dev).long()).clamp_min(0)
    n = torch.minimum(torch.minimum(counts, n_stop), budget)
    stop = n_stop <= torch.minimum(counts, budget)
    length = ~stop & (budget <= counts)
    finish = torch.where(stop, int(FinishReason.STOP),
                         torch.where(length, int(FinishReason.LENGTH), int(FinishReason.NONE)))
    return StopResult(n, finish.long())


# ---- the same on the host (the engine's per-round tail) ------------------------------------
# The engine reads the few integers of a round back once ([a, y, drafts] or [argmax, drafts]
# per request) and finishes on the host: for R requests of γ+1 tokens that is a few hundred Python
# operations instead of ~30 small kernel launches (~5-10 us of host time each on CUDA).

def accept_greedy_host(drafts: Sequence[Sequence[int]], argmax: Sequence[Sequence[int]],
                       lengths: Sequence[int]) -> tuple[list, list]:
    """`verify_greedy` on host lists: (accepted a [R], next token y [R])."""
    acc, nxt = [], []
    for x, m, n in zip(drafts, argmax, lengths):
        a = 0
        while a < n and x[a] == m[a]:
            a += 1
        acc.append(a)
        nxt.append(m[a])
    return acc, nxt


def emit_and_stop_host(drafts: Sequence[Sequence[int]], accepted: Sequence[int],
                       next_tokens: Sequence[int], stop_ids: Sequence, num_generated: Sequence[int],
                       max_tokens: Sequence[int]) -> tuple[list, list]:
    """`emitted_tokens` + `apply_stops` on host lists: (tokens to emit per request, FinishReason
    per request). Same rules: x_1..x_a then y, cut after the first stop token (kept) or at the
    token budget max_tokens - num_generated; a stop on the last allowed token reports STOP."""
    out, fin = [], []
    for x, a, y, stops, gen, mx in zip(drafts, accepted, next_tokens, stop_ids, num_generated,
                                       max_tokens):
        toks = list(x[:a]) + [y]
        n_stop = next((i + 1 for i, t in enumerate(toks) if t in stops), len(toks) + 1)
        budget = max(mx - gen, 0)
        n = min(len(toks), n_stop, budget)
        if n_stop <= min(len(toks), budget):
            f = FinishReason.STOP
        elif budget <= len(toks):
            f = FinishReason.LENGTH
        else:
            f = FinishReason.NONE
        out.append(toks[:n])
        fin.append(f)
    return out, fin


__all__ = ["VerifyResult", "verify", "verify_greedy", "emitted_tokens", "FinishReason",
           "StopResult", "stop_table", "clip_lengths", "apply_stops", "RESIDUAL_EPS",
           "accept_greedy_host", "emit_and_stop_host"]
