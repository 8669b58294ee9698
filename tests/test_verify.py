"""dspark.spec.verify: exact sampling law of speculative rounds, greedy path, stops; metrics.

Toy language model: a Markov chain over a 6-token vocabulary. The target is P_t[prev] and the
draft Q[prev] is deliberately different, so every branch (accept, residual, bonus) matters.
"""
import numpy as np
import pytest
import torch
from scipy import stats

from dspark.metrics import SpecMetrics, aggregate, record_batch
from dspark.sampling import Purpose, probs_from_logits, sample_from_probs, uniforms
from dspark.spec.verify import (FinishReason, VerifyResult, apply_stops, clip_lengths, emitted_tokens,
                                stop_table, verify, verify_greedy)

V, GAMMA, START, P0 = 6, 3, 2, 10
_g = torch.Generator().manual_seed(1234)
TARGET_LOGITS = torch.randn(V, V, generator=_g) * 1.5
DRAFT_LOGITS = torch.randn(V, V, generator=_g) * 1.5  # unrelated to the target: low acceptance


pytestmark = pytest.mark.usefixtures("one_thread")


def target_table(temperature=1.0, top_k=0):
    t = torch.full((V,), float(temperature))
    return probs_from_logits(TARGET_LOGITS, t, torch.full((V,), top_k) if top_k else None)


def draft_block(x0, pos, seeds, greedy_draft=False):
    """Sequential draft of GAMMA tokens from the draft chain; q = exact rows sampled from."""
    prev, toks, qs = x0, [], []
    for k in range(1, GAMMA + 1):
        q = probs_from_logits(DRAFT_LOGITS[prev], torch.full(prev.shape, 0.0 if greedy_draft else 1.0))
        tok = sample_from_probs(q, uniforms(seeds, pos + k, Purpose.DRAFT))
        toks.append(tok)
        qs.append(q)
        prev = tok
    return torch.stack(toks, 1), (None if greedy_draft else torch.stack(qs, 1))


def run_rounds(verifier, n, rounds=2, p_table=None, greedy_draft=False, lengths="random", seed0=0):
    """Speculative decoding of n independent requests from token START; returns the emitted
    tokens [n, rounds*(γ+1)] (-1 padded) and their counts."""
    p_table = target_table() if p_table is None else p_table
    seeds = torch.arange(seed0, seed0 + n, dtype=torch.long)
    x0 = torch.full((n,), START, dtype=torch.long)
    pos = torch.full((n,), P0, dtype=torch.long)
    gen = torch.Generator().manual_seed(99)  # lengths independent of drafts: lossless for any law
    out = torch.full((n, rounds * (GAMMA + 1)), -1, dtype=torch.long)
    count = torch.zeros(n, dtype=torch.long)
    for _ in range(rounds):
        x, q = draft_block(x0, pos, seeds, greedy_draft)
        ell = torch.randint(0, GAMMA + 1, (n,), generator=gen) if lengths == "random" \
            else torch.full((n,), lengths, dtype=torch.long)
        p = p_table[torch.cat([x0.unsqueeze(1), x], 1)]            # [n, γ+1, V]
        res = verifier(x, q, p, ell, seeds, pos)
        assert (res.accepted <= ell).all()
        toks, cnt = emitted_tokens(x, res)
        col = torch.arange(GAMMA + 1)
        idx = (count.unsqueeze(1) + col).clamp(max=out.shape[1] - 1)
        out.scatter_(1, idx, torch.where(col < cnt.unsqueeze(1), toks, out.gather(1, idx)))
        count += cnt
        x0, pos = res.next_token, pos + cnt
    return out, count


