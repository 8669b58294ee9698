"""kernels.sampling_filters.filter_logits (top-k / top-p in one launch) against probs_from_logits,
and the fused verify / draft paths that take it (sampling.fused_filters_enabled).

Without CUDA the kernel runs under TRITON_INTERPRET=1 with a small BLOCK, so every row spans
several chunks (the tie ranks are carried across chunk boundaries). Logits rounded to a few
values make ties at the top-k / top-p boundaries common: the kept set must be torch's (stable
sort: equal logits by token id)."""
from triton_env import DEV, triton_ok  # noqa: F401 (before triton)

import pytest  # noqa: E402
import torch  # noqa: E402

import dspark.kernels.sampling as ks  # noqa: E402
from dspark.kernels.sampling_filters import filter_logits  # noqa: E402
from dspark.sampling import probs_from_logits  # noqa: E402
from dspark.spec.verify import verify  # noqa: E402

pytestmark = [triton_ok, pytest.mark.usefixtures("one_thread")]
BLOCK = 64


def probs_of(y, t):
    """probs_from_logits' output from filter_logits' (y, t): softmax(y) on sampled rows, the
    first argmax of the raw logits (y as-is) on greedy rows."""
    p = torch.softmax(y.float(), 1)
    g = t <= 0
    p[g] = torch.zeros_like(p[g]).scatter_(1, y[g].argmax(1, keepdim=True), 1.0)
    return p


def case(gen, n, v, ties: bool, layout="contiguous"):
    logits = torch.randn(n, v, generator=gen) * 3
    if ties:
        logits = (logits * 2).round() / 2              # ~25 distinct values: ties everywhere
    if layout == "strided":
        logits = torch.cat([logits, torch.zeros(n, 9)], 1)[:, :v]
    elif layout == "bf16":
        logits = logits.bfloat16()
    temp = torch.rand(n, generator=gen) + 0.3
    temp[::4] = 0.0                                    # greedy rows
    top_k = torch.randint(-1, v + 3, (n,), generator=gen)
    top_k[1::3] = torch.randint(1, 6, (len(top_k[1::3]),), generator=gen)   # small k too
    top_p = torch.rand(n, generator=gen) * 0.98 + 0.01
    top_p[2::5] = 1.0                                  # off on some rows
    return logits, temp, top_k, top_p


@pytest.mark.parametrize("layout,ties", [("contiguous", False), ("contiguous", True),
                                          ("strided", True), ("bf16", True)])
def test_kept_tokens_and_probs_equal_the_torch_path(layout, ties):
    gen = torch.Generator().manual_seed(3 + ties)
    for which in ("k", "p", "kp"):
        logits, temp, top_k, top_p = case(gen, 8, 200, ties, layout)
        k = top_k if "k" in which else None
        p = top_p if "p" in which else None
        ref = probs_from_logits(logits, temp, k, p)
        y, t = filter_logits(logits.to(DEV), temp.to(DEV), None if k is None else k.to(DEV),
                             None if p is None else p.to(DEV), block=BLOCK)
        assert torch.equal(t.cpu(), (temp > 0).float())
        got = probs_of(y.cpu(), t.cpu())
        assert torch.equal(got > 0, ref > 0), (which, (got > 0).sum(1), (ref > 0).sum(1))
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)


def test_edge_rows():
    """k = 1, k >= V, p tiny, p just below 1, a row of -inf but two tied tokens."""
    v = 200
    logits = torch.randn(5, v) * 2
    logits[4] = float("-inf")
    logits[4, 17] = logits[4, 99] = 3.0
    temp = torch.tensor([0.9, 1.0, 1.0, 1.1, 1.0])
    top_k = torch.tensor([1, v, v + 50, 0, 0])
    top_p = torch.tensor([1.0, 0.001, 0.9999, 0.5, 0.5])
    ref = probs_from_logits(logits, temp, top_k, top_p)
    y, t = filter_logits(logits.to(DEV), temp.to(DEV), top_k.to(DEV), top_p.to(DEV), block=BLOCK)
    got = probs_of(y.cpu(), t.cpu())
    assert torch.equal(got > 0, ref > 0)
    assert (got[4] > 0).sum() == 1 and got[4, 17] == 1.0      # the lower id of the tie
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)


