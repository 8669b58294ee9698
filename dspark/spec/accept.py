"""Acceptance of a round, the device part: which target rows each request's block is checked
against, argmaxes (greedy) or the lossless rejection test and next-token draw (sampled), all left
on the device. The engine reads the result back in one copy and commits on the host
(`Engine._commit`); the overlapped decode loop (dspark/overlap.py) feeds the next round from it
before that read."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cuda.transfer import to_device
from ..logit_adjust import LogitAdjust
from ..request import has_probs, stack_field
from ..sampling import (argmax_rows, filters_used, fused_filters_enabled,
                        fused_sampling_enabled, probs_from_logits,
                        stack_params)
from .gumbel import gumbel_draws, gumbel_tokens
from .verify import verify


@dataclass
class Decision:
    """Acceptance results still on the device (`decide`): `head` [R, γ+1] target argmaxes
    (greedy; [R, 1] for a plain decode step) or [R, 2] = (accepted a, next token y); the drafts
    [R, γ] that were verified (not read when nothing was)."""
    head: torch.Tensor
    drafts: torch.Tensor
    verified: bool                   # any request verified drafts this round
    greedy: bool
    # [R] ℓ on the device (greedy: for accepted_next); None when every request verifies all
    # its γ drafts (nothing to cut at)
    lengths: torch.Tensor | None = None

    def table(self) -> torch.Tensor:
        """What the host needs, one tensor (one read back): head, then the drafts if verified."""
        return torch.cat([self.head, self.drafts], 1) if self.verified else self.head

    def accepted_next(self) -> tuple:
        """(accepted a [R], next token y [R]) on the device, without a read back: what the host
        computes from the table (accept_greedy_host for greedy decisions)."""
        if not self.greedy:
            return self.head[:, 0], self.head[:, 1]
        R, w = self.head.shape
        if w == 1 or not self.verified:
            a = torch.zeros(R, dtype=torch.long, device=self.head.device)
        else:
            # the leading run of drafts equal to the argmaxes, cut at ℓ (every small kernel
            # costs host time in the round: no cut when every block is verified whole)
            a = (self.drafts == self.head[:, :-1]).cumprod(1).sum(1)
            if self.lengths is not None:
                a = torch.minimum(a, self.lengths)
        return a, self.head.gather(1, a[:, None])[:, 0]

    def next_tokens(self) -> torch.Tensor:
        """[R] each request's next token when nothing was verified (ℓ = 0: a plain decode step)."""
        return self.head[:, 0] if self.greedy else self.head[:, 1]