def law_pvalues(out, p_table):
    """Chi-square p-values of first token, second token and their joint vs the target chain."""
    p = p_table.double().numpy()
    n = out.shape[0]
    first, second = out[:, 0].numpy(), out[:, 1].numpy()
    assert (second >= 0).all()
    exp1 = p[START]
    exp2 = exp1 @ p
    joint = (exp1[:, None] * p).ravel()
    obs_joint = np.bincount(first * V + second, minlength=V * V)

    def chi(obs, exp):
        keep = exp > 0
        assert obs[~keep].sum() == 0, "a zero-probability token was emitted"
        exp = exp[keep] / exp[keep].sum()  # float32 tables: renormalise for scipy's sum check
        return stats.chisquare(obs[keep], exp * obs.sum()).pvalue

    return (chi(np.bincount(first, minlength=V), exp1), chi(np.bincount(second, minlength=V), exp2),
            chi(obs_joint, joint))


# Deliberately broken verifiers: the same tests must reject them ---------------------------------

def make_reference(mode):
    def ref(x, q, p, ell, seeds, pos):
        g = x.shape[1]
        offs = torch.arange(g)
        px = p[:, :g].gather(2, x.unsqueeze(2)).squeeze(2)
        qx = torch.ones_like(px) if q is None else q.gather(2, x.unsqueeze(2)).squeeze(2).clamp_min(1e-8)
        u = uniforms(seeds.unsqueeze(1), pos.unsqueeze(1) + 1 + offs, Purpose.ACCEPT)
        ok = (u * (1.0 if mode == "ignore_q" else qx) < px) & (offs < ell.unsqueeze(1))
        a = ok.long().sum(1) if mode == "count_all" else ok.long().cumprod(1).sum(1)
        rows = torch.arange(x.shape[0])
        p_row = p[rows, a]
        q_row = torch.zeros_like(p_row).scatter_(1, x.gather(1, a.clamp(max=g - 1).unsqueeze(1)), 1.0) \
            if q is None else q[rows, a.clamp(max=g - 1)]
        resid = (p_row - q_row).clamp_min(0)
        use = (a < ell) & (resid.sum(1) > 1e-8) & (mode != "resample_p")
        y = sample_from_probs(torch.where(use.unsqueeze(1), resid, p_row),
                              uniforms(seeds, pos + a + 1, Purpose.RESIDUAL))
        return VerifyResult(a, y)
    return ref


def test_reference_matches_production_verify():
    # the broken variants differ from production only in the one intended piece
    seeds = torch.arange(500)
    x0 = torch.full((500,), START)
    pos = torch.full((500,), P0)
    x, q = draft_block(x0, pos, seeds)
    p = target_table()[torch.cat([x0.unsqueeze(1), x], 1)]
    ell = torch.arange(500) % (GAMMA + 1)
    a, y = verify(x, q, p, ell, seeds, pos)
    ra, ry = make_reference("exact")(x, q, p, ell, seeds, pos)
    assert torch.equal(a, ra) and torch.equal(y, ry)
    assert 0 < (a == 0).sum() < 500 and (a == ell).any() and (a < ell).any()


N_LAW = 120_000


@pytest.mark.parametrize("case", ["sampled", "greedy_draft", "topk_target", "full_length"])
def test_exact_sampling_law_first_and_second_token(case):
    p_table = target_table(top_k=3) if case == "topk_target" else target_table()
    out, _ = run_rounds(verify, N_LAW, p_table=p_table, greedy_draft=case == "greedy_draft",
                        lengths=GAMMA if case == "full_length" else "random")
    for pv in law_pvalues(out, p_table):
        assert pv > 1e-3, (case, law_pvalues(out, p_table))


@pytest.mark.parametrize("mode", ["resample_p", "count_all", "ignore_q"])
def test_broken_verifiers_fail_the_law_test(mode):
    out, _ = run_rounds(make_reference(mode), N_LAW, lengths=GAMMA)
    assert min(law_pvalues(out, target_table())) < 1e-6, mode


