"""Engine.step() lands the round launched by the previous call, launches the next one, then
builds the landed round's outputs (dspark/engine.py): what a caller sees is still one committed
round per call, and the round in flight is dropped for requests aborted meanwhile."""
import pytest

from dspark import Engine, SamplingParams
from dspark.request import Status


@pytest.fixture(scope="module")
def eng():
    # fp32 KV: a request's tokens do not depend on its batch (tests/test_deterministic.py)
    return Engine(device="cpu", max_model_len=256, kv_cache_dtype="fp32")


def _alone(eng, prompt, sp):
    return eng.generate(prompt, sp).token_ids


def test_a_round_is_in_flight_between_steps_and_aborts_drop_it(eng):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    keep_want = _alone(eng, "def fibonacci(n):", sp)
    keep = eng.add_request("def fibonacci(n):", sp)
    victim = eng.add_request("import os\n", sp)
    seen = {keep: [], victim: []}
    for _ in range(3):
        for o in eng.step():
            seen[o.request_id] += o.new_token_ids
    # the next round of both requests is queued already (on CUDA: running on the device)
    assert eng._launched is not None
    assert {r.request_id for r in eng._launched.reqs} == {keep, victim}
    out = eng.abort_request(victim)
    assert out.finished and out.finish_reason == "abort" and out.token_ids == seen[victim]
    while eng.has_unfinished():
        for o in eng.step():
            assert o.request_id == keep              # the victim's row of the round is dropped
            seen[keep] += o.new_token_ids
    assert seen[keep] == keep_want
    assert eng._launched is None and not eng.requests and not eng.scheduler.running


def test_aborting_every_request_of_the_round_in_flight_leaves_nothing_unfinished(eng):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    rid = eng.add_request("x = 1\n", sp)
    eng.step()
    eng.step()
    assert eng._launched is not None
    eng.abort(rid)
    assert not eng.has_unfinished()
    # the stale round is not landed as this request's step: a new request gets its first
    # token from its first step, as on an idle engine
    want = _alone(eng, "y = 2\n", SamplingParams(temperature=0, max_tokens=1))
    nxt = eng.add_request("y = 2\n", SamplingParams(temperature=0, max_tokens=1))
    outs = eng.step()
    assert [o.request_id for o in outs] == [nxt] and outs[0].token_ids == want
    assert outs[0].finished and not eng.has_unfinished()


def test_samples_ending_in_one_round_show_finished_with_their_last_delta(eng):
    """n samples that finish in the same round: each step returns one output per sample that
    got tokens; a sample shows finished (in any output) only once its own last delta came, so
    a consumer that stops reading a sample at its finish still gets all of its text."""
    sp = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=7, ignore_eos=True)
    want = eng.generate("import os\n", sp)
    rid = eng.add_request("import os\n", sp)
    text, closed, ids = {}, set(), {}
    while eng.has_unfinished():
        for o in eng.step():
            assert o.request_id == rid
            for c in o.outputs:
                if c.new_token_ids or c.text_delta:
                    assert c.index not in closed, "a delta after the sample showed finished"
                    text[c.index] = text.get(c.index, "") + c.text_delta
                    ids[c.index] = ids.get(c.index, []) + c.new_token_ids
                if c.finished:
                    closed.add(c.index)
    assert closed == {0, 1, 2}
    for c in want.outputs:
        assert text[c.index] == c.text and ids[c.index] == c.token_ids
    assert all(len(c.token_ids) == 7 for c in want.outputs)
    assert rid not in eng._groups and all(r.status == Status.FINISHED
                                          for r in eng.requests.values()) and not eng.requests


def test_aborting_the_round_in_flight_still_drafts_a_request_it_did_not_carry():
    """A request recomputed after a preemption turns running in the launch but is not in that
    round; its first block is drafted when the round lands. With every request of the round
    aborted, landing it must still draft that one (else the next round has no drafts)."""
    eng = Engine(device="cpu", kv_cache_dtype="fp32", num_kv_blocks=3, max_num_seqs=3)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    big = [3, 5, 7] * 83 + [2]
    want = _alone(eng, big, sp)
    eng.add_request([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    eng.add_request([9, 10, 11], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    rid = eng.add_request(big, sp)
    for _ in range(50):
        eng.step()
        rnd = eng._launched
        carried = {r.request_id for r in rnd.reqs} if rnd is not None else set()
        if rnd is not None and rnd.reqs and any(r.request_id not in carried
                                                 for r in eng.scheduler.running):
            break
    else:
        pytest.fail("no round was launched without a running request (no preemption)")
    assert eng.scheduler.num_preemptions >= 1
    for r in list(rnd.reqs):
        eng.abort(r.parent)
    got = []
    while eng.has_unfinished():
        for o in eng.step():
            got = o.token_ids
    assert got == want


def test_outputs_of_a_round_landed_by_score_are_dropped_with_an_abort(eng):
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    a = eng.add_request("x = 1\n", sp)
    b = eng.add_request("def f():", sp)
    eng.step()
    eng.step()
    eng.score([1, 2, 3])              # lands the round in flight; its outputs wait for step()
    assert eng.abort_request(a).finish_reason == "abort"
    outs = eng.step()
    assert [o.request_id for o in outs] == [b] * len(outs) and outs
    eng.abort(b)
    assert not eng.has_unfinished()


def test_a_failed_launch_keeps_the_landed_rounds_outputs(eng, monkeypatch):
    """The launch after a landed round raises: the step raises, and the landed round's outputs
    (its tokens are committed) come with the next step."""
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    rid = eng.add_request("import sys\n", sp)
    seen = []
    for o in eng.step() + eng.step():
        seen += o.new_token_ids
    real = eng._launch
    assert eng._launched is not None   # step 3 lands it, then launches the next: that fails

    def failing():
        raise RuntimeError("simulated launch failure")
    monkeypatch.setattr(eng, "_launch", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        eng.step()
    monkeypatch.setattr(eng, "_launch", real)
    req = eng.requests[rid]
    landed = eng.step()               # the kept outputs first, then this step's round
    for o in landed:
        seen += o.new_token_ids
    assert seen == req.output_ids
    eng.abort(rid)
