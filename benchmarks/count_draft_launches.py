"""Launch census of the DSpark drafter's graphs, counted on CPU: one draft pass and one context
write of the shipped pair (or, with --qwen3, of a tiny random Qwen3 target + DeepSpec drafter
pair), with the kernels the H200 runs.

On the GPU both run as CUDA graphs whose time, for the shipped model (hidden 192, vocabulary
512), is set by how many kernels they hold, not by their widths. This builds the shipped engine
on CPU in bf16 with fp8 KV records and forces the Triton backends the GPU picks ("auto" on CUDA)
through the interpreter (TRITON_INTERPRET=1, set here): mHC, norm / RoPE and the decode fusions
(norm.NORM_BACKEND), the sampling kernels (sampling.FUSED_BACKEND). The few call sites that test
`x.is_cuda` themselves are given their CUDA branch:
* norm.linear_fp32 of 16-bit x and w: cuBLAS with fp32 output (`torch.mm(out_dtype=)`), counted
  as one GEMM "mm.out_fp32" (the skinny Triton GEMV, where it would apply, as one launch);
* QuantSim.kv (the fp8 KV record roundtrip): its Triton kernel.
Then it counts, inside `DraftPass._draft` and `DSparkDrafter.commit_rows` (what the graphs
hold), every Triton launch and every aten op that launches a kernel (a TorchDispatchMode: views,
empty tensors, detach and other metadata-only ops left out), grouped by op and by the dspark
source line that issued it (innermost dspark frame, and the drafter / draft-pass line that led
there). An fp32 GEMM (mm / bmm / addmm in fp32) may be two kernels on CUDA (cuBLAS split-K plus
its reduce): listed, counted once.

The Qwen3 pair (dspark.tools.make_qwen3_checkpoint, preset `tiny`, bf16, no fp8 records) runs
`Qwen3DraftPass` with kernels="triton" (what it picks on CUDA): its counts are the 4B drafter's
per layer and per Markov step, only the widths differ.

    python benchmarks/count_draft_launches.py [--batch 1] [--temperature 1.0] [--top 40]
    python benchmarks/count_draft_launches.py --qwen3 [--markov-head vanilla|gated|rnn]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")      # before anything imports triton

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PKG = os.path.join(ROOT, "dspark") + os.sep
SITES = ("models/drafter.py", "models/draft_block.py", "draft_pass.py",   # rows charged to
         "models/dspark_qwen3.py", "models/dspark_qwen3_pass.py", "models/dspark_qwen3_fused.py")
# aten ops that launch nothing on the GPU (allocation, aliasing, metadata)
NO_KERNEL = {"empty", "empty_strided", "empty_like", "detach", "lift_fresh", "alias",
             "_unsafe_view", "set_", "resize_", "sym_size", "sym_stride", "sym_numel",
             "sym_storage_offset", "is_contiguous", "dim", "size", "stride",
             # a Python scalar operand wrapped as a tensor (torch.where(c, x, 2)): on the host
             "scalar_tensor"}
SYNC = {"_local_scalar_dense", "item", "is_nonzero"}  # host reads: counted apart (a graph has none)
GEMMS = {"mm", "bmm", "addmm", "baddbmm", "matmul"}


def _source(skip_kernels: bool = False):
    """(innermost dspark frame, the drafter / draft-pass frame above it or None) as strings."""
    inner = site = None
    for fr in reversed(traceback.extract_stack()[:-2]):
        if not fr.filename.startswith(PKG):
            continue
        rel = fr.filename[len(PKG):]
        here = f"{rel}:{fr.lineno} {fr.name}"
        if inner is None:
            inner = here
        if rel in SITES:
            site = here
            break
    return inner or "?", site


class Census(TorchDispatchMode):
    """Counts launches while `active`; `record(kind, name)` adds a launch made outside aten."""

    def __init__(self):
        super().__init__()
        self.rows: list = []           # (phase, kind, op, inner, site)
        self.phase, self.paused = None, 0

    def record(self, kind: str, name: str):
        if self.phase is not None and not self.paused:
            inner, site = _source()
            self.rows.append((self.phase, kind, name, inner, site))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.phase is not None and not self.paused and _composite(func):
            # under inference mode composite ops (linear, einsum, ...) reach the mode whole:
            # their decomposition is what launches (its ops come back through this mode)
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if self.phase is None or self.paused:
            return out
        name = func.overloadpacket.__name__
        if func.is_view or name in NO_KERNEL:
            return out
        kind = "sync" if name in SYNC else "aten"
        if name in GEMMS:
            dt = args[0].dtype if isinstance(args[0], torch.Tensor) else None
            name = f"{name} ({str(dt).replace('torch.', '')}" + \
                (", cuBLAS may add a split-K reduce)" if dt == torch.float32 else ")")
        elif name in ("_to_copy", "copy_"):
            src = args[1] if name == "copy_" else args[0]
            dst = args[0] if name == "copy_" else out
            name = f"{name} {str(src.dtype).replace('torch.', '')}->" \
                   f"{str(dst.dtype).replace('torch.', '')}"
        self.rows.append((self.phase, kind, name, *_source()))
        return out


CENSUS: Census | None = None


def _composite(func) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(
        func.name(), torch._C.DispatchKey.CompositeImplicitAutograd)


@contextlib.contextmanager
def paused():
    CENSUS.paused += 1
    try:
        yield
    finally:
        CENSUS.paused -= 1


@contextlib.contextmanager
def instrument():
    """Triton launches counted (their interpreter internals not); the CUDA branches of the
    `x.is_cuda` call sites taken (module doc). Everything is put back on exit."""
    import triton.runtime.interpreter as interp

    from dspark import runner
    from dspark.kernels import cache_write, fp8_gemm
    from dspark.models.deepseek_v4 import norm
    run, kv, original = interp.InterpretedFunction.run, runner.QuantSim.kv, norm.linear_fp32

    def counted_run(self, *args, **kwargs):
        if kwargs.get("warmup"):
            return run(self, *args, **kwargs)
        CENSUS.record("triton", self.fn.__name__)
        with paused():
            return run(self, *args, **kwargs)

    def quant_kv(self, x):
        if x.shape[-1] == 512:
            return cache_write.fp8_ds_mla_roundtrip_triton(x)
        return kv(self, x)

    def linear_fp32(x, w, skinny=False, head=False, argmax_out=None, out=None):
        sixteen = w.dtype in (torch.bfloat16, torch.float16) and x.dtype == w.dtype
        if not sixteen or torch.is_grad_enabled():
            return original(x, w, skinny, head, argmax_out, out)
        rows = x.numel() // max(x.shape[-1], 1)
        gemv = (skinny or head) and w.dim() == 2 and 0 < rows <= fp8_gemm.SKINNY_MAX_T and (
            (head and rows <= fp8_gemm.HEAD_SKINNY_MAX_T) or
            (not head and w.numel() * 2 <= fp8_gemm.LINEAR16_MAX_BYTES))
        CENSUS.record("triton" if gemv else "aten",
                      "fp8_skinny (linear16, emulated)" if gemv else "mm.out_fp32 (bf16 cuBLAS)")
        with paused():
            y = torch.nn.functional.linear(x.float(), w.float())
        return norm._finish(y, argmax_out, out)
    users = [m for m in list(sys.modules.values()) if getattr(m, "__name__", "").startswith(
        "dspark") and getattr(m, "linear_fp32", None) is original]
    interp.InterpretedFunction.run, runner.QuantSim.kv = counted_run, quant_kv
    for m in users:
        m.linear_fp32 = linear_fp32
    try:
        yield
    finally:
        interp.InterpretedFunction.run, runner.QuantSim.kv = run, kv
        for m in users:
            m.linear_fp32 = original


@contextlib.contextmanager
def gpu_backends():
    """The Triton backends CUDA picks ("auto"), forced; the previous settings put back."""
    from dspark import sampling
    from dspark.models.deepseek_v4 import mhc, norm
    saved = mhc.BACKEND, norm.NORM_BACKEND, sampling.FUSED_BACKEND
    mhc.BACKEND, norm.NORM_BACKEND, sampling.FUSED_BACKEND = "triton", "triton", "triton"
    try:
        yield
    finally:
        mhc.BACKEND, norm.NORM_BACKEND, sampling.FUSED_BACKEND = saved


QWEN3_4B_DRAFT = dict(draft_layers=5, block_size=7)    # dspark_qwen3_4b_block7's depth and γ


def qwen3_pair(root: str, markov_head: str = "vanilla") -> tuple:
    """(target dir, drafter dir): a random bf16 Qwen3 pair of `tiny` widths under `root` (made
    once), the drafter with the 4B drafter's 5 layers and block of 7, so that its counts are the
    4B pass's (launch counts depend on depth and γ, not on widths)."""
    from dspark.tools.make_qwen3_checkpoint import make_qwen3_checkpoint
    target, draft = os.path.join(root, "target"), os.path.join(root, f"dspark_{markov_head}")
    if not os.path.exists(os.path.join(target, "config.json")):
        make_qwen3_checkpoint(target, "tiny", "target", seed=0, dtype="bf16")
    cfg = os.path.join(draft, "config.json")
    if not os.path.exists(cfg):
        make_qwen3_checkpoint(draft, "tiny", "dspark", seed=0, dtype="bf16", markov_head=markov_head,
                              draft_layers=QWEN3_4B_DRAFT["draft_layers"])
        with open(cfg) as f:
            raw = json.load(f)
        raw["block_size"] = QWEN3_4B_DRAFT["block_size"]    # no tensor depends on γ
        with open(cfg, "w") as f:
            json.dump(raw, f, indent=1)
    return target, draft


