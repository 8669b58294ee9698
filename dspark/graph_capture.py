"""Capturing a fixed-shape step as a CUDA graph (the V4 draft pass, the Qwen3 and V4 target steps).

Warm the step up on a side stream first: lazy initialisation (cuBLAS handles and workspaces,
Triton compiles) must not happen inside a capture. Then capture into a memory pool shared by all
graphs of one owner (their replays are serial).
"""
from __future__ import annotations

import torch


def warm_up(fn, times: int = 1, device=None) -> None:
    """Run ``fn()`` ``times`` on a side stream, ordered after and before the current stream."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)


def capture(fn, pool):
    """(graph, outputs of ``fn()``) with ``fn()`` captured into memory pool ``pool``."""
    graph = torch.cuda.CUDAGraph()
    # thread_local: other threads (an async server's loop) may use CUDA meanwhile
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        outputs = fn()
    return graph, outputs