def test_greedy_target_equals_argmax_decoding():
    n, rounds = 64, 6
    p_table = target_table(temperature=0.0)
    # plain greedy decoding of the target chain from START
    chain, tok = [], START
    for _ in range(rounds * (GAMMA + 1)):
        tok = int(TARGET_LOGITS[tok].argmax())
        chain.append(tok)
    # a draft that often agrees with the target: target logits plus noise
    global DRAFT_LOGITS
    saved = DRAFT_LOGITS
    DRAFT_LOGITS = TARGET_LOGITS + 0.3 * torch.randn(V, V, generator=torch.Generator().manual_seed(5))
    try:
        def fast(x, q, p, ell, seeds, pos):
            return verify_greedy(x, p.argmax(2), ell)
        for verifier in (verify, fast):
            out, count = run_rounds(verifier, n, rounds=rounds, p_table=p_table)
            for i in range(n):
                assert out[i, :count[i]].tolist() == chain[:count[i]]
            assert count.float().mean() > rounds * 1.5  # drafts were actually accepted
        # both paths agree exactly, including on sampled (non-greedy) drafts
        seeds, x0, pos = torch.arange(200), torch.full((200,), START), torch.full((200,), P0)
        x, q = draft_block(x0, pos, seeds)
        p = p_table[torch.cat([x0.unsqueeze(1), x], 1)]
        ell = torch.arange(200) % (GAMMA + 1)
        assert all(torch.equal(s, f) for s, f in zip(verify(x, q, p, ell, seeds, pos),
                                                     verify_greedy(x, p.argmax(2), ell)))
    finally:
        DRAFT_LOGITS = saved


def test_verify_deterministic_and_validates_shapes():
    seeds, x0, pos = torch.arange(300), torch.full((300,), START), torch.full((300,), P0)
    x, q = draft_block(x0, pos, seeds)
    p = target_table()[torch.cat([x0.unsqueeze(1), x], 1)]
    ell = torch.full((300,), GAMMA)
    r1, r2 = verify(x, q, p, ell, seeds, pos), verify(x, q, p, ell, seeds, pos)
    assert torch.equal(r1.accepted, r2.accepted) and torch.equal(r1.next_token, r2.next_token)
    r3 = verify(x, q, p, ell, seeds + 1000, pos)
    assert not (torch.equal(r1.accepted, r3.accepted) and torch.equal(r1.next_token, r3.next_token))
    with pytest.raises(ValueError, match="target rows"):
        verify(x, q, p[:, :GAMMA], ell, seeds, pos)
    with pytest.raises(ValueError, match="draft_probs"):
        verify(x, q[:, :, :4], p, ell, seeds, pos)
    with pytest.raises(ValueError, match="lengths"):
        verify(x, q, p, ell[:5], seeds, pos)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_verify_on_cuda_matches_cpu():
    seeds, x0, pos = torch.arange(2000), torch.full((2000,), START), torch.full((2000,), P0)
    x, q = draft_block(x0, pos, seeds)
    p = target_table(top_k=4)[torch.cat([x0.unsqueeze(1), x], 1)]
    ell = torch.arange(2000) % (GAMMA + 1)
    for qq in (q, None):
        cpu = verify(x, qq, p, ell, seeds, pos)
        gpu = verify(x.cuda(), None if qq is None else qq.cuda(), p.cuda(), ell.cuda(), seeds.cuda(),
                     pos.cuda())
        assert gpu.accepted.is_cuda and torch.equal(cpu.accepted, gpu.accepted.cpu())
        assert torch.equal(cpu.next_token, gpu.next_token.cpu())
    toks, cnt = emitted_tokens(x.cuda(), gpu)
    n, fin = apply_stops(toks, cnt, stop_table([[1]] * 2000, "cuda"), torch.zeros(2000, dtype=torch.long,
                         device="cuda"), torch.full((2000,), 3, device="cuda"))
    assert n.is_cuda and int(n.max()) <= 3


# ---- stops / max_tokens ------------------------------------------------------------------------

