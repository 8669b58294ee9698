"""Counts of the one-time costs a serving step must not pay: Triton compiles, CUDA-graph
captures, and steps of a graph-capable runner that ran eagerly (and why).

In steady state all three stay flat: `Engine.warmup()` is meant to compile and capture every
shape traffic produces. A count that grows inside timed traffic is a shape the warm-up missed
(python -m dspark.bench prints them per run).

* Graph captures and eager fallbacks are counted on the object that owns the graphs (the V4 /
  Qwen3 target graphs, the draft passes) by `count_capture` / `count_fallback`, so two engines in
  one process keep their own counts; `runner_stats(runner)` adds up one runner's.
* Triton compiles are counted process-wide through Triton's post-compile hook
  (`triton.knobs.runtime.jit_post_compile_hook` in Triton >= 3.4, `JITFunction.compiled_hook`
  before), installed once by `install_triton_hook()`; any hook already set keeps being called.
  Where neither exists the count is "unavailable". Interpreted Triton (TRITON_INTERPRET=1, CPU)
  compiles nothing.
"""
from __future__ import annotations

import collections
import threading

_lock = threading.Lock()
_triton = {"installed": False, "available": False, "compiles": 0}


def _stats(owner) -> dict:
    st = owner.__dict__.get("_compile_stats")
    if st is None:
        st = owner.__dict__["_compile_stats"] = {"graph_captures": 0,
                                                 "eager_fallbacks": collections.Counter()}
    return st


def count_capture(owner) -> None:
    """`owner` captured one CUDA graph."""
    _stats(owner)["graph_captures"] += 1


def count_fallback(owner, reason: str) -> None:
    """A step `owner` could have replayed as a graph ran eagerly, because of `reason`."""
    _stats(owner)["eager_fallbacks"][reason] += 1


def target_fallback_reason(items, graphs) -> str:
    """Why a target step [(request id, start, tokens)] does not fit `graphs`' fixed shapes: its
    bucketing rules (graph_capture.step_fit), a disabled graph set, duplicate requests."""
    from .cuda.graph_capture import step_fit
    if getattr(graphs, "disabled", False):
        return "capture failed"
    fit = step_fit(items, graphs.q_lens, graphs.batch_buckets, graphs.page_buckets,
                   graphs.cache.block_size)
    if isinstance(fit, str):
        return fit
    if len({rid for rid, _, _ in items}) != len(items):
        return "duplicate request"
    return "scratch request in the step"


def _owners(runner):
    """(label, graph owner) of a runner: target graphs and draft pass, where present."""
    for label, attr in (("target", "target_graphs"), ("draft", "draft_pass")):
        obj = getattr(runner, attr, None)
        if obj is not None:
            yield label, obj


def runner_stats(runner) -> dict:
    """{"graph_captures": n, "eager_fallbacks": {"<target|draft>: reason": n}} of one runner."""
    caps, falls = 0, collections.Counter()
    for label, obj in _owners(runner):
        st = obj.__dict__.get("_compile_stats")
        if st is None:
            continue
        caps += st["graph_captures"]
        for reason, n in dict(st["eager_fallbacks"]).items():   # a copy: other threads read
            falls[f"{label}: {reason}"] += n
    return {"graph_captures": caps, "eager_fallbacks": dict(falls)}


def install_triton_hook() -> bool:
    """Count Triton compiles from now on (once per process). False where Triton offers no hook."""
    with _lock:
        if _triton["installed"]:
            return _triton["available"]
        _triton["installed"] = True
        try:
            import triton
        except ImportError:
            return False
        knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
        if knobs is not None and hasattr(knobs, "jit_post_compile_hook"):
            holder, attr = knobs, "jit_post_compile_hook"
        else:
            from triton.runtime.jit import JITFunction
            if not hasattr(JITFunction, "compiled_hook"):
                return False
            holder, attr = JITFunction, "compiled_hook"
        previous = getattr(holder, attr)

        def on_compile(*args, **kwargs):
            _triton["compiles"] += 1
            return previous(*args, **kwargs) if previous is not None else None

        setattr(holder, attr, on_compile)
        _triton["available"] = True
        return True


def triton_compiles():
    """Triton compiles in this process since the hook was installed, or "unavailable"."""
    return _triton["compiles"] if _triton["available"] else "unavailable"


def delta(after: dict, before: dict) -> dict:
    """What happened between two stats snapshots (Engine.compile_stats())."""
    def sub(a, b):
        return a - b if isinstance(a, int) and isinstance(b, int) else a
    falls = {k: n - before["eager_fallbacks"].get(k, 0) for k, n in after["eager_fallbacks"].items()}
    return {"triton_compiles": sub(after["triton_compiles"], before["triton_compiles"]),
            "graph_captures": after["graph_captures"] - before["graph_captures"],
            "eager_fallbacks": {k: n for k, n in falls.items() if n}}


def combined(a: dict, b: dict) -> dict:
    """Two deltas together (e.g. repeated timed runs): counts added, fallbacks by reason."""
    def add(x, y):
        return x + y if isinstance(x, int) and isinstance(y, int) else "unavailable"
    falls = dict(a["eager_fallbacks"])
    for k, n in b["eager_fallbacks"].items():
        falls[k] = falls.get(k, 0) + n
    return {"triton_compiles": add(a["triton_compiles"], b["triton_compiles"]),
            "graph_captures": a["graph_captures"] + b["graph_captures"],
            "eager_fallbacks": falls}


def total(stats: dict) -> int:
    """Compiles + captures + fallbacks of a snapshot or delta (an unavailable count as 0)."""
    tc = stats["triton_compiles"]
    return (tc if isinstance(tc, int) else 0) + stats["graph_captures"] + \
        sum(stats["eager_fallbacks"].values())
