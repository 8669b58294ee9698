"""Log-probabilities reported with outputs (SamplingParams.logprobs / prompt_logprobs).

They come from the target's raw distribution: log-softmax of the target's logits before any
penalty, bias or temperature (vLLM's default). Under speculation the emitted token j of a round
was decided by verify row first_row + j, so its logprob is read from the logits that verified
it: exact, the same numbers target-only decoding gives."""
from __future__ import annotations

import torch

from .outputs import Logprob


def logprob_dicts(lp: torch.Tensor, tokens: list, k: int, tokenizer=None) -> list:
    """Per row of log-probs lp [n, V] and its token: {token id: Logprob} with the token (its
    rank among all) and the k most likely."""
    idx = torch.as_tensor(tokens, dtype=torch.long, device=lp.device)[:, None]
    chosen = lp.gather(1, idx)
    ranks = ((lp > chosen).sum(1) + 1).tolist()
    chosen = chosen[:, 0].tolist()
    top_v, top_i = lp.topk(min(k, lp.shape[1]), dim=1) if k else (lp[:, :0], lp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()

    def text(t):
        # the token's own spelling, special tokens too (the text of an output leaves them out)
        return tokenizer.decode([t], skip_special_tokens=False) if tokenizer else None

    out = []
    for j, tok in enumerate(tokens):
        d = {tok: Logprob(chosen[j], ranks[j], text(tok))}
        for r, (v, t) in enumerate(zip(top_v[j], top_i[j])):
            if t not in d:
                d[t] = Logprob(v, r + 1, text(t))
        out.append(d)
    return out


def emitted_logprobs(logits: torch.Tensor, first_row: int, tokens: list, k: int,
                     tokenizer=None) -> list:
    """Logprobs of a round's emitted tokens: token j from row first_row + j."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits[first_row:first_row + len(tokens)].float(), -1)
    return logprob_dicts(lp, tokens, k, tokenizer)


def record_prompt_logprobs(req, rows: torch.Tensor, start: int, tokenizer=None) -> None:
    """Append to req.prompt_logprobs the prompt tokens start+1 .. predicted by the prefill rows
    at start .. (row m predicts the token at start + m + 1). Positions already recorded (a
    prefill recomputed after a preemption) are skipped."""
    first = max(start + 1, len(req.prompt_logprobs))
    toks = req.prompt_ids[first:start + 1 + rows.shape[0]]
    if toks:
        lp = torch.log_softmax(rows[first - start - 1:first - start - 1 + len(toks)].float(), -1)
        req.prompt_logprobs.extend(logprob_dicts(lp, toks, req.params.prompt_logprobs, tokenizer))
