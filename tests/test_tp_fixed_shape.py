"""The single-device fast path under tensor / expert parallelism, on CPU (gloo, several processes).

* the fixed-shape decode / verify step (V4DecodeGraphs + static_forward, run eagerly on CPU;
  captured as CUDA graphs on GPU) on every rank, the collectives inside the step and rank 0's
  inputs and plan broadcast in it: logits and taps at world 2 and 4 equal the single-process
  eager paged forward (an independent path, itself checked against the dense reference and HF)
  within fp32 tolerance, greedy choices exactly where the reference's top-2 margin exceeds
  the tolerance by far;
* the collectives a step issues are the ones comm_profile.step_collectives lists (what the
  benchmark times);
* the expert-parallel MoE's fixed-shape paths: the ranks' partials sum to the whole MoE;
* DSpark rounds through the Engine at world 2: greedy tokens equal world 1.
"""
import multiprocessing

import pytest
import torch
import torch.distributed as dist

from dspark import Engine, SamplingParams
from dspark.attention import get_backend
from dspark.config import ModelConfig
from dspark.distributed.comm import TPGroup
from dspark.distributed.comm_profile import step_collectives
from dspark.distributed.engine import DistributedRunner
from dspark.kvcache.paged import PagedKVCache
from dspark.models.deepseek_v4.graph import reserve_scratch
from dspark.request import BlockTokens
from dspark.runner import ModelRunner
from triton_env import gpu, needs_cuda

TOL = 1e-4
MARGIN = 1e-2        # 100x the logits tolerance: a greedy choice this clear cannot flip


@pytest.fixture(autouse=True)
def _no_leftover_group():
    yield
    assert not dist.is_initialized(), "a test left a process group behind"
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("dspark-tp")]


def _cache(cfg, device="cpu", kv="fp32"):
    return PagedKVCache(cfg, kv_cache_dtype=kv, block_size=16, num_blocks=24, max_num_seqs=4,
                        lookahead=cfg.dspark_block_size, max_batch_tokens=96, device=device)


def _steps(cfg):
    """(prefill items, then fixed-shape steps) for 3 requests: decode (q = 1) and verify blocks
    (q = γ + 1, drafts as device tensors) crossing ratio-4 and ratio-16 entry boundaries, with
    rollbacks (truncate) after verifies. Each step: (items, truncations after it)."""
    V, q = cfg.vocab_size, cfg.dspark_block_size + 1
    lens = [14, 3, 29]
    prefill = [(r, 0, [(7 * i + 3 * r + 1) % V for i in range(n)]) for r, n in enumerate(lens)]
    steps, pos = [], list(lens)
    for k in range(6):
        if k % 2 == 0:
            items = [(r, pos[r], [(5 * k + r + 2) % V]) for r in range(3)]
            steps.append((items, {}))
            pos = [p + 1 for p in pos]
        else:
            items = [(r, pos[r], BlockTokens((3 * k + r) % V, torch.tensor(
                [(11 * k + 7 * j + r) % V for j in range(q - 1)]))) for r in range(3)]
            keep = {r: pos[r] + 1 + (k + r) % q for r in range(3)}      # accepted: 1..q rows
            steps.append((items, keep))
            pos = [min(keep[r], pos[r] + q) for r in range(3)]
    return prefill, steps, pos


def _drive(runner, cache, cfg, guard=None):
    """Run `_steps` on `runner` over `cache`; [(logits, taps)] of every fixed-shape step.
    guard: a SyncGuard armed around each of those steps."""
    prefill, steps, end = _steps(cfg)
    q = cfg.dspark_block_size + 1
    for rid, _, toks in prefill:
        cache.add_request(rid)
        cache.reserve(rid, len(toks) + 2 * q)
    runner.target_forward(prefill)
    out = []
    for items, keep in steps:
        for rid, start, toks in items:
            cache.reserve(rid, start + len(toks) + q)
        if guard is not None:
            guard.armed = True
        try:
            logits, taps = runner.target_forward(items)
        finally:
            if guard is not None:
                guard.armed = False
        out.append((logits.clone(), None if taps is None else taps.clone()))
        for rid, n in keep.items():
            cache.truncate(rid, n)
    return out


