"""Logit adjustments that depend on a request's tokens: penalties, logit_bias, min_tokens, min_p.

They change the law a token is sampled from, so for speculation to stay lossless they are applied
to the target's verify rows and to the drafter's Markov steps alike, each row with the history
it conditions on: the committed tokens plus the drafted tokens before it (draft step k and
target row k see the same history). The result then goes through the one logits->probabilities
path (`sampling.probs_from_logits`, or the fused kernels, which take the adjusted logits as they
are), so q and p stay exact.

Order (vLLM's meanings): repetition_penalty on tokens of the prompt or the output (a positive
logit divided by it, a negative one multiplied), frequency_penalty * count and presence_penalty
* [count > 0] subtracted for output tokens, logit_bias added, stop ids masked while fewer than
min_tokens tokens were generated, then min_p: tokens whose tempered probability is below
min_p * the most likely one's are masked (on logits: x < max(x) + temperature * log(min_p)).
"""
from __future__ import annotations

import math

import torch


class LogitAdjust:
    """Adjustments for R requests (one row each; `block` for R x (γ+1) verify rows). Built on
    the host from the requests (`build`: None when no request adjusts). `push(tokens)` counts a
    newly drafted token per request, so the next `apply` conditions on it."""

    def __init__(self, reqs, vocab: int, device):
        dev = torch.device(device)
        R = len(reqs)
        ps = [r.params for r in reqs]
        self.vocab, self.device = vocab, dev
        f32 = lambda xs: torch.tensor(xs, dtype=torch.float32, device=dev)  # noqa: E731
        self.rep = f32([float(p.repetition_penalty) for p in ps])
        self.freq = f32([float(p.frequency_penalty) for p in ps])
        self.pres = f32([float(p.presence_penalty) for p in ps])
        self.penalised = any(p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty
                             for p in ps)
        self.counts = self.seen = None
        if self.penalised:
            counts = torch.zeros(R, vocab, dtype=torch.float32)
            seen = torch.zeros(R, vocab, dtype=torch.bool)
            for i, r in enumerate(reqs):
                out = torch.as_tensor(list(r.output_ids), dtype=torch.long)
                counts[i].index_add_(0, out, torch.ones(len(out)))
                seen[i, torch.as_tensor(list(r.prompt_ids), dtype=torch.long)] = True
            self.counts, self.seen = counts.to(dev), (seen | (counts > 0)).to(dev)
        self.bias = None
        if any(p.logit_bias for p in ps):
            bias = torch.zeros(R, vocab, dtype=torch.float32)
            for i, p in enumerate(ps):
                for tok, b in (p.logit_bias or {}).items():
                    bias[i, int(tok)] += float(b)
            self.bias = bias.to(dev)
        # min_tokens: how many more tokens must come before a stop id may; the stop ids
        self.need = torch.tensor([max(0, p.min_tokens - len(r.output_ids)) for r, p in zip(reqs, ps)],
                                 dtype=torch.long, device=dev)
        self.stop_mask = None
        if any(p.min_tokens > 0 for p in ps):
            mask = torch.zeros(R, vocab, dtype=torch.bool)
            for i, r in enumerate(reqs):
                ids = [t for t in r.stop_ids if 0 <= t < vocab]
                mask[i, ids] = True
            self.stop_mask = mask.to(dev)
        # min_p as a logit threshold offset: temperature * log(min_p); -inf = off (and greedy)
        self.min_p_offset = None
        if any(p.min_p > 0 for p in ps):
            self.min_p_offset = f32([float(p.temperature) * math.log(p.min_p)
                                     if p.min_p > 0 and p.temperature > 0 else -math.inf
                                     for p in ps])
        self.step = 0                  # drafted tokens pushed so far

    @classmethod
    def build(cls, reqs, vocab: int, device) -> "LogitAdjust | None":
        if not any(r.params.adjusts_logits for r in reqs):
            return None
        return cls(reqs, vocab, device)

    def push(self, tokens: torch.Tensor) -> None:
        """Count one drafted token per request [R] (int64, on the device)."""
        if self.counts is not None:
            self.counts.scatter_add_(1, tokens[:, None], torch.ones_like(self.counts[:, :1]))
            self.seen.scatter_(1, tokens[:, None], True)
        self.step += 1

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Adjusted float32 logits [R, V] for one row per request (a new tensor)."""
        return self._apply(x.float(), self.counts, self.seen, self.need - self.step)

    def apply_block(self, x: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """Adjusted float32 logits [R, γ+1, V] for verify rows: row i conditions on the first i
        drafts [R, γ] as well."""
        R, w, V = x.shape
        counts = seen = None
        if self.counts is not None:
            hist = torch.zeros(R, w, V, dtype=torch.float32, device=x.device)
            if w > 1:
                hist[:, 1:].scatter_(2, drafts[:, :w - 1, None], 1.0)
            hist = hist.cumsum(1)
            counts = self.counts[:, None] + hist
            seen = self.seen[:, None] | (hist > 0)
        need = self.need[:, None] - torch.arange(w, device=x.device)
        return self._apply(x.float(), counts, seen, need, block=True)

    def _apply(self, x, counts, seen, need, block: bool = False):
        col = (lambda t: t[:, None, None]) if block else (lambda t: t[:, None])  # noqa: E731
        per_row = (lambda t: t[:, None]) if block else (lambda t: t)             # noqa: E731
        if self.penalised:
            rep = col(self.rep)
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
            x = x - col(self.freq) * counts - col(self.pres) * (counts > 0).float()
        if self.bias is not None:
            x = x + per_row(self.bias)
        if self.stop_mask is not None:
            x = x.masked_fill(per_row(self.stop_mask) & (need > 0)[..., None], float("-inf"))
        if self.min_p_offset is not None:
            top = x.amax(-1, keepdim=True)
            x = x.masked_fill(x < top + col(self.min_p_offset), float("-inf"))
        return x
