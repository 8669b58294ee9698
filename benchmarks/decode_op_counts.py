"""Launches per batch-1 decode forward of the fixed-shape V4 step, counted on CPU.

What a GPU decode step launches is mostly a function of the op structure, not of the widths, so
a tiny model with the V4-Flash 4-layer schedule (SWA, SWA, CSA, HCA; 3 hash layers; FP8
projections, FP4 experts, fp8 KV records) shows the same op counts as the H200 checkpoint. The
step runs the path the GPU decode runs: `V4DecodeGraphs` (eagerly, capture=False), Triton
attention / indexer / cache-write kernels, Triton mHC, Triton FP8 / FP4 GEMMs — all in the
Triton interpreter (TRITON_INTERPRET=1, set here).

Counted with torch.profiler (CPU activities) over one `V4DecodeGraphs.run`:
* every Triton kernel launch = 1 (its interpreter internals are not counted);
* the FP8 / FP4 linears (`fp8_linear`, `fp4_linear`, `fp4_moe_grouped`) = 1 unit each, their
  internals left out (owned by the GEMM kernels);
* every other top-level aten op (an aten op without an aten ancestor), split into ops that do
  work (a kernel on the GPU) and pure views / allocations (no kernel).

    python benchmarks/decode_op_counts.py [--sources] [--json out.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")      # before anything imports triton

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

# ops that launch nothing on the GPU (metadata / allocation only)
NO_KERNEL = {
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::_unsafe_view", "aten::slice",
    "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::t",
    "aten::transpose", "aten::permute", "aten::as_strided", "aten::split", "aten::split_with_sizes",
    "aten::unflatten", "aten::flatten", "aten::view_as_real", "aten::view_as_complex",
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::resize_", "aten::detach",
    "aten::alias", "aten::lift_fresh", "aten::chunk", "aten::unbind", "aten::narrow",
    "aten::numpy_T", "aten::_to_copy_view", "aten::contiguous", "aten::to", "aten::clone",
    "aten::diagonal", "aten::movedim", "aten::real", "aten::imag", "aten::result_type",
    "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense", "aten::set_", "aten::dim",
}
# of these, the ones that launch when their subtree does work (a copy)
MAYBE = {"aten::reshape", "aten::contiguous", "aten::to", "aten::clone", "aten::flatten",
         "aten::unflatten"}

# torch-level calls that never launch (for the by-source listing)
PY_NO_KERNEL = {"__get__", "dim", "stride", "data_ptr", "numel", "storage_offset", "device",
                "is_contiguous", "is_floating_point", "element_size", "size",
                "_record_function_enter_new", "_record_function_exit._RecordFunction", "view",
                "unsqueeze", "unflatten", "view_as_complex", "view_as_real", "empty", "unbind",
                "reshape", "flatten", "split", "squeeze", "expand", "t", "transpose",
                "is_pinned", "__len__", "__hash__", "__bool__", "__index__", "__format__"} - {"__getitem__"}
BLACK_BOX = "[gemm] "
TRITON = "[triton] "


def make_checkpoint(out: str):
    from dspark.tools.make_checkpoint import make_checkpoint as mk
    if not os.path.exists(os.path.join(out, "config.json")):
        mk(out, preset="tiny", layers=4, seed=0, dtype="fp8", fp4_experts=True, dspark=False,
           overrides={"compress_ratios": (0, 0, 4, 16), "num_hash_layers": 3,
                      "o_lora_rank": 128},      # 128-aligned wo_a groups, as in V4-Flash
           progress=False)
    return out


class _paused:
    def __enter__(self):
        for m in SOURCES:
            m.paused += 1

    def __exit__(self, *exc):
        for m in SOURCES:
            m.paused -= 1


def _instrument():
    """Named ranges around every Triton launch and around the FP8 / FP4 GEMM entry points."""
    import triton.runtime.interpreter as interp
    from torch.profiler import record_function

    run = interp.InterpretedFunction.run

    def traced_run(self, *args, **kwargs):
        with record_function(TRITON + self.fn.__name__), _paused():
            return run(self, *args, **kwargs)
    interp.InterpretedFunction.run = traced_run

    from dspark.models import qlinear

    def boxed(name, fn):
        def wrapper(*args, **kwargs):
            with record_function(BLACK_BOX + name), _paused():
                return fn(*args, **kwargs)
        return wrapper
    for name in ("fp8_linear", "fp4_linear", "fp4_moe_grouped", "fp4_moe"):
        setattr(qlinear, name, boxed(name, getattr(qlinear, name)))


def build(ckpt: str):
    from dspark import Engine
    from dspark.models import qlinear
    from dspark.models.deepseek_v4 import mhc, norm
    from dspark.models.deepseek_v4.graph import V4DecodeGraphs, reserve_scratch

    eng = Engine(ckpt, device="cpu", dtype="bf16", kv_cache_dtype="fp8", speculative="none",
                 attention_backend="triton", weight_format="quantized", max_num_seqs=2,
                 num_kv_blocks=16)
    for m in eng.model.modules():          # the GPU's GEMM kernels (grouped FP4 MoE included)
        if isinstance(m, qlinear.QuantLinear):
            m.backend = "triton"
    mhc.BACKEND = "triton"                 # the fused mHC kernels, as on CUDA
    if hasattr(norm, "NORM_BACKEND"):
        norm.NORM_BACKEND = "triton"       # the fused norm / RoPE kernel, as on CUDA
    reserve_scratch(eng.cache)
    graphs = V4DecodeGraphs(eng.model, eng.cache, "triton", q_lens=(1,), max_batch=1,
                            capture=False)
    return eng, graphs


def _launches(event, kids) -> bool:
    """Whether a top-level aten op does work on the device (itself or an op below it)."""
    if event.name not in NO_KERNEL:
        return True
    return any(_launches(k, kids) for k in kids.get(event.id, ()))


class _Sources(torch.overrides.TorchFunctionMode):
    """Innermost dspark/ source line of every torch call made outside the Triton launches and
    GEMM units, in call order (the profiler's own with_stack traces every Python call, which
    the Triton interpreter makes millions of)."""

    def __init__(self):
        super().__init__()
        self.calls, self.paused = [], 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            import traceback
            where = "?"
            for fr in reversed(traceback.extract_stack(limit=12)[:-1]):
                if "dspark/" in fr.filename:
                    where = f"{fr.filename.split('dspark/', 1)[1]}:{fr.lineno} {fr.name}"
                    break
            name = getattr(func, "__name__", str(func))
            out = func(*args, **(kwargs or {}))
            if not (name.endswith("_") or name == "__setitem__") and _aliases(out, args):
                return out                      # a view / no-op (same storage): no launch
            self.calls.append((name, where))
            return out
        return func(*args, **(kwargs or {}))


def _aliases(out, args) -> bool:
    if not isinstance(out, torch.Tensor) or out.device.type == "meta":
        return False
    ptr = out.untyped_storage().data_ptr()
    return any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr
               for a in args)


SOURCES: list = []     # the active _Sources, if any


def profile_step(eng, graphs, context: int = 24, sources: bool = False):
    """Op counts of one batch-1 decode forward (after `context` prefill tokens and 2 warm
    decode steps)."""
    from torch.profiler import ProfilerActivity, profile
    rid = "r"
    cache = eng.cache
    toks = [(7 * i + 3) % eng.cfg.vocab_size for i in range(context + 4)]
    cache.add_request(rid)
    cache.reserve(rid, context)
    eng.runner.target_forward([(rid, 0, toks[:context])])        # eager prefill
    pos = context
    for _ in range(2):
        cache.reserve(rid, pos + 1)
        assert graphs.run([(rid, pos, [toks[pos]])]) is not None
        pos += 1
    cache.reserve(rid, pos + 1)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        graphs.run([(rid, pos, [toks[pos]])])
    srcs = collections.Counter()
    if sources:          # a second step, traced by source line (torch calls, views included)
        cache.reserve(rid, pos + 2)
        mode = _Sources()
        SOURCES.append(mode)
        with torch.inference_mode(), mode:
            graphs.run([(rid, pos + 1, [toks[pos + 1]])])
        SOURCES.remove(mode)
        srcs.update(mode.calls)
    events = prof.events()
    kids = collections.defaultdict(list)
    for e in events:
        if e.cpu_parent is not None:
            kids[e.cpu_parent.id].append(e)
    counts, views = collections.Counter(), collections.Counter()
    for e in events:
        name = e.name
        anc, inside = e.cpu_parent, False
        while anc is not None:
            if anc.name.startswith(("aten::", TRITON, BLACK_BOX)):
                inside = True
                break
            anc = anc.cpu_parent
        if inside:
            continue
        if name.startswith(TRITON) or name.startswith(BLACK_BOX):
            counts[name] += 1
        elif name.startswith("aten::"):
            if _launches(e, kids):
                counts[name] += 1
            else:
                views[name] += 1
    return counts, views, srcs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", default=os.path.join(tempfile.gettempdir(), "dspark_opcount_ckpt"))
    ap.add_argument("--sources", action="store_true", help="also list ops by dspark source line")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    _instrument()
    eng, graphs = build(make_checkpoint(args.ckpt))
    counts, views, sources = profile_step(eng, graphs, sources=args.sources)
    total = sum(counts.values())
    print(f"launches per decode forward: {total} "
          f"(aten {sum(v for k, v in counts.items() if k.startswith('aten::'))}, "
          f"triton {sum(v for k, v in counts.items() if k.startswith(TRITON))}, "
          f"gemm units {sum(v for k, v in counts.items() if k.startswith(BLACK_BOX))}); "
          f"view / alloc ops {sum(views.values())}")
    for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {v:5d}  {k}")
    if args.sources:
        print("torch calls by source line (views included):")
        for (name, src), v in sorted(sources.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            if name in PY_NO_KERNEL:
                continue
            print(f"  {v:5d}  {name:<24} {src}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"launches": dict(counts), "views": dict(views)}, f, indent=2)


if __name__ == "__main__":
    main()
