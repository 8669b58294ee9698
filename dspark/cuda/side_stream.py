"""Independent work on a second CUDA stream, so that its kernels overlap the ones issued
meanwhile on the current stream.

A batch-1 decode step is a chain of ~150 small kernels, each paying a fixed launch / ramp-up /
tail cost that no single kernel can hide (H200: a pure read of 9 MB in one kernel takes ~4 us
from a cold L2, 2.2 TB/s). Branches of the step that do not depend on each other (the shared
expert next to the router and the routed experts) can run side by side instead:

    side = fork(x.device)                    # None: run inline (CPU, or debug.NO_SIDE_STREAMS)
    with on(side):
        shared = shared_expert(x)            # kernels queued on the side stream
    routed = ...                             # kernels queued on the current stream meanwhile
    join(side)                               # the current stream waits for the side work
    out = routed + shared

`record(side)` marks what is queued on a lane so far and `wait(other, mark)` makes another lane
wait for just that part (a branch that needs an early result of a lane, not the whole lane).

Inside a CUDA-graph capture fork / join become edges of the graph (parallel branches; allocations
of a stream forked from the capturing one go to the graph's pool). `fork(device, lane)` keeps one
stream per lane (lane 1, 2, ...: branches that should also overlap each other).

Kernels that keep device scratch across launches (the arrival counters of the split-K FP8 and
gate kernels) take one buffer per `lane()`: two branches may run such kernels at the same time.
Lazily built state that both branches read (e.g. a RoPE table) must exist before the fork.

Memory: tensors made on a side stream and read on the current one are read after `join`, and
the side stream only runs work forked after that read was queued, so the allocator's per-stream
reuse cannot hand their blocks to a writer too early; inputs of the side work stay alive until
after `join` (the caller holds them).
"""
from __future__ import annotations

import contextlib
import threading

import torch

from dspark import debug

_STREAMS: dict = {}          # (device index, lane) -> stream
_LANE_OF: dict = {}          # stream -> lane
_CURRENT = threading.local()


def lane() -> int:
    """The lane whose stream `on` made current in this thread (0: the main stream)."""
    return getattr(_CURRENT, "lane", 0)


def enabled() -> bool:
    """Whether branches run on side streams: not with dspark.debug.NO_SIDE_STREAMS, nor in a
    tensor-parallel process group (a branch may hold a collective, the TP indexer's all-gather,
    and collectives stay on the one stream they are ordered on)."""
    if debug.NO_SIDE_STREAMS:
        return False
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


# The side lanes' streams have a higher priority than the main stream's, so the block scheduler
# hands SMs to their (small, latency-bound) kernels before the remaining programs of a big
# main-stream kernel; in a CUDA graph the priority is each kernel node's (PyTorch instantiates
# graphs with cudaGraphInstantiateFlagUseNodePriority). Why (H200 timeline, batch-1 decode): the
# shared expert's SwiGLU and down GEMV waited ~20 us behind the routed experts' 3072-program
# gate/up kernel, and the routed down kernel, which adds the shared output, then waited 4-7 us
# for them (with the priority alone the router beside the shared GEMV took 15 instead of 7 us:
# QuantMoE puts it on a high-priority lane as well). V4-Flash widths, 4 layers, batch-1 decode
# graph: device time per step 0.916 ms with it vs 0.924 without.
SIDE_PRIORITY = -1


def fork(device: torch.device, lane: int = 1) -> torch.cuda.Stream | None:
    """The device's stream of side lane `lane` (>= 1), made to wait for the work queued so far on
    the current stream (forking a lane again adds that wait); None off CUDA or when disabled
    (then `on(None)` runs inline and `join(None)` is a no-op)."""
    if device.type != "cuda" or not enabled():
        return None
    assert lane >= 1, lane
    index = device.index if device.index is not None else torch.cuda.current_device()
    side = _STREAMS.get((index, lane))
    if side is None:
        side = _STREAMS[index, lane] = torch.cuda.Stream(
            device=index, priority=SIDE_PRIORITY)
        _LANE_OF[side] = lane
    side.wait_stream(torch.cuda.current_stream(index))
    return side


@contextlib.contextmanager
def on(side: torch.cuda.Stream | None):
    """Context that queues its kernels on `side` (inline when None)."""
    if side is None:
        yield
        return
    before = lane()
    _CURRENT.lane = _LANE_OF[side]
    try:
        with torch.cuda.stream(side):
            yield
    finally:
        _CURRENT.lane = before


def record(side: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """A point in `side`'s queue (everything queued on it so far) that another lane can `wait`
    for without waiting for what `side` runs after it; None inline."""
    if side is None:
        return None
    event = torch.cuda.Event()
    event.record(side)
    return event


def wait(side: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
    """`side` runs what is queued on it next only after `event` (from `record`) happened."""
    if side is not None and event is not None:
        side.wait_event(event)


def join(side: torch.cuda.Stream | None) -> None:
    """The current stream waits for everything queued on `side` so far."""
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)
