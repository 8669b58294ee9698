"""The Python heap of a process that serves: no collector pause over the startup objects.

A loaded engine leaves a few hundred thousand objects that the cyclic garbage collector tracks
(modules, parameters, Triton kernels, CUDA graphs, tokenizer tables): ~300k for the shipped pair
on CPU, where one full collection takes ~150 ms. Decode rounds allocate little that survives,
yet the objects they do keep (outputs, token lists) add up to a full collection now and then: a
pause of ~40 rounds at 64 requests, a large share of a bench run of 0.2-0.5 s. The processes that
own their heap (the server; the bench while it times) therefore collect once and freeze
what is alive (`gc.freeze`, as vLLM's and SGLang's engine processes do): the collector then only
looks at objects created afterwards.

The cost: a frozen object that later becomes part of an unreachable cycle is never collected. An
engine lives as long as its process here, so nothing of note; a script that builds and drops
many engines should not freeze (or call `gc.unfreeze()` before dropping one)."""
from __future__ import annotations

import gc
import time
from contextlib import contextmanager


def freeze_heap() -> int:
    """Collect, then move every tracked object alive now out of the collector's reach.
    Returns how many objects are frozen in all (`gc.get_freeze_count`)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextmanager
def frozen_heap():
    """`freeze_heap` for the duration of a block (yields the frozen count), then `gc.unfreeze()`:
    for a run inside a process that goes on (the bench called as a function, in tests too)."""
    try:
        yield freeze_heap()
    finally:
        gc.unfreeze()


class CollectorPauses:
    """Context manager: the cyclic collector's runs inside it, by count and wall ms (any
    generation), from `gc.callbacks`. Nested or concurrent use is fine: each instance counts
    every collection that starts and stops while it is active."""

    def __init__(self):
        self.count = 0
        self.seconds = 0.0
        self._start = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.count += 1
            self.seconds += time.perf_counter() - self._start
            self._start = None

    def __enter__(self) -> "CollectorPauses":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    @property
    def ms(self) -> float:
        return 1e3 * self.seconds
