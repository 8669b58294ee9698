"""Rank-sharded checkpoint loading: each rank reads only its slices of each tensor.

    weights = load_checkpoint_shard("/ckpt", cfg, rank=1, world=4)   # {official name: local part}

Same validation as `dspark.models.loader.load_checkpoint` (shard headers against the inventory,
one CheckpointError listing every problem). Then, for every tensor this rank holds (ShardPlan), the
rows/columns it needs are read with `safe_open(...).get_slice(name)[...]` and de-quantized on the
slice: an FP8 weight reads the 128-aligned superset of its rows/columns and the matching 128x128
scale tiles, an FP4 weight reads whole 32-column groups of packed bytes and their scales; after
`dequant_fp8_blocks` / `dequant_fp4_experts` the superset is cropped, so the result equals slicing
the fully de-quantized tensor bit for bit. Routed experts of other ranks are never read.

keep_quantized=True (weight_format="quantized"): FP8 / FP4 weights stay as stored: the rank's
rows/columns of the e4m3 codes (packed int8 for FP4) and exactly the scale tiles / groups under
them, under the official `.scale` names (what `QuantLinear` loads). The split must fall on the
scale blocks (`sharding.check_quantized_split`); otherwise a ValueError names the tensor.
"""
from __future__ import annotations

import math
import os

import torch
from tqdm.auto import tqdm

from dspark.config import ModelConfig
from dspark.models.deepseek_v4.weights import scale_name, tensor_inventory
from dspark.models.loader import (_REGENERATE, CheckpointError, _headers, _open, _shard_map,
                                  _validate, cast_float, held_dtype, load_checkpoint,
                                  log_float_casts)
from dspark.formats.quant import FP4_GROUP, FP8_BLOCK, dequant_fp4_experts, dequant_fp8_blocks

from .sharding import SKIP, ShardPlan, quantized_split_problem


def _bounds(sl: slice, n: int) -> tuple[int, int]:
    start, stop, step = sl.indices(n)
    if step != 1:
        raise ValueError("sharded reads need contiguous slices")
    return start, stop


