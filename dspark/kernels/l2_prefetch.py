"""Weights pulled into L2 ahead of the kernel that reads them, while the memory bus is idle.

A batch-1 decode step alternates memory-bound GEMVs (FP8 projections: the HBM read is the cost)
with phases that leave most of the bandwidth unused: the routed experts' FP4 kernels are bound by
their decode instructions (~1.5 TB/s of the H200's ~4.3), the attention core and the small norm /
mHC kernels read little. Weights never change during a step, so the next projection's bytes can
be fetched during such a phase; its GEMV then reads them from L2 instead of paying the HBM ramp.

    ahead = prefetch_during(tensors, device)    # side lane: one kernel of bulk L2 prefetches
    ...                                         # the phase it overlaps, on the current stream
    side_stream.join(ahead)

The kernel issues `cp.async.bulk.prefetch.L2.global` (the TMA unit fetches each chunk; nothing
waits for it and nothing is written), one CHUNK per thread. It changes no value, only where the
later loads hit. `weight_eviction` (DSPARK_EVICT_FIRST=1) marks the streaming kernels' own
weight loads evict-first, so that their bytes leave L2 before the prefetched ones. Off by default: DSPARK_L2_PREFETCH=1 (plain) or =last (lines marked
evict-last, so streaming loads evict other lines first); DSPARK_L2_PREFETCH_MB caps the bytes of
one phase (default 24: the H200's L2 is 50 MB in two halves). CUDA with SM 9.0+ only (bulk
copies); a no-op elsewhere, under the interpreter, and while a capture would have to build a new
plan (plans are device tensors, built on the eager warm-up step before capture).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from dspark.models import side_stream

CHUNK = 32 << 10           # bytes per bulk prefetch (one per thread)
BLOCK = 32                 # chunks per program (one warp)
LANE = 9                   # the side lane the prefetch kernels run on
MODES = ("0", "1", "last")


def mode() -> str:
    m = os.environ.get("DSPARK_L2_PREFETCH", "0")
    if m not in MODES:
        raise ValueError(f"DSPARK_L2_PREFETCH={m!r}: use one of {', '.join(MODES)}")
    return m


def max_bytes() -> int:
    return int(float(os.environ.get("DSPARK_L2_PREFETCH_MB", "24")) * (1 << 20))


def weight_eviction() -> str:
    """The L2 eviction policy of the weight-streaming kernels' weight loads (the FP8 skinny GEMV,
    the grouped FP4 MoE): "evict_first" with DSPARK_EVICT_FIRST=1 (each weight byte is read once
    per step: first out, so that prefetched lines stay), else "" (normal). Not under the
    interpreter."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return ""
    return "evict_first" if os.environ.get("DSPARK_EVICT_FIRST", "0") == "1" else ""


@functools.lru_cache(maxsize=None)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    if device.type != "cuda" or mode() == "0":
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return _device_supports(device.index if device.index is not None
                            else torch.cuda.current_device())


def chunks(tensors, limit: int, chunk: int = CHUNK) -> list[tuple[int, int]]:
    """(address, bytes) pieces covering the tensors' bytes in order, at most `limit` bytes in
    all: each piece 16-byte aligned, a multiple of 16 bytes, at most `chunk` bytes, inside its
    tensor (a tensor's unaligned head and tail bytes are left out). Tensors must be contiguous
    (else skipped: their bytes are not one range)."""
    out, left = [], limit
    for t in tensors:
        if t is None or not t.is_contiguous() or left < 16:
            continue
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        a = (start + 15) // 16 * 16
        end = min((end // 16) * 16, a + left // 16 * 16)
        while a < end:
            n = min(chunk, end - a)
            out.append((a, n))
            left -= n
            a += n
    return out


@triton.jit
def _l2_prefetch_kernel(addr_ptr, size_ptr, BLOCK: tl.constexpr, EVICT_LAST: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(addr_ptr + i)
    n = tl.load(size_ptr + i)
    if EVICT_LAST:
        tl.inline_asm_elementwise(
            asm="{ .reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
                "cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; } mov.u32 $0, 0;",
            constraints="=r,l,r", args=[a, n], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            asm="cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
            constraints="=r,l,r", args=[a, n], dtype=tl.int32, is_pure=False, pack=1)


class Plan:
    """The chunk table of one set of tensors on the device (padded to whole programs with
    repeats of the first chunk: a repeated prefetch is a no-op)."""

    def __init__(self, tensors, device: torch.device, limit: int):
        pieces = chunks(tensors, limit)
        self.nbytes = sum(n for _, n in pieces)
        self.programs = triton.cdiv(len(pieces), BLOCK)
        pieces += pieces[:1] * (self.programs * BLOCK - len(pieces))
        self.addr = torch.tensor([a for a, _ in pieces], dtype=torch.int64, device=device)
        self.size = torch.tensor([n for _, n in pieces], dtype=torch.int32, device=device)

    def launch(self) -> None:
        if self.programs:
            _l2_prefetch_kernel[(self.programs,)](self.addr, self.size, BLOCK=BLOCK,
                                                  EVICT_LAST=mode() == "last", num_warps=1)


_PLANS: dict = {}


def plan_for(tensors, device: torch.device) -> Plan | None:
    """The cached Plan of these tensors (keyed by their addresses and sizes); None while a CUDA
    graph is being captured and the plan does not exist yet (building it copies to the device)."""
    tensors = [t for t in tensors if t is not None]
    limit = max_bytes()
    key = (device, limit) + tuple((t.data_ptr(), t.numel() * t.element_size()) for t in tensors)
    plan = _PLANS.get(key)
    if plan is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        plan = _PLANS[key] = Plan(tensors, device, limit)
    return plan


def prefetch_during(tensors, device: torch.device):
    """Queue the L2 prefetch of `tensors` (in order, up to DSPARK_L2_PREFETCH_MB) on a side lane
    forked here: it runs next to what the current stream does next. Returns the lane to
    `side_stream.join` (None: nothing queued)."""
    if not enabled(device):
        return None
    plan = plan_for(tensors, device)
    if plan is None or not plan.programs:
        return None
    lane = side_stream.fork(device, LANE)
    with side_stream.on(lane):
        plan.launch()
    return lane


def linear_tensors(*modules) -> list:
    """The weight tensors of linear layers (QuantLinear: codes then scales; nn.Linear: weight),
    in the order given; None entries are skipped."""
    out = []
    for m in modules:
        if m is None:
            continue
        out.append(m.weight)
        s = getattr(m, "scale", None)
        if isinstance(s, torch.Tensor):
            out.append(s)
    return out
