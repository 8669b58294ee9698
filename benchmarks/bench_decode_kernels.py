"""Few-token (decode / verify) weight-streaming kernels at V4-Flash shapes, old vs new, on CUDA.

* FP8 linears (e4m3 + 128x128 UE8M0, bf16 activations) of the decode step, T = 1, 2, 6 tokens:
  `skinny` = `_fp8_skinny_kernel` (weight tiles through shared memory, fp16 MMA operands) vs
  `tc` = `fp8_gemv_tc` (fragments loaded per lane, no shared memory) and its plan variants.
* Grouped FP4 routed MoE of one layer (256 experts, top-6, packed e2m1 + 1x32 UE8M0), T = 1, 6,
  16, 64, 128: `fma` = the CUDA-core per-pair kernels of fp4_moe.py vs `mma` = the expert-grouped
  dot_scaled tensor-core kernels of fp4_moe_mma.py (block configs).
* Read ceiling (`--read-ceiling`, on by default): one kernel that only streams the same number of
  bytes (16-byte loads, 264 / 528 / 1056 programs, the fastest kept), timed the same way: what a
  kernel of that size pays for its weights at best, launch, ramp-up and tail included (H200:
  8.9 MB 4.0 us = 2.2 TB/s, 53.5 MB 14.9 us = 3.6 TB/s against the 4.2 TB/s of a 2 GB
  copy). The per-step sum over the decode step's FP8 / MoE launches is the floor of those
  kernels under the copy-bandwidth roofline's byte count (launch counts of FP8_SHAPES: the new
  path runs wq_a + wkv and the shared w1 + w3 row-stacked, one launch each, as the engine does).

Timing: each variant is captured in one CUDA graph of R back-to-back calls that read R different
weight copies (FP8) or R different routings over the 256 experts (MoE), so every call starts with
its weights out of L2, and launch gaps are the graph's, as in the engine's decode graphs.
us = graph replay time / R (median of --iters replays). TB/s = bytes the call must read (codes +
scales of the used weights) / us, against the ~4.3 TB/s copy bandwidth. Every variant is checked
against de-quantize + F.linear (fp32) in the same run before timing.

    python benchmarks/bench_decode_kernels.py --json out/bench_decode_kernels.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dspark.kernels import fp8_gemm as fg  # noqa: E402
from dspark.kernels.fp4_moe import (fp4_moe, fp4_moe_grouped, stack_fp4_experts)  # noqa: E402
from dspark.kernels.fp4_moe_mma import fp4_moe_mma  # noqa: E402
from dspark.kernels.fp4_moe_tc import fp4_moe_tc  # noqa: E402
from dspark.formats.quant import dequant_fp8_blocks, quant_fp4, quant_fp8_blocks  # noqa: E402

COPY_BW = 4.3e12
# (name, N, K, (calls per decode step of the 4-layer V4-Flash checkpoint: old path, new path));
# wo_a: the old path runs one linear per group (32 per step), the new one grouped launch per layer;
# wq_a / wkv and the shared w1 / w3 share their input: the new path runs each pair row-stacked
FP8_SHAPES = [("wq_a", 1024, 4096, (4, 0)), ("wq_b", 32768, 1024, (4, 4)),
              ("wkv", 512, 4096, (4, 0)), ("wq_a+wkv rows", 1536, 4096, (0, 4)),
              ("wo_a/group", 1024, 4096, (32, 0)), ("wo_b", 4096, 8192, (4, 4)),
              ("shared.w1/w3", 2048, 4096, (8, 0)), ("shared.w1+w3 rows", 4096, 4096, (0, 4)),
              ("shared.w2", 4096, 2048, (4, 4)), ("wo_a 8 groups", 8192, 4096, (0, 4))]


def graph_time(calls, iters: int) -> float:
    """Seconds per call: one CUDA graph replaying `calls` (a list of thunks) back to back."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls[:2]:
            c()                                            # compile / autotune outside capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e-3 / len(calls))
    return statistics.median(times)


