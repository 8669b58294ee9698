"""`norm_rope`: RMSNorm and / or RoPE with the roundings of the model's torch code, one fused
Triton launch on CUDA (dspark.kernels.norm_rope) instead of 3-8 small ops.

The torch composition below is the definition (and what runs on CPU and under autograd). A rope
is anything with `Rope`'s table / rows contract: the layers' `Rope` and the drafter's `DraftRope`."""
from __future__ import annotations

import torch

from .norm import fused_kernels, rms_normalize


def norm_rope(x: torch.Tensor, rope, positions: torch.Tensor, norm=None, eps: float = 1e-6,
              inverse: bool = False, bound: int | None = None, memo: dict | None = None,
              dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None):
    """rope(norm(x.to(dtype))) in dtype (default x.dtype), returned as out_dtype (default dtype).

    norm: an RMSNorm module, "unweighted" (rms_normalize with `eps`: the per-head query norm) or
    None (x is only cast, then rotated). rope None: no rotation. ``inverse``, ``bound``,
    ``memo``: as in Rope.apply."""
    dtype = dtype or x.dtype
    out = out_dtype or dtype
    weight = norm.weight if norm is not None and norm != "unweighted" else None
    k = fused_kernels(x, dtype, out, *(() if weight is None else (weight,)))
    if k is not None and (rope is None or hasattr(rope, "table")) and (
            weight is None or weight.is_contiguous()):
        # any rope with Rope's table / rows contract (the drafter's DraftRope too); a rope
        # holding a host-side bound of its own (DraftRope inside `bounded`) lends it here
        if bound is None and rope is not None:
            bound = getattr(rope, "bound", None)
        cis, pos = None, None
        if rope is not None and bound is not None:     # the kernel gathers the table's rows
            cis, pos = rope.table(bound, x.device, inverse), positions
        elif rope is not None:
            cis = rope.rows(positions, x.device, inverse, bound, memo)
        norm_eps = None if norm is None else (eps if weight is None else norm.eps)
        return k.norm_rope(x, weight, norm_eps, cis, 0 if rope is None else rope.rope_dim,
                           dtype, out, positions=pos)
    if norm is None:
        x = x.to(dtype)
    elif weight is None:
        x = rms_normalize(x.to(dtype), eps).to(dtype)
    else:
        x = norm(x.to(dtype))
    if rope is not None:
        x = (rope.apply(x, positions, inverse) if bound is None and memo is None
             else rope.apply(x, positions, inverse, bound=bound, memo=memo))
    return x.to(out)
