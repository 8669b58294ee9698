"""Independent work on a second CUDA stream, so that its kernels overlap the ones issued
meanwhile on the current stream.

A batch-1 decode step is a chain of ~150 small kernels, each paying a fixed launch / ramp-up /
tail cost that no single kernel can hide (H200: a pure read of 9 MB in one kernel takes ~4 us
from a cold L2, 2.2 TB/s). Branches of the step that do not depend on each other (the shared
expert next to the router and the routed experts) can run side by side instead:

    side = fork(x.device)                    # None: run inline (CPU, or DSPARK_SIDE_STREAM=0)
    with on(side):
        shared = shared_expert(x)            # kernels queued on the side stream
    routed = ...                             # kernels queued on the current stream meanwhile
    join(side)                               # the current stream waits for the side work
    out = routed + shared

Inside a CUDA-graph capture fork / join become edges of the graph (parallel branches; allocations
of a stream forked from the capturing one go to the graph's pool). Memory: tensors made on the
side stream and read on the current one are read after `join`, and the side stream only runs
work forked after that read was queued, so the allocator's per-stream reuse cannot hand their
blocks to a writer too early; inputs of the side work stay alive until after `join` (the caller
holds them).
"""
from __future__ import annotations

import contextlib
import os

import torch

_STREAMS: dict = {}


def enabled() -> bool:
    """DSPARK_SIDE_STREAM=0 runs every branch inline on the current stream (A/B switch)."""
    return os.environ.get("DSPARK_SIDE_STREAM", "1") != "0"


def fork(device: torch.device) -> torch.cuda.Stream | None:
    """The device's side stream, made to wait for the work queued so far on the current stream;
    None off CUDA or when disabled (then `on(None)` runs inline and `join(None)` is a no-op)."""
    if device.type != "cuda" or not enabled():
        return None
    key = device.index if device.index is not None else torch.cuda.current_device()
    side = _STREAMS.get(key)
    if side is None:
        side = _STREAMS[key] = torch.cuda.Stream(device=key)
    side.wait_stream(torch.cuda.current_stream(key))
    return side


def on(side: torch.cuda.Stream | None):
    """Context that queues its kernels on `side` (inline when None)."""
    return torch.cuda.stream(side) if side is not None else contextlib.nullcontext()


def join(side: torch.cuda.Stream | None) -> None:
    """The current stream waits for everything queued on `side` so far."""
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)
