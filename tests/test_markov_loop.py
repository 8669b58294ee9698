"""dspark.kernels.markov_loop (the drafter's γ Markov steps in one launch) against the unfused
torch path as the oracle: per slot `DSparkDrafter.markov_step` (the drafter's own code: W1 rows,
W2 through linear_fp32, the fp32 confidence), x = base + bias, then `x.argmax(1)` (greedy) or
`probs_from_logits` + `sample_from_probs` (sampled), the previous token fed back.

Without CUDA the kernel runs under TRITON_INTERPRET=1; BLOCK_V is small so every row spans
several V blocks (argmax, running max / sum and cdf carried across block boundaries).
"""
from triton_env import DEV, triton_ok  # noqa: F401 (before triton)

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from dspark.kernels import markov_loop as ml  # noqa: E402
from dspark.models.drafter import DSparkDrafter  # noqa: E402
from dspark.sampling import probs_from_logits, sample_from_probs  # noqa: E402

pytestmark = [triton_ok, pytest.mark.usefixtures("one_thread")]
BLOCK_V = 32
G, V, D = 4, 100, 24          # V spans 4 blocks of 32, the last one partial


def _head(gen, rank, dtype):
    w1 = torch.randn(V, rank, generator=gen).to(dtype)
    w2 = (torch.randn(V, rank, generator=gen) * 0.5).to(dtype)
    conf = SimpleNamespace(weight=torch.randn(1, D + rank, generator=gen).to(dtype))
    return SimpleNamespace(markov_w1=w1, markov_w2=w2, confidence=conf)


def _case(gen, R, rank, dtype):
    head = _head(gen, rank, dtype)
    base = torch.randn(R, G, V, generator=gen) * 2
    hidden = torch.randn(R, G, D, generator=gen)
    anchors = torch.randint(0, V, (R,), generator=gen)
    return head, base, hidden, anchors


def oracle(head, base, hidden, anchors, temperature=None, u=None, snap=False):
    """The torch path, slot by slot: (tokens [R, γ], q [R, γ, V] or None, conf [R, γ], u).
    snap: u landing within 1e-3 (relative) of a cdf boundary of the reference q is moved to the
    middle of the token interval it picked, so that rounding cannot change the draw."""
    prev, toks, qs, confs = anchors, [], [], []
    u = None if u is None else u.clone()
    for k in range(base.shape[1]):
        bias, conf = DSparkDrafter.markov_step(head, hidden[:, k].float(), prev)
        x = base[:, k].float() + bias
        if temperature is None:
            prev = x.argmax(dim=1)
        else:
            q = probs_from_logits(x, temperature)
            if snap:
                cdf = q.double().cumsum(1)
                total = cdf[:, -1:]
                near = ((u[:, k:k + 1].double() * total - cdf).abs() < 1e-3 * total).any(1)
                tok = sample_from_probs(q, u[:, k])
                lo = torch.where(tok > 0, cdf.gather(1, (tok - 1).clamp(min=0)[:, None])[:, 0], 0)
                mid = ((lo + cdf.gather(1, tok[:, None])[:, 0]) / 2 / total[:, 0]).float()
                u[:, k] = torch.where(near, mid, u[:, k])
            prev = sample_from_probs(q, u[:, k])
            qs.append(q)
        toks.append(prev), confs.append(conf)
    return (torch.stack(toks, 1), torch.stack(qs, 1) if qs else None, torch.stack(confs, 1), u)


def fused(head, base, hidden, anchors, temperature=None, u=None):
    dev = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    toks, q, conf = ml.markov_loop(dev(base), dev(anchors), dev(head.markov_w1),
                                   dev(head.markov_w2), dev(hidden), dev(head.confidence.weight),
                                   dev(temperature), dev(u), greedy=temperature is None,
                                   block_v=BLOCK_V)
    return toks.cpu(), None if q is None else q.cpu(), conf.cpu()


