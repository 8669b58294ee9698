"""Tensor-parallel attention + expert-parallel MoE on CPU: gloo, several processes.

Every multi-process test spawns real ranks (torch.multiprocessing, spawn) over a gloo group on
127.0.0.1 at a free port, compares against the single-process engine, and closes the group.
"""
import multiprocessing
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from dspark import Engine, SamplingParams
from dspark.config import ModelConfig
from dspark.distributed.comm import free_port
from dspark.distributed.engine import DistributedRunner
from dspark.distributed.loader import load_checkpoint_shard
from dspark.distributed.sharding import SKIP, ShardPlan, check_world_size, take
from dspark.models.loader import CheckpointError, load_checkpoint
from dspark.runner import QuantSim
from dspark.tools.make_checkpoint import preset_config


def _ids(n, vocab, a=7, b=3):
    return [(a * i + b) % vocab for i in range(n)]


@pytest.fixture(autouse=True)
def _no_leftover_group():
    yield
    assert not dist.is_initialized(), "a test left a process group behind"
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("dspark-tp")]


# ---- sharding rules and the rank-sharded loader (single process) -----------------------------

def test_world_size_rules():
    flash = preset_config("flash")
    for n in (1, 2, 4, 8):
        check_world_size(flash, n)
    with pytest.raises(ValueError, match="Valid sizes"):
        check_world_size(flash, 3)
    tiny = preset_config("tiny")           # 4 heads in 2 output groups: 4 ranks split a group
    plan = ShardPlan(tiny, 3, 4)
    assert plan.local_groups == 1 and plan.local_heads == 1
    assert plan.slices("layers.0.attn.wo_a.weight") == (slice(64, 128), slice(512, 1024))
    assert plan.slices("layers.0.attn.wo_b.weight") == (slice(None), slice(64, 128))
    # experts: a partition over ranks; KV head and compressors replicated
    owned = [ShardPlan(flash, r, 8).local_experts for r in range(8)]
    assert sorted(sum(owned, [])) == list(range(flash.n_routed_experts))
    assert ShardPlan(flash, 1, 8).slices("layers.2.attn.wkv.weight") == ()
    assert ShardPlan(flash, 1, 8).slices("layers.2.attn.compressor.wkv.weight") == ()
    assert ShardPlan(flash, 1, 8).slices("mtp.0.ffn.experts.3.w1.weight") is SKIP


