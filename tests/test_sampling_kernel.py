"""dspark.kernels.sampling.fused_verify against the torch path (probs_from_logits + verify), its
hash against dspark.sampling.uniforms, its output law, and the engine running through it.

Without CUDA the kernel runs under TRITON_INTERPRET=1; BLOCK_V is small so every row spans
several chunks (running max / sum / cdf carried across chunk boundaries).
"""
from triton_env import DEV, triton_ok  # noqa: F401 (before triton)

import pytest  # noqa: E402
import torch  # noqa: E402
from scipy import stats  # noqa: E402

import dspark.kernels.sampling as ks  # noqa: E402
import dspark.sampling as sampling  # noqa: E402
from dspark import Engine, SamplingParams  # noqa: E402
from dspark.bench.datasets import load_prompts  # noqa: E402
from dspark.engine import default_model_path  # noqa: E402
from dspark.sampling import Purpose, probs_from_logits, uniforms  # noqa: E402
from dspark.spec.verify import verify  # noqa: E402

pytestmark = [triton_ok, pytest.mark.usefixtures("one_thread")]
BLOCK_V = 64


def torch_path(x, q, logits, temp, lens, seeds, pos):
    r, rows, v = logits.shape
    p = probs_from_logits(logits.reshape(r * rows, v), temp.repeat_interleave(rows))
    return verify(x, q, p.view(r, rows, v), lens, seeds, pos)


def fused(x, q, logits, temp, lens, seeds, pos):
    dev = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    res = ks.fused_verify(dev(x), dev(q), dev(logits), dev(temp), dev(lens), dev(seeds),
                          dev(pos), block_v=BLOCK_V)
    return res.accepted.cpu(), res.next_token.cpu()


def random_case(gen, r, g, v, greedy_share=0.3, layout="contiguous"):
    """Logits with std 2 (a cdf boundary within rounding of u is rare), drafts sampled from a q
    that leans towards p (so runs of several accepts happen), random lengths, mixed greedy rows."""
    if layout == "strided":     # a view: padded V and rows interleaved with other data
        logits = (torch.randn(g + 1, r, v + 7, generator=gen) * 2).transpose(0, 1)[..., :v]
    else:
        logits = torch.randn(r, g + 1, v, generator=gen) * 2
    if layout == "bf16":
        logits = logits.bfloat16()
    temp = torch.rand(r, generator=gen) + 0.4
    temp[torch.rand(r, generator=gen) < greedy_share] = 0.0
    q = torch.softmax(logits[:, :g].float() * 0.8 + torch.randn(r, g, v, generator=gen), -1)
    x = torch.multinomial(q.reshape(-1, v), 1, generator=gen).view(r, g)
    lens = torch.randint(0, g + 1, (r,), generator=gen)
    seeds = torch.randint(-2 ** 62, 2 ** 62, (r,), generator=gen)
    pos = torch.randint(0, 2 ** 40, (r,), generator=gen)
    return x, q, logits, temp, lens, seeds, pos


def test_matches_torch_path_on_random_cases():
    gen = torch.Generator().manual_seed(7)
    rows = mismatches = 0
    seen = {"rejected": 0, "all accepted": 0, "length 0": 0, "greedy": 0}
    layouts = ("contiguous", "strided", "bf16")
    for case in range(40):
        r, g = (int(torch.randint(1, 6, (1,), generator=gen)) for _ in range(2))
        v = int(torch.randint(37, 301, (1,), generator=gen))
        x, q, logits, temp, lens, seeds, pos = random_case(gen, r, g, v, layout=layouts[case % 3])
        for draft_probs in (q, None):
            ref = torch_path(x, draft_probs, logits, temp, lens, seeds, pos)
            acc, nxt = fused(x, draft_probs, logits, temp, lens, seeds, pos)
            rows += r
            mismatches += int(((acc != ref.accepted) | (nxt != ref.next_token)).sum())
            seen["rejected"] += int((ref.accepted < lens).sum())
            seen["all accepted"] += int(((ref.accepted == lens) & (lens > 0)).sum())
            seen["length 0"] += int((lens == 0).sum())
            seen["greedy"] += int((temp == 0).sum())
    assert min(seen.values()) >= 10, seen           # every branch was exercised
    # sums run in another order than torch's: only a u within rounding of a boundary may differ
    assert mismatches <= rows // 200, (mismatches, rows)


