"""DSpark loop: greedy identity, exact sampling law, metrics, errors."""
import itertools
import random

import pytest
import torch

import dspark.spec.accept as accept_mod
from dspark import Engine, SamplingParams
from dspark.spec import verify as verify_mod


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])


def _engines(path, device="cpu", **kw):
    spec = Engine(path, device=device, dtype="fp32", kv_cache_dtype="fp32", **kw)
    off = Engine(path, device=device, dtype="fp32", kv_cache_dtype="fp32", speculative="none")
    return spec, off


def _prompts(n, vocab, seed):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


@pytest.mark.parametrize("ckpt", ["small_vocab_ckpt", "tiny_ckpt"])
def test_greedy_identity(ckpt, request):
    path = request.getfixturevalue(ckpt)
    spec, off = _engines(path)
    vocab = spec.cfg.vocab_size
    prompts = _prompts(6, vocab, seed=1)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = [o.token_ids for o in off.generate(prompts, sp)]
    together = spec.generate(prompts, sp)
    assert [o.token_ids for o in together] == ref
    one_by_one = [spec.generate(p, sp).token_ids for p in prompts[:3]]
    assert one_by_one == ref[:3]
    # a small token budget forces chunked prefill interleaved with verify blocks
    chunked, _ = _engines(path, max_num_batched_tokens=7, max_num_seqs=3)
    assert [o.token_ids for o in chunked.generate(prompts, sp)] == ref
    m = together[0].metrics
    if ckpt == "small_vocab_ckpt":     # 8 tokens: random drafts are accepted now and then
        assert sum(o.metrics.accepted for o in together) > 0


def test_metrics_are_consistent(small_vocab_ckpt):
    spec, _ = _engines(small_vocab_ckpt)
    outs = spec.generate(_prompts(4, 8, seed=2), SamplingParams(temperature=1.0, max_tokens=20,
                                                               ignore_eos=True))
    for o in outs:
        m = o.metrics
        m.check()
        assert m.accepted <= m.verified <= m.proposed
        assert len(o.token_ids) == 20 and o.finish_reason == "length"
        # every token after the first comes from a round: emitted = generated - 1
        assert m.emitted == len(o.token_ids) - 1
        assert abs(m.mean_accepted_length - m.emitted / m.rounds) < 1e-9


