"""Host work of one DSpark round, measured on CPU along the CUDA path's code.

    PYTHONPATH=. python benchmarks/host_round_cpu.py --temperature 0 --rounds 200
    PYTHONPATH=. python benchmarks/host_round_cpu.py --policy scheduled
    PYTHONPATH=. python benchmarks/host_round_cpu.py --concurrency 1,16,64   # rounds of C requests
    PYTHONPATH=. python benchmarks/host_round_cpu.py --concurrency 1 --device-ms 0.553,0.262,0.008

The shipped pair on CPU, set up as the engine runs it on CUDA: the V4 target's fixed-shape step
(V4DecodeGraphs) and the draft pass / context writes as "graphs", sampled verification through
the fused kernel. Every graph replay and the fused kernel are stand-ins that do no work (the
drafts and logits stay what the buffers hold), so what is timed and counted is the host side a
round issues around its replays:

* CPU us per round (wall, no profiler) and Python function calls per round (cProfile);
* torch ops per round issued outside the graphs (TorchDispatchMode; each is a launch or more on
  CUDA, ~5-20 us of host there);
* host reads per round (Tensor.tolist / item / cpu / numpy / bool / int / float calls: on CUDA
  each is a wait for the device unless it reads a host tensor);
* with --top N, the N functions with the most own time under cProfile.

--device-ms gives the stand-in replays busy times on a simulated device that runs beside the host
(a read back waits for the work queued before it), so a round's time shows where the host waits
for the device and where the device idles while the host works; scale the times to this CPU's
speed against the GPU host's to stand for that machine.

--policy picks the verify policy (default fixed); the scheduled ones price rounds with the SPS
table measured for the shipped pair on the H200 (`H200_SPS_MS`), not a CPU profile, so their
widths are those of the GPU run.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import pstats
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dspark.draft_pass as draft_pass_mod
import dspark.kernels.sampling as sampling_kernels
from dspark import Engine, SamplingParams
from dspark.engine import default_model_path
from dspark.formats.sampling import VerifyResult
from dspark.models.deepseek_v4.graph import V4DecodeGraphs, reserve_scratch


# SPS(B) of the shipped pair on the H200 ([B, step ms]; benchmarks/results/
# bench_dspark_vs_off_h200.json, "sps_ms")
H200_SPS_MS = [[1, 0.817], [2, 0.820], [4, 0.877], [6, 0.877], [12, 1.111], [24, 1.141],
               [36, 1.311], [48, 1.311], [72, 1.577], [96, 1.577], [144, 2.088], [192, 2.088],
               [288, 2.589], [384, 2.977]]


class SimulatedDevice:
    """A device timeline for the stand-in replays (--device-ms): a launch occupies the device
    for its busy time from the later of now and the end of the work queued before it; a read
    back's event is complete when the work queued before the read has ended, and waiting for
    it spins until then. Host and device then overlap as they do on CUDA."""

    def __init__(self, busy_s: dict):
        self.busy_s, self.busy_until = busy_s, 0.0

    def launch(self, kind: str) -> None:
        self.busy_until = max(time.perf_counter(), self.busy_until) + self.busy_s.get(kind, 0.0)

    def event(self):
        return _SimulatedEvent(self.busy_until)


class _SimulatedEvent:
    def __init__(self, done_at: float):
        self.done_at = done_at

    def synchronize(self) -> None:
        while time.perf_counter() < self.done_at:
            pass


DEVICE = None          # the SimulatedDevice of --device-ms, when given


class _NoWorkGraph:
    """A captured graph whose replay does nothing (its outputs keep their buffers' values) but
    occupy the simulated device, if any, for its kind's busy time."""
    kind = "draft"

    def replay(self):
        if DEVICE is not None:
            DEVICE.launch(self.kind)


def _capture_once(fn, pool):
    return _NoWorkGraph(), fn()          # run once for the output buffers, never again


def _fused_verify_stub(drafts, q, logits, temp, lens, seeds, P):
    """fused_verify's outputs from one op (the kernel's single launch on CUDA): all accepted."""
    a = lens.clone()
    return VerifyResult(a, a)


def cuda_path_engine(max_num_seqs: int = 4, policy: str = "fixed",
                     pages_per_seq: int = 4) -> Engine:
    """The shipped pair on CPU with the CUDA round's code path and no device work in replays."""
    draft_pass_mod.capture, draft_pass_mod.warm_up = _capture_once, lambda *a, **k: None
    torch.cuda.graph_pool_handle = lambda: None
    import dspark.spec.accept as accept_mod
    accept_mod.fused_sampling_enabled = lambda dev: True
    sampling_kernels.fused_verify = _fused_verify_stub
    sps = {} if policy == "fixed" else {"sps_table": H200_SPS_MS}
    eng = Engine(default_model_path(), device="cpu", dtype="fp32", max_num_seqs=max_num_seqs,
                 num_kv_blocks=pages_per_seq * max_num_seqs + 2, verify_policy=policy, **sps)
    r = eng.runner
    reserve_scratch(eng.cache)
    r.target_graphs = V4DecodeGraphs(r.model, eng.cache, "torch",
                                     q_lens=range(1, r.drafter.gamma + 2), max_batch=max_num_seqs,
                                     tap_layers=r.tap_layers, capture=False)
    # the target graph's replay: no work (time on the simulated device, if any)
    r.target_graphs._forward = lambda B, q, P: DEVICE is not None and DEVICE.launch("verify")
    r.uniform_verify = True
    if hasattr(eng.policy, "uniform"):
        eng.policy.uniform = True
    dp = r.draft_pass
    dp.cuda_graphs = dp.graphs_wanted = True
    graph = dp._graph

    def kinded(key, bound, capture):          # "draft" or "context": its simulated busy time
        got = graph(key, bound, capture)
        got.graph.kind = key[0]
        return got
    dp._graph = kinded
    read = eng._reader.read

    def read_with_event(t):                   # the read back waits for the simulated device
        host, ready = read(t)
        return host, (DEVICE.event() if DEVICE is not None else ready)
    eng._reader.read = read_with_event
    return eng


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def count_reads(counter):
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name, fn):
        def read(self, *a, **k):
            counter[name] += 1
            return fn(self, *a, **k)
        return read
    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def fresh_request(eng, sp, prompt) -> None:
    """Abort what runs, admit `prompt` and run its prompt step (not a steady-state round)."""
    for rid in eng.request_ids():
        eng.abort(rid)
    eng.add_request(prompt, sp)
    eng.step()


