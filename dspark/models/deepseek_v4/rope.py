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
    """cos/sin lookup by absolute position; tables grow on demand."""

    def __init__(self, rope_dim: int, base: float, yarn: dict | None = None):
        self.rope_dim = rope_dim
        self.freqs = rope_frequencies(rope_dim, base, yarn)
        self._cos = self._sin = None

    def _table(self, n: int, device):
        if self._cos is None or self._cos.shape[0] < n or self._cos.device != torch.device(device):
            size = max(n, 2 * (0 if self._cos is None else self._cos.shape[0]), 256)
            ang = torch.arange(size, dtype=torch.float64, device="cpu")[:, None] * self.freqs[None, :]
            self._cos = ang.cos().float().to(device)
            self._sin = ang.sin().float().to(device)
        return self._cos, self._sin

    def apply(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate the last rope_dim dims of x [..., T, (heads,) dim] at positions [T]; returns new x."""
        cos_t, sin_t = self._table(int(positions.max()) + 1 if positions.numel() else 1, x.device)
        cos, sin = cos_t[positions], sin_t[positions]          # [T, r/2]
        while cos.dim() < x.dim():                              # broadcast over head axes
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        if inverse:
            sin = -sin
        r = self.rope_dim
        rot = x[..., -r:].float().unflatten(-1, (r // 2, 2))
        re, im = rot[..., 0], rot[..., 1]
        out = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2)
        return torch.cat((x[..., :-r], out.to(x.dtype)), dim=-1)


def rope_for_layer(cfg, ratio: int) -> Rope:
    if ratio == 0:
        return Rope(cfg.qk_rope_head_dim, cfg.rope_theta)
    yarn = dict(factor=cfg.rope_factor, original_seq_len=cfg.original_seq_len,
                beta_fast=cfg.beta_fast, beta_slow=cfg.beta_slow)
    return Rope(cfg.qk_rope_head_dim, cfg.compress_rope_theta, yarn)
