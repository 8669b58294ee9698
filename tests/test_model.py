"""DeepSeek-V4 reference decoder: parity with transformers, chunked prefill, mixed batches."""
import random

import pytest
import torch

from dspark import Engine
from hf_oracle import hf_logits

LONG = 70   # crosses CSA (4) and HCA (16) boundaries, SWA eviction (window 8), top-k (4) selection


def _prompt(n, seed=0, vocab=1024):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return Engine(tiny_ckpt, device="cpu", dtype="fp32", kv_cache_dtype="fp32", speculative="none",
                  kv_layout="dense")


def _assert_close(ours, ref, rel=1e-4):
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= rel * scale, f"max |Δ| = {err:.3e} vs logit scale {scale:.3f}"


@pytest.mark.parametrize("ckpt", ["tiny_ckpt", "tiny_quant_ckpt"])
def test_logits_match_transformers(ckpt, request):
    path = request.getfixturevalue(ckpt)
    eng = Engine(path, device="cpu", dtype="fp32", kv_cache_dtype="fp32", speculative="none")
    ids = _prompt(LONG, seed=1)
    ours = eng.score(ids)
    ref = hf_logits(path, ids).float()
    assert ours.shape == ref.shape == (LONG, eng.cfg.vocab_size)
    _assert_close(ours, ref)


def _run_chunks(engine, ids, chunks):
    state, _ = engine.runner.new_states()
    out, p = [], 0
    for c in chunks:
        logits, _ = engine.runner.target_forward([(state, p, ids[p:p + c])])
        out.append(logits)
        p += c
    return torch.cat(out)


def test_chunked_prefill_and_decode_equal_full_prefill(engine):
    ids = _prompt(LONG, seed=2)
    full = engine.score(ids)
    rng = random.Random(3)
    chunks, left = [], LONG
    while left:
        c = min(left, rng.choice([1, 1, 2, 3, 5, 6, 13]))
        chunks.append(c)
        left -= c
    _assert_close(_run_chunks(engine, ids, chunks), full, rel=2e-5)
    _assert_close(_run_chunks(engine, ids, [1] * LONG), full, rel=2e-5)


def test_mixed_batch_equals_each_request_alone(engine):
    lens = [LONG, 23, 1, 41]
    prompts = [_prompt(n, seed=10 + i) for i, n in enumerate(lens)]
    alone = [engine.score(p) for p in prompts]
    # two steps: first a prefix chunk of each, then the rest, all requests in one flat batch
    states = [engine.runner.new_states()[0] for _ in prompts]
    cut = [n // 2 for n in lens]
    first, _ = engine.runner.target_forward([(s, 0, p[:c]) for s, p, c in zip(states, prompts, cut)])
    second, _ = engine.runner.target_forward([(s, c, p[c:]) for s, p, c in zip(states, prompts, cut)])
    o1 = o2 = 0
    for p, c, ref in zip(prompts, cut, alone):
        got = torch.cat([first[o1:o1 + c], second[o2:o2 + len(p) - c]])
        o1, o2 = o1 + c, o2 + len(p) - c
        _assert_close(got, ref, rel=2e-5)


def test_rollback_by_rewriting_positions(engine):
    """Feeding k junk tokens, then re-feeding from the rollback point, equals never feeding them:
    at positions straddling CSA/HCA boundaries and the SWA wrap-around."""
    ids = _prompt(LONG, seed=4)
    full = engine.score(ids)
    for cut in (15, 31, 47):          # 16 is an HCA boundary; window 8 wraps many times
        state, _ = engine.runner.new_states()
        engine.runner.target_forward([(state, 0, ids[:cut])])
        engine.runner.target_forward([(state, cut, _prompt(6, seed=cut))])   # rejected drafts
        tail, _ = engine.runner.target_forward([(state, cut, ids[cut:])])
        _assert_close(tail, full[cut:], rel=2e-5)