@pytest.mark.parametrize("R", [1, 3])
@pytest.mark.parametrize("rank", [0, 8, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_tokens_and_confidences_equal_the_torch_path(R, rank, dtype):
    gen = torch.Generator().manual_seed(100 * R + rank)
    head, base, hidden, anchors = _case(gen, R, rank, dtype)
    want, _, want_conf, _ = oracle(head, base, hidden, anchors)
    toks, q, conf = fused(head, base, hidden, anchors)
    assert q is None
    assert toks.dtype == torch.int64 and torch.equal(toks, want)
    torch.testing.assert_close(conf, want_conf, rtol=1e-5, atol=1e-5)
    # the rows feed their tokens forward: the slots do not all repeat one token
    assert len(set(want.flatten().tolist())) > G * R // 2


def test_greedy_ties_take_the_first_index():
    """Slot k of row r has two exactly equal maxima (base equal, their W2 rows zero, so the
    bias is exactly 0 on both paths): in different V blocks, in one block, and at the edges of
    the row. The first index wins, as torch's argmax."""
    gen = torch.Generator().manual_seed(5)
    R = 3
    head, base, hidden, anchors = _case(gen, R, 8, torch.float32)
    pairs = [[(3, 70), (40, 41), (0, V - 1), (33, 64)],
             [(10, 90), (96, 99), (31, 32), (5, 6)],
             [(63, 64), (1, 2), (20, 95), (50, 85)]]
    for r in range(R):
        for k, (a, b) in enumerate(pairs[r]):
            head.markov_w2[[a, b]] = 0.0
            base[r, k, [a, b]] = 40.0
    want, _, _, _ = oracle(head, base, hidden, anchors)
    assert want.tolist() == [[a for a, _ in row] for row in pairs]
    assert torch.equal(fused(head, base, hidden, anchors)[0], want)


@pytest.mark.parametrize("R", [1, 3])
@pytest.mark.parametrize("rank", [0, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sampled_tokens_q_and_confidences_equal_the_torch_path(R, rank, dtype):
    """Temperatures 0.6 / 1.0 / 1.7 with T <= 0 rows among them (one-hot q at the argmax); u
    snapped away from the reference cdf boundaries, so every token must be the same."""
    gen = torch.Generator().manual_seed(7 + R + rank)
    temps = {1: [[1.0], [0.0]], 3: [[0.6, 0.0, 1.7], [-1.0, 1.0, 0.0]]}[R]
    draws = 0
    for trial, t in enumerate(temps):
        head, base, hidden, anchors = _case(gen, R, rank, dtype)
        temperature = torch.tensor(t)
        u = torch.rand(R, G, generator=gen)
        want, want_q, want_conf, u = oracle(head, base, hidden, anchors, temperature, u,
                                            snap=True)
        toks, q, conf = fused(head, base, hidden, anchors, temperature, u)
        assert torch.equal(toks, want), (trial, toks, want)
        torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(conf, want_conf, rtol=1e-5, atol=1e-5)
        greedy = temperature <= 0
        assert bool((q[greedy].amax(-1) == 1).all()) and bool((q[greedy].sum(-1) == 1).all())
        assert bool((q.gather(2, toks[..., None]) > 0).all())
        draws += int((~greedy).sum()) * G
    assert draws >= G


def test_sampled_token_follows_u_across_the_row():
    """One slot, u on a grid: the token is the first whose cdf exceeds u (the draw uses u, not
    some fixed index), and its count matches n·q within one for every token."""
    gen = torch.Generator().manual_seed(11)
    n = 200
    head = _head(gen, 8, torch.float32)
    base = (torch.randn(1, 1, V, generator=gen) * 0.5).expand(n, 1, V).contiguous()
    hidden = torch.randn(1, 1, D, generator=gen).expand(n, 1, D).contiguous()
    anchors = torch.full((n,), 17)
    u = ((torch.arange(n, dtype=torch.float32) + 0.5) / n)[:, None]
    toks, q, _ = fused(head, base, hidden, anchors, torch.full((n,), 1.0), u)
    counts = torch.bincount(toks[:, 0], minlength=V).double()
    assert float((counts - q[0, 0].double() * n).abs().max()) <= 1.01
    assert bool((toks[1:, 0] >= toks[:-1, 0]).all())     # monotone in u


def test_strided_and_bf16_inputs():
    """Base logits as a strided bf16 view and a bf16 hidden state: read as they are."""
    gen = torch.Generator().manual_seed(3)
    R = 3
    head, _, _, anchors = _case(gen, R, 8, torch.bfloat16)
    base = (torch.randn(G, R, V + 7, generator=gen) * 2).bfloat16().transpose(0, 1)[..., :V]
    hidden = torch.randn(R, G, D, generator=gen).bfloat16()
    want, _, want_conf, _ = oracle(head, base, hidden, anchors)
    toks, _, conf = fused(head, base, hidden, anchors)
    assert torch.equal(toks, want)
    torch.testing.assert_close(conf, want_conf, rtol=1e-5, atol=1e-5)


def test_supported_and_bad_inputs():
    assert ml.supported(512, 64) and ml.supported(1024, 32) and ml.supported(512, 0)
    assert not ml.supported(129280, 256) and not ml.supported(4096, 128)
    gen = torch.Generator().manual_seed(1)
    head, base, hidden, anchors = _case(gen, 2, 8, torch.float32)
    args = (base, anchors, head.markov_w1, head.markov_w2, hidden, head.confidence.weight)

    def call(*a, **k):
        return ml.markov_loop(*a, **k)
    with pytest.raises(ValueError, match="base logits"):
        call(base[0], *args[1:], greedy=True)
    with pytest.raises(ValueError, match="anchors"):
        call(base, anchors.float(), *args[2:], greedy=True)
    with pytest.raises(ValueError, match="W1 and W2"):
        call(base, anchors, head.markov_w1[:, :4], *args[3:], greedy=True)
    with pytest.raises(ValueError, match="confidence weight"):
        call(*args[:5], head.confidence.weight[:, 1:], greedy=True)
    with pytest.raises(ValueError, match="hidden"):
        call(*args[:4], hidden[:, 1:], args[5], greedy=True)
    with pytest.raises(ValueError, match="temperature"):
        call(*args, greedy=False)
    with pytest.raises(ValueError, match="u \\[R, γ\\]"):
        call(*args, torch.ones(2), torch.rand(2, G + 1))
    wide = torch.zeros(ml.MAX_VOCAB * 2, 8)
    with pytest.raises(ValueError, match="supported"):
        call(torch.zeros(2, G, wide.shape[0]), anchors, wide, wide, hidden,
             head.confidence.weight, greedy=True)


@pytest.mark.parametrize("rank", [0, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gumbel_tokens_are_the_per_step_gumbel_draws(rank, dtype):
    """gumbel=(seeds, starts) (deterministic mode's drafter): slot k's token is
    `spec.gumbel.gumbel_draws` of the slot's logits keyed by (seed, start + k + 1), greedy rows
    the argmax, no q; negative seeds and positions past 2**32 included."""
    from dspark.spec.gumbel import gumbel_draws
    gen = torch.Generator().manual_seed(11 + rank)
    R = 4
    head, base, hidden, anchors = _case(gen, R, rank, dtype)
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.6])
    seeds = torch.tensor([5, -7, 2 ** 40 + 3, 0])
    starts = torch.tensor([0, 9, 2 ** 33 - 2, 123])
    prev, want, want_conf = anchors, [], []
    for k in range(G):
        bias, conf = DSparkDrafter.markov_step(head, hidden[:, k].float(), prev)
        prev = gumbel_draws(base[:, k].float() + bias, temperature, None, None, seeds,
                            starts + k + 1)
        want.append(prev), want_conf.append(conf)
    d = lambda t: t.to(DEV)  # noqa: E731
    toks, q, conf = ml.markov_loop(d(base), d(anchors), d(head.markov_w1), d(head.markov_w2),
                                   d(hidden), d(head.confidence.weight), d(temperature),
                                   gumbel=(d(seeds), d(starts)), block_v=BLOCK_V)
    assert q is None
    assert toks.cpu().tolist() == torch.stack(want, 1).tolist()
    torch.testing.assert_close(conf.cpu(), torch.stack(want_conf, 1), rtol=1e-5, atol=1e-5)
    # the rows draw: a sampled row's slots are not its argmaxes throughout
    assert len(set(toks.cpu().flatten().tolist())) > G
