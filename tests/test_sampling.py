"""dspark.sampling: SamplingParams validation, probs_from_logits, counter RNG, inverse-CDF sampling."""
import math

import numpy as np
import pytest
import torch
from scipy import stats

from dspark.sampling import (Purpose, SamplingParams, probs_from_logits, sample_from_probs,
                             stack_params, uniforms)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


pytestmark = pytest.mark.usefixtures("one_thread")


# ---- SamplingParams ----------------------------------------------------------------------------

@pytest.mark.parametrize("kw, field", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_p=float("nan")), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(top_k=2.5), "top_k"), (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=True), "max_tokens"),
    (dict(stop_token_ids=(5, 100)), "stop_token_ids"), (dict(stop_token_ids=(-1,)), "stop_token_ids"),
    (dict(stop_token_ids=7), "stop_token_ids"), (dict(seed=2 ** 64), "seed"), (dict(seed="1"), "seed"),
    (dict(ignore_eos=1), "ignore_eos"),
])
def test_validate_rejects_with_field_value_and_range(kw, field):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw).validate(vocab_size=100)
    msg = str(e.value)
    assert f"SamplingParams.{field}=" in msg and "expected" in msg
    assert repr(kw[field]) in msg


def test_validate_accepts_good_params_and_normalises_stop_ids():
    p = SamplingParams(temperature=0, top_p=0.3, top_k=7, max_tokens=1, stop_token_ids=[3, 99],
                       seed=-5, ignore_eos=True).validate(vocab_size=100)
    assert p.stop_token_ids == (3, 99) and p.greedy
    assert SamplingParams().validate() == SamplingParams()
    SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), stop_token_ids=[np.int64(2)]).validate(10)
    assert SamplingParams(stop_token_ids=[3]).all_stop_ids([2, 3]) == (3, 2)
    assert SamplingParams(stop_token_ids=[3], ignore_eos=True).all_stop_ids([2]) == (3,)


def test_stack_params_skips_unused_filters():
    t, k, p = stack_params([SamplingParams(), SamplingParams(temperature=0, top_k=5)])
    assert t.tolist() == [1.0, 0.0] and k is None and p is None  # top_k of a greedy row is moot
    t, k, p = stack_params([SamplingParams(top_k=5), SamplingParams(top_p=0.5)])
    assert k.tolist() == [5, 0] and p.tolist() == [1.0, 0.5]


# ---- probs_from_logits -------------------------------------------------------------------------

def _reference_probs(logits, temperature, top_k, top_p):
    """Per-row float64 brute force of the documented order: temperature, top-k, top-p, renormalise."""
    z = np.asarray(logits, dtype=np.float64)
    v = z.size
    if temperature == 0:
        out = np.zeros(v)
        out[int(np.argmax(z))] = 1
        return out
    z = z / temperature
    order = sorted(range(v), key=lambda i: -z[i])
    keep = order[: (top_k if top_k > 0 else v)]
    w = np.exp(z[keep] - z[keep].max())
    w /= w.sum()
    if top_p < 1:
        cum, n = 0.0, 0
        while cum < top_p and n < len(keep):
            cum += w[n]
            n += 1
        keep = keep[:n]
    out = np.zeros(v)
    w = np.exp(z[keep] - z[keep].max())
    out[keep] = w / w.sum()
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_probs_from_logits_matches_per_row_reference(device):
    g = torch.Generator().manual_seed(0)
    n, v = 64, 37
    logits = torch.randn(n, v, generator=g) * 3
    temps = torch.tensor([0.0, 0.3, 1.0, 2.5])[torch.randint(0, 4, (n,), generator=g)]
    top_k = torch.tensor([0, 1, 4, 37, 80])[torch.randint(0, 5, (n,), generator=g)]
    top_p = torch.tensor([1.0, 0.95, 0.5, 0.05])[torch.randint(0, 4, (n,), generator=g)]
    out = probs_from_logits(logits.to(device), temps.to(device), top_k.to(device), top_p.to(device)).cpu()
    assert out.dtype == torch.float32
    for i in range(n):
        ref = _reference_probs(logits[i], temps[i].item(), top_k[i].item(), top_p[i].item())
        np.testing.assert_allclose(out[i].numpy(), ref, atol=2e-6, err_msg=f"row {i}")
    # None = off for every row, identical to explicit off values
    plain = probs_from_logits(logits, temps)
    off = probs_from_logits(logits, temps, torch.zeros(n, dtype=torch.long), torch.ones(n))
    torch.testing.assert_close(plain, off)