class _RecordingOpen:
    """Wraps a safe_open handle and records every slice request (name, index)."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *a):
        return self.inner.__exit__(*a)

    def get_slice(self, name):
        sl, log = self.inner.get_slice(name), self.log

        class S:
            def __getitem__(self, key):
                out = sl[key]
                log.append((name, out.numel(), sl.get_shape()))
                return out
        return S()


def _load_shard_recorded(monkeypatch, path, cfg, rank, world, **kw):
    """(the rank's tensors, its ShardPlan, [(name, elements read, stored shape)] of every read)."""
    import dspark.distributed.loader as L
    log, real_open = [], L._open
    monkeypatch.setattr(L, "_open", lambda p, s: _RecordingOpen(real_open(p, s), log))
    part = load_checkpoint_shard(path, cfg, rank, world, **kw)
    monkeypatch.setattr(L, "_open", real_open)
    return part, ShardPlan(cfg, rank, world), log


def _assert_reads_only_its_part(log, plan, cfg, rank, world):
    read = {n for n, _, _ in log}
    for e in range(cfg.n_routed_experts):        # other ranks' experts are never opened
        hit = any(f".ffn.experts.{e}." in n for n in read)
        assert hit == plan.owns_expert(e), (e, rank, world)
    for name, numel, shape in log:                # sliced tensors: only their part
        if name.endswith(".attn.wq_b.weight") and "indexer" not in name:
            assert numel * world == shape[0] * shape[1]


@pytest.mark.parametrize("ckpt", ["tiny_ckpt", "tiny_quant_ckpt"])
def test_sharded_loader_reads_only_its_slices(ckpt, request, monkeypatch):
    path = request.getfixturevalue(ckpt)
    cfg = ModelConfig.from_path(path)
    full = load_checkpoint(path, cfg, progress=False)
    for world in (2, 4):
        for rank in range(world):
            part, plan, log = _load_shard_recorded(monkeypatch, path, cfg, rank, world)
            for name, t in full.items():
                sl = plan.slices(name)
                if sl is SKIP:
                    assert name not in part
                    continue
                want = take(t, sl)
                assert part[name].shape == plan.local_shape(name, t.shape) == want.shape, name
                assert part[name].dtype == want.dtype and torch.equal(part[name], want), name
            _assert_reads_only_its_part(log, plan, cfg, rank, world)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_loader_keeps_quantized_slices(tiny_quant_ckpt, world, monkeypatch):
    """keep_quantized: each rank gets its rows/cols of the stored codes and exactly the scale
    tiles under them (de-quantized, they equal the slice of the de-quantized tensor), reads only
    its slices, and never opens other ranks' experts."""
    from dspark.models.deepseek_v4.weights import scale_name, tensor_inventory
    from dspark.formats.quant import dequant_fp4_experts, dequant_fp8_blocks
    cfg = ModelConfig.from_path(tiny_quant_ckpt)
    inv = tensor_inventory(cfg)
    full = load_checkpoint(tiny_quant_ckpt, cfg, progress=False)
    for rank in range(world):
        part, plan, log = _load_shard_recorded(monkeypatch, tiny_quant_ckpt, cfg, rank, world,
                                               keep_quantized=True)
        for name, spec in inv.items():
            sl = plan.slices(name)
            if sl is SKIP:
                assert name not in part
                continue
            want = take(full[name], sl)
            if spec.kind in ("fp8", "fp4"):
                w, sc = part[name], part[scale_name(name)]
                deq = dequant_fp8_blocks if spec.kind == "fp8" else dequant_fp4_experts
                assert torch.equal(deq(w, sc, torch.float32), want), name
            else:
                assert torch.equal(part[name], want), name
        _assert_reads_only_its_part(log, plan, cfg, rank, world)


def test_quantized_split_must_fall_on_blocks():
    from dspark.distributed.sharding import check_quantized_split
    flash = preset_config("flash", dtype="fp8", fp4_experts=True, dspark=True)
    for n in (1, 2, 4, 8):
        check_quantized_split(flash, n)                  # V4-Flash widths split on 128-blocks
    tiny = preset_config("tiny", dtype="fp8", fp4_experts=True)
    check_quantized_split(tiny, 2)                       # 64-row halves inside one block: fine
    check_quantized_split(tiny, 4)
    bad = preset_config("tiny", dtype="fp8", overrides={"o_lora_rank": 192})
    with pytest.raises(ValueError, match=r"wo_a.*rows 192:384.*128x128 FP8 scale blocks"):
        check_quantized_split(bad, 2)
    check_quantized_split(preset_config("tiny", overrides={"o_lora_rank": 192}), 2)   # bf16: ok
    with pytest.raises(ValueError, match="weight_format='bf16'"):
        DistributedRunner.launch("/nonexistent", bad, 2, weight_format="quantized")


# ---- logits: world size 2 and 4 against the single-process engine ----------------------------

def _reference(path):
    eng = Engine(path, device="cpu", dtype="fp32", kv_cache_dtype="fp32", kv_layout="dense")
    return eng.runner, eng.cfg


def _passes(runner, cfg):
    """Two prefill chunks of one request (every layer type, compressed boundaries crossed, the
    indexer choosing 4 of 17 entries), a two-request batch, the draft context and a draft."""
    ids = _ids(70, cfg.vocab_size)
    s, ds = runner.new_states()
    l1, t1 = runner.target_forward([(s, 0, ids[:50])])
    runner.commit_context(ds, t1, 0)
    u, _ = runner.new_states()
    l2, t2 = runner.target_forward([(s, 50, ids[50:]), (u, 0, _ids(9, cfg.vocab_size, 5, 1))])
    runner.commit_context(ds, t2[:20], 50)
    reqs = [SimpleNamespace(anchor=5, num_committed=70, draft_state=ds,
                            params=SamplingParams(temperature=1.0), seed=3)]
    block = runner.draft(reqs)[0]
    return l1, l2, t2, block


@pytest.mark.parametrize("ckpt,world,mode,fmt,drafter", [
    ("tiny_ckpt", 2, "auto", "bf16", "sharded"),
    ("tiny_ckpt", 4, "auto", "bf16", "replicated"),
    ("tiny_quant_ckpt", 2, "auto", "bf16", "replicated"),
    ("tiny_quant_ckpt", 4, "auto", "bf16", "sharded"),
    ("tiny_ckpt", 2, "gather", "bf16", "replicated"),
    ("tiny_quant_ckpt", 2, "auto", "quantized", "replicated"),
    ("tiny_quant_ckpt", 4, "auto", "quantized", "sharded")])
def test_tp_logits_match_single_process(ckpt, world, mode, fmt, drafter, request):
    """World N against the single-process engine. weight_format="quantized": every rank keeps its
    FP8 codes + scale tiles / its packed FP4 experts; on CPU a QuantLinear de-quantizes exactly
    and then runs F.linear, so the reference is the de-quantized ("bf16" format, fp32 compute)
    single-process engine at the same 1e-4 (fp32 partial sums reduced in another order) and the
    single-process quantized engine equally. drafter="sharded": the drafter split like the
    target, every rank drafts; "replicated": rank 0 holds it whole and drafts alone."""
    path = request.getfixturevalue(ckpt)
    ref_runner, cfg = _reference(path)
    ref = _passes(ref_runner, cfg)
    refs = [ref]
    if fmt == "quantized":
        q1 = Engine(path, device="cpu", dtype="fp32", kv_cache_dtype="fp32", kv_layout="dense",
                    weight_format="quantized")
        refs.append(_passes(q1.runner, cfg))
    runner = DistributedRunner.launch(path, cfg, world, dtype=torch.float32, indexer_mode=mode,
                                      weight_format=fmt, drafter_mode=drafter)
    try:
        got = _passes(runner, cfg)
        stats = runner.worker_stats()
    finally:
        runner.shutdown()
    for r in refs:
        for a, b in zip(r[:3], got[:3]):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        assert torch.equal(got[3].tokens, r[3].tokens)
        torch.testing.assert_close(got[3].conf_logits, r[3].conf_logits, rtol=1e-4, atol=1e-4)
    # workers hold one state pair per live request and drop them with rank 0's objects
    assert [s["rank"] for s in stats] == list(range(world))
    assert all(s["states"] <= 4 for s in stats[1:])
    if drafter == "replicated":          # the drafter on rank 0 only, unsharded
        from dspark.distributed.ep_moe import EPMoE
        assert not any(isinstance(m, EPMoE) for m in runner.drafter.modules())
    if fmt == "quantized":
        from dspark.models.qlinear import QuantLinear
        assert isinstance(runner.model.layers[2].attn.wo_a, QuantLinear)
        assert all(s["weights"]["fp8"] > 0 and s["weights"]["fp4"] > 0 for s in stats)
        # every rank holds 1/world of the routed experts, packed (rank 0 also the whole
        # drafter's when it is replicated)
        fp4 = [s["weights"]["fp4"] for s in stats]
        assert len(set(fp4[1:] if drafter == "replicated" else fp4)) == 1
        assert drafter == "sharded" or fp4[0] > fp4[1]


def test_tp_fp8_kv_rounding_stays_close(tiny_quant_ckpt):
    """With FP8/FP4 cache rounding on, partial-sum order can flip a rounding step: close, not
    equal."""
    eng = Engine(tiny_quant_ckpt, device="cpu", dtype="fp32", kv_layout="dense")
    ids = _ids(70, eng.cfg.vocab_size)
    ref = eng.score(ids)
    runner = DistributedRunner.launch(tiny_quant_ckpt, eng.cfg, 2, quant=QuantSim())
    try:
        s, _ = runner.new_states()
        got, _ = runner.target_forward([(s, 0, ids)])
    finally:
        runner.shutdown()
    d = (got - ref).abs()
    assert d.median() < 1e-3 and d.max() < 0.2


# ---- the engine: generate() with tensor_parallel_size=2 --------------------------------------

@pytest.mark.parametrize("layout", ["paged", "dense"])
def test_engine_generate_tp2_equals_single_process(tiny_ckpt, layout):
    kw = dict(device="cpu", dtype="fp32", kv_cache_dtype="fp32", kv_layout=layout,
              max_num_seqs=3, max_num_batched_tokens=40)
    prompts = [_ids(5 + 13 * r, 1024, 7, 3 * r) for r in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=11)
    one = Engine(tiny_ckpt, **kw)
    want = [[o.token_ids for o in one.generate(prompts, sp)] for sp in (greedy, sampled)]
    want_score = one.score(prompts[3])
    eng = Engine(tiny_ckpt, tensor_parallel_size=2, **kw)
    try:
        got = [[o.token_ids for o in eng.generate(prompts, sp)] for sp in (greedy, sampled)]
        got_score = eng.score(prompts[3])
        stats = eng.runner.worker_stats()
    finally:
        eng.close()
    assert got == want
    torch.testing.assert_close(got_score, want_score, rtol=1e-4, atol=1e-4)
    # every request finished: workers freed their states and cache pages like rank 0
    assert all(s["states"] == 0 for s in stats[1:])
    assert len({(s["cache_requests"], s["cache_free_pages"]) for s in stats}) == 1
    eng.close()                                            # idempotent


def test_engine_generate_tp2_quantized_equals_single_process(tiny_quant_ckpt):
    kw = dict(device="cpu", dtype="fp32", kv_cache_dtype="fp32", max_num_seqs=3,
              max_num_batched_tokens=40, weight_format="quantized")
    prompts = [_ids(5 + 13 * r, 1024, 7, 3 * r) for r in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in Engine(tiny_quant_ckpt, **kw).generate(prompts, greedy)]
    eng = Engine(tiny_quant_ckpt, tensor_parallel_size=2, **kw)
    try:
        got = [o.token_ids for o in eng.generate(prompts, greedy)]
        rep = eng.memory_report()
    finally:
        eng.close()
    assert got == want
    assert rep["fp8"] > 0 and rep["fp4"] > 0


# ---- failures ----------------------------------------------------------------------------------

def test_launch_failure_cleans_up(tiny_ckpt, tmp_path):
    cfg = ModelConfig.from_path(tiny_ckpt)
    with pytest.raises(CheckpointError):
        DistributedRunner.launch(str(tmp_path), cfg, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        Engine(tiny_ckpt, device="cpu", tensor_parallel_size=3)


def test_free_port_is_bindable():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))


