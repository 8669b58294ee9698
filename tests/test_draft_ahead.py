"""Drafting ahead of the read back (ModelRunner.draft_ahead): a round's next blocks are drafted from
its device-side acceptance, context rows past the accepted drafts going to the scratch slot. The
oracle is the host path the engine takes without it (read the acceptance, commit the context rows
of the accepted drafts, then draft): same tokens, finish reasons and per-round acceptance, which
equal drafts and draft contexts imply (a wrong context row changes the drafts, and with them the
accepted counts even where the emitted tokens cannot change, as under greedy decoding)."""
from triton_env import triton_ok  # noqa: F401 (before triton)

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from dspark import Engine, SamplingParams  # noqa: E402
from dspark.runner import ModelRunner  # noqa: E402

CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])


def _run(path, prompts, params, ahead: bool, monkeypatch, device="cpu", max_num_seqs=3, **kw):
    calls = []
    with monkeypatch.context() as m:
        if not ahead:
            m.setattr(ModelRunner, "drafts_ahead", property(lambda self: False))
        eng = Engine(path, device=device, max_num_seqs=max_num_seqs, **kw)
        orig = eng.runner.draft_ahead
        m.setattr(eng.runner, "draft_ahead", lambda *a, **k: calls.append(1) or orig(*a, **k))
        outs = eng.generate(prompts, params)
    return [(o.token_ids, o.finish_reason, o.metrics.rounds, o.metrics.accepted,
             list(o.metrics.pos_accepted)) for o in outs], len(calls)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_ahead_equals_drafting_after_the_read(monkeypatch, temperature, device):
    """Shipped pair, five prompts of 1-40 tokens through three sequence slots (prompts finish
    their prefill in rounds that also verify), per-request budgets and a stop token mid-run.
    On CUDA both paths replay the same target and draft graphs."""
    eng = Engine(device=device)
    rng = random.Random(5)
    V = eng.cfg.vocab_size
    prompts = [[rng.randrange(3, V) for _ in range(n)] for n in (1, 9, 40, 17, 3)]
    free = [o.token_ids for o in eng.generate(prompts[:1], SamplingParams(
        temperature=temperature, max_tokens=24, ignore_eos=True, seed=0))]
    params = [SamplingParams(temperature=temperature, max_tokens=mt, seed=i, ignore_eos=True,
                             stop_token_ids=stops)
              for i, (mt, stops) in enumerate([(24, (free[0][9],)), (30, ()), (2, ()), (19, ()),
                                               (30, ())])]
    want, n_host = _run(None, prompts, params, False, monkeypatch, device)
    got, n_ahead = _run(None, prompts, params, True, monkeypatch, device)
    assert n_host == 0 and n_ahead > 10          # the paths really differ
    assert got == want
    assert want[0][1] == "stop" and want[2][1] == "length"
    assert sum(w[3] for w in want) > 0           # drafts were accepted: the comparison bites


def test_draft_ahead_with_fp32_cache_and_chunked_prefill(monkeypatch):
    """Prompts longer than the step's token budget are prefilled in chunks, the last chunk in a
    round that verifies other requests' blocks."""
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (70, 5, 33)]
    params = [SamplingParams(temperature=1.0, max_tokens=20, seed=i, ignore_eos=True)
              for i in range(3)]
    kw = dict(max_num_batched_tokens=32, kv_cache_dtype="fp32")
    want, _ = _run(None, prompts, params, False, monkeypatch, **kw)
    got, n = _run(None, prompts, params, True, monkeypatch, **kw)
    assert n > 0 and got == want


def test_draft_ahead_reads_nothing_back(monkeypatch):
    """Nothing of draft_ahead (context write, draft pass) waits for the device: no .item() /
    int(t) / .tolist() while it runs, so the host queues it behind the acceptance and goes on
    to read that alone."""
    from test_host_sync import SyncGuard
    eng = Engine(device="cpu", max_num_seqs=2)
    guard = SyncGuard()
    armed, calls = guard.arm(eng.runner.draft_ahead), []
    monkeypatch.setattr(eng.runner, "draft_ahead", lambda *a, **k: calls.append(1) or armed(*a, **k))
    guard.watch_tolist(monkeypatch)
    with guard:
        eng.generate(["def fib(n):", "import os\n"], [SamplingParams(temperature=t, max_tokens=12)
                                                     for t in (0.0, 1.0)])
    assert len(calls) > 3
    assert guard.hits == [], f"{len(guard.hits)} device->host reads; first:\n{guard.hits[0]}"


def test_draft_ahead_through_preemption(monkeypatch):
    """Two requests crossing into their second 256-token page of a 2-page cache: one is
    preempted and recomputed from its tokens (its next block drafted by the host path, the
    other's ahead of the read back); both paths give the same tokens and acceptance."""
    prompts = [[3, 5, 7] * 83 + [2], [6, 4] * 125 + [1, 2, 3]]         # 250, 253 tokens
    params = [SamplingParams(temperature=t, seed=s, max_tokens=12, ignore_eos=True)
              for t, s in ((1.0, 1), (0.0, 2))]
    kw = dict(num_kv_blocks=2)
    want, _ = _run(None, prompts, params, False, monkeypatch, max_num_seqs=2, **kw)
    calls = []
    with monkeypatch.context() as m:
        eng = Engine(device="cpu", max_num_seqs=2, **kw)
        orig = eng.runner.draft_ahead
        m.setattr(eng.runner, "draft_ahead", lambda *a, **k: calls.append(1) or orig(*a, **k))
        outs = eng.generate(prompts, params)
    got = [(o.token_ids, o.finish_reason, o.metrics.rounds, o.metrics.accepted,
            list(o.metrics.pos_accepted)) for o in outs]
    assert eng.scheduler.num_preemptions > 0, "the cache was sized to force preemption"
    assert calls and got == want