def test_emitted_tokens_layout():
    x = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7]])
    toks, cnt = emitted_tokens(x, (torch.tensor([0, 2, 3]), torch.tensor([9, 9, 9])))
    assert toks.tolist() == [[9, -1, -1, -1], [5, 6, 9, -1], [5, 6, 7, 9]] and cnt.tolist() == [1, 3, 4]


def test_apply_stops_cases():
    toks = torch.tensor([[5, 7, 9, 3]] * 7)
    cnt = torch.tensor([4, 4, 2, 4, 4, 4, 4])
    stops = stop_table([[7], [3], [9], [], [7, 1], [], []])
    gen = torch.tensor([0, 0, 0, 8, 8, 6, 0])
    mx = torch.tensor([100, 100, 100, 10, 10, 10, 100])
    n, fin = apply_stops(toks, cnt, stops, gen, mx)
    S, L, N = FinishReason.STOP, FinishReason.LENGTH, FinishReason.NONE
    # stop among drafts (no bonus) | stop = extra token | stop in padding ignored | max_tokens cut |
    # stop and length on the same token -> STOP | budget == count -> LENGTH | nothing
    assert n.tolist() == [2, 4, 2, 2, 2, 4, 4]
    assert fin.tolist() == [S, S, N, L, S, L, N]
    assert stop_table([[1, 2], []]).tolist() == [[1, 2], [-1, -1]]


def test_clip_lengths_before_verification():
    x = torch.tensor([[5, 7, 9], [5, 6, 9], [7, 7, 7], [1, 2, 3]])
    ell = torch.tensor([3, 3, 3, 2])
    stops = stop_table([[7], [9, 6], [7], []])
    assert clip_lengths(ell, x, stops).tolist() == [2, 2, 1, 2]
    assert clip_lengths(ell, remaining=torch.tensor([10, 2, 1, 0])).tolist() == [3, 1, 0, 0]
    assert clip_lengths(ell, x, stops, torch.tensor([2, 10, 10, 10])).tolist() == [1, 2, 1, 2]


# ---- metrics fed by verification ---------------------------------------------------------------

def test_metrics_from_verified_rounds():
    m = SpecMetrics()
    m.record_round(verified=3, accepted=3, emitted=4, proposed=5)
    m.record_round(verified=2, accepted=0, emitted=1, proposed=5)
    m.record_round(verified=4, accepted=2, emitted=2, proposed=5)  # cut by a stop draft
    m.check()
    assert (m.rounds, m.proposed, m.verified, m.accepted, m.emitted) == (3, 15, 9, 5, 7)
    assert m.mean_accepted_length == pytest.approx(7 / 3) and m.acceptance_rate == pytest.approx(5 / 9)
    assert m.pos_verified == [3, 3, 2, 1] and m.pos_accepted == [2, 2, 1]
    assert m.pos_reached == [3, 2, 2]
    assert m.conditional_acceptance == pytest.approx([2 / 3, 1.0, 0.5])
    assert m.per_position_rate == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    assert m.tau_hist == [0, 1, 1, 0, 1] and m.verify_rate == pytest.approx(7 / 12)
    with pytest.raises(ValueError):
        m.record_round(verified=2, accepted=3, emitted=4, proposed=5)
    with pytest.raises(ValueError):
        m.record_round(verified=6, accepted=1, emitted=2, proposed=5)
    # batch recording from a real verify call, then aggregation
    seeds, x0, pos = torch.arange(400), torch.full((400,), START), torch.full((400,), P0)
    x, q = draft_block(x0, pos, seeds)
    p = target_table()[torch.cat([x0.unsqueeze(1), x], 1)]
    ell = torch.arange(400) % (GAMMA + 1)
    res = verify(x, q, p, ell, seeds, pos)
    per_req = [SpecMetrics() for _ in range(400)]
    record_batch(per_req, GAMMA, ell, res.accepted, res.accepted + 1)
    per_req[0].record_timing(ttft=0.5, decode_time=1.0, decode_tokens=10)
    per_req[1].record_timing(ttft=1.5, decode_time=3.0, decode_tokens=10)
    total = aggregate(per_req)
    total.check()
    assert total.rounds == 400 and total.verified == int(ell.sum())
    assert total.accepted == int(res.accepted.sum())
    assert total.mean_accepted_length == pytest.approx(1 + res.accepted.float().mean().item())
    assert total.ttft == pytest.approx(1.0) and total.tpot == pytest.approx(0.2)
    assert total.merge(m).rounds == 403


