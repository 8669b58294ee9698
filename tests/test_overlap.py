"""Overlapped decode (dspark/overlap.py): the next round is launched from the previous round's
device-side tokens before the host reads them. Everything a user sees must equal the
step-by-step loop: tokens, finish reasons, stop tokens, budgets, aborts and arrivals mid-flight,
page accounting; and the loop must really run ahead (rounds launched before a read back)."""
from triton_env import triton_ok  # noqa: F401 (before triton)

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from dspark import Engine, SamplingParams  # noqa: E402


def _engine(path, overlap, **kw):
    kw.setdefault("kv_cache_dtype", "fp32")
    return Engine(path, device="cpu", dtype="fp32", speculative="none", overlap_decode=overlap, **kw)


def _prompts(n, vocab, seed):
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randrange(1, 20))] for _ in range(n)]


def _summary(outs):
    return [(o.token_ids, o.finish_reason, o.metrics.emitted) for o in outs]


def _all_pages_free(eng):
    """No request holds pages or a state slot any more (the CUDA graphs' scratch request aside,
    which holds its own for the engine's lifetime)."""
    from dspark.models.deepseek_v4.graph import SCRATCH_RID
    c = eng.cache
    scratch = c.has_request(SCRATCH_RID)
    return (c.num_free_pages == c.num_blocks - len(c.page_table(SCRATCH_RID))
            and c.num_free_slots == c.slots.max_slots - scratch
            and all(rid == SCRATCH_RID for rid in c._reqs))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_overlapped_equals_step_by_step(tiny_ckpt, temperature):
    ref_eng = _engine(tiny_ckpt, False)
    vocab = ref_eng.cfg.vocab_size
    prompts = _prompts(5, vocab, seed=3)
    free = [o.token_ids for o in ref_eng.generate(
        prompts, SamplingParams(temperature=temperature, max_tokens=16, ignore_eos=True, seed=7))]
    # per request: a different budget, and stop tokens that occur mid-sequence for some
    params = [SamplingParams(temperature=temperature, max_tokens=mt, seed=7, ignore_eos=True,
                             stop_token_ids=stops)
              for mt, stops in [(16, ()), (1, ()), (2, ()), (16, (free[3][4],)),
                                (12, (free[4][0],))]]
    ref = ref_eng.generate(prompts, params)
    assert ref[3].finish_reason == "stop" and len(ref[3].token_ids) <= 5
    eng = _engine(tiny_ckpt, True)
    got = eng.generate(prompts, params)
    assert _summary(got) == _summary(ref)
    assert eng.overlap.rounds > 0 and eng.overlap.in_flight is None or \
        all(r.status.value == "finished" for r in eng.overlap.in_flight.reqs)
    assert _all_pages_free(eng)
    # again on the same engine (a round of finished requests may still be in flight): same
    assert _summary(eng.generate(prompts, params)) == _summary(ref)
    assert _all_pages_free(eng)


def test_arrivals_and_aborts_mid_flight(tiny_ckpt):
    """A request added while a round is in flight drains it (prefill takes the ordinary path);
    an abort while its row is in flight drops the row; the others are untouched."""
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref_eng = _engine(tiny_ckpt, False)
    vocab = ref_eng.cfg.vocab_size
    a, b, c = _prompts(3, vocab, seed=5)
    ref = [ref_eng.generate(p, sp).token_ids for p in (a, c)]

    eng = _engine(tiny_ckpt, True)
    ra, rb = eng.add_request(a, sp), eng.add_request(b, sp)
    toks = {ra: [], rb: []}
    for _ in range(4):                     # prefill, then overlapped decode rounds
        for o in eng.step():
            toks[o.request_id] = o.token_ids
    assert eng.overlap.in_flight is not None
    assert eng.abort(rb)                   # its row is in flight right now
    rc = eng.add_request(c, sp)            # arrives mid-flight
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
            assert o.request_id != rb
    assert done[ra].token_ids == ref[0] and done[rc].token_ids == ref[1]
    assert eng.overlap.rounds > 0
    assert _all_pages_free(eng)


def test_pages_running_short_fall_back_to_the_ordinary_round(tiny_ckpt):
    """With a cache too small for every request to run ahead, reserve fails in the overlapped
    launch: the round in flight is committed and the ordinary round (which preempts) runs."""
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    rng = random.Random(9)
    # two prompts just short of a 256-token page, two pages: both need a second page to decode
    prompts = [[rng.randrange(2, 64) for _ in range(n)] for n in (244, 250)]
    kw = dict(num_kv_blocks=2, max_num_seqs=2)
    ref = _engine(tiny_ckpt, False, **kw).generate(prompts, sp)
    eng = _engine(tiny_ckpt, True, **kw)
    got = eng.generate(prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert eng.scheduler.num_preemptions > 0 and eng.overlap.rounds > 0 and eng.overlap.refused > 0
    assert _all_pages_free(eng)


def test_overlap_only_where_it_applies(tiny_ckpt):
    spec = Engine(tiny_ckpt, device="cpu", dtype="fp32", kv_cache_dtype="fp32",
                  overlap_decode=True)
    assert spec.drafter is not None and not spec.overlap.applies()   # drafts: ordinary rounds
    spec.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=6))
    assert spec.overlap.rounds == 0
    assert _engine(tiny_ckpt, None).overlap is None                    # CPU default: off


@triton_ok
def test_device_anchors_through_the_fixed_shape_path(tiny_ckpt):
    """The GPU decode path's plumbing on CPU: the fixed-shape V4 step (run eagerly) takes the
    anchors as device tensors (BlockTokens with a tensor anchor) from the round before."""
    from dspark.models.deepseek_v4.graph import V4DecodeGraphs, reserve_scratch
    prompts = _prompts(2, 64, seed=11)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for fixed in (False, True):
        eng = _engine(tiny_ckpt, True, kv_cache_dtype="fp8", attention_backend="triton",
                      max_num_seqs=3, num_kv_blocks=7)
        eng.scheduler.max_num_seqs = 2
        if fixed:
            r = eng.runner
            reserve_scratch(eng.cache)
            r.target_graphs = V4DecodeGraphs(r.model, eng.cache, "triton", q_lens=(1,),
                                             max_batch=2, capture=False)
        outs[fixed] = [o.token_ids for o in eng.generate(prompts, sp)]
        assert eng.overlap.rounds > 0
        if fixed:
            assert r.target_graphs.num_replays > 0
    assert outs[True] == outs[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_overlapped_decode_on_cuda_graphs_equals_step_by_step(temperature):
    """The default CUDA decode path (target graphs, device anchors, pinned read backs) on the
    shipped model with speculation off: overlap on == off, token for token."""
    prompts = ["def fibonacci(n):\n", "import os\n\n\ndef main():\n", "class Stack:\n    def "]
    sp = [SamplingParams(temperature=temperature, max_tokens=mt, seed=3) for mt in (40, 7, 25)]
    outs = {}
    for overlap in (False, True):
        eng = Engine(device="cuda", dtype="bf16", speculative="none", overlap_decode=overlap,
                     max_num_seqs=4)
        outs[overlap] = _summary(eng.generate(prompts, sp))
        if overlap:
            assert eng.overlap.rounds > 0
            assert eng.runner.target_graphs is not None and eng.runner.target_graphs.num_replays
            assert _all_pages_free(eng)
    assert outs[True] == outs[False]