def build(batch: int, temperature: float, path=None):
    """The engine (shipped model unless `path`: bf16, fp8 KV records, eager; `path` = (target,
    drafter) dirs: a Qwen3 pair, bf16, its draft pass on the Triton kernels) and `batch` running
    requests with context committed at varied positions."""
    from types import SimpleNamespace

    from dspark import Engine, SamplingParams
    if isinstance(path, (tuple, list)):
        eng = Engine(path[0], draft=path[1], device="cpu", dtype="bf16", cuda_graphs=False,
                     max_num_seqs=max(batch, 2))
        eng.runner.draft_pass.kernels = "triton"
    else:
        eng = Engine(path, device="cpu", dtype="bf16", kv_cache_dtype="fp8", cuda_graphs=False,
                     target_cuda_graphs=False, max_num_seqs=max(batch, 2))
    runner, cfg = eng.runner, eng.cfg
    gen = torch.Generator().manual_seed(0)
    width = len(cfg.dspark_target_layer_ids) * cfg.hidden_size
    reqs = []
    for r in range(batch):
        P = (200, 5, 127, 300)[r % 4] + r
        _, ds = runner.new_states()
        runner.commit_context(ds, torch.randn(P, width, generator=gen).to(eng.dtype), 0)
        reqs.append(SimpleNamespace(anchor=(7 * r + 3) % cfg.vocab_size, num_committed=P,
                                    draft_state=ds, seed=1000 + r,
                                    params=SamplingParams(temperature=temperature)))
    runner.flush_context()
    return eng, reqs