def test_greedy_rows_take_the_first_argmax_across_chunks():
    v = 150
    logits = torch.randn(3, 2, v, generator=torch.Generator().manual_seed(1))
    logits[:, 0, 100] = logits[:, 0, 10] = 9.0           # tie: chunk 0 and chunk 1 (BLOCK_V 64)
    logits[:, 1, 77] = 9.0
    x = torch.tensor([[0], [100], [10]])                 # unverified / tie loser / first argmax
    lens = torch.tensor([0, 1, 1])
    temp, seeds, pos = torch.zeros(3), torch.tensor([1, 2, 3]), torch.tensor([5, 6, 7])
    acc, nxt = fused(x, None, logits, temp, lens, seeds, pos)
    assert acc.tolist() == [0, 0, 1] and nxt.tolist() == [10, 10, 77]
    ref = torch_path(x, None, logits, temp, lens, seeds, pos)
    assert acc.tolist() == ref.accepted.tolist() and nxt.tolist() == ref.next_token.tolist()


def test_mixed_greedy_and_sampled_rows_in_one_batch():
    gen = torch.Generator().manual_seed(3)
    x, q, logits, _, _, seeds, pos = random_case(gen, 4, 3, 97)
    temp = torch.tensor([0.0, 0.7, 0.0, 1.3])
    lens = torch.tensor([3, 2, 1, 3])
    ref = torch_path(x, q, logits, temp, lens, seeds, pos)
    acc, nxt = fused(x, q, logits, temp, lens, seeds, pos)
    assert torch.equal(acc, ref.accepted) and torch.equal(nxt, ref.next_token)


def test_length_zero_samples_row_zero_like_plain_decode():
    # the speculation-off engine: no drafts, one token from row 0 keyed (seed, P+1, RESIDUAL)
    gen = torch.Generator().manual_seed(4)
    x, _, logits, _, _, seeds, pos = random_case(gen, 5, 2, 123)
    temp, lens = torch.full((5,), 0.9), torch.zeros(5, dtype=torch.long)
    acc, nxt = fused(x, None, logits, temp, lens, seeds, pos)
    assert acc.tolist() == [0] * 5
    ref = torch_path(x, None, logits, temp, lens, seeds, pos)
    assert torch.equal(nxt, ref.next_token)
    # inverse CDF of p_0 with that uniform, independently of verify
    p0 = torch.softmax(logits[:, 0] / 0.9, -1)
    u = uniforms(seeds, pos + 1, Purpose.RESIDUAL)
    expect = (p0.cumsum(-1) <= u[:, None] * p0.sum(-1, keepdim=True)).sum(-1)
    assert nxt.tolist() == expect.tolist()


def test_full_acceptance_samples_the_bonus_row():
    gen = torch.Generator().manual_seed(5)
    r, g, v = 3, 4, 90
    x = torch.randint(0, v, (r, g), generator=gen)
    logits = torch.randn(r, g + 1, v, generator=gen)
    logits[:, :g].scatter_(2, x[:, :, None], 60.0)   # p(draft) rounds to 1: accepted for any u
    temp, lens = torch.ones(r), torch.tensor([4, 2, 3])
    seeds, pos = torch.tensor([11, 12, 13]), torch.tensor([0, 100, 2 ** 35])
    acc, nxt = fused(x, None, logits, temp, lens, seeds, pos)
    assert torch.equal(acc, lens)
    ref = torch_path(x, None, logits, temp, lens, seeds, pos)
    assert torch.equal(nxt, ref.next_token)