def _row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[rows] argmax of each logit row: the one the runner's graph computed with the logits
    (`logits.row_argmax`, V4DecodeGraphs) when there is one, else argmax_rows (same values)."""
    got = getattr(logits, "row_argmax", None)
    return got if got is not None else argmax_rows(logits)


_last_temperatures = (None, None)    # (key, device tensor) of the last round's, swapped whole


def _temperatures(reqs, dev) -> torch.Tensor:
    """fp32 [R] temperatures on the device; the last round's tensor when they are the same (the
    usual case: the same requests round after round), else one asynchronous upload. Read-only:
    fused_verify only reads it. The memo is one (key, tensor) pair replaced in one assignment,
    so engines in other threads never see one's key with another's tensor."""
    global _last_temperatures
    key = (dev, tuple(float(r.params.temperature) for r in reqs))
    last = _last_temperatures
    if last[0] != key:
        last = _last_temperatures = (key, to_device(list(key[1]), torch.float32, dev))
    return last[1]


def decide(reqs, logits, first_rows, lengths, anchor_pos, gamma: int,
           deterministic: bool = False) -> Decision:
    """The device part of a round's acceptance, nothing read back: per request the target's
    argmax rows (greedy) or [accepted a, next token y] (sampled verification, exact law).
    reqs carry .seed, .params and .draft (tokens, probs); logits [rows, V] of the flat forward;
    first_rows / lengths (ℓ) / anchor_pos per request; gamma drafted tokens per block.
    deterministic: `decide_gumbel` (every request on its own rows, the Gumbel-max sampler);
    a round of greedy requests without adjustments takes the greedy path below, which decides
    the same tokens (the argmax of each row) row by row."""
    g = gamma
    R, V, dev = len(reqs), logits.shape[-1], logits.device
    greedy = all(r.params.greedy for r in reqs)
    # penalties / logit_bias / min_tokens / min_p: every row adjusted with its own history
    # (committed tokens + the drafts before it), the same law the drafter sampled from
    adjust = LogitAdjust.build(reqs, V, dev)
    if deterministic and not (greedy and adjust is None):
        return decide_gumbel(reqs, logits, first_rows, lengths, anchor_pos, gamma)
    if greedy and adjust is None and not any(lengths) and \
            list(first_rows) == list(range(logits.shape[0])):
        # a plain greedy decode step (one logit row per request, nothing verified): the rows'
        # argmaxes as they are: no row indices to upload, no gather, no drafts
        head = _row_argmax(logits)[:, None]                                      # [R, 1]
        return Decision(head, head.new_empty(R, 0), False, True)
    # every request verifies all γ drafts in its own γ+1 rows, back to back (a uniform verify
    # step, the usual round): the rows are the logits as they are, no index upload or gather
    whole = (list(lengths) == [g] * R and logits.shape[0] == R * (g + 1)
             and list(first_rows) == list(range(0, R * (g + 1), g + 1)))
    verified = any(lengths)
    if not verified:
        drafts = torch.zeros(R, g, dtype=torch.long, device=dev)
    elif all(lengths):
        drafts = stack_field([r.draft for r in reqs], "tokens")
    else:
        none = torch.zeros(g, dtype=torch.long, device=dev)
        drafts = torch.stack([r.draft.tokens if n else none for r, n in zip(reqs, lengths)])
    if greedy and adjust is None and whole:
        # greedy fast path: argmaxes only, no softmax over V, no random draws; the compare
        # runs on the host after the one read back (and on the device, accepted_next, for a
        # draft queued ahead of it)
        return Decision(_row_argmax(logits).view(R, g + 1), drafts, verified, True)
    # the host integers the device part needs in ONE upload (pinned and asynchronous on
    # CUDA; a tensor per field costs a synchronous copy each): target rows [R, γ+1] (row i
    # predicts anchor position + i + 1, padded past ℓ), ℓ, seeds, anchor positions
    flat = [f + min(i, n) for f, n in zip(first_rows, lengths) for i in range(g + 1)]
    flat += list(lengths) + [r.seed for r in reqs] + list(anchor_pos)
    ints = to_device(flat, torch.long, dev)
    row_idx = ints[:R * (g + 1)].view(R, g + 1)
    lens, seeds, P = ints[R * (g + 1):R * (g + 4)].view(3, R).unbind(0)
    if adjust is not None:
        logits = adjust.apply_block(logits[row_idx], drafts).flatten(0, 1)     # [R * (γ+1), V]
        row_idx = torch.arange(R * (g + 1), device=dev).view(R, g + 1)
        if greedy:
            return Decision(logits.argmax(-1)[row_idx], drafts, verified, True, lens)
    if greedy:         # (the fast path above, on rows gathered by row_idx)
        return Decision(_row_argmax(logits)[row_idx], drafts, verified, True, lens)  # [R, γ+1]
    use_top_k, use_top_p = filters_used([r.params for r in reqs])
    # q = None: every verified draft is a point mass at its token (greedy drafts, or
    # nothing verified), which verify and fused_verify build implicitly
    q = None
    if all(lengths) and all(has_probs(r.draft) for r in reqs):
        q = stack_field([r.draft for r in reqs], "probs")
    elif any(has_probs(r.draft) for r, n in zip(reqs, lengths) if n):
        q = torch.zeros(R, g, V, device=dev)
        for i, r in enumerate(reqs):
            if lengths[i]:       # greedy drafts keep no distribution: a point mass
                q[i] = r.draft.probs if r.draft.probs is not None else \
                    torch.zeros(g, V, device=dev).scatter_(1, r.draft.tokens[:, None], 1.0)
    filters = use_top_k or use_top_p
    fused = fused_sampling_enabled(dev) and (
        not filters or fused_filters_enabled(dev, R * (g + 1), logits.shape[-1]))
    if fused:
        from ..kernels.sampling import fused_verify   # Triton: imported only when used
    if fused and not filters:
        temp = _temperatures(reqs, dev)
        rows = logits.view(R, g + 1, V) if whole else logits[row_idx]
        res = fused_verify(drafts, q, rows, temp, lens, seeds, P)
        return Decision(torch.stack([res.accepted, res.next_token], 1), drafts, verified, False)
    temp, top_k, top_p = stack_params([r.params for r in reqs], dev)
    rep = lambda t: None if t is None else t.repeat_interleave(g + 1)  # noqa: E731
    rows = logits[row_idx.flatten()]
    if fused:             # tempered, filtered logits at temperature 1 (greedy rows: 0, as-is)
        from ..kernels.sampling_filters import filter_logits
        y, t_eff = filter_logits(rows, rep(temp), rep(top_k), rep(top_p))
        res = fused_verify(drafts, q, y.view(R, g + 1, V), t_eff.view(R, g + 1)[:, 0].contiguous(),
                           lens, seeds, P)
    else:
        p = probs_from_logits(rows, rep(temp), rep(top_k), rep(top_p)).view(R, g + 1, V)
        res = verify(drafts, q, p, lens, seeds, P)
    return Decision(torch.stack([res.accepted, res.next_token], 1), drafts, verified, False)


def decide_gumbel(reqs, logits, first_rows, lengths, anchor_pos, gamma: int) -> Decision:
    """Deterministic mode's acceptance (spec/gumbel.py): per request, the token each of its rows
    0..ℓ decides (row i decides position anchor + i + 1: the argmax for greedy requests, the
    Gumbel-max draw keyed by (seed, that position) otherwise), from that row's logits adjusted
    with the request's own history and the drafts before it; a = the leading run of drafts equal
    to those tokens, y = the token of row a. Nothing depends on other requests, on ℓ (rows past
    a are never emitted) or on the drafts' law: the emitted tokens are plain decoding's.
    Returns [a, y] per request in the sampled layout (Decision.greedy False).

    On CUDA the requests without top-k / top-p or logit adjustments are decided together
    (`gumbel_draws` over all their rows: one kernel whose programs each read one row, so a
    row gets the values it gets alone). On CPU, and for the others, each row is decided on its
    own [V] tensor (`gumbel_tokens`)."""
    R, V, dev = len(reqs), logits.shape[-1], logits.device
    g = gamma
    if all(lengths):
        drafts = stack_field([r.draft for r in reqs], "tokens", g)
    else:
        none = torch.zeros(g, dtype=torch.long, device=dev)
        drafts = torch.stack([req.draft.tokens[:g] if n else none for req, n in zip(reqs, lengths)])
    batched = [i for i, req in enumerate(reqs) if logits.is_cuda and _plain_gumbel(req.params)]
    heads = [None] * R
    if batched:
        heads_b = _gumbel_heads_batched([reqs[i] for i in batched], logits,
                                        [first_rows[i] for i in batched],
                                        [lengths[i] for i in batched],
                                        [anchor_pos[i] for i in batched], drafts, batched, g)
        if len(batched) == R:
            return Decision(heads_b, drafts, any(lengths), False)
        for j, i in enumerate(batched):
            heads[i] = heads_b[j]
    for i, (req, f, n, p) in enumerate(zip(reqs, first_rows, lengths, anchor_pos)):
        if heads[i] is not None:
            continue
        x = drafts[i]
        rows = logits[f:f + n + 1].float()
        adjust = LogitAdjust.build([req], V, dev)
        if adjust is not None:
            pad = torch.cat([rows, rows[-1:].expand(g + 1 - rows.shape[0], V)])
            rows = adjust.apply_block(pad[None], x[None])[0, :n + 1]
        toks = gumbel_tokens(rows, req.params, req.seed, range(p + 1, p + n + 2))
        a = (toks[:n] == x[:n]).long().cumprod(0).sum() if n else toks.new_zeros(())
        heads[i] = torch.stack([a, toks[a]])
    return Decision(torch.stack(heads), drafts, any(lengths), False)


def _plain_gumbel(params) -> bool:
    """A request whose rows `gumbel_draws` decides as `gumbel_token` does (no filters, no
    logit adjustments)."""
    return params.top_k <= 0 and params.top_p >= 1 and not params.adjusts_logits


def _gumbel_heads_batched(reqs, logits, first_rows, lengths, anchor_pos, drafts, which,
                          g: int) -> torch.Tensor:
    """[a, y] [R, 2] of `decide_gumbel` for requests without filters or adjustments, from one
    batched draw over every request's γ+1 rows (rows past ℓ repeat row ℓ and are never taken:
    a <= ℓ). One upload of the host integers."""
    R, dev = len(reqs), logits.device
    whole = len(which) == drafts.shape[0]
    rows = [f + min(k, n) for f, n in zip(first_rows, lengths) for k in range(g + 1)]
    pos = [p + 1 + min(k, n) for p, n in zip(anchor_pos, lengths) for k in range(g + 1)]
    seeds = [r.seed for r in reqs for _ in range(g + 1)]
    # k < ℓ for each draft slot (drafts past ℓ are never accepted)
    live = [int(k < n) for n in lengths for k in range(g)]
    ints = to_device(rows + pos + seeds + live + ([] if whole else list(which)), torch.long, dev)
    n_rows = R * (g + 1)
    row_idx, positions, seed_t = ints[:3 * n_rows].view(3, n_rows).unbind(0)
    live = ints[3 * n_rows:3 * n_rows + R * g].view(R, g)
    if all(r.params.greedy for r in reqs):       # argmaxes: no noise to draw
        toks = logits[row_idx].argmax(1).view(R, g + 1)
    else:
        temperature = _temperatures(reqs, dev).repeat_interleave(g + 1)
        toks = gumbel_draws(logits[row_idx], temperature, None, None, seed_t,
                            positions).view(R, g + 1)
    x = drafts if whole else drafts[ints[3 * n_rows + R * g:]]
    a = ((toks[:, :g] == x).long() * live).cumprod(1).sum(1)
    return torch.stack([a, toks.gather(1, a[:, None])[:, 0]], 1)