def _reference(path, device="cpu", backend="reference", weight_format="bf16"):
    """The single-process eager paged forward of the same steps."""
    cfg = ModelConfig.from_path(path)
    eng = Engine(path, device=device, dtype="fp32", kv_cache_dtype="fp32", kv_layout="dense",
                 weight_format=weight_format)
    cache = _cache(cfg, device)
    reserve_scratch(cache)                 # the slot / page numbering of the fixed-shape caches
    runner = ModelRunner(eng.model, eng.drafter, device, None,
                         backend=get_backend(backend)(cache))
    return cfg, [(lg.cpu(), tp.cpu()) for lg, tp in _drive(runner, cache, cfg)]


def _assert_same(got, want, tol=TOL, margin=MARGIN):
    assert len(got) == len(want)
    for (lg, tg), (lw, tw) in zip(got, want):
        lg, tg = lg.cpu(), tg.cpu()
        torch.testing.assert_close(lg, lw, rtol=tol, atol=tol)
        torch.testing.assert_close(tg, tw, rtol=tol, atol=tol)
        top2 = lw.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > margin
        # the check has teeth: a quarter of the rows at least (a random tiny quantized
        # checkpoint has flat logits; its H200 run had half the rows clear)
        assert clear.float().mean() >= 0.25
        assert torch.equal(lg.argmax(-1)[clear], lw.argmax(-1)[clear])


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fixed_shape_steps_under_tp_equal_world_1(tiny_ckpt, world, monkeypatch):
    """...and rank 0 reads nothing back from its device in those steps (drafts stay there: the
    workers get the token ids from the step's broadcast), counted as in test_host_sync.py."""
    from test_host_sync import SyncGuard
    cfg, want = _reference(tiny_ckpt)
    runner = DistributedRunner.launch(tiny_ckpt, cfg, world, dtype=torch.float32)
    guard = SyncGuard()
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist",
                        lambda self: (guard.record("Tensor.tolist"), tolist(self))[1])
    try:
        cache = _cache(cfg)
        runner.configure(None, get_backend("reference")(cache), target_graphs=True)
        assert runner.target_graphs is not None and runner.uniform_verify
        with guard:
            got = _drive(runner, cache, cfg, guard)
        # the collectives of one more decode step: what the benchmark times
        items = [(r, start, [1]) for r, start in enumerate(_steps(cfg)[2])]
        for rid, start, _ in items:
            cache.reserve(rid, start + 1)
        B, q, P = runner.target_graphs.fits(items)
        runner.tp.trace = []
        runner.target_forward(items)
        trace, runner.tp.trace = runner.tp.trace, None
        stats = runner.worker_stats()
    finally:
        runner.shutdown()
    _assert_same(got, want)
    assert guard.hits == [], f"{len(guard.hits)} host reads; first:\n{guard.hits[0]}"
    # every step on every rank took the fixed-shape path
    assert [s["fixed_steps"] for s in stats] == [len(want) + 1] * world
    words = runner.target_graphs._layout(B, q, P).end
    assert trace == step_collectives(cfg, world, B * q, words)


@pytest.mark.parametrize("ckpt,world", [("tiny_ckpt", 2), ("tiny_ckpt", 4),
                                        ("tiny_quant_ckpt", 2)])   # (interpreted FP4 kernels)
def test_ep_moe_partials_sum_to_the_moe(ckpt, world, request):
    """Each rank's fixed-shape routed-expert partial (gathered plain experts; FP4 experts through
    fp4_moe_grouped, the Triton kernels interpreted) + shared part, summed over ranks, equals the
    single-device MoE of the same weights."""
    from dspark.distributed.tp import build_rank_model
    from dspark.models.qlinear import QuantLinear
    path = request.getfixturevalue(ckpt)
    cfg = ModelConfig.from_path(path)
    fmt = "quantized" if ckpt == "tiny_quant_ckpt" else "bf16"
    full = Engine(path, device="cpu", dtype="fp32", kv_cache_dtype="fp32", kv_layout="dense",
                  weight_format=fmt, speculative="none").model
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, cfg.hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (4,), generator=g)
    layers = (0, 3)                         # a hash-routed and a score-routed layer
    totals = {layer: 0 for layer in layers}
    with torch.inference_mode():
        for rank in range(world):
            model, _ = build_rank_model(path, cfg, TPGroup(rank, world), weight_format=fmt)
            for layer in layers:
                ffn = model.layers[layer].ffn
                if fmt == "quantized":
                    for e in ffn.experts.values():
                        assert isinstance(e.w1, QuantLinear) and e.w1.kind == "fp4"
                        e.w1.backend = "triton"     # the grouped kernels (interpreted)
                idx, w = ffn.gate(x, ids)
                assert ffn.routed_fixed(x, idx, w) is not None
                totals[layer] = totals[layer] + ffn.partial(x, ids)
        for layer in layers:
            want = full.layers[layer].ffn(x, ids)
            torch.testing.assert_close(totals[layer], want, rtol=1e-5, atol=1e-5)