def rounds_of(eng, n: int) -> None:
    for _ in range(n):
        eng.step()


def fresh_batch(eng, sp, prompt, concurrency: int) -> None:
    """Abort what runs, admit `concurrency` requests and step until every one is past its
    prompt (the rounds timed afterwards are steady-state rounds of all of them)."""
    for rid in eng.request_ids():
        eng.abort(rid)
    for i in range(concurrency):
        eng.add_request(prompt + " " * i, sp)        # distinct prompts, nearly one length
    while eng.scheduler.waiting or any(not r.output_ids for r in eng.scheduler.running):
        eng.step()


def concurrency_rows(levels, temperature: float, policy: str, rounds: int, repeats: int) -> None:
    """Host us per round with C requests in every round, for each C of `levels` (best of
    `repeats` runs of `rounds` rounds after 10 untimed ones), and per request."""
    sp = SamplingParams(temperature=temperature, max_tokens=10 ** 6, ignore_eos=True, seed=1)
    for c in levels:
        # pages for the prompt and every round's γ + 1 rows (no preemption while timed); one
        # cache slot more than C: reserve_scratch takes one
        eng = cuda_path_engine(max(4, c + 1), policy, pages_per_seq=-(-(64 + 6 * (rounds + 12)) // 256) + 1)
        best = float("inf")
        with torch.inference_mode():
            for _ in range(repeats):
                fresh_batch(eng, sp, "def fibonacci(n):\n", c)
                rounds_of(eng, 10)
                before = eng.compile_stats()
                t0 = time.perf_counter()
                rounds_of(eng, rounds)
                best = min(best, (time.perf_counter() - t0) / rounds * 1e6)
                if eng.compile_stats() != before or len(eng.scheduler.running) != c:
                    raise RuntimeError(f"c={c}: the timed rounds were not steady state "
                                       f"({eng.compile_stats()}, {len(eng.scheduler.running)} running)")
            # the counts, which do not move with the machine's load as its clock does (the
            # host's own work: no waits for a simulated device)
            global DEVICE
            device, DEVICE = DEVICE, None
            fresh_batch(eng, sp, "def fibonacci(n):\n", c)
            rounds_of(eng, 10)
            prof = cProfile.Profile()
            prof.enable()
            rounds_of(eng, rounds)
            prof.disable()
            calls = sum(nc for (_, nc, _, _, _) in pstats.Stats(prof).stats.values())
            ops = OpCounter()
            with ops:
                rounds_of(eng, rounds)
            DEVICE = device
        print(f"{policy} T={temperature} c={c}: {best:.0f} us/round, {best / c:.1f} us/request "
              f"(best of {repeats} x {rounds}); {calls / rounds:.0f} Python calls, "
              f"{sum(ops.ops.values()) / rounds:.1f} torch ops per round")
        eng.close()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--top", type=int, default=0)
    p.add_argument("--policy", default="fixed", help="verify policy (fixed, scheduled, ...)")
    p.add_argument("--concurrency", default=None,
                   help="comma list C: host us per round of C requests (instead of the batch-1 "
                        "counts and profile)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device-ms", default=None,
                   help="verify,draft,context: busy ms of those replays on a simulated device "
                        "(e.g. the H200's batch-1 trace of the shipped pair: 0.553,0.262,0.008), "
                        "so that rounds time host and device overlapping as on CUDA")
    a = p.parse_args(argv)
    if a.device_ms:
        global DEVICE
        v, d, c = (float(x) / 1e3 for x in a.device_ms.split(","))
        DEVICE = SimulatedDevice({"verify": v, "draft": d, "context": c})
    if a.concurrency:
        concurrency_rows([int(c) for c in a.concurrency.split(",")], a.temperature, a.policy,
                         min(a.rounds, 60), a.repeats)
        return
    eng = cuda_path_engine(policy=a.policy)
    sp = SamplingParams(temperature=a.temperature, max_tokens=10 ** 6, ignore_eos=True, seed=1)
    prompt = "def fibonacci(n):\n"
    with torch.inference_mode():
        fresh_request(eng, sp, prompt)
        rounds_of(eng, 50)                                     # warm
        best = float("inf")
        for _ in range(10):
            fresh_request(eng, sp, prompt)
            t0 = time.perf_counter()
            rounds_of(eng, a.rounds)
            best = min(best, (time.perf_counter() - t0) / a.rounds * 1e6)
        fresh_request(eng, sp, prompt)
        prof = cProfile.Profile()
        prof.enable()
        rounds_of(eng, a.rounds)
        prof.disable()
        calls = sum(nc for (_, nc, _, _, _) in pstats.Stats(prof).stats.values())
        fresh_request(eng, sp, prompt)
        ops, reads = OpCounter(), collections.Counter()
        with ops, count_reads(reads):
            rounds_of(eng, a.rounds)
    n = a.rounds
    print(f"{a.policy} T={a.temperature}: {best:.0f} us/round (best of 10 x {n}), "
          f"{calls / n:.0f} Python calls/round, {sum(ops.ops.values()) / n:.1f} torch ops/round, "
          f"{sum(reads.values()) / n:.1f} host reads/round")
    print("  ops/round:", ", ".join(f"{k} {v / n:.1f}" for k, v in ops.ops.most_common()))
    print("  reads/round:", ", ".join(f"{k} {v / n:.1f}" for k, v in reads.most_common()))
    if a.top:
        st = pstats.Stats(prof)
        rows = sorted(((tt, ct, nc, f"{fn[0].split('/')[-1]}:{fn[1]}({fn[2]})")
                       for fn, (_, nc, tt, ct, _) in st.stats.items()), reverse=True)
        print(f"{'own us':>8} {'cum us':>8} {'calls':>6}  (per round, under cProfile)")
        for tt, ct, nc, name in rows[:a.top]:
            print(f"{1e6 * tt / n:>8.1f} {1e6 * ct / n:>8.1f} {nc / n:>6.1f}  {name}")


if __name__ == "__main__":
    main()
