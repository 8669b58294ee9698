"""Dense, position-indexed per-request state for the reference decoder path.

Every cached quantity is stored at its absolute position (window kv, compressor rows) or at its
entry index j = p // ratio (compressed entries, indexer keys). A forward over positions [s, e)
overwrites exactly those slots, so rolling a request back to length n is free: the next forward
simply starts writing at n (spec §4.5, dspark.md §5.3). The paged engine (dspark/kvcache) keeps
the same contract with bounded memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def _grow(t: torch.Tensor | None, n: int, width: int, dtype, device, fill=0.0) -> torch.Tensor:
    if t is not None and t.shape[0] >= n:
        return t
    cap = max(n, 64 if t is None else 2 * t.shape[0])
    new = torch.full((cap, width), fill, dtype=dtype, device=device)
    if t is not None:
        new[: t.shape[0]] = t
    return new


@dataclass
class LayerState:
    kv: torch.Tensor | None = None        # [pos, head_dim] window kv (post norm + RoPE)
    comp_a: torch.Tensor | None = None    # [pos, c*d] compressor values (fp32)
    comp_z: torch.Tensor | None = None    # [pos, c*d] compressor gate logits incl. ape (fp32)
    entries: torch.Tensor | None = None   # [j, head_dim] compressed entries
    idx_a: torch.Tensor | None = None     # indexer compressor rows
    idx_z: torch.Tensor | None = None
    idx_keys: torch.Tensor | None = None  # [j, index_head_dim]


class DenseState:
    """All layers' state for one request. Created empty; sized on first write."""

    def __init__(self, num_layers: int):
        self.layers = [LayerState() for _ in range(num_layers)]

    @staticmethod
    def write(st: LayerState, name: str, start: int, rows: torch.Tensor, fill=0.0):
        cur = getattr(st, name)
        t = _grow(cur, start + rows.shape[0], rows.shape[1], rows.dtype, rows.device, fill)
        t[start:start + rows.shape[0]] = rows
        setattr(st, name, t)
