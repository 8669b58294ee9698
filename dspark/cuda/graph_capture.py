"""Capturing a fixed-shape step as a CUDA graph (the V4 draft pass, the Qwen3 and V4 target steps).

Warm the step up on a side stream first: lazy initialisation (cuBLAS handles and workspaces,
Triton compiles) must not happen inside a capture. Then capture into a memory pool shared by all
graphs of one owner (their replays are serial).

Buffers a kernel keeps across launches (arrival counters, shared tables) are baked into every
graph captured while they were current: `held_buffer` grows such a buffer without ever freeing
the one it replaces, so an older graph never writes into memory the allocator has handed to
another tensor (or returned to the driver: an illegal address).
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


def pow2_buckets(limit: int) -> list:
    """1, 2, 4, ... below `limit`, then `limit` itself."""
    return [b for b in (1 << i for i in range(limit.bit_length())) if b < limit] + [limit]


# why a step carrying a prompt chunk wider than every captured width runs eagerly
PROMPT_STEP = "prefill / mixed step"


def step_bucket(items, q_lens, batch_buckets: list, page_buckets: list, block_size: int):
    """(batch bucket, q, page bucket) of a decode / verify step [(request id, start, tokens)]:
    every request feeds the same q (one of `q_lens`) and the batch and the pages each request
    needs fit the largest buckets; None otherwise (the step runs eagerly)."""
    fit = step_fit(items, q_lens, batch_buckets, page_buckets, block_size)
    return None if isinstance(fit, str) else fit


def step_fit(items, q_lens, batch_buckets: list, page_buckets: list, block_size: int):
    """`step_bucket`'s bucket, or the reason (a str) why the step does not fit one."""
    if not items:
        return "empty step"
    if len(items) > batch_buckets[-1]:
        return "batch too large"
    lens = {len(t) for _, _, t in items}
    if max(lens) > max(q_lens):
        return PROMPT_STEP
    if len(lens) > 1:
        return "ragged lengths"
    q = lens.pop()
    if q not in q_lens:
        return "query length not captured"
    need = max(-(-(start + q) // block_size) for _, start, _ in items)
    if need > page_buckets[-1]:
        return "context past the largest page bucket"
    B = next(b for b in batch_buckets if b >= len(items))
    P = next(p for p in page_buckets if p >= need)
    return B, q, P


# buffers replaced by larger ones, kept alive for the graphs captured with them
_RETIRED: list = []


def held_buffer(store: dict, key, numel: int, make):
    """store[key] if it has at least `numel` elements, else a new one from make(n), n >= numel
    and at least twice the old size (it replaces the old buffer, which is kept alive, never
    freed: graphs may hold its address)."""
    buf = store.get(key)
    if buf is None or buf.numel() < numel:
        if buf is not None:
            _RETIRED.append(buf)
            numel = max(numel, 2 * buf.numel())     # doubling: the kept ones sum to < the live one
        buf = store[key] = make(numel)
    return buf
