"""Programmatic dependent launch (PDL, Hopper+): a kernel starts before the one ahead of it on
the stream has finished, does the work that needs nothing from it, then waits for it.

A batch-1 decode step is ~130 kernels in a chain; a weight-streaming GEMV pays its ramp-up (the
first weight bytes arrive ~1-2 us after the kernel starts) after the kernel ahead of it has
drained. With PDL the GEMV is launched while that kernel (a norm, RoPE, a combine: ~2-4 us) still
runs and waits for it on the GPU (`wait`) instead of being launched after it; with
DSPARK_PDL=prefetch it first asks L2 for its own weight slice (`prefetch_l2`: weights never
change during a step), so that its ramp-up would overlap the kernel ahead.

The rules that keep it exact:
- a kernel launched with `launch_pdl=True` (`launch_kwargs`) reads nothing another kernel writes
  and writes nothing before `wait()`, and every one of its programs calls `wait()` (a program
  that exits early without it could let the grid complete before the kernel ahead did, and the
  kernel after it would then stop waiting too soon);
- `launch_dependents()` only lets the next kernel start early: it may come anywhere (the next
  kernel's `wait()` still waits for this whole grid to finish and its writes to be visible).
Kernels launched without the attribute (torch's, cuBLAS's) keep full ordering. In a CUDA-graph
capture the attribute becomes a programmatic edge between the two kernel nodes.

On by default since session 19 (`mode`: DSPARK_PDL=1 early launch and wait, =0 off, =prefetch
also the L2 prefetch); never under the interpreter or before SM 9.0. Measured on the H200
(session 13, V4-Flash widths, 4 layers, batch-1 decode graph, `bench_decode_v4.py`) with the
prefetch: device time per step 1.027 ms vs 0.943 ms without PDL. The timeline shows the GEMVs
themselves slower, not waiting (wo_a 13.2 -> 23.3 us, wo_b 15.8 -> 21.4, wq_b 12.6 -> 18.2, each
starting ~1 us earlier), and the MoE router beside the early shared expert 7.3 -> 15 us: the
bulk prefetches compete with the kernels' own loads instead of running ahead of them. Without
the prefetch (=1, session 14): 0.923 vs 0.923 ms, no gain. (Session 14 also tried an L2 prefetch
of the next projections' weights by a side-lane kernel during the MoE and the attention core,
where the HBM is mostly idle, with evict-first weight loads: the GEMVs that read the prefetched
weights took the same time, 12.4 vs 12.5 us for wq_b, and the step was 0.942 vs 0.923 ms;
removed.) Correct either way (tests/test_pdl.py and the graph replay tests, with the prefetch,
passed on the H200).

Session 18 (measured in session 19, below): the tensor-core FP8 GEMV (`fp8_gemv_tc`, every FP8
linear of 1-8 tokens since session 16) takes PDL too, and before its wait each lane loads its
first step's weight words into registers (16 bytes x 4 + the scale byte;
DSPARK_FP8_TC_PRELOAD=0: wait first): that step's HBM latency then overlaps the kernel ahead
instead of following it. Offline SASS showed why a prefetch placed before a plain wait cannot
work: ptxas hoists griddepcontrol.wait (ACQBULK) above independent loads and sinks loads to
their use; the GEMV's wait is therefore predicated on the preloaded words (true either way), so
all five loads are issued before it (tests/test_pdl.py checks the SASS order). The combine
(before wo_a) and hc_post's finishing launch (before wq_a + wkv) trigger their dependents.
Session 19 on the H200 (same call, `run_h200.sh` ab): the decode step's device time 0.766 ms
without PDL, 0.764 with PDL waiting first, 0.753 with PDL and the preload (step 0.786 / 0.780 /
0.770 ms); a chain of 4 cold FP8 GEMVs (`bench_pdl_chain.py`) 46.2 / 45.6 / 44.2 us, outputs
bit-equal. Hence the default.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:                            # (Triton 3.6 on the H200, 3.9 here); without: no-ops, PDL off
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch_dependents
    from triton.language.extra.cuda import gdc_wait as _gdc_wait
    _HAS_GDC = True
except ImportError:                         # pragma: no cover - depends on the Triton version
    _HAS_GDC = False

    @triton.jit
    def _gdc_wait():
        pass

    @triton.jit
    def _gdc_launch_dependents():
        pass


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


MODES = ("0", "1", "prefetch")


def mode() -> str:
    """DSPARK_PDL: "1" (default) early launch and wait, "0" off, "prefetch" also the L2 bulk
    prefetch of the weight slice before the wait (the variant measured slower)."""
    m = os.environ.get("DSPARK_PDL", "1")
    if m not in MODES:
        raise ValueError(f"DSPARK_PDL={m!r}: use one of {', '.join(MODES)}")
    return m


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with PDL (the kernels' PDL constexpr)."""
    if device.type != "cuda" or not _HAS_GDC or _interpreting() or mode() == "0":
        return False
    return _device_supports(device.index if device.index is not None
                            else torch.cuda.current_device())


def prefetch_enabled(device: torch.device) -> bool:
    """Whether PDL kernels prefetch their weights into L2 before waiting (DSPARK_PDL=prefetch)."""
    return enabled(device) and mode() == "prefetch"


def launch_kwargs(on: bool) -> dict:
    """Extra launch arguments of a kernel compiled with PDL=on."""
    return {"launch_pdl": True} if on else {}


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait until the kernel ahead on the stream has finished and its writes are visible (a
    no-op without PDL)."""
    if PDL:
        _gdc_wait()


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the next kernel on the stream (if launched with PDL) start now."""
    if PDL:
        _gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, nbytes, PDL: tl.constexpr):
    """Ask L2 for the `nbytes` bytes from each of `ptrs` (any shape; 16-byte aligned addresses,
    nbytes a multiple of 16, inside the tensor), one bulk (TMA-unit) prefetch each: loads that
    follow hit L2. Nothing is returned and nothing waits for it."""
    if PDL:
        tl.inline_asm_elementwise(
            asm="cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
            constraints="=r,l,r", args=[ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)
