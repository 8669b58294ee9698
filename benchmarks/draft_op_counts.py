"""Launches of one draft pass of the shipped pair (dspark/assets/default), counted on CPU.

A captured draft pass at batch 1 is bound by its number of kernels (~2-3.5 us each in a CUDA
graph on the H200), and that number is a function of the op structure, so it can be counted
here. The pass runs eagerly with every Triton backend forced (norm / RoPE, mHC, sampling and the
Markov loop, as on CUDA), in the Triton interpreter (TRITON_INTERPRET=1, set here), under
no_grad (under inference_mode composite ops such as `to` reach the dispatch mode undecomposed,
no-ops included). Counted: every Triton launch (its interpreter internals not), and every aten
op a TorchDispatchMode sees outside them, less views, allocations and metadata queries.

    python benchmarks/draft_op_counts.py [--batch 1] [--temperature 0,1] [-v]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")      # before anything imports triton

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

# aten ops that launch nothing on the GPU
NO_KERNEL = {"view", "_unsafe_view", "_reshape_alias", "slice", "select", "unsqueeze", "squeeze",
             "expand", "t", "transpose", "permute", "as_strided", "split", "split_with_sizes",
             "unflatten", "alias", "detach", "empty", "empty_like", "empty_strided", "resize_",
             "lift_fresh", "unbind", "narrow", "diagonal", "_local_scalar_dense", "set_",
             "view_as_real", "view_as_complex", "sym_size", "sym_stride", "sym_numel",
             "sym_storage_offset", "is_same_size", "new_empty", "new_empty_strided", "dim",
             "stride", "size", "is_contiguous"}


class Count(TorchDispatchMode):
    """aten compute ops, and (through `instrument`) Triton launches, by name."""

    active = None

    def __init__(self):
        super().__init__()
        self.ops, self.paused = collections.Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and name not in NO_KERNEL:
            self.ops["aten." + name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        Count.active = self
        return super().__enter__()

    def __exit__(self, *exc):
        Count.active = None
        return super().__exit__(*exc)


def instrument():
    import triton.runtime.interpreter as interp
    run = interp.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        mode = Count.active
        if mode is None:
            return run(self, *args, **kwargs)
        if not mode.paused:
            mode.ops["triton." + self.fn.__name__] += 1
        mode.paused += 1          # the interpreter's own tensor traffic is not the pass's
        try:
            return run(self, *args, **kwargs)
        finally:
            mode.paused -= 1
    interp.InterpretedFunction.run = counted


def build():
    from dspark import Engine
    from dspark import sampling
    from dspark.models.deepseek_v4 import mhc, norm
    sampling.FUSED_BACKEND = norm.NORM_BACKEND = mhc.BACKEND = "triton"
    torch.set_num_threads(1)
    return Engine(device="cpu", dtype="bf16", cuda_graphs=False, target_cuda_graphs=False)


def requests(eng, batch: int, temperature: float, context: int = 40):
    from types import SimpleNamespace
    from dspark import SamplingParams
    runner, cfg = eng.runner, eng.cfg
    gen = torch.Generator().manual_seed(0)
    reqs = []
    for i in range(batch):
        _, ds = runner.new_states()
        taps = torch.randn(context, len(cfg.dspark_target_layer_ids) * cfg.hidden_size,
                           generator=gen)
        runner.commit_context(ds, taps.to(eng.dtype), 0)
        reqs.append(SimpleNamespace(anchor=7 + i, num_committed=context, draft_state=ds,
                                    seed=3 + i, params=SamplingParams(temperature=temperature)))
    runner.flush_context()
    return reqs


def count(eng, reqs) -> collections.Counter:
    dp, quant = eng.runner.draft_pass, eng.runner.quant
    with torch.no_grad():
        dp(reqs, quant)                       # warm: compile caches, cached weight copies
        with Count() as mode:
            dp(reqs, quant)
    return mode.ops


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--temperature", default="0,1", help="a comma list")
    ap.add_argument("-v", "--verbose", action="store_true", help="counts by op")
    a = ap.parse_args(argv)
    instrument()
    eng = build()
    for t in (float(x) for x in a.temperature.split(",")):
        ops = count(eng, requests(eng, a.batch, t))
        triton_n = sum(v for k, v in ops.items() if k.startswith("triton."))
        aten_n = sum(v for k, v in ops.items() if k.startswith("aten."))
        print(f"batch {a.batch} T={t:g}: {triton_n + aten_n} launches "
              f"({triton_n} Triton, {aten_n} aten)")
        if a.verbose:
            for k, v in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0])):
                print(f"  {v:5d}  {k}")


if __name__ == "__main__":
    main()