# ---- NCCL on GPUs: every world size the machine has (1 on a single-GPU box) -------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL)")
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_tp_nccl_logits_match_single_process(tiny_quant_ckpt, world, monkeypatch):
    """The same passes as the gloo tests, with the default process group on NCCL (one process
    per GPU, NVLink multicast off as on the lent machines), against the fp32 CPU reference."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"world size {world} needs {world} GPUs; {torch.cuda.device_count()} visible")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    ref_runner, cfg = _reference(tiny_quant_ckpt)
    ref = _passes(ref_runner, cfg)
    torch.backends.cuda.matmul.allow_tf32 = False
    runner = DistributedRunner.launch(tiny_quant_ckpt, cfg, world, device="cuda",
                                      dtype=torch.float32, weight_format="bf16")
    try:
        assert dist.get_backend() == "nccl"
        got = _passes(runner, cfg)
        stats = runner.worker_stats()
    finally:
        runner.shutdown()
    for a, b in zip(ref[:3], got[:3]):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-3, atol=1e-3)
    assert torch.equal(got[3].tokens.cpu(), ref[3].tokens)
    assert [s["rank"] for s in stats] == list(range(world))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL)")
@pytest.mark.parametrize("world", [2, 4, 8])
def test_tp_nccl_quantized_matches_world_1(tiny_quant_ckpt, world, monkeypatch):
    """weight_format="quantized" over NCCL (Triton FP8 / FP4 kernels on each rank's codes)
    against the same kernels at world 1: only the split GEMMs and the reduction order differ."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"world size {world} needs {world} GPUs; {torch.cuda.device_count()} visible")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    cfg = ModelConfig.from_path(tiny_quant_ckpt)
    outs = []
    for n in (1, world):
        runner = DistributedRunner.launch(tiny_quant_ckpt, cfg, n, device="cuda",
                                          dtype=torch.float32, weight_format="quantized")
        try:
            outs.append([t.cpu() for t in _passes(runner, cfg)[:3]])
            stats = runner.worker_stats()
        finally:
            runner.shutdown()
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=1e-2, atol=1e-2)
    assert all(s["weights"]["fp8"] > 0 and s["cuda_allocated"] > 0 for s in stats)