def test_draft_with_no_mass_on_its_token_is_tested_against_the_floor():
    """q(x) = 0 is a broken draft; the test is u * max(q(x), Q_FLOOR) < p(x): accepted where p(x)
    is ordinary, rejected where p(x) is far below Q_FLOOR (a test of u * 0 < p(x) would accept)."""
    gen = torch.Generator().manual_seed(6)
    x, q, logits, _, _, seeds, pos = random_case(gen, 4, 2, 80)
    q.scatter_(2, x[:, :, None], 0.0)
    temp, lens = torch.ones(4), torch.full((4,), 2)
    rare = torch.tensor([False, True, False, True])
    first = logits[:, 0].gather(1, x[:, :1])
    logits[:, 0].scatter_(1, x[:, :1], torch.where(rare[:, None], logits[:, 0].amax(1, True) - 40,
                                                   first))
    acc, nxt = fused(x, q, logits, temp, lens, seeds, pos)
    assert ((acc >= 1) == ~rare).all(), acc
    ref = torch_path(x, q, logits, temp, lens, seeds, pos)
    assert torch.equal(acc, ref.accepted) and torch.equal(nxt, ref.next_token)


def test_first_emitted_token_follows_the_target_law():
    """Losslessness: draft x ~ q, then accept x or take the corrected token; over many seeds the
    first emitted token is distributed as p, even though q is far from p."""
    n, v = 400, 5
    p_logits = torch.tensor([2.0, 1.2, 0.7, -0.5, 0.0])
    q_law = torch.tensor([0.04, 0.1, 0.2, 0.3, 0.36])
    p_law = torch.softmax(p_logits.double(), 0)
    seeds = torch.arange(1000, 1000 + n)
    pos = torch.full((n,), 42)
    x = torch.multinomial(q_law, n, replacement=True, generator=torch.Generator().manual_seed(8))
    q = q_law.expand(n, 1, v).contiguous()
    logits = p_logits.expand(n, 2, v).contiguous()
    acc, nxt = fused(x[:, None], q, logits, torch.ones(n), torch.ones(n, dtype=torch.long),
                     seeds, pos)
    first = torch.where(acc == 1, x, nxt)
    counts = torch.bincount(first, minlength=v).double()
    assert stats.chisquare(counts, n * p_law).pvalue > 1e-3
    # the same sample size tells q apart from p: the check has power
    assert stats.chisquare(torch.bincount(x, minlength=v).double(), n * p_law).pvalue < 1e-6


def test_hash_is_bit_identical_to_uniforms():
    """uniforms_triton (the draft pass's uniforms on CUDA) == dspark.sampling.uniforms bit for bit,
    on int64 edge values and random keys, broadcast [n, 1] x [1, m] like the draft pass calls it."""
    gen = torch.Generator().manual_seed(9)
    edge = torch.tensor([-2 ** 63, 2 ** 63 - 1, -1, 0, 1, 2 ** 32 - 1, 2 ** 32, -2 ** 32])
    seeds = torch.cat([edge, edge, torch.randint(-2 ** 63, 2 ** 63 - 1, (240,), generator=gen)])
    pos = torch.cat([edge, edge.flip(0), torch.randint(0, 2 ** 45, (240,), generator=gen)])
    for purpose in Purpose:
        out = ks.uniforms_triton(seeds.to(DEV), pos.to(DEV), purpose)
        assert torch.equal(out.cpu(), uniforms(seeds, pos, purpose)), purpose
    s2, p2 = seeds[:7, None], torch.arange(3, 9)[None, :]
    assert torch.equal(ks.uniforms_triton(s2.to(DEV), p2.to(DEV), Purpose.DRAFT).cpu(),
                       uniforms(s2, p2, Purpose.DRAFT))


