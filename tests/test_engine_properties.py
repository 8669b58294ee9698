"""Property-based test of the engine (hypothesis): random requests, sampling parameters, aborts
and tiny KV caches on the shipped default model (4 layers, vocabulary 512, 256-token pages).

For every scenario:
  - a request is rejected at add_request exactly when it is invalid (an id outside the
    vocabulary, a prompt of max_model_len tokens or more), with a ValueError, and nothing else
    ever raises;
  - every admitted request ends once: finished ("stop" / "length", with the length rules) or
    aborted;
  - nothing leaks: every page and request slot is free afterwards and the engine holds no
    request (each engine is reused by later scenarios, so a leak also breaks those);
  - the other requests' outputs are unchanged by aborts, rejections and preemption: each greedy
    token is the target's argmax on its own prefix (scored afresh by `Engine.score`), each top-k
    token is among the target's k best. The comparison allows a near-tie of 1e-4 in fp32 logits:
    batching changes the GEMM shapes and so the fp32 rounding (~1e-6), never more.
Examples are derandomized (the same scenarios on every run) and few, to stay within ~30 s.
"""
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings, strategies as st  # noqa: E402

from dspark import Engine, SamplingParams  # noqa: E402

VOCAB, PAGE = 512, 256
TIE = 1e-4                      # fp32 logits: batching moves them by ~1e-6
_ENGINES = {}


def _engine(num_kv_blocks, max_num_seqs, speculative):
    key = (num_kv_blocks, max_num_seqs, speculative)
    if key not in _ENGINES:
        _ENGINES[key] = Engine(device="cpu", dtype="fp32", num_kv_blocks=num_kv_blocks,
                               max_num_seqs=max_num_seqs, speculative=speculative)
    return _ENGINES[key]


prompt_ids = st.one_of(
    st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=24),                 # short
    # just short of a page: decoding crosses into a second page (preemption in a tiny cache)
    st.builds(lambda n, t: [t] * n, st.integers(236, 300), st.integers(2, VOCAB - 1)),
    st.lists(st.integers(-3, VOCAB + 3), min_size=1, max_size=6),                # maybe invalid
)
params = st.builds(
    SamplingParams, temperature=st.sampled_from([0.0, 0.8]), top_k=st.sampled_from([0, 5]),
    max_tokens=st.integers(1, 12), ignore_eos=st.booleans(), seed=st.integers(0, 2 ** 31))
scenario = st.fixed_dictionaries(dict(
    num_kv_blocks=st.integers(1, 3), max_num_seqs=st.integers(1, 3),
    speculative=st.sampled_from([None, "none"]),
    requests=st.lists(st.tuples(st.integers(0, 3), prompt_ids, params), min_size=1, max_size=5),
    aborts=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 4)), max_size=2)))


def _check_tokens(eng, prompt, sp, out):
    toks = out.token_ids
    limit = min(sp.max_tokens, eng.max_model_len - len(prompt))
    assert 1 <= len(toks) <= limit and all(0 <= t < VOCAB for t in toks)
    stops = set(sp.all_stop_ids(eng.eos_token_ids))
    assert not stops & set(toks[:-1])
    if out.finish_reason == "stop":
        assert toks[-1] in stops
    else:
        assert out.finish_reason == "length" and len(toks) == limit
    if sp.temperature > 0 and not sp.top_k:
        return
    logits = eng.score(prompt + toks[:-1])[len(prompt) - 1:]
    for i, t in enumerate(toks):
        row = logits[i]
        k = 1 if sp.temperature == 0 else sp.top_k
        assert row[t] >= torch.topk(row, k).values[-1] - TIE, (i, t, row.argmax().item())


@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenario)
# two requests growing past their first page in a 2-page cache: one is preempted and recomputed
@example(dict(num_kv_blocks=2, max_num_seqs=2, speculative=None, aborts=[(3, 2)], requests=[
    (0, [7] * 250, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
    (0, [9] * 250, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
    (1, [3, 4, 5], SamplingParams(temperature=0.8, top_k=5, max_tokens=12, seed=1))]))
# one page: a prompt past it, ids outside the vocabulary, a request that runs into the page end
@example(dict(num_kv_blocks=1, max_num_seqs=2, speculative="none", aborts=[], requests=[
    (0, [5] * 260, SamplingParams(temperature=0)), (0, [600, 3], SamplingParams()),
    (0, [-1], SamplingParams()), (1, [4] * 250, SamplingParams(temperature=0, max_tokens=12))]))
def test_random_requests_aborts_and_tiny_caches(s):
    eng = _engine(s["num_kv_blocks"], s["max_num_seqs"], s["speculative"])
    assert eng.cache.num_blocks * PAGE >= eng.max_model_len
    pending = sorted(enumerate(s["requests"]), key=lambda r: r[1][0])
    admitted, finished, aborted = {}, {}, set()
    step = 0
    while pending or eng.has_unfinished():
        while pending and pending[0][1][0] <= step:
            _, (_, prompt, sp) = pending.pop(0)
            invalid = any(not 0 <= t < VOCAB for t in prompt) or len(prompt) >= eng.max_model_len
            try:
                rid = eng.add_request(prompt, sp)
            except ValueError:
                assert invalid, (len(prompt), eng.max_model_len)
                continue
            assert not invalid
            admitted[rid] = (prompt, sp)
        for when, which in s["aborts"]:
            live = sorted(eng.requests)
            if when == step and live:
                rid = live[which % len(live)]
                assert eng.abort(rid) and not eng.abort(rid)
                aborted.add(rid)
        for out in eng.step():
            if out.finished:
                assert out.request_id not in finished and out.request_id not in aborted
                finished[out.request_id] = out
        step += 1
        assert step < 500, "the engine stopped making progress"
    assert set(finished) | aborted == set(admitted) and not set(finished) & aborted
    # nothing leaked: pages, request slots, engine and scheduler state
    assert not eng.requests and not eng.has_unfinished()
    assert eng.cache.num_free_pages == eng.cache.num_blocks
    assert eng.cache.num_free_slots == s["max_num_seqs"]
    for rid, out in finished.items():
        _check_tokens(eng, *admitted[rid], out)
    assert eng.cache.num_free_pages == eng.cache.num_blocks     # score() frees its pages too
