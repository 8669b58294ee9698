"""Tensor-parallel attention + expert-parallel MoE on CPU: gloo, several processes.

Every multi-process test spawns real ranks (torch.multiprocessing, spawn) over a gloo group on
127.0.0.1 at a free port, compares against the single-process engine, and closes the group.
"""
import multiprocessing

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


@pytest.mark.parametrize("ckpt", ["tiny_ckpt", "tiny_quant_ckpt"])
def test_sharded_loader_reads_only_its_slices(ckpt, request, monkeypatch):
    import dspark.distributed.loader as L
    path = request.getfixturevalue(ckpt)
    cfg = ModelConfig.from_path(path)
    full = load_checkpoint(path, cfg, progress=False)
    real_open = L._open
    for world in (2, 4):
        for rank in range(world):
            log = []
            monkeypatch.setattr(L, "_open", lambda p, s: _RecordingOpen(real_open(p, s), log))
            part = load_checkpoint_shard(path, cfg, rank, world)
            plan = ShardPlan(cfg, rank, world)
            for name, t in full.items():
                sl = plan.slices(name)
                if sl is SKIP:
                    assert name not in part
                    continue
                want = take(t, sl)
                assert part[name].shape == plan.local_shape(name, t.shape) == want.shape, name
                assert part[name].dtype == want.dtype and torch.equal(part[name], want), name
            read = {n for n, _, _ in log}
            for e in range(cfg.n_routed_experts):        # other ranks' experts are never opened
                hit = any(f".ffn.experts.{e}." in n for n in read)
                assert hit == plan.owns_expert(e), (e, rank, world)
            for name, numel, shape in log:                # sliced tensors: only their part
                if ".attn.wq_b.weight" in name and "indexer" not in name and \
                        name.endswith(".weight"):
                    assert numel * world == shape[0] * shape[1]


# ---- logits: world size 2 and 4 against the single-process engine ----------------------------

def _reference(path):
    eng = Engine(path, device="cpu", dtype="fp32", kv_cache_dtype="fp32", kv_layout="dense")
    return eng.runner, eng.cfg


def _passes(runner, cfg):
    """Two prefill chunks of one request (every layer type, compressed boundaries crossed, the
    indexer choosing 4 of 17 entries), a two-request batch, the draft context and a draft."""
    from types import SimpleNamespace
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


@pytest.mark.parametrize("ckpt,world,mode", [("tiny_ckpt", 2, "auto"), ("tiny_ckpt", 4, "auto"),
                                             ("tiny_quant_ckpt", 2, "auto"),
                                             ("tiny_quant_ckpt", 4, "auto"),
                                             ("tiny_ckpt", 2, "gather")])
def test_tp_logits_match_single_process(ckpt, world, mode, request):
    path = request.getfixturevalue(ckpt)
    ref_runner, cfg = _reference(path)
    ref = _passes(ref_runner, cfg)
    runner = DistributedRunner.launch(path, cfg, world, dtype=torch.float32, indexer_mode=mode)
    try:
        got = _passes(runner, cfg)
        stats = runner.worker_stats()
    finally:
        runner.shutdown()
    for a, b in zip(ref[:3], got[:3]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[3].tokens, ref[3].tokens)
    torch.testing.assert_close(got[3].conf_logits, ref[3].conf_logits, rtol=1e-4, atol=1e-4)
    # workers hold one state pair per live request and drop them with rank 0's objects
    assert [s["rank"] for s in stats] == list(range(world))
    assert all(s["states"] <= 4 for s in stats[1:])


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
                                      dtype=torch.float32)
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