def test_engine_outputs_agree_with_the_torch_path(monkeypatch):
    """The whole engine at temperature 1 through the kernels (sampling.FUSED_BACKEND "triton",
    interpreted on CPU) and through the torch path: same seeds, same tokens. Speculative (draft probs) and
    speculation-off (length 0, no q) engines."""
    from dspark.kernels import markov_loop as ml
    calls, draws = [], []
    real, real_loop = ks.fused_verify, ml.markov_loop
    monkeypatch.setattr(ks, "fused_verify", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(ml, "markov_loop", lambda *a, **k: draws.append(1) or real_loop(*a, **k))
    prompts = load_prompts(default_model_path() + "/heldout_prompts.jsonl", 3)
    params = [SamplingParams(temperature=1.0, max_tokens=32, seed=s) for s in (1, 2, 3)]
    for speculative in ("dspark", "none"):
        eng = Engine(device=DEV, dtype="fp32", speculative=speculative)
        outs = {}
        for mode in ("0", "1"):
            monkeypatch.setattr(sampling, "FUSED_BACKEND", "triton" if mode == "1" else "reference")
            n, d = len(calls), len(draws)
            outs[mode] = [o.token_ids for o in eng.generate(prompts, params)]
            assert (len(calls) > n) == (mode == "1")
            # the draft pass's Markov loop draws through the kernels too (speculative engine:
            # the shipped head is small enough for markov_loop's one launch)
            assert (len(draws) > d) == (mode == "1" and speculative == "dspark")
        assert outs["0"] == outs["1"], speculative


def _sample_case(gen, n, v, layout="contiguous"):
    if layout == "strided":
        logits = (torch.randn(v + 5, n, generator=gen) * 2).t()[:, :v]
    else:
        logits = torch.randn(n, v, generator=gen) * 2
    if layout == "bf16":
        logits = logits.bfloat16()
    logits[:, :3] = float("-inf")            # masked entries: never drawn, q = 0
    temp = torch.rand(n, generator=gen) + 0.4
    temp[::3] = 0.0                          # greedy rows
    return logits, temp, torch.rand(n, generator=gen)


@pytest.mark.parametrize("layout", ["contiguous", "strided", "bf16"])
def test_fused_sample_matches_probs_and_draw_of_the_torch_path(layout):
    """q == probs_from_logits (1e-6) and the token == sample_from_probs(q, u) on every row here
    (a mismatch needs u within rounding of a cdf boundary); greedy rows: one-hot, the argmax."""
    from dspark.sampling import sample_from_probs
    gen = torch.Generator().manual_seed(3)
    mismatches, rows = 0, 0
    for v in (37, 300):
        logits, temp, u = _sample_case(gen, 9, v, layout)
        q_ref = probs_from_logits(logits, temp)
        tok_ref = sample_from_probs(q_ref, u)
        q, tok = ks.fused_sample(logits.to(DEV), temp.to(DEV), u.to(DEV), block_v=BLOCK_V)
        torch.testing.assert_close(q.cpu(), q_ref, atol=1e-6, rtol=1e-5)
        mismatches += int((tok.cpu() != tok_ref).sum())
        rows += len(tok)
        assert bool((q.cpu().gather(1, tok.cpu()[:, None]) > 0).all())
        greedy = temp <= 0
        assert torch.equal(tok.cpu()[greedy], logits[greedy].float().argmax(1))
    assert mismatches <= rows // 200, (mismatches, rows)


def test_fused_sample_draws_follow_q():
    """Inverse CDF on a stratified grid of u: token i is drawn for the grid points inside its
    cdf interval, so its count is n·q_i within one: q is exactly the law the draft token came
    from, as the verify's rejection test needs. A masked entry (q = 0) is never drawn."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(1, 23, generator=gen)
    logits[0, 4] = float("-inf")
    n = 400
    u = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    q, tok = ks.fused_sample(logits.expand(n, -1).contiguous().to(DEV),
                             torch.full((n,), 0.8).to(DEV), u.to(DEV), block_v=16)
    counts = torch.bincount(tok.cpu(), minlength=23).double()
    assert counts[4] == 0
    assert float((counts - q[0].cpu().double() * n).abs().max()) <= 1.01


def test_fused_switch(monkeypatch):
    """Default: the kernels on CUDA only; "reference" / "triton" force; anything else fails."""
    from dspark.sampling import fused_sampling_enabled as on
    monkeypatch.setattr(sampling, "FUSED_BACKEND", "auto")
    assert on("cuda") and not on("cpu")
    monkeypatch.setattr(sampling, "FUSED_BACKEND", "reference")
    assert not on("cuda") and not on("cpu")
    monkeypatch.setattr(sampling, "FUSED_BACKEND", "triton")
    assert on("cpu") and on("cuda")
    monkeypatch.setattr(sampling, "FUSED_BACKEND", "fast")
    with pytest.raises(ValueError, match="FUSED_BACKEND 'fast'"):
        on("cpu")