@triton.jit
def _stream_read(p, out, n_words, WPP, BLOCK: tl.constexpr):
    """Sum of int32 words [pid * WPP, (pid + 1) * WPP): a read-only stream, nothing else."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, WPP, BLOCK):
        offs = pid * WPP + i + tl.arange(0, BLOCK)
        acc += tl.load(p + offs, mask=offs < n_words, other=0)
    tl.store(out + pid, tl.sum(acc, 0))


def read_ceiling_us(nbytes: int, iters: int) -> tuple[float, int]:
    """(us, programs): the fastest pure read of nbytes (cold L2, graph replay of R copies)."""
    words = triton.cdiv(nbytes, 4)
    R = max(4, min(64, (512 << 20) // max(nbytes, 1)))
    bufs = [torch.ones(words, dtype=torch.int32, device="cuda") for _ in range(R)]
    best = None
    for progs in (264, 528, 1056):
        wpp = triton.cdiv(triton.cdiv(words, progs), 1024) * 1024
        out = torch.empty(progs, dtype=torch.int32, device="cuda")
        t = graph_time([lambda b=b, wpp=wpp, progs=progs, out=out: _stream_read[(progs,)](
            b, out, words, wpp, BLOCK=1024, num_warps=4) for b in bufs], iters)
        if best is None or t < best[0]:
            best = (t, progs)
    return best[0] * 1e6, best[1]


def bench_read(rows, iters):
    """The read ceiling at the byte counts of the FP8 shapes (T = 1) and the MoE layer rows."""
    sizes = sorted({(r["kind"] + " " + r["op"], r["bytes"], r["per_step"][1] if r["kind"] == "fp8"
                     else r["per_step"]) for r in rows if r["T"] == 1 and (
                         r["kind"] == "fp8" or r["op"] == MOE_VARIANTS[0][0])},
                   key=lambda s: s[1])
    print(f"\n{'read ceiling (same bytes)':28s} {'MB':>7s} {'us':>8s} {'TB/s':>5s} {'progs':>6s} "
          f"{'ours us':>8s} {'% of ceiling':>12s}")
    step_floor = step_ours = 0.0
    for name, nbytes, per_step in sizes:
        us, progs = read_ceiling_us(nbytes, iters)
        ours = next(r for r in rows if r["T"] == 1 and r["kind"] + " " + r["op"] == name)
        ours_us = ours["tc_us"] if ours["kind"] == "fp8" else ours["us"]
        step_floor += us * per_step
        step_ours += ours_us * per_step
        rows.append(dict(kind="read", op=name, T=1, bytes=nbytes, per_step=per_step, us=us,
                         programs=progs, ours_us=ours_us))
        print(f"{name:28s} {nbytes / 1e6:7.1f} {us:8.1f} {nbytes / us / 1e6:5.2f} {progs:6d} "
              f"{ours_us:8.1f} {100 * us / ours_us:11.0f}%", flush=True)
    print(f"per decode step (these launches): read ceiling {step_floor:.0f} us, ours "
          f"{step_ours:.0f} us")
    return step_floor, step_ours


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


# FP8 variants timed next to the shipped path (old = the skinny kernel, fp16 operands; new =
# fp8_gemv_tc with its default plan, fp8_gemv_tc.TUNING). Variants: (name, fp8_gemv_tc kwargs).
TC_VARIANTS = [("u2", dict(unroll=2)), ("u4", dict(unroll=4)),      # (the default: 1 step)
               ("t1024", dict(target=1024)), ("t4096", dict(target=4096)), ("w2", dict(warps=2)),
               ("w4 t4096", dict(warps=4, target=4096))]


def bench_fp8(tokens, iters, rows):
    from dspark.kernels.fp8_gemv_tc import fp8_gemv_tc
    for name, N, K, per_step in FP8_SHAPES:
        if per_step[1] == 0:
            continue                      # launches the engine no longer makes
        nbytes = N * K + fg.triton.cdiv(N, 128) * fg.triton.cdiv(K, 128)
        R = max(4, min(64, (512 << 20) // nbytes))
        w0, s0 = quant_fp8_blocks(torch.randn(N, K, device="cuda") * 0.02)
        ws = [(w0.clone().view(torch.uint8), s0.clone().view(torch.uint8)) for _ in range(R)]
        ref_w = dequant_fp8_blocks(w0, s0).float()
        G = 8 if "groups" in name else 1
        for T in tokens:
            x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), ref_w)
            if G > 1:
                x = torch.randn(T, G, K, device="cuda", dtype=torch.bfloat16)
                ref = torch.einsum("tgi,gri->tgr", x.float(), ref_w.view(G, N // G, K)).reshape(T, N)
            variants = [("skinny", lambda x, w, s: fg.fp8_skinny_triton(
                            x, w, s, N, K, torch.bfloat16, "fp16", groups=G, tc=False)),
                        ("tc", lambda x, w, s: fp8_gemv_tc(x, w, s, N, K, groups=G))]
            variants += [(f"tc {v}", lambda x, w, s, kw=kw: fp8_gemv_tc(x, w, s, N, K, groups=G,
                                                                         **kw))
                         for v, kw in TC_VARIANTS]
            res = {}
            for variant, fn in variants:
                err = _rel(fn(x, *ws[0]).reshape(T, N), ref)
                t = graph_time([lambda w=w, s=s: fn(x, w, s) for w, s in ws], iters)
                res[variant] = (t, err)
            # the same weights every call: they stay in L2 (<= 33.6 MB here), the time a GEMV
            # would take on weights an L2 prefetch had fetched ahead of it
            res["tc hot"] = (graph_time([lambda: variants[1][1](x, *ws[0])] * R, iters),
                             res["tc"][1])
            rows.append(dict(kind="fp8", op=name, T=T, N=N, K=K, per_step=per_step, bytes=nbytes,
                             **{f"{v}_us": t * 1e6 for v, (t, _) in res.items()},
                             **{f"{v}_err": e for v, (_, e) in res.items()}))
            _print_row(rows[-1])


# grouped MoE variants: (name, kind, block, num_warps, num_stages); the first is the baseline
MOE_VARIANTS = [("fma 4x32 pair decode", "fma-pair", (4, 32), 4, 3),     # shipped
                ("fma 8x32 pair decode", "fma-pair", (8, 32), 4, 3),
                # tensor-core decode (fp4_moe_tc: K splits of gate/up and down, warps, steps per
                # asm block); H200: 39.6 / 37.2 us per layer at 1 token for split
                # 4/2 unrolled 1 / 2 vs 51.4 for the CUDA-core kernels above
                ("tc split 4/2 w1", "tc", None, 1, 0, {"up_split": 4, "down_split": 2,
                                                       "unroll": 1}),
                ("tc split 4/2 w1 unroll 2", "tc", None, 1, 0, {"up_split": 4, "down_split": 2,
                                                                "unroll": 2}),
                ("tc split 4/2 w1 unroll 4", "tc", None, 1, 0, {"up_split": 4, "down_split": 2,
                                                                "unroll": 4}),
                ("tc split 8/4 w1 unroll 2", "tc", None, 1, 0, {"up_split": 8, "down_split": 4,
                                                                "unroll": 2}),
                ("mma 32x256 w4 s3", "mma", (32, 256), 4, 3),
                ("mma 32x256 w4 s4", "mma", (32, 256), 4, 4),
                ("mma 64x256 w4 s3", "mma", (64, 256), 4, 3)]
MOE_TOKENS = [1, 6, 16, 64, 128]      # decode, verify, short prefills


def bench_moe(tokens, iters, rows, E=256, k=6, D=4096, I=2048, only=()):
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts = [tuple(quant_fp4(torch.randn(*shape, device="cuda", generator=gen) * 0.02)
                     for shape in ((I, D), (I, D), (D, I))) for _ in range(E)]
    stack = stack_fp4_experts(experts)
    per_expert = sum(a.numel() + b.numel() for a, b in experts[0])
    print(f"\n{'grouped FP4 MoE (one layer)':28s} {'T':>3s} {'MB':>7s} {'us':>8s} {'TB/s':>5s} "
          f"{'vs old':>7s} {'rel err':>8s}")
    for T in tokens:
        R = 16 if T <= 16 else 4
        xs = [torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(R)]
        idxs = [torch.rand(T, E, device="cuda", generator=gen).topk(k, dim=-1).indices
                for _ in range(R)]
        wts = [torch.rand(T, k, device="cuda", generator=gen) for _ in range(R)]
        used = statistics.mean(int(torch.unique(i).numel()) for i in idxs)
        nbytes = int(used * per_expert)
        ref = fp4_moe(xs[0], idxs[0], wts[0], experts, 10.0, grouped=False)   # per-expert loop
        base = None
        for name, kind, block, warps, stages, *opt in MOE_VARIANTS:
            if only and not any(s in name for s in only):
                continue
            if kind == "tc":
                fn = lambda a, i, w, warps=warps, opt=opt[0]: fp4_moe_tc(  # noqa: E731
                    a, i, w, stack, 10.0, warps=warps, **opt)
            elif kind.startswith("fma"):          # a given block: the CUDA-core kernels
                fn = lambda a, i, w, block=block, pd=kind != "fma": fp4_moe_grouped(  # noqa: E731
                    a, i, w, stack, 10.0, block=block, pair_decode=pd)
            else:
                fn = lambda a, i, w, block=block, warps=warps, stages=stages: fp4_moe_mma(  # noqa: E731
                    a, i, w, stack, 10.0, block=block, num_warps=warps, num_stages=stages)
            try:
                err = _rel(fn(xs[0], idxs[0], wts[0]), ref)
                t = graph_time([lambda j=j, fn=fn: fn(xs[j], idxs[j], wts[j]) for j in range(R)],
                               iters)
            except Exception as e:                          # a config that fails is a finding
                print(f"{name:28s} {T:3d} failed: {type(e).__name__}: {str(e)[:120]}")
                continue
            base = base or t
            rows.append(dict(kind="fp4 moe", op=name, T=T, N=D, K=I, per_step=4, bytes=nbytes,
                             us=t * 1e6, err=err))
            print(f"{name:28s} {T:3d} {nbytes / 1e6:7.1f} {t * 1e6:8.1f} {nbytes / t / 1e12:5.2f} "
                  f"{base / t:6.2f}x {err:8.1e}", flush=True)


_HEADER = (f"{'op':28s} {'T':>3s} {'MB':>7s} {'old us':>8s} {'TB/s':>5s} {'new us':>8s} "
           f"{'TB/s':>5s} {'speedup':>7s} {'err old':>8s} {'err new':>8s}")


def _print_row(r):
    old, new = "skinny", "tc"
    to, tn = r[f"{old}_us"], r[f"{new}_us"]
    print(f"{r['kind'] + ' ' + r['op']:28s} {r['T']:3d} {r['bytes'] / 1e6:7.1f} {to:8.1f} "
          f"{r['bytes'] / to / 1e6:5.2f} {tn:8.1f} {r['bytes'] / tn / 1e6:5.2f} {to / tn:6.2f}x "
          f"{r[f'{old}_err']:8.1e} {r[f'{new}_err']:8.1e}"
          + "".join(f" | {v[3:]} {r[f'{v}_us']:.1f}" for v in
                    [f"tc {n}" for n, _ in TC_VARIANTS] + ["tc hot"] if f"{v}_us" in r), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 6])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--skip-moe", action="store_true")
    ap.add_argument("--skip-fp8", action="store_true")
    ap.add_argument("--moe-tokens", type=int, nargs="+", default=MOE_TOKENS)
    ap.add_argument("--moe-only", nargs="+", default=(),
                    help="MoE variants whose names contain one of these strings")
    ap.add_argument("--no-read-ceiling", dest="read_ceiling", action="store_false",
                    help="skip the pure-read kernel at the same byte counts")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode_kernels: no CUDA device (this times GPU kernels); on CPU run "
              "python -m pytest -q tests/test_qlinear.py tests/test_fp4_moe_grouped.py")
        return 0
    torch.manual_seed(0)
    rows = []
    print("FP8: old = skinny kernel (fp16 operands), new = tensor-core GEMV (fp8_gemv_tc); MoE: "
          "variants; us per call from CUDA-graph replays, cold L2")
    print(_HEADER)
    if not args.skip_fp8:
        bench_fp8(args.tokens, args.iters, rows)
    if not args.skip_moe:
        bench_moe(args.moe_tokens, args.iters, rows, only=args.moe_only)
    ceiling = bench_read(rows, args.iters) if args.read_ceiling else None
    step = {"fp8 old": 0.0, "fp8 new": 0.0}
    for r in rows:
        if r["T"] == 1 and r["kind"] == "fp8":
            step["fp8 old"] += r["skinny_us"] * r["per_step"][1]
            step["fp8 new"] += r["tc_us"] * r["per_step"][1]
        elif r["T"] == 1 and r["kind"] == "fp4 moe":
            step[f"moe {r['op']}"] = r["us"] * r["per_step"]
    if ceiling:
        step["read ceiling of fp8 new + moe (first variant)"] = ceiling[0]
    print("per decode step at T = 1 (4 layers, these kernels only): "
          + ", ".join(f"{k} {v:.0f} us" for k, v in step.items() if v))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_bw=COPY_BW, rows=rows,
                           step_us=step), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