def test_bench_tp_smoke(tmp_path):
    """benchmarks/bench_tp.py --preset tiny --device cpu: the single-device runner and world 2
    (gloo), decode steps and DSpark rounds; greedy decode tokens equal; the step's collectives
    timed; weight-bytes estimate = what each rank holds (the replicated drafter on rank 0)."""
    import importlib.util
    import os
    from dspark.distributed.comm_profile import step_collectives
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("bench_tp", os.path.join(root, "benchmarks",
                                                                           "bench_tp.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--preset", "tiny", "--device", "cpu", "--workers", "1", "--world", "2",
                      "--batch", "2", "--steps", "2", "--warmup", "1",
                      "--workdir", str(tmp_path / "ckpt"), "--json", str(tmp_path / "r.json")])
    runs = {(r["kind"], r["world"]): r for r in out["runs"]}
    assert set(runs) == {("single", 1), ("tp", 2)} and all("error" not in r for r in runs.values())
    tp2 = runs["tp", 2]
    assert tp2["agreement"][2]["all_equal"]
    row = tp2["batches"][2]
    assert row["decode"]["step_ms"] > 0 and row["round"]["round_ms"] > row["round"]["verify_ms"]
    cfg = ModelConfig.from_path(str(tmp_path / "ckpt"))
    n_dec = len(step_collectives(cfg, 2, 2, 1))           # (bucket B = 2, q = 1)
    assert row["decode_comm"]["collectives"] == n_dec and row["decode_comm"]["comm_ms"] > 0
    # every step of both phases on every rank took the fixed-shape path
    assert [m["fixed_steps"] for m in row["memory"]] == [3 + 3] * 2
    est = out["weight_bytes_per_rank_estimate"][2]
    got = [m["weights"]["total"] for m in row["memory"]]
    assert all(abs(e - g) <= 1024 for e, g in zip(est, got)), (est, got)
    assert (tmp_path / "r.json").exists()
    with pytest.raises(SystemExit, match="single-device row only"):
        bench.main(["--preset", "tiny", "--device", "cpu", "--world", "2", "--deterministic"])
    # --deterministic reaches the single row's engine
    args = SimpleNamespace(cfg=cfg, prompt_len=4, warmup=0, steps=1, kv_cache_dtype="fp8",
                           deterministic=True)
    runner, _, close = bench.single_runner(str(tmp_path / "ckpt"), "cpu", "fp32", args, 1)
    assert runner.deterministic and runner.token_serial
    close()