def test_probs_from_logits_edge_cases():
    logits = torch.tensor([[1.0, 3.0, 3.0, float("-inf")], [0.0, 0.0, 0.0, 0.0]])
    greedy = probs_from_logits(logits, torch.zeros(2))
    assert greedy.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]  # first index on ties
    p = probs_from_logits(logits, torch.ones(2), top_p=torch.tensor([1e-6, 1.0]))
    assert p[0, 3] == 0 and p[0].max() == 1.0  # tiny top_p keeps exactly one token
    assert torch.allclose(p[1], torch.full((4,), 0.25))
    # top_p = 1 must keep a long tail of tiny probabilities even though the cumsum rounds to 1 early
    tail = torch.cat([torch.tensor([30.0]), torch.zeros(5000)]).unsqueeze(0)
    assert (probs_from_logits(tail, torch.ones(1), top_p=torch.ones(1)) > 0).all()
    bf16 = probs_from_logits(logits.bfloat16(), torch.ones(2))
    assert bf16.dtype == torch.float32 and torch.allclose(bf16.sum(1), torch.ones(2))


# ---- uniforms ----------------------------------------------------------------------------------

def _keys(n_seeds=400, n_pos=500):
    seeds = (torch.arange(n_seeds, dtype=torch.long) * 7919 - 1000).unsqueeze(1)
    return seeds, torch.arange(n_pos, dtype=torch.long).unsqueeze(0)


def test_uniforms_are_uniform_per_purpose():
    seeds, pos = _keys()
    for purpose in Purpose:
        u = uniforms(seeds, pos, purpose)
        assert u.shape == (400, 500) and u.dtype == torch.float32
        assert float(u.min()) >= 0 and float(u.max()) < 1
        assert stats.kstest(u.flatten().double().numpy(), "uniform").pvalue > 1e-3, purpose
        counts = torch.histc(u, bins=100, min=0, max=1).numpy()
        assert stats.chisquare(counts).pvalue > 1e-3, purpose


def test_uniforms_independent_across_purposes_neighbours_and_seeds():
    seeds, pos = _keys()
    d, a, r = (uniforms(seeds, pos, p).double().numpy() for p in (Purpose.DRAFT, Purpose.ACCEPT,
                                                                  Purpose.RESIDUAL))
    n = d.size
    pairs = [(d, a), (a, r), (d, r), (d[:, 1:], d[:, :-1]), (d[1:], d[:-1])]  # purposes, positions, seeds
    for x, y in pairs:
        assert abs(np.corrcoef(x.ravel(), y.ravel())[0, 1]) < 5 / math.sqrt(n)
        joint = np.histogram2d(x.ravel(), y.ravel(), bins=10, range=[[0, 1], [0, 1]])[0]
        assert stats.chisquare(joint.ravel()).pvalue > 1e-3


def test_uniforms_deterministic_and_keyed():
    s = torch.tensor([1, 2, -3, 2 ** 62 + 5], dtype=torch.long)
    p = torch.tensor([0, 10, 10, 2 ** 40], dtype=torch.long)
    u1, u2 = uniforms(s, p, Purpose.DRAFT), uniforms(s.clone(), p.clone(), Purpose.DRAFT)
    assert torch.equal(u1, u2)
    assert not torch.equal(u1, uniforms(s, p + 1, Purpose.DRAFT))
    assert not torch.equal(u1, uniforms(s + 1, p, Purpose.DRAFT))
    assert not torch.equal(u1, uniforms(s, p, Purpose.ACCEPT))
    # seeds differing only in the high 32 bits must give different streams
    assert uniforms(torch.tensor([1]), torch.tensor([0]), 1) != uniforms(torch.tensor([1 + 2 ** 32]),
                                                                         torch.tensor([0]), 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_uniforms_and_sampling_bit_identical_on_cuda():
    seeds, pos = _keys(64, 64)
    for purpose in Purpose:
        assert torch.equal(uniforms(seeds, pos, purpose), uniforms(seeds.cuda(), pos.cuda(), purpose).cpu())
    probs = torch.softmax(torch.randn(256, 1000, generator=torch.Generator().manual_seed(1)), 1)
    probs[:, ::3] = 0
    u = uniforms(torch.arange(256), torch.zeros(256, dtype=torch.long), Purpose.DRAFT)
    tok = sample_from_probs(probs.cuda(), u.cuda()).cpu()
    assert (probs.gather(1, tok.unsqueeze(1)) > 0).all()


# ---- sample_from_probs -------------------------------------------------------------------------

def test_sample_from_probs_law_and_support():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.0, 0.3, 0.0])
    n = 200_000
    u = uniforms(torch.arange(n), torch.zeros(n, dtype=torch.long), Purpose.RESIDUAL)
    tok = sample_from_probs(probs.expand(n, 6), u)
    counts = torch.bincount(tok, minlength=6).numpy()
    assert counts[[1, 3, 5]].sum() == 0
    assert stats.chisquare(counts[[0, 2, 4]], n * np.array([0.5, 0.2, 0.3])).pvalue > 1e-3
    # unnormalised rows sample the normalised law: same tokens for scaled probs
    assert torch.equal(tok, sample_from_probs(probs.expand(n, 6) * 7.5, u))


