"""Randomized engine stress on the paged cache: admissions at random times, stop tokens landing
mid-block, rollbacks every round, preemption under page pressure; no page may leak and every
output must equal the plain target's greedy output."""
import random

import pytest

from dspark import Engine, SamplingParams


@pytest.mark.parametrize("seed,uniform", [(0, False), (1, False), (0, True)])
def test_random_admission_stops_and_preemption(small_vocab_ckpt, seed, uniform):
    """uniform: the runner says it replays uniform steps (as with target graphs on CUDA), so
    verify blocks are padded to one width and short prompts are fed in padded round-width chunks
    next to them (Scheduler.schedule), under the same preemptions."""
    rng = random.Random(seed)
    ref_engine = Engine(small_vocab_ckpt, device="cpu", dtype="fp32", kv_cache_dtype="fp32",
                        speculative="none", kv_layout="dense")
    # 4 pages of 256 tokens for up to 6 sequences whose prompts + outputs reach ~300 tokens:
    # verify blocks must preempt others to grow
    eng = Engine(small_vocab_ckpt, device="cpu", dtype="fp32", kv_cache_dtype="fp32",
                 max_num_seqs=6, max_num_batched_tokens=96, num_kv_blocks=4)
    eng.runner.uniform_verify = uniform
    chunks = []
    forward = eng.runner.target_forward

    def recording(items, *a, **kw):
        waiting = {r.target_state: r for r in eng.scheduler.waiting}
        chunks.extend(len(t) - (len(waiting[st].prefill_ids) - start)
                      for st, start, t in items if st in waiting)
        return forward(items, *a, **kw)

    eng.runner.target_forward = recording
    jobs = []
    for i in range(10):
        prompt = [rng.randrange(8) for _ in range(rng.choice([3, 150, 200, 250]))]
        stop = (rng.randrange(8),) if rng.random() < 0.3 else ()
        sp = SamplingParams(temperature=0, max_tokens=rng.choice([5, 40, 60]), stop_token_ids=stop,
                            ignore_eos=True)
        jobs.append((prompt, sp))
    expected = [o.token_ids for o in ref_engine.generate([p for p, _ in jobs], [s for _, s in jobs])]
    pending, done, step = list(range(len(jobs))), {}, 0
    while pending or eng.has_unfinished():
        if pending and rng.random() < 0.9:          # requests arrive while others run
            i = pending.pop(0)
            eng.add_request(jobs[i][0], jobs[i][1], request_id=i)
        for out in eng.step():
            if out.finished:
                done[int(out.request_id)] = out.token_ids
        step += 1
        assert step < 2000
        used = eng.cache.num_blocks - eng.cache.num_free_pages
        assert used <= eng.cache.num_blocks
    assert [done[i] for i in range(len(jobs))] == expected
    assert eng.cache.num_free_pages == eng.cache.num_blocks      # nothing leaked
    assert eng.cache.num_free_slots == 6
    assert eng.scheduler.num_preemptions > 0, "the cache was sized to force preemption"
    # prompt chunks fed past the prompt's end (padded to the round width) only where uniform
    assert any(c > 0 for c in chunks) == uniform


def test_generation_up_to_a_full_cache_ends_with_length(small_vocab_ckpt):
    """A request that grows to the whole cache (one 256-token page) stops there with "length":
    verify blocks are clipped to the room left instead of asking for pages that cannot exist."""
    eng = Engine(small_vocab_ckpt, device="cpu", dtype="fp32", kv_cache_dtype="fp32",
                 num_kv_blocks=1)
    assert eng.max_model_len == 256
    out = eng.generate([1] * 240, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 256 - 240
    assert eng.cache.num_free_pages == 1