def census(batch: int = 1, temperature: float = 1.0, rows: int = 3, path=None) -> list:
    """[(phase, kind, op, inner, site)] of one draft pass ("draft") and one context write of
    `rows` rows per request ("context"), after a warm-up of each (weight caches built). `path`:
    as in `build`."""
    global CENSUS
    CENSUS = Census()
    with instrument(), gpu_backends():
        eng, reqs = build(batch, temperature, path)
        runner, dp = eng.runner, eng.runner.draft_pass
        d = eng.drafter
        # the context write's device work: the Qwen3 pass picks its kernels in _commit_rows
        holder = dp if hasattr(dp, "_commit_rows") else d
        name = "_commit_rows" if holder is dp else "commit_rows"
        draft, commit = dp._draft, getattr(holder, name)

        def traced(phase, fn):
            def call(*args, **kwargs):
                if CENSUS.phase is not None:
                    return fn(*args, **kwargs)
                CENSUS.phase = phase
                try:
                    return fn(*args, **kwargs)
                finally:
                    CENSUS.phase = None
            return call
        width = (d.fc if hasattr(d, "fc") else d.main_proj).weight.shape[1]
        taps = torch.randn(batch * rows, width).to(eng.dtype)

        def context_round():
            for i, r in enumerate(reqs):
                runner.commit_context(r.draft_state, taps[i * rows:(i + 1) * rows],
                                      r.num_committed - rows)
            runner.flush_context()
        with torch.inference_mode():
            runner.draft(reqs), context_round()          # warm-up: caches, RoPE tables
            dp._draft = traced("draft", draft)
            setattr(holder, name, traced("context", commit))
            try:
                with CENSUS:
                    runner.draft(reqs)
                    context_round()
            finally:
                del dp._draft                            # the class's methods again
                delattr(holder, name)
    return CENSUS.rows