def test_fused_verify_on_filtered_logits_matches_the_torch_path():
    """verify(probs_from_logits(.., top_k, top_p)) == fused_verify(filter_logits(..)) per
    request: same accepted counts and tokens (same uniforms)."""
    gen = torch.Generator().manual_seed(5)
    r, g, v = 6, 3, 160
    logits = torch.randn(r, g + 1, v, generator=gen) * 2
    temp = torch.rand(r, generator=gen) + 0.4
    temp[0] = 0.0
    top_k = torch.tensor([0, 5, 40, 0, 2, 160])
    top_p = torch.tensor([1.0, 0.8, 0.95, 0.6, 1.0, 0.3])
    rep = lambda t: t.repeat_interleave(g + 1)  # noqa: E731
    p = probs_from_logits(logits.flatten(0, 1), rep(temp), rep(top_k), rep(top_p)).view(r, g + 1, v)
    q = torch.softmax(logits[:, :g] * 0.7 + torch.randn(r, g, v, generator=gen), -1)
    x = torch.multinomial(q.flatten(0, 1), 1, generator=gen).view(r, g)
    lens = torch.tensor([3, 3, 2, 1, 3, 0])
    seeds = torch.randint(0, 2 ** 40, (r,), generator=gen)
    pos = torch.randint(0, 2 ** 30, (r,), generator=gen)
    ref = verify(x, q, p, lens, seeds, pos)
    y, t = filter_logits(logits.flatten(0, 1).to(DEV), rep(temp).to(DEV), rep(top_k).to(DEV),
                         rep(top_p).to(DEV), block=BLOCK)
    d = lambda a: a.to(DEV)  # noqa: E731
    res = ks.fused_verify(d(x), d(q), y.view(r, g + 1, v), t.view(r, g + 1)[:, 0], d(lens),
                          d(seeds), d(pos), block_v=BLOCK)
    assert torch.equal(res.accepted.cpu(), ref.accepted)
    assert torch.equal(res.next_token.cpu(), ref.next_token)


def test_engine_with_top_k_top_p_through_the_fused_kernels(monkeypatch):
    """The speculative engine with top-k and top-p: filter_logits + the fused draft / verify
    kernels (interpreted on CPU) give the tokens of the torch path."""
    import dspark.sampling as sampling
    from dspark import Engine, SamplingParams
    from dspark.bench.datasets import load_prompts
    from dspark.engine import default_model_path
    import dspark.kernels.sampling_filters as kf
    calls = []
    real = kf.filter_logits
    monkeypatch.setattr(kf, "filter_logits", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompts = load_prompts(default_model_path() + "/heldout_prompts.jsonl", 1)
    params = [SamplingParams(temperature=0.8, top_k=12, top_p=0.9, max_tokens=6, seed=7)]
    eng = Engine(device=DEV, dtype="fp32", speculative="dspark")
    outs = {}
    for mode in ("0", "1"):             # "0": the torch path, "1": the kernels
        monkeypatch.setattr(sampling, "FUSED_BACKEND", "triton" if mode == "1" else "reference")
        n = len(calls)
        outs[mode] = [o.token_ids for o in eng.generate(prompts, params)]
        assert (len(calls) > n) == (mode == "1")
    assert outs["0"] == outs["1"]


def test_fused_filters_rule(monkeypatch):
    """By default the fused filters take small vocabularies and many rows (where they measured
    faster), not one long row; never without fused sampling."""
    import dspark.sampling as sampling
    from dspark.sampling import fused_filters_enabled
    monkeypatch.setattr(sampling, "FUSED_BACKEND", "triton")
    assert fused_filters_enabled("cpu", 1, 512) and fused_filters_enabled("cpu", 48, 129280)
    assert not fused_filters_enabled("cpu", 1, 129280) and not fused_filters_enabled("cpu", 6, 129280)
    monkeypatch.setattr(sampling, "FUSED_BACKEND", "reference")
    assert not fused_filters_enabled("cpu", 48, 512)
    monkeypatch.setattr(sampling, "FUSED_BACKEND", "auto")
    assert not fused_filters_enabled("cpu", 48, 512) and fused_filters_enabled("cuda", 48, 512)


def test_candidate_list_overflow_falls_back_to_the_row():
    """More tokens at or above the lane-maximum bound than the list holds (cap 2): the searches
    walk the whole row and keep the same tokens."""
    gen = torch.Generator().manual_seed(11)
    logits, temp, _, top_p = case(gen, 6, 250, True)
    top_k = torch.tensor([5, 3, 12, 40, 2, 7])
    ref = probs_from_logits(logits, temp, top_k, top_p)
    for cap in (2, 4096):
        y, t = filter_logits(logits.to(DEV), temp.to(DEV), top_k.to(DEV), top_p.to(DEV),
                             block=BLOCK, cap=cap)
        got = probs_of(y.cpu(), t.cpu())
        assert torch.equal(got > 0, ref > 0), cap
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)