def _first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@pytest.mark.parametrize("drafter", ["replicated", "sharded"])
def test_dspark_rounds_under_tp_greedy_equal_world_1(tiny_ckpt, drafter):
    """Engine.generate with DSpark at world 2 (fixed-shape steps on every rank, the drafter
    replicated on rank 0 or sharded) against world 1. Greedy output is the target's greedy
    sequence whatever was drafted; a token may differ only where world 1's top-2 logits are
    within the tolerance of a tie (checked, so the test cannot flake on one)."""
    kw = dict(device="cpu", dtype="fp32", kv_cache_dtype="fp32", attention_backend="reference",
              max_num_seqs=3, max_num_batched_tokens=64)
    prompts = [[(7 * i + 3 * r + 1) % 1024 for i in range(5 + 11 * r)] for r in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    one = Engine(tiny_ckpt, **kw)
    want = [list(o.token_ids) for o in one.generate(prompts, sp)]
    eng = Engine(tiny_ckpt, tensor_parallel_size=2, target_cuda_graphs=True,
                 tensor_parallel_drafter=drafter, **kw)
    try:
        res = eng.generate(prompts, sp)
        stats = eng.runner.worker_stats()
    finally:
        eng.close()
    assert all(o.metrics.verified > 0 for o in res)               # DSpark rounds ran
    assert all(s["fixed_steps"] > 0 for s in stats)               # through the fixed-shape step
    for p, w, o in zip(prompts, want, res):
        i = _first_difference(list(o.token_ids), w)
        if i is not None:
            top2 = one.score(p + w[:i])[-1].topk(2).values
            assert top2[0] - top2[1] < 1e-3, (i, w, list(o.token_ids))


# ---- GPU: NCCL, the fixed-shape steps captured as CUDA graphs with the collectives inside -------

@gpu
@needs_cuda
@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("ckpt,fmt", [("tiny_ckpt", "bf16"), ("tiny_quant_ckpt", "quantized")])
def test_tp_nccl_graph_steps_equal_single_device(ckpt, fmt, world, request, monkeypatch):
    """World 1..8 (as many as are visible) on NCCL (NVLS off): every rank captures the decode /
    verify buckets as CUDA graphs (NCCL all-reduces / all-gathers and the input broadcast
    inside) and replays them; logits and taps == the single-device eager paged forward on the
    Triton kernels (TF32-level tolerance; quantized: FP8 / FP4 kernels on each rank's codes)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"world size {world} needs {world} GPUs; {torch.cuda.device_count()} visible")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    path = request.getfixturevalue(ckpt)
    cfg, want = _reference(path, "cuda", "triton", fmt)
    runner = DistributedRunner.launch(path, cfg, world, device="cuda", dtype=torch.float32,
                                      weight_format=fmt)
    try:
        cache = _cache(cfg, "cuda")
        runner.configure(None, get_backend("triton")(cache), target_graphs=True)
        g = runner.target_graphs
        assert g is not None and g.capture
        got = _drive(runner, cache, cfg)
        stats = runner.worker_stats()
    finally:
        runner.shutdown()
    assert not g.disabled and len(g.graphs) >= 2           # decode and verify buckets captured
    assert [s["fixed_steps"] for s in stats] == [len(want)] * world
    _assert_same(got, want, tol=5e-3, margin=0.1)


@gpu
@needs_cuda
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("drafter", ["replicated", "sharded"])
def test_tp_nccl_engine_dspark_greedy_equals_world_1(tiny_quant_ckpt, world, drafter,
                                                     monkeypatch):
    """Engine.generate with DSpark on world GPUs (warmup() captures every round's graphs first:
    target steps on every rank, the replicated draft pass on rank 0) against world 1."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"world size {world} needs {world} GPUs; {torch.cuda.device_count()} visible")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    kw = dict(device="cuda", dtype="fp32", kv_cache_dtype="fp32", max_num_seqs=3,
              max_num_batched_tokens=64, weight_format="quantized")
    prompts = [[(7 * i + 3 * r + 1) % 1024 for i in range(5 + 11 * r)] for r in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    one = Engine(tiny_quant_ckpt, **kw)
    want = [list(o.token_ids) for o in one.generate(prompts, sp)]
    eng = Engine(tiny_quant_ckpt, tensor_parallel_size=world, tensor_parallel_drafter=drafter,
                 **kw)
    try:
        info = eng.warmup(prompt_lengths=[8], batch_sizes=[3])
        res = eng.generate(prompts, sp)
        stats = eng.runner.worker_stats()
    finally:
        eng.close()
    assert info["graphs"]["target"] > 0
    assert all(s["fixed_steps"] > 0 for s in stats)
    for p, w, o in zip(prompts, want, res):
        i = _first_difference(list(o.token_ids), w)
        if i is not None:                      # only at a near tie (TF32 / reduction order)
            top2 = one.score(p + w[:i])[-1].topk(2).values
            assert top2[0] - top2[1] < 0.05, (i, w, list(o.token_ids))


def test_drafter_choice_errors_name_the_setting(tiny_ckpt):
    from dspark.engine_config import EngineConfigError
    with pytest.raises(EngineConfigError, match="tensor_parallel_drafter.*replicated.*sharded"):
        Engine(tiny_ckpt, device="cpu", tensor_parallel_size=2, tensor_parallel_drafter="both")
    with pytest.raises(ValueError, match="drafter='both'.*replicated"):
        DistributedRunner.launch(tiny_ckpt, ModelConfig.from_path(tiny_ckpt), 2,
                                 drafter_mode="both")
    with pytest.raises(ValueError, match="cuda_graphs=True with tensor_parallel_drafter='sharded'"):
        Engine(tiny_ckpt, device="cpu", tensor_parallel_size=2, cuda_graphs=True,
               tensor_parallel_drafter="sharded")


def _echo_rank(rank, world, init, out):
    from dspark.distributed.comm import broadcast_message, destroy_distributed, init_distributed
    g = init_distributed(rank, world, init, "cpu")
    try:
        for _ in range(3):
            out.put(broadcast_message(None, g.cpu_group, rank))
    finally:
        destroy_distributed()


def test_control_messages_short_and_long():
    """comm.broadcast_message: a step's message (one fixed-size broadcast), one exactly at the
    buffer's edge and a long prefill's token ids (a second broadcast) arrive intact, in order."""
    from dspark.distributed.comm import (CONTROL_BYTES, broadcast_message, destroy_distributed,
                                         init_distributed, local_init_method)
    import pickle
    ctx = multiprocessing.get_context("spawn")
    out, init = ctx.Queue(), local_init_method()
    worker = ctx.Process(target=_echo_rank, args=(1, 2, init, out), daemon=True)
    worker.start()
    edge = b"x" * 10
    while len(pickle.dumps(edge, protocol=pickle.HIGHEST_PROTOCOL)) < CONTROL_BYTES - 8:
        edge += b"x"
    msgs = [(1, [("fwd", [(("tp-state", (0, "t")), 5, 6)], None)]), edge, (2, list(range(5000)))]
    g = init_distributed(0, 2, init, "cpu")
    try:
        for m in msgs:
            assert broadcast_message(m, g.cpu_group, 0) is m
        got = [out.get(timeout=60) for _ in msgs]
    finally:
        destroy_distributed()
        worker.join(30)
    assert got == msgs and worker.exitcode == 0


def test_auto_weight_format_under_tp():
    """weight_format="auto" with tensor_parallel_size > 1: quantized wherever every rank's split
    falls on the scale blocks (CPU too: each rank de-quantizes its own codes per call)."""
    from dspark.build import auto_weight_format
    from dspark.tools.make_checkpoint import preset_config
    quant = preset_config("tiny", dtype="fp8", fp4_experts=True)
    assert auto_weight_format(quant, "cpu", 2) == "quantized"
    assert auto_weight_format(quant, "cpu", 4) == "quantized"
    assert auto_weight_format(quant, "cpu", 1) == "bf16"
    bad = preset_config("tiny", dtype="fp8", overrides={"o_lora_rank": 192})
    assert auto_weight_format(bad, "cuda", 2) == "bf16"     # wo_a rows 192:384 cut a 128-block
    assert auto_weight_format(preset_config("tiny"), "cuda", 2) == "bf16"