def test_sample_from_probs_never_returns_zero_probability_token():
    g = torch.Generator().manual_seed(3)
    probs = torch.rand(512, 4096, generator=g) ** 8
    probs[probs < 0.05] = 0          # many zero entries, including the last columns of some rows
    probs[:, -50:] = 0
    probs[0] = 0
    probs[0, 7] = 1e-30              # a single tiny positive mass
    extremes = torch.tensor([0.0, 1 - 2 ** -24, 0.5, 1 - 2 ** -23]).repeat(128)
    for u in (extremes, torch.rand(512, generator=g)):
        tok = sample_from_probs(probs, u)
        assert (probs.gather(1, tok.unsqueeze(1)) > 0).all()
    assert sample_from_probs(probs[:1], torch.tensor([1 - 2 ** -24])).item() == 7
    # u = 0 picks the first positive token, u -> 1 the last positive one
    row = torch.tensor([[0.0, 0.4, 0.0, 0.6, 0.0]])
    assert sample_from_probs(row, torch.tensor([0.0])).item() == 1
    assert sample_from_probs(row, torch.tensor([1 - 2 ** -24])).item() == 3


def test_argmax_rows_two_pass_matches_argmax():
    """The chunked two-pass argmax (CUDA default) == torch's argmax, ties (first index) and NaN
    (counts as the maximum, first one wins) included, on CPU by forcing the two passes."""
    from dspark.sampling import argmax_rows
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (5, 3, 129280), generator=g).float()     # many ties per row
    x[0, 0, 70000] = 10.0
    x[0, 0, 90000] = 10.0                                              # tie across chunks
    x[1, 2, 5] = float("nan")
    x[1, 2, 100000] = float("nan")
    x[2, 1, 129279] = 99.0                                             # last column
    want = x.argmax(-1)
    assert torch.equal(argmax_rows(x, two_pass=True), want)
    assert want[0, 0] == 70000 and want[1, 2] == 5 and want[2, 1] == 129279
    if torch.cuda.is_available():                                      # the default path there
        assert torch.equal(argmax_rows(x.cuda()).cpu(), want)
    odd = torch.randn(2, 1001, generator=g)                            # no chunk divides: one pass
    assert torch.equal(argmax_rows(odd, two_pass=True), odd.argmax(-1))


# ---- logit adjustments (penalties, logit_bias, min_tokens, min_p) ------------------------------

def _adjust_reference(x, prompt, out, p, stop_ids):
    """float64 NumPy of the documented order, one row: history = prompt + out."""
    z = np.asarray(x, dtype=np.float64).copy()
    for t in set(prompt) | set(out):
        z[t] = z[t] / p.repetition_penalty if z[t] > 0 else z[t] * p.repetition_penalty
    for t in set(out):
        z[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    for t, b in (p.logit_bias or {}).items():
        z[t] += b
    if len(out) < p.min_tokens:
        z[list(stop_ids)] = -np.inf
    if p.min_p > 0 and p.temperature > 0:
        z[z < z.max() + p.temperature * math.log(p.min_p)] = -np.inf
    return z


def test_logit_adjust_matches_reference_and_block_equals_steps():
    from types import SimpleNamespace

    from dspark.logit_adjust import LogitAdjust
    g = torch.Generator().manual_seed(0)
    V, gamma = 11, 3
    params = [SamplingParams(repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=-0.4,
                             logit_bias={3: 2.0, 7: -1.5}, min_tokens=4, min_p=0.2,
                             temperature=0.7),
              SamplingParams(),                                 # no adjustment: unchanged
              SamplingParams(temperature=0, repetition_penalty=0.5, min_tokens=1)]
    reqs = [SimpleNamespace(params=p, prompt_ids=[1, 2, 2], output_ids=out, stop_ids=(0, 5))
            for p, out in zip(params, ([4, 4, 9], [6], []))]
    assert LogitAdjust.build(reqs[1:2], V, "cpu") is None
    adj = LogitAdjust.build(reqs, V, "cpu")
    x = torch.randn(len(reqs), gamma + 1, V, generator=g) * 3
    drafts = torch.randint(0, V, (len(reqs), gamma), generator=g)
    block = adj.apply_block(x, drafts)
    for i, r in enumerate(reqs):
        for k in range(gamma + 1):
            hist = r.output_ids + drafts[i, :k].tolist()
            want = _adjust_reference(x[i, k].numpy(), r.prompt_ids, hist, r.params, r.stop_ids)
            np.testing.assert_allclose(block[i, k].double().numpy(), want, rtol=1e-5, atol=1e-5)
    # the drafter's steps: apply, then push the sampled token; row k sees the same history
    for k in range(gamma + 1):
        np.testing.assert_allclose(adj.apply(x[:, k]).numpy(), block[:, k].numpy(), rtol=1e-6)
        if k < gamma:
            adj.push(drafts[:, k])
    assert torch.equal(block[1], x[1])
