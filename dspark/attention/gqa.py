"""GQA attention (Qwen3 targets and the DeepSpec drafter): the causal / bidirectional torch
`attend`, and `PagedGQABackend`, the attention hook over a `PagedGQACache`.

``PagedGQABackend.forward_fn(batch)`` validates the batch against the cache (contiguous
positions, pages reserved), advances each request's length, and returns the
``attn_fn(attn, x, batch, layer_id, quant)`` that ``Qwen3Model.forward_hidden`` accepts. It is
the reference torch path: scatter the batch's K/V into their slots, gather each request's rows
0..end-1 and run the same causal GQA ``attend`` as the dense path (identical numerics).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.kvcache.paged_gqa import PagedGQACache


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
    """q [L, Hq, d], k/v [S, Hkv, d] (GQA), mask [L, S] bool (True = visible) or None -> [L, Hq, d]."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                       v.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)
    return o[0].transpose(0, 1)


@dataclass
class _SegPlan:
    rows: slice            # this segment's rows in the flat batch
    start: int
    end: int
    read: torch.Tensor     # int64 [end] slots of positions 0..end-1
    mask: torch.Tensor     # bool [end - start, end] causal visibility


class PagedGQABackend:
    """Reference torch attention over a ``PagedGQACache`` (see the module docstring)."""

    name = "paged-gqa-reference"

    def __init__(self, cache: PagedGQACache):
        self.cache = cache

    def plan(self, batch) -> tuple[torch.Tensor, list]:
        """Check every segment, then advance lengths; (write slots [T], per-segment plans)."""
        c, seen = self.cache, set()
        for s in batch.segments:
            if s.state in seen:
                raise ValueError(f"request {s.state!r} appears twice in one forward")
            seen.add(s.state)
            c.check_forward(s.state, s.start, s.start + s.length)
        writes, segs = [], []
        dev = c.device
        for s in batch.segments:
            end = s.start + s.length
            c.begin_forward(s.state, s.start, end)
            read = c.slots_for(s.state, 0, end)
            writes.append(read[s.start:])
            qpos = torch.arange(s.start, end, device=dev)
            mask = torch.arange(end, device=dev)[None, :] <= qpos[:, None]
            segs.append(_SegPlan(slice(s.offset, s.offset + s.length), s.start, end, read, mask))
        write = torch.cat(writes) if writes else torch.zeros(0, dtype=torch.long, device=dev)
        return write, segs

    def forward_fn(self, batch):
        write, segs = self.plan(batch)
        c = self.cache

        def attn_fn(attn, x, batch, layer_id, quant=None):
            q = attn.project_q(x, batch.positions)
            k, v = attn.project_kv(x, batch.positions)
            K, V = c.k[layer_id], c.v[layer_id]
            K[write], V[write] = k.to(K.dtype), v.to(V.dtype)
            out = torch.empty_like(q)
            for sp in segs:
                out[sp.rows] = attend(q[sp.rows], K[sp.read], V[sp.read], sp.mask)
            return attn.output(out)

        return attn_fn
