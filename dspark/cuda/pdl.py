"""Programmatic dependent launch (PDL, Hopper+): a kernel starts before the one ahead of it on
the stream has finished, does the work that needs nothing from it, then waits for it.

A batch-1 decode step is ~130 kernels in a chain; a weight-streaming GEMV pays its ramp-up (the
first weight bytes arrive ~1-2 us after the kernel starts) after the kernel ahead of it has
drained. With PDL the GEMV is launched while that kernel (a norm, RoPE, a combine: ~2-4 us) still
runs and waits for it on the GPU (`wait`) instead of being launched after it.

The rules that keep it exact:
- a kernel launched with `launch_pdl=True` (`launch_kwargs`) reads nothing another kernel writes
  and writes nothing before `wait()`, and every one of its programs calls `wait()` (a program
  that exits early without it could let the grid complete before the kernel ahead did, and the
  kernel after it would then stop waiting too soon);
- `launch_dependents()` only lets the next kernel start early: it may come anywhere (the next
  kernel's `wait()` still waits for this whole grid to finish and its writes to be visible).
Kernels launched without the attribute (torch's, cuBLAS's) keep full ordering. In a CUDA-graph
capture the attribute becomes a programmatic edge between the two kernel nodes.

On sm_90+ CUDA devices (never under the interpreter; dspark.debug.NO_PDL turns it off). The
tensor-core FP8 GEMV (`fp8_gemv_tc`, every FP8 linear of 1-8 tokens) loads each lane's first
step of weight words into registers before its wait (16 bytes x 4 + the scale byte), so that
step's HBM latency overlaps the kernel ahead instead of following it. ptxas hoists
griddepcontrol.wait (ACQBULK) above independent loads and sinks loads to their use, so the wait
is predicated on the preloaded words (true either way) and all five loads are issued before it
(tests/test_pdl.py checks the SASS order). The combine (before wo_a) and hc_post's finishing
launch (before wq_a + wkv) trigger their dependents. H200, V4-Flash decode step (device time):
0.753 ms with PDL and the preload, 0.764 with PDL waiting first, 0.766 without PDL; a chain of 4
cold FP8 GEMVs (`benchmarks/bench_pdl_chain.py`) 44.2 / 45.6 / 46.2 us, outputs bit-equal.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from dspark import debug

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


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with PDL (the kernels' PDL constexpr)."""
    if device.type != "cuda" or not _HAS_GDC or _interpreting() or debug.NO_PDL:
        return False
    return _device_supports(device.index if device.index is not None
                            else torch.cuda.current_device())


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