def test_host_twins_match_the_tensor_versions():
    """accept_greedy_host / emit_and_stop_host (the engine's per-round tail) == verify_greedy +
    emitted_tokens + apply_stops on random rounds: stops among drafts, on the bonus token, budgets
    cut mid-block, empty stop lists, lengths 0..γ."""
    from dspark.spec.verify import accept_greedy_host, emit_and_stop_host
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        R, g = int(torch.randint(1, 5, (1,), generator=gen)), int(torch.randint(1, 6, (1,), generator=gen))
        x = torch.randint(0, 6, (R, g), generator=gen)
        am = torch.randint(0, 6, (R, g + 1), generator=gen)
        am[:, :g] = torch.where(torch.rand(R, g, generator=gen) < 0.7, x, am[:, :g])
        ell = torch.randint(0, g + 1, (R,), generator=gen)
        stops = [torch.randint(0, 6, (int(torch.randint(0, 3, (1,), generator=gen)),),
                               generator=gen).tolist() for _ in range(R)]
        gen_n = torch.randint(0, 8, (R,), generator=gen)
        mx = gen_n + torch.randint(0, g + 3, (R,), generator=gen)
        res = verify_greedy(x, am, ell)
        toks, cnt = emitted_tokens(x, res)
        n, fin = apply_stops(toks, cnt, stop_table(stops), gen_n, mx)
        a, y = accept_greedy_host(x.tolist(), am.tolist(), ell.tolist())
        assert a == res.accepted.tolist() and y == res.next_token.tolist()
        out, hfin = emit_and_stop_host(x.tolist(), a, y, [set(s) for s in stops], gen_n.tolist(),
                                       mx.tolist())
        assert [len(o) for o in out] == n.tolist() and [int(f) for f in hfin] == fin.tolist()
        assert out == [t[:k] for t, k in zip(toks.tolist(), n.tolist())]


def test_decide_reads_the_argmax_a_graph_attached():
    """Greedy decisions take the rows' argmax the runner's graph computed with the logits
    (`logits.row_argmax`), plain decode and verify rows alike, and compute it without one."""
    from types import SimpleNamespace

    from dspark.sampling import SamplingParams
    from dspark.spec.accept import decide
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=gen)
    reqs = [SimpleNamespace(params=SamplingParams(temperature=0), seed=0,
                            draft=SimpleNamespace(tokens=torch.tensor([1]), probs=None))
            for _ in range(2)]
    plain = decide([SimpleNamespace(params=SamplingParams(temperature=0), seed=0,
                                                     draft=None) for _ in range(4)],
                   logits, [0, 1, 2, 3], [0] * 4, [5] * 4, 2)
    assert torch.equal(plain.head[:, 0], logits.argmax(-1))
    hint = torch.tensor([7, 8, 9, 10])
    logits.row_argmax = hint
    plain = decide([SimpleNamespace(params=SamplingParams(temperature=0), seed=0, draft=None)
                    for _ in range(4)], logits, [0, 1, 2, 3], [0] * 4, [5] * 4, 2)
    assert torch.equal(plain.head[:, 0], hint)
    blocks = decide(reqs, logits, [0, 2], [1, 1], [5, 6], 1)      # rows [0, 1] and [2, 3]
    assert torch.equal(blocks.head, hint.view(2, 2))
