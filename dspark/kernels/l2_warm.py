"""Weights read into L2 ahead of the GEMV that needs them, while the memory bus is idle: opt-in
DSPARK_L2_WARM=1, staged in session 16 and not yet timed in the decode step on a GPU.

    lane = warm_ahead((attn.wo_a,), device)   # a low-priority side lane reads wo_a's bytes
    ...                                       # the attention core, on the current stream
    out = attn.output(o, ...)                 # wo_a's GEMV finds (most of) its bytes in L2
    side_stream.join(lane)

Why: in the batch-1 decode step the attention core (sparse MQA, combine, small norm kernels:
~15-20 us per layer) reads little from HBM, and the output projections after it are 33.6 MB
GEMVs that cost their HBM ramp and tail. H200, session 16 (bench_decode_kernels, fp8_gemv_tc,
1 token): wo_a's 8 groups 12.9 us with a cold L2, 8.4 us with its weights already in L2; wq_b
11.9 vs 8.2, wo_b 13.2 vs 8.5. Session 14's attempt issued `cp.async.bulk.prefetch.L2` hints
and measured no gain (the GEMVs took the same time); here the bytes are loaded for real (16-byte
loads marked evict-last, folded into one word per program so nothing is optimised away), so
they are in L2 when the kernel ends. The lane runs at the main stream's priority (the other side
lanes are high-priority) so that the attention core's kernels get SMs first. Bytes per phase:
DSPARK_L2_WARM_MB (default 32: the H200's L2 is 50 MB).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dspark.models import side_stream

LANE = 9
PROGRAMS = 264            # 2 per H200 SM
BLOCK = 1024              # int32 words per program step (8 per thread at 4 warps: 2 x 16 B)
_SINKS: dict = {}


def enabled(device: torch.device) -> bool:
    return (device.type == "cuda" and os.environ.get("DSPARK_L2_WARM", "0") == "1"
            and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"))


def max_bytes() -> int:
    return int(float(os.environ.get("DSPARK_L2_WARM_MB", "32")) * (1 << 20))


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _warm_kernel(words_ptr, n_words, per_prog, sink_ptr, BLOCK: tl.constexpr):
    """Program p reads words p * per_prog .. (evict-last) and stores their XOR at sink[p]."""
    pid = tl.program_id(0)
    lo = pid * per_prog
    hi = tl.minimum(lo + per_prog, n_words)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for off in range(lo, hi, BLOCK):
        i = off + tl.arange(0, BLOCK)
        acc ^= tl.load(words_ptr + i, mask=i < hi, other=0, eviction_policy="evict_last")
    tl.store(sink_ptr + pid, tl.reduce(acc, 0, _xor))


def _sink(device: torch.device) -> torch.Tensor:
    key = (device, side_stream.lane())
    if key not in _SINKS:
        _SINKS[key] = torch.zeros(PROGRAMS, dtype=torch.int32, device=device)
    return _SINKS[key]


def warm(t: torch.Tensor, limit: int | None = None) -> torch.Tensor:
    """Read the first `limit` bytes (all by default; whole 4-byte words) of a contiguous tensor
    on the current stream; returns the per-program XOR words (the sink)."""
    words = t.reshape(-1).view(torch.uint8)
    n = words.numel() if limit is None else min(words.numel(), limit)
    words = words[: n // 4 * 4].view(torch.int32)
    progs = max(1, min(PROGRAMS, triton.cdiv(words.numel(), BLOCK)))
    per = triton.cdiv(triton.cdiv(words.numel(), progs), BLOCK) * BLOCK
    sink = _sink(t.device)
    _warm_kernel[(progs,)](words, words.numel(), per, sink, BLOCK=BLOCK, num_warps=4)
    return sink[:progs]


def warm_ahead(modules, device: torch.device):
    """Queue reads of these linear layers' weights (in order, up to DSPARK_L2_WARM_MB) on the
    low-priority lane forked here; returns the lane for `side_stream.join` (None: nothing
    queued, e.g. not enabled)."""
    if not enabled(device):
        return None
    lane = side_stream.fork(device, LANE, priority=0)
    if lane is None:
        return None
    left = max_bytes()
    with side_stream.on(lane):
        for m in modules:
            w = getattr(m, "weight", None)
            if left <= 0 or not isinstance(w, torch.Tensor) or not w.is_contiguous():
                continue
            warm(w, left)
            left -= w.numel() * w.element_size()
    return lane
