"""The bit-exact contract that the torch sampling / verification code (dspark.sampling,
dspark.spec.verify) and the fused Triton kernels (dspark.kernels.sampling) share, as leaf code
both import: the counter-based random stream (its 32-bit mixer and the purposes that key its
independent streams), verification's constants, its result and its argument check. Any change
here changes both paths at once: the kernels are tested equal to the torch path.
"""
from __future__ import annotations

import enum
from typing import NamedTuple

import torch

_M32 = 0xFFFFFFFF


class Purpose(enum.IntEnum):
    """Independent random streams. RESIDUAL also covers the bonus token and plain decode samples:
    exactly one target-side token is sampled per position, so they never collide."""
    DRAFT = 1
    ACCEPT = 2
    RESIDUAL = 3
    GUMBEL = 4      # deterministic mode: per-(position, token) noise shared by target and drafter


def _mix32(x):
    # 32-bit xorshift-multiply finaliser (a bijection on [0, 2**32) with good avalanche), so
    # chaining it over the key words gives well-spread outputs. Both multipliers are < 2**31: the
    # int64 product of a 32-bit value never overflows, so results are exact and identical on every
    # device (no reliance on signed wrap-around). Works on Python ints too (host-side constants).
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


RESIDUAL_EPS = 1e-8  # below this residual mass, fall back to p (DeepSpec sample_residual)
Q_FLOOR = 1e-8       # q is clamped so p/q stays finite for a token q (wrongly) gave ~0 mass


class VerifyResult(NamedTuple):
    accepted: torch.Tensor    # int64 [R]: leading run of accepted drafts, 0..ℓ_r
    next_token: torch.Tensor  # int64 [R]: corrected (a < ℓ) or bonus (a = ℓ) token, next anchor


def _check(draft_tokens, target_rows, lengths):
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [R, γ], got shape {tuple(draft_tokens.shape)}")
    r, g = draft_tokens.shape
    if g < 1:
        raise ValueError("draft_tokens must have γ >= 1 columns (pass lengths 0 to verify none)")
    if target_rows.shape[:2] != (r, g + 1):
        raise ValueError(f"target rows must be [R, γ+1, ...] = [{r}, {g + 1}, ...], "
                         f"got {tuple(target_rows.shape)}")
    if lengths.shape != (r,):
        raise ValueError(f"lengths must be [R] = [{r}], got {tuple(lengths.shape)}")
