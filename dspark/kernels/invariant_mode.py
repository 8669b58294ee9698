"""The batch-invariant mode's switches (`dspark.kernels.invariant`), without Triton: code that
runs on every path (the eager reference forward, the graph owners) enters them, and only the
mode itself loads the kernels."""
from __future__ import annotations

import contextlib

_depth = 0              # choices() contexts entered
_routing = 0            # products() contexts entered


def on() -> bool:
    """Whether the launch being built must be batch-invariant."""
    return _depth > 0


@contextlib.contextmanager
def choices():
    """Our kernel wrappers take their batch-invariant choices inside; aten's products are not
    routed (graph replays launch none)."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


@contextlib.contextmanager
def products():
    """Inside `choices()`: aten's matrix products run `invariant.invariant_bmm` (the steps a
    graph captures, eager steps); outside, or already routed: nothing."""
    global _routing
    if _depth == 0 or _routing:
        yield
        return
    from .invariant import _InvariantProducts      # imports triton: only in the mode
    _routing += 1
    try:
        with _InvariantProducts():
            yield
    finally:
        _routing -= 1