def report(rows: list, top: int = 40, out=sys.stdout):
    for phase in ("draft", "context"):
        got = [r for r in rows if r[0] == phase]
        launches = [r for r in got if r[1] != "sync"]
        kinds = collections.Counter(r[1] for r in launches)
        print(f"\n== {phase}: {len(launches)} launches (triton {kinds['triton']}, aten "
              f"{kinds['aten']}); host syncs {len(got) - len(launches)}", file=out)
        print("-- by op", file=out)
        for (kind, op), n in collections.Counter((r[1], r[2]) for r in got).most_common():
            print(f"  {n:4d}  {'[triton] ' if kind == 'triton' else ''}{op}", file=out)
        print("-- by source line (innermost dspark line <- drafter / draft-pass line)", file=out)
        by_line = collections.Counter((r[3], r[4]) for r in got)
        for (inner, site), n in by_line.most_common(top):
            ops = collections.Counter(r[2] for r in got if (r[3], r[4]) == (inner, site))
            what = ", ".join(f"{k} x{v}" if v > 1 else k for k, v in ops.most_common())
            where = inner if site in (None, inner) else f"{inner} <- {site}"
            print(f"  {n:4d}  {where}\n          {what}", file=out)
        if len(by_line) > top:
            print(f"  ... {len(by_line) - top} more lines", file=out)


def totals(rows: list) -> dict:
    return {p: sum(1 for r in rows if r[0] == p and r[1] != "sync") for p in ("draft", "context")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="the requests' temperature (0: greedy Markov steps)")
    ap.add_argument("--rows", type=int, default=3, help="context rows written per request")
    ap.add_argument("--top", type=int, default=40, help="source lines listed per phase")
    ap.add_argument("--qwen3", action="store_true",
                    help="a tiny random Qwen3 target + DeepSpec drafter pair instead of V4")
    ap.add_argument("--markov-head", default="vanilla", choices=("vanilla", "gated", "rnn"))
    ap.add_argument("--workdir", default=os.path.join(ROOT, "out", "qwen3_pair"),
                    help="where --qwen3 writes its pair (reused)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    path = qwen3_pair(args.workdir, args.markov_head) if args.qwen3 else None
    rows = census(args.batch, args.temperature, args.rows, path)
    report(rows, args.top)
    print(f"\ntotal launches: {totals(rows)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"totals": totals(rows), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
