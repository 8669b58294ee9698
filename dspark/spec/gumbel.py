"""Gumbel-max sampling keyed by (request seed, absolute position): the deterministic mode's
sampler, shared by plain decoding, verification and the drafter.

The token at position t of a request is argmax_v (x_v / T + g_v) over the kept tokens (top-k /
top-p), with g_v = -log(-log u_v) and u_v a counter-based uniform keyed by (seed, t, v): by the
Gumbel-max theorem that token has law softmax(x / T) restricted to the kept tokens, i.e. exactly
the law `probs_from_logits` gives. Because the noise of position t is fixed before any model runs:
  - plain decoding emits that argmax;
  - verification accepts a draft exactly when it equals that argmax and otherwise emits the
    argmax, so it emits the very tokens plain decoding would (speculation on == off, for any
    drafts and any verify length), and every token still has law p;
  - the drafter draws its own tokens as argmax(x_draft / T + g) with the SAME g (a coupling:
    when q is close to p the two argmaxes agree often), which changes only how often drafts are
    accepted, never what is emitted.
Greedy rows (temperature 0) take the plain argmax.

Every row is computed on its own [V] tensor: elementwise CPU kernels may round the remainder of
a tensor through a scalar path, so a row's values must not depend on where it sits in a batch.
The uniforms have 52 bits (float64, never 0 or 1), so the law is p up to 2**-52 per token.
"""
from __future__ import annotations

import torch

from ..formats.sampling import _M32, Purpose, _mix32
from ..sampling import probs_from_logits

_TWO_M52 = 2.0 ** -52


def _key(seed, position):
    """The hash of (seed, position): Python ints, or int64 tensors of any shape (elementwise;
    a negative int64 seed is its two's complement, as `gumbel_noise` reads it)."""
    h = _mix32((0x9E3779B9 * (int(Purpose.GUMBEL) + 1)) & _M32)
    for word in (seed & _M32, (seed >> 32) & _M32, (position >> 32) & _M32, position & _M32):
        h = _mix32(h ^ word)
    return h


def _noise_of_keys(h, vocab: int, device) -> torch.Tensor:
    """float64 [..., vocab] Gumbel noise of key(s) h: one 32-bit mix per token index for each of
    two words (26 bits kept of each)."""
    v = torch.arange(vocab, dtype=torch.int64, device=device)
    if isinstance(h, torch.Tensor):
        h = h.unsqueeze(-1)
    w1 = _mix32(v ^ h)
    w2 = _mix32(w1 ^ _mix32(h ^ 0x85EBCA6B))
    k = (w1 >> 6) * (1 << 26) + (w2 >> 6)                       # 52 bits
    u = (k.to(torch.float64) + 0.5) * _TWO_M52                   # in (0, 1), exact
    return -torch.log(-torch.log(u))


def _row_noise(seed: int, position: int, vocab: int, device) -> torch.Tensor:
    """float64 [vocab] Gumbel noise of one (seed, position), the key hashed on the host."""
    return _noise_of_keys(_key(seed, position), vocab, device)


def gumbel_noise(seed: int, position: int, vocab: int, device="cpu") -> torch.Tensor:
    """The noise g [vocab] (float64) that decides the token at `position` of the request seeded
    `seed` (any int64)."""
    return _row_noise(int(seed) & ((1 << 64) - 1), int(position), vocab, torch.device(device))


def gumbel_token(row: torch.Tensor, temperature: float, top_k: int, top_p: float, seed: int,
                 position: int) -> int | torch.Tensor:
    """The token at `position` given its (adjusted) logits row [V]: argmax(row) for temperature
    0, else argmax over the kept tokens of row / T + g(seed, position). Returns a 0-d int64
    tensor on row's device (nothing read back)."""
    if temperature == 0:
        return row.argmax()
    x = row.float()
    if top_k > 0 or top_p < 1:
        keep = probs_from_logits(x[None], torch.tensor([float(temperature)]),
                                 torch.tensor([int(top_k)]), torch.tensor([float(top_p)]))[0] > 0
        x = x.masked_fill(~keep, float("-inf"))
    score = (x / float(temperature)).double() + gumbel_noise(seed, position, x.shape[0], x.device)
    return score.argmax()


def gumbel_draws(rows: torch.Tensor, temperature: torch.Tensor, top_k, top_p,
                 seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 [R]: `gumbel_token` of every row of rows [R, V] at once from device tensors
    (temperature [R] fp32, top_k [R] int64 / top_p [R] fp32 or None, seeds / positions [R]
    int64): no host value, so a CUDA graph can hold it (the draft pass's Gumbel sampler, and the
    verifier's on CUDA). Without filters on CUDA: one launch (kernels/gumbel.py). The same keys
    and noise; the batched elementwise ops may round a noise value differently in its
    last bit than a row on its own, which can only change which draft is proposed (the drafts'
    coupling with the target), never what verification emits."""
    if rows.is_cuda and top_k is None and top_p is None:
        from ..kernels.gumbel import gumbel_argmax     # one launch (imports triton: CUDA only)
        return gumbel_argmax(rows, temperature, seeds, positions)
    x = rows.float()
    greedy = temperature == 0
    if top_k is not None or top_p is not None:
        keep = probs_from_logits(x, temperature, top_k, top_p) > 0
        x = x.masked_fill(~keep, float("-inf"))
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    noise = _noise_of_keys(_key(seeds, positions), x.shape[1], x.device)
    score = (x / t[:, None]).double() + noise
    return torch.where(greedy, rows.argmax(1), score.argmax(1))


def gumbel_tokens(rows: torch.Tensor, params, seed: int, positions) -> torch.Tensor:
    """int64 [n]: `gumbel_token` of each row of rows [n, V], deciding `positions[i]`."""
    return torch.stack([gumbel_token(rows[i], params.temperature, params.top_k, params.top_p,
                                     seed, int(p)) for i, p in enumerate(positions)])


__all__ = ["gumbel_draws", "gumbel_noise", "gumbel_token", "gumbel_tokens"]
