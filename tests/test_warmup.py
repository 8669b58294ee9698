"""Engine.warmup: dummy requests over the shapes traffic hits, leaving the engine as it was."""
from types import SimpleNamespace

import pytest

from dspark import Engine, SamplingParams
from dspark.spec.policy import SpsTable, make_policy
from dspark.warmup import _verify_widths, default_batch_sizes, default_prompt_lengths


def test_default_shapes():
    assert default_prompt_lengths(40) == [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33]
    assert default_prompt_lengths(2) == [1, 2]
    assert default_batch_sizes(8) == [2, 4, 8] and default_batch_sizes(1) == []


def test_warmup_leaves_the_engine_idle_and_outputs_unchanged():
    prompt = [5, 6, 7, 8, 9, 10]
    sp = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
    want = Engine(device="cpu", max_num_seqs=4).generate(prompt, sp).token_ids
    eng = Engine(device="cpu", max_num_seqs=4)
    free = eng.cache.num_free_pages
    rep = eng.warmup(prompt_lengths=[1, 2, 17], batch_sizes=None)
    assert rep["prompt_lengths"] == [1, 2, 17] and rep["batch_sizes"] == [2, 4]
    assert rep["requests"] == 2 * 3 + 2 * (2 + 4)         # greedy and T = 1 each
    assert not eng.has_unfinished() and not eng.requests
    assert eng.cache.num_free_pages == free
    assert eng.generate(prompt, sp).token_ids == want      # same seed, same tokens


def test_warmup_needs_an_idle_engine():
    eng = Engine(device="cpu")
    eng.add_request([1, 2, 3])
    with pytest.raises(RuntimeError, match="idle"):
        eng.warmup(prompt_lengths=[1], batch_sizes=[])


def test_graph_widths_cover_every_width_a_policy_chooses():
    """The target graphs captured ahead of traffic cover every round width: the fixed policy's
    one, any of 0..γ drafts for the others (the scheduled ones change it round to round)."""
    sps = SpsTable.from_ms([[1, 1.0]])
    for name, kw, want in (("fixed", {}, {6}), ("fixed", {"num_verify": 2}, {3}),
                           ("threshold", {}, set(range(1, 7))),
                           ("scheduled", {"sps": sps}, set(range(1, 7))),
                           ("scheduled-async", {"sps": sps}, set(range(1, 7)))):
        eng = SimpleNamespace(drafter=SimpleNamespace(gamma=5), policy=make_policy(name, **kw))
        assert _verify_widths(eng) == want, name
    assert _verify_widths(SimpleNamespace(drafter=None, policy=None)) == {1}