def test_stop_token_mid_block_ends_exactly_there(small_vocab_ckpt):
    spec, off = _engines(small_vocab_ckpt)
    p = [1, 2, 3, 4]
    free = off.generate(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)).token_ids
    stop = free[7]
    first = free.index(stop)
    for eng in (spec, off):
        out = eng.generate(p, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=(stop,),
                                             ignore_eos=True))
        assert out.token_ids == free[:first + 1] and out.finish_reason == "stop"
    for n in (1, 5, 9):
        out = spec.generate(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        assert out.token_ids == free[:n] and out.finish_reason == "length"
    assert not spec.requests and not spec.has_unfinished()


# ---- exact sampling distribution ---------------------------------------------------------

def _target_law(engine, prompt, steps, temperature):
    """Exact distribution of the first `steps` generated tokens under target-only sampling,
    by enumeration (vocab 8)."""
    law = {(): 1.0}
    for _ in range(steps):                     # expand the prefix tree one token at a time
        nxt = {}
        for seq, pr in law.items():
            probs = torch.softmax(engine.score(prompt + list(seq))[-1] / temperature, -1)
            for tok, q in enumerate(probs.tolist()):
                nxt[seq + (tok,)] = pr * q
        law = nxt
    return law


def _chi2_pvalue(counts, law, n):
    from scipy.stats import chi2
    # merge small-expectation cells so the chi-square approximation holds
    cells = sorted(law, key=law.get, reverse=True)
    stat, dof, rest_o, rest_e = 0.0, -1, 0, 0.0
    for c in cells:
        e = law[c] * n
        if e >= 5:
            stat += (counts.get(c, 0) - e) ** 2 / e
            dof += 1
        else:
            rest_o += counts.get(c, 0)
            rest_e += e
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / rest_e
        dof += 1
    return chi2.sf(stat, max(dof, 1))


def _sample_counts(engine, prompt, steps, temperature, n, **params):
    # max_tokens past `steps` so the first tokens come from full verify blocks (the engine clips
    # blocks to max_tokens), then count only the first `steps` tokens. A request is aborted as
    # soon as it has them: later rounds cannot change emitted tokens (per-request seeds, keyed by
    # position), so the counts are those of running every request to max_tokens, without the
    # ~40% of the work those later rounds cost
    sp = [SamplingParams(temperature=temperature, max_tokens=steps + 5, seed=s, ignore_eos=True,
                         **params) for s in range(n)]
    rids = [engine.add_request(prompt, p) for p in sp]
    first = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id not in first and len(o.token_ids) >= steps:
                first[o.request_id] = tuple(o.token_ids[:steps])
                if not o.finished:
                    assert engine.abort(o.request_id)
    assert not engine.requests and sorted(first) == sorted(rids)
    counts = {}
    for rid in rids:
        counts[first[rid]] = counts.get(first[rid], 0) + 1
    return counts


def _broken_verify(draft_tokens, draft_probs, target_probs, lengths, seeds, positions):
    """Skips the residual: after a rejection it resamples from p instead of max(0, p - q)."""
    res = verify_mod.verify(draft_tokens, draft_probs, target_probs, lengths, seeds, positions)
    rows = torch.arange(len(lengths))
    p = target_probs[rows, res.accepted]
    from dspark.sampling import Purpose, sample_from_probs, uniforms
    y = sample_from_probs(p, uniforms(seeds, positions + res.accepted + 1, Purpose.RESIDUAL))
    return verify_mod.VerifyResult(res.accepted, y)


def test_sampling_distribution_is_exact(small_vocab_ckpt, monkeypatch):
    spec, off = _engines(small_vocab_ckpt, max_num_seqs=512, max_num_batched_tokens=4096)
    prompt, steps, T, n = [3, 1, 4, 1, 5], 2, 1.0, 800
    law = _target_law(off, prompt, steps, T)
    counts = _sample_counts(spec, prompt, steps, T, n)
    assert _chi2_pvalue(counts, law, n) > 1e-3
    # the same test must reject a verifier that skips the residual distribution
    monkeypatch.setattr(accept_mod, "verify", _broken_verify)
    bad = _sample_counts(spec, prompt, steps, T, n)
    assert _chi2_pvalue(bad, law, n) < 1e-3


def _penalised_law(engine, prompt, steps, temperature, rep, freq, pres, bias):
    """Exact law of the first tokens under target-only sampling with penalties and logit_bias,
    by enumeration, the adjustments written out in NumPy (vLLM's definitions)."""
    import numpy as np
    law = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for seq, pr in law.items():
            x = engine.score(prompt + list(seq))[-1].double().numpy()
            seen = set(prompt) | set(seq)
            for t in seen:
                x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
            for t in set(seq):
                x[t] -= freq * seq.count(t) + pres
            for t, b in bias.items():
                x[t] += b
            q = np.exp((x - x.max()) / temperature)
            q /= q.sum()
            for tok, v in enumerate(q):
                nxt[seq + (tok,)] = pr * v
        law = nxt
    return law


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_sampling_distribution_is_exact_with_penalties_and_logit_bias(small_vocab_ckpt, device):
    """Penalties and logit_bias change the law; speculation must sample exactly the changed law
    (the drafter's steps and the target's rows both adjusted from their own history). On CUDA
    the fused sampling kernels take the adjusted logits."""
    spec, off = _engines(small_vocab_ckpt, device, max_num_seqs=512, max_num_batched_tokens=4096)
    prompt, steps, T, n = [3, 1, 4, 1, 5], 2, 1.0, 800
    kw = dict(repetition_penalty=1.8, frequency_penalty=0.7, presence_penalty=0.5,
              logit_bias={2: 1.5, 6: -2.0})
    law = _penalised_law(off, prompt, steps, T, 1.8, 0.7, 0.5, {2: 1.5, 6: -2.0})
    counts = _sample_counts(spec, prompt, steps, T, n, **kw)
    assert _chi2_pvalue(counts, law, n) > 1e-3
    # the test can tell: the unpenalised law is rejected by the same counts
    assert _chi2_pvalue(counts, _target_law(off, prompt, steps, T), n) < 1e-3


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_greedy_identity_with_adjustments(small_vocab_ckpt, device):
    """Greedy with penalties, bias, min_tokens and min_p: speculation emits exactly the tokens
    of target-only decoding, and min_tokens holds stop ids back."""
    spec, off = _engines(small_vocab_ckpt, device)
    prompts = _prompts(4, 8, seed=3)
    free = off.generate(prompts[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stop = free.token_ids[0]
    sp = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3,
                        frequency_penalty=0.4, presence_penalty=0.2, logit_bias={1: 0.8},
                        min_tokens=6, stop_token_ids=[stop], min_p=0.1)
    ref = off.generate(prompts, sp)
    got = spec.generate(prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert stop not in ref[0].token_ids[:6] and len(ref[0].token_ids) >= 6
    assert sum(o.metrics.verified for o in got) > 0


# ---- errors --------------------------------------------------------------------------------

def test_bad_configuration_errors(tiny_ckpt, tmp_path):
    with pytest.raises(ValueError, match="dspark_block_size=5"):
        Engine(tiny_ckpt, device="cpu", num_speculative_tokens=7)
    from dspark.tools.make_checkpoint import make_checkpoint
    plain = str(tmp_path / "plain")
    make_checkpoint(plain, preset="tiny", progress=False)
    with pytest.raises(ValueError, match="mtp"):
        Engine(plain, device="cpu", speculative="dspark")
    eng = Engine(plain, device="cpu", dtype="fp32", max_model_len=16)
    with pytest.raises(ValueError, match="empty prompt"):
        eng.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        eng.generate(list(range(20)), SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        eng.generate([1, 2], SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="tokenizer"):
        eng.generate("hello", SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.generate([1, 5000], SamplingParams())
    # a batch with one bad prompt is rejected whole and leaves nothing behind
    with pytest.raises(ValueError, match="empty prompt"):
        eng.generate([[1, 2], []], SamplingParams())
    assert not eng.requests and not eng.has_unfinished()
    # a bad request leaves the engine usable
    out = eng.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=3))
    assert len(out.token_ids) == 3


@pytest.mark.parametrize("ckpt", ["small_vocab_ckpt", "tiny_ckpt"])
def test_uniform_verify_width_keeps_greedy_identity(ckpt, request):
    """Where the runner replays uniform steps as graphs, every verify block of a round is fed to
    the round's widest ℓ (its own next drafts past ℓ): ragged policies (threshold) and budgets
    cut short by max_tokens then give uniform steps, and the output stays the target's own."""
    path = request.getfixturevalue(ckpt)
    spec, off = _engines(path, verify_policy="threshold", threshold=0.3)
    spec.runner.uniform_verify = True       # what a runner with target graphs says on CUDA
    steps = []
    forward = spec.runner.target_forward

    def recording(items, *a, **kw):
        running = {id(r.target_state) for r in spec.scheduler.running}
        steps.append([(len(t), id(st) in running) for st, _, t in items])
        return forward(items, *a, **kw)

    spec.runner.target_forward = recording
    padded = []
    lengths = spec._verify_lengths

    def verify_lengths(running):
        width = lengths(running)
        padded.extend(r.feed_len - r.verify_len for r in running)
        return width

    spec._verify_lengths = verify_lengths
    vocab = spec.cfg.vocab_size
    prompts = _prompts(5, vocab, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 14, 20, 17, 11)]
    ref = [o.token_ids for o in off.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == ref
    assert any(padded), "no block was padded: the test lost its purpose"
    verify_only = [s for s in steps if all(running for _, running in s) and len(s) > 1]
    assert verify_only and all(len({n for n, _ in s}) == 1 for s in verify_only)


def test_uniform_verify_width_is_the_fixed_policys_block(tiny_ckpt):
    """With the fixed policy every verify step carries γ + 1 tokens per request, also in the
    last rounds, where max_tokens leaves room for fewer drafts: one width, one set of graphs."""
    spec, off = _engines(tiny_ckpt)
    spec.runner.uniform_verify = True
    widths = []
    forward = spec.runner.target_forward

    def recording(items, *a, **kw):
        if all(st in {r.target_state for r in spec.scheduler.running} for st, _, _ in items):
            widths.extend(len(t) for _, _, t in items)
        return forward(items, *a, **kw)

    spec.runner.target_forward = recording
    prompts = _prompts(3, spec.cfg.vocab_size, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 9, 13)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == \
        [o.token_ids for o in off.generate(prompts, params)]
    assert widths and set(widths) == {spec.drafter.gamma + 1}


@pytest.mark.parametrize("policy,uniform", [("scheduled", False), ("scheduled-async", False),
                                            ("scheduled", True), ("scheduled-async", True)])
def test_sampling_distribution_is_exact_under_the_scheduler(small_vocab_ckpt, policy, uniform,
                                                            tmp_path, monkeypatch):
    """The SPS-scheduled policies at the default engine settings (SPS profiled on this CPU):
    whatever lengths they pick, the emitted tokens follow the target's law. uniform: the
    runner pads every round to one width (as the CUDA-graph steps do) and the policies pick one
    width per round, which a convex SPS makes vary with the load and the confidences."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))      # a fresh profile, not a shared one
    # (every B a bucket: SpsTable looks B up in the next bucket up, a step function); step time
    # convex in B, so the best width shrinks as more requests run
    kw = dict(sps_table=[[b, 10.0 + 1e-4 * b * b] for b in range(1, 513)]) if uniform else {}
    spec = Engine(small_vocab_ckpt, device="cpu", dtype="fp32", kv_cache_dtype="fp32",
                  verify_policy=policy, **kw)
    if uniform:
        spec.runner.uniform_verify = spec.policy.uniform = True
        # the width comes from earlier rounds on the host (host_width): never this round's read
        monkeypatch.setattr(type(spec.policy), "lengths", _never)
    off = Engine(small_vocab_ckpt, device="cpu", dtype="fp32", kv_cache_dtype="fp32",
                 speculative="none")
    prompt, steps, T, n = [3, 1, 4, 1, 5], 2, 1.0, 480
    law = _target_law(off, prompt, steps, T)
    spec.round_log = []
    counts = _sample_counts(spec, prompt, steps, T, n)
    assert _chi2_pvalue(counts, law, n) > 1e-3
    lengths = [ell for _, ell, _ in spec.round_log]
    assert len(lengths) >= n, "every request ran at least one speculative round"
    if uniform:
        assert len(set(lengths)) > 1, "the width never changed: the test lost its purpose"


def _never(*a, **k):
    raise AssertionError("the policy read this round's confidences")


# step time 1 ms + 0.2 ms per verify token: the best width shrinks with the load and with the
# drafter's confidences, so the scheduled policies' widths change from round to round
STEEP_SPS = [[b, 1.0 + 0.2 * b] for b in range(1, 257)]
READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def _reads_before_forward(eng, monkeypatch) -> list:
    """Per round with running requests: the tensor reads (on CUDA each a wait for the device)
    between the start of the round and its target forward, filled in as the engine steps."""
    counts, armed = [], [False]
    for name in READS:
        def read(self, *a, _fn=getattr(torch.Tensor, name), **k):
            if armed[0]:
                counts[-1] += 1
            return _fn(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, read)
    lengths, forward = eng._verify_lengths, eng.runner.target_forward

    def verify_lengths(running):
        if running:
            counts.append(0)
            armed[0] = True
        return lengths(running)

    def target_forward(*a, **k):
        armed[0] = False
        return forward(*a, **k)
    monkeypatch.setattr(eng, "_verify_lengths", verify_lengths)
    monkeypatch.setattr(eng.runner, "target_forward", target_forward)
    return counts


@pytest.mark.parametrize("policy,uniform", [("fixed", True), ("scheduled", True),
                                            ("scheduled-async", True), ("scheduled", False)])
def test_uniform_rounds_read_nothing_before_the_verify_launch(tiny_ckpt, policy, uniform,
                                                              monkeypatch):
    """Where rounds replay as uniform graph steps fed the drafts as device tensors (the V4
    target graphs on CUDA), nothing from a round's start to its target forward reads the
    device, which would wait for the draft pass still running: the fixed ℓ is known on the host,
    and the scheduled policies take the width from earlier rounds' survivals (host_width).
    uniform=False: the scheduled policy reads this round's confidences (the test can tell)."""
    kw = {} if policy == "fixed" else dict(sps_table=STEEP_SPS)
    eng = Engine(tiny_ckpt, device="cpu", dtype="fp32", kv_cache_dtype="fp32", max_num_seqs=4,
                 verify_policy=policy, **kw)
    eng.runner.uniform_verify = True
    if policy != "fixed":
        eng.policy.uniform = uniform
    monkeypatch.setattr(type(eng.runner), "takes_device_tokens", True)
    prompts = _prompts(4, eng.cfg.vocab_size, seed=7)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in eng.generate(prompts, sp)]   # host buffers grown to this load
    counts = _reads_before_forward(eng, monkeypatch)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == want
    assert counts and (not any(counts) if uniform else all(counts)), counts


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_uniform_widths_may_change_every_round(tiny_ckpt, temperature, monkeypatch):
    """The scheduled policies' width may be any of 0..γ and change every round (0: every
    running request decodes one token): each verify step feeds width + 1 tokens per request
    (fewer only where max_tokens leaves less room: never here), and greedy output stays the
    target's own."""
    spec, off = _engines(tiny_ckpt, verify_policy="scheduled", sps_table=STEEP_SPS,
                         max_num_seqs=3)
    spec.runner.uniform_verify = spec.policy.uniform = True
    g = spec.drafter.gamma
    script = itertools.cycle([0, g, 1, 0, 3, g, 2, g - 1, 0])
    chosen, fed = [], []
    host_width = spec.policy.host_width

    def scripted(ids, positions, conf):
        host_width(ids, positions, conf)
        chosen.append(next(script))
        return chosen[-1]
    monkeypatch.setattr(spec.policy, "host_width", scripted)
    forward = spec.runner.target_forward

    def recording(items, *a, **kw):
        running = {r.target_state for r in spec.scheduler.running}
        fed.append((len(chosen), {len(t) for st, _, t in items if st in running}))
        return forward(items, *a, **kw)
    monkeypatch.setattr(spec.runner, "target_forward", recording)
    prompts = _prompts(5, spec.cfg.vocab_size, seed=9)
    params = [SamplingParams(temperature=temperature, max_tokens=40, ignore_eos=True, seed=i)
              for i in range(5)]
    outs = spec.generate(prompts, params)
    assert all(len(o.token_ids) == 40 for o in outs)
    if temperature == 0:
        assert [o.token_ids for o in outs] == [o.token_ids for o in off.generate(prompts, params)]
    steps = [(chosen[n - 1], widths) for n, widths in fed if widths]
    assert {0, 1, g} <= {w for w, _ in steps}
    assert all(widths == {w + 1} for w, widths in steps), steps


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_short_prompts_ride_in_uniform_steps(tiny_ckpt, temperature):
    """Where the runner replays uniform steps, a short prompt is fed one round width per step
    next to the verify blocks, its last chunk padded (Scheduler.schedule), so no step of short
    prompts is ragged (eager on CUDA). Tokens (greedy, and seeded sampling: draws are keyed by
    position) and prompt logprobs equal the same engine's with whole-prompt prefills."""
    outs, steps = {}, []
    vocab = None
    for uniform in (False, True):
        eng = Engine(tiny_ckpt, device="cpu", dtype="fp32", kv_cache_dtype="fp32", max_num_seqs=3)
        eng.runner.uniform_verify = uniform
        forward = eng.runner.target_forward

        def recording(items, *a, _steps=steps if uniform else [], _eng=eng, **kw):
            waiting = {r.target_state for r in _eng.scheduler.waiting}
            _steps.append([(len(t), st in waiting) for st, _, t in items])
            return forward(items, *a, **kw)

        eng.runner.target_forward = recording
        vocab = eng.cfg.vocab_size
        prompts = _prompts(5, vocab, seed=11) + [[3] * 40]     # the last: 7 chunks of 6
        params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=i,
                                 prompt_logprobs=1)
                  for i, n in enumerate((7, 12, 5, 16, 9, 6))]
        res = eng.generate(prompts, params)
        outs[uniform] = [(o.token_ids, [None if lp is None else sorted(lp) for lp in o.prompt_logprobs],
                          [None if lp is None else [round(v.logprob, 4) for v in lp.values()]
                           for lp in o.prompt_logprobs]) for o in res]
    assert [o[:2] for o in outs[True]] == [o[:2] for o in outs[False]]
    for (_, _, a), (_, _, b) in zip(outs[True], outs[False]):
        assert a[0] is None and b[0] is None
        assert all(x == pytest.approx(y, abs=1e-3) for x, y in zip(a[1:], b[1:]))
    width = eng.drafter.gamma + 1
    assert all(len({n for n, _ in s}) == 1 and s[0][0] == width for s in steps), steps
    assert any(any(p for _, p in s) and not all(p for _, p in s) for s in steps), \
        "no step carried a prompt chunk next to a verify block"
