"""Interleaved (GPT-J style) rotary embedding on the last `rope_dim` dims of a vector.

Sliding-window layers (ratio 0) use plain `rope_theta`; compressed layers use
`compress_rope_theta` with YaRN frequency blending and *no* mscale (spec §3.3). One table per
kind, shared by queries, window kv, compressed entries and indexer q/keys of that layer.
"""
from __future__ import annotations

import math

import torch


def rope_frequencies(rope_dim: int, base: float, yarn: dict | None = None) -> torch.Tensor:
    """Angular frequency per rotated pair, float64 [rope_dim // 2]."""
    # explicit cpu: modules may be built under a meta-device context
    theta = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float64, device="cpu") / rope_dim))
    if yarn is None:
        return theta
    factor, orig = yarn["factor"], yarn["original_seq_len"]

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(yarn["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(yarn["beta_slow"])), rope_dim - 1)
    if low == high:
        high += 0.001  # avoid 0/0 in the ramp, as the reference does
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
    return theta / factor * ramp + theta * (1 - ramp)


class Rope:
    """Rotation by absolute position as a complex multiply with a cached e^{i·pos·freq} table.

    x's rotated pairs (re, im) times (cos + i·sin) is (re·cos − im·sin, re·sin + im·cos): the
    reference formula in one op instead of ~10; the inverse rotation multiplies by the stored
    conjugate (cos − i·sin), which is the reference's sin → −sin. Tables grow on demand, one per
    device. (Rows are gathered per call on purpose: caching them by `positions` identity would go
    stale under in-place updated static buffers, e.g. CUDA-graph inputs.)
    """

    def __init__(self, rope_dim: int, base: float, yarn: dict | None = None):
        self.rope_dim = rope_dim
        self.freqs = rope_frequencies(rope_dim, base, yarn)
        self._tables = {}      # device -> (cis [size, r/2] complex64, its conjugate)
        # tables outgrown, kept alive: a CUDA graph captured with one (another engine's, which
        # shares this Rope) still reads it by address
        self._retired = []

    def _table(self, n: int, device):
        device = torch.device(device)
        table = self._tables.get(device)
        if table is None or table[0].shape[0] < n:
            size = max(n, 2 * (0 if table is None else table[0].shape[0]), 256)
            # in blocks of 256 positions: a row's cos / sin never depend on the table's size
            # (a multi-threaded CPU kernel may round a chunk's remainder through a scalar path,
            # and where chunks end depends on the size; deterministic mode needs every row fixed)
            cos, sin = [], []
            for lo in range(0, size, 256):
                pos = torch.arange(lo, min(lo + 256, size), dtype=torch.float64, device="cpu")
                ang = pos[:, None] * self.freqs[None, :]
                cos.append(ang.cos().float()), sin.append(ang.sin().float())
            cos, sin = torch.cat(cos), torch.cat(sin)
            if device in self._tables:
                self._retired.append(self._tables[device])
            table = (torch.complex(cos, sin).to(device), torch.complex(cos, -sin).to(device))
            self._tables[device] = table
        return table

    def table(self, bound: int, device, inverse: bool = False) -> torch.Tensor:
        """complex64 [>= bound, r/2]: e^{±i·p·freq} for every position p < bound (a view of the
        cached table; kernels index it by position themselves)."""
        cis, conj = self._table(max(bound, 1), device)
        return conj if inverse else cis

    def rows(self, positions: torch.Tensor, device, inverse: bool = False,
             bound: int | None = None, memo: dict | None = None) -> torch.Tensor:
        """complex64 [T, r/2]: e^{±i·p·freq} for each position p (− for the inverse rotation).

        ``bound``: a host-side int > every position (the caller knows its positions on the host:
        Batch.position_bound, the attention plan). Without it the table size is read from
        ``positions`` — a device->host sync on GPU. ``memo``: a dict owned by ONE forward and
        used only with that forward's positions tensor; rows gathered once per (table, direction)
        are reused by every layer of the forward."""
        if memo is not None:
            key = (id(self), torch.device(device), inverse)
            got = memo.get(key)
            if got is None:
                got = memo[key] = self.rows(positions, device, inverse, bound)
            return got
        if bound is None:
            bound = int(positions.max()) + 1 if positions.numel() else 1
        cis, conj = self._table(max(bound, 1), device)
        return (conj if inverse else cis)[positions]

    def apply(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False,
              bound: int | None = None, memo: dict | None = None) -> torch.Tensor:
        """Rotate the last rope_dim dims of x [..., T, (heads,) dim] at positions [T]; returns new x.
        ``bound``, ``memo``: see ``rows``."""
        return rotate(x, self.rows(positions, x.device, inverse, bound, memo), self.rope_dim)


def rotate(x: torch.Tensor, cis: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """x [..., T, (heads,) dim] with its last rope_dim dims (interleaved pairs) multiplied by the
    unit complex rows cis [T, rope_dim/2]; returns a new tensor in x's dtype."""
    while cis.dim() < x.dim():                                  # broadcast over head axes
        cis = cis.unsqueeze(-2)
    r = rope_dim
    pairs = x[..., -r:].float().unflatten(-1, (r // 2, 2))
    if pairs.storage_offset() % 2 or any(st % 2 for st in pairs.stride()[:-1]):
        pairs = pairs.contiguous()                              # view_as_complex needs even strides
    out = torch.view_as_real(torch.view_as_complex(pairs) * cis).flatten(-2)
    return torch.cat((x[..., :-r], out.to(x.dtype)), dim=-1)


_SHARED: dict = {}


def rope_for_layer(cfg, ratio: int) -> Rope:
    """The Rope of a layer kind: one shared instance (and table) per distinct (dim, base, YaRN)."""
    if ratio == 0:
        key = (cfg.qk_rope_head_dim, cfg.rope_theta, None)
    else:
        key = (cfg.qk_rope_head_dim, cfg.compress_rope_theta,
               (("factor", cfg.rope_factor), ("original_seq_len", cfg.original_seq_len),
                ("beta_fast", cfg.beta_fast), ("beta_slow", cfg.beta_slow)))
    if key not in _SHARED:
        _SHARED[key] = Rope(key[0], key[1], dict(key[2]) if key[2] else None)
    return _SHARED[key]