def _fp8_slice(w_sl, s_sl, shape, sl, dtype) -> torch.Tensor:
    """Rows/cols `sl` of an FP8 weight with 128x128 tiles, de-quantized."""
    (r0, r1), (c0, c1) = (_bounds(s, n) for s, n in zip(sl, shape))
    a, b = r0 // FP8_BLOCK * FP8_BLOCK, c0 // FP8_BLOCK * FP8_BLOCK      # tile-aligned starts
    w = w_sl[a:r1, b:c1]
    s = s_sl[a // FP8_BLOCK: math.ceil(r1 / FP8_BLOCK), b // FP8_BLOCK: math.ceil(c1 / FP8_BLOCK)]
    return dequant_fp8_blocks(w, s, dtype)[r0 - a:, c0 - b:].contiguous()


def _fp4_slice(w_sl, s_sl, shape, sl, dtype) -> torch.Tensor:
    """Rows/cols `sl` (logical columns) of a packed FP4 weight with 1x32 groups, de-quantized."""
    (r0, r1), (c0, c1) = (_bounds(s, n) for s, n in zip(sl, shape))
    b = c0 // FP4_GROUP * FP4_GROUP
    e = min(shape[1], math.ceil(c1 / FP4_GROUP) * FP4_GROUP)                # whole groups
    w = w_sl[r0:r1, b // 2: e // 2]
    s = s_sl[r0:r1, b // FP4_GROUP: math.ceil(e / FP4_GROUP)]
    return dequant_fp4_experts(w, s, dtype)[:, c0 - b: c1 - b].contiguous()


def _fp8_raw_slice(w_sl, s_sl, shape, sl):
    """Rows/cols `sl` of an FP8 weight as stored (e4m3 codes) + the scale tiles under them."""
    (r0, r1), (c0, c1) = (_bounds(s, n) for s, n in zip(sl, shape))
    w = w_sl[r0:r1, c0:c1]
    s = s_sl[r0 // FP8_BLOCK: (r1 - 1) // FP8_BLOCK + 1, c0 // FP8_BLOCK: (c1 - 1) // FP8_BLOCK + 1]
    return w, s


def _fp4_raw_slice(w_sl, s_sl, shape, sl):
    """Rows/cols `sl` (logical columns; cols start on a 32-group) of a packed FP4 weight + its
    scale groups."""
    (r0, r1), (c0, c1) = (_bounds(s, n) for s, n in zip(sl, shape))
    w = w_sl[r0:r1, c0 // 2: math.ceil(c1 / 2)]
    s = s_sl[r0:r1, c0 // FP4_GROUP: math.ceil(c1 / FP4_GROUP)]
    return w, s


def load_checkpoint_shard(path: str, cfg: ModelConfig, rank: int, world: int,
                          dtype: torch.dtype = torch.float32, device="cpu",
                          progress: bool = False, include=None,
                          keep_quantized: bool = False) -> dict[str, torch.Tensor]:
    """{official name: this rank's part} for every tensor the rank holds (see ShardPlan), with the
    dtypes of `load_checkpoint` (fp8/fp4/bf16 weights as `dtype`, fp32 params as float32, the hash
    table as int64; unquantized tensors stored in another float dtype are cast, rank 0 logs
    what), on `device`. `include(name) -> bool` restricts the tensors read (e.g. no
    `mtp.*` without a drafter). world == 1 without `include` reads everything with
    `load_checkpoint`; with it, only the tensors asked for.
    keep_quantized: fp8 / fp4 weights as stored plus their `.scale` entries (module docstring)."""
    if world == 1 and include is None:
        out = load_checkpoint(path, cfg, dtype=dtype, device=device, progress=progress,
                              keep_quantized=keep_quantized)
        return {k: v for k, v in out.items() if include is None or include(k)}
    if not os.path.isdir(path):
        raise CheckpointError(f"{path!r} is not a directory; pass the checkpoint directory that holds "
                              f"config.json and the *.safetensors files")
    plan = ShardPlan(cfg, rank, world)
    inventory = tensor_inventory(cfg)
    found = _headers(path, _shard_map(path))
    _validate(path, cfg, found)
    if rank == 0:       # every rank casts the same way: one report for the whole checkpoint
        log_float_casts(path, cfg, found, dtype)

    handles: dict[str, object] = {}

    def sliced(canon: str):
        shard, fname = found[canon][0], found[canon][1]
        if shard not in handles:
            handles[shard] = _open(path, shard).__enter__()
        return handles[shard].get_slice(fname)

    wanted = [(n, s) for n, s in inventory.items()
              if plan.slices(n) is not SKIP and (include is None or include(n))]
    out = {}
    try:
        for name, spec in tqdm(wanted, desc=f"loading rank {rank}/{world}", unit="tensor",
                               disable=not progress):
            sl = plan.slices(name)
            if keep_quantized and spec.kind in ("fp8", "fp4"):
                why = quantized_split_problem(name, spec.kind, spec.shape, sl)
                if why:
                    raise ValueError(f"weight_format='quantized', tensor_parallel_size={world}: "
                                     f"rank {rank}'s part of {why}; use weight_format='bf16'")
            try:
                if keep_quantized and spec.kind in ("fp8", "fp4"):
                    full = tuple(slice(None) for _ in spec.shape)
                    read = _fp8_raw_slice if spec.kind == "fp8" else _fp4_raw_slice
                    w, s = read(sliced(name), sliced(scale_name(name)), spec.shape, sl or full)
                    out[scale_name(name)] = s.contiguous().to(device)
                    t = w.contiguous()
                elif spec.kind in ("fp8", "fp4"):
                    full = tuple(slice(None) for _ in spec.shape)
                    read = _fp8_slice if spec.kind == "fp8" else _fp4_slice
                    t = read(sliced(name), sliced(scale_name(name)), spec.shape, sl or full, dtype)
                else:
                    t = sliced(name)[tuple(sl)] if sl else sliced(name)[:]
                    t = cast_float(t, held_dtype(spec.kind, dtype), name)
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"{path}: cannot read rank {rank}'s part of {name} "
                                      f"({type(e).__name__}: {e}); Fix: {_REGENERATE}") from None
            out[name] = t.to(device)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return out
