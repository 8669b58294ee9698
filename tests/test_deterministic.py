"""Deterministic mode (EngineConfig.deterministic): a request's tokens and logits do not depend on
its batch, its chunking, speculation, the verify policy or preemption; the Gumbel-max sampler
keyed by (seed, position) has exactly the target's law."""
import contextlib
import math
import random

import pytest
import torch

from dspark import Engine, EngineConfig, SamplingParams
from dspark.engine_config import EngineConfigError
from dspark.request import DraftBlock, Request
from dspark.sampling import probs_from_logits
from dspark.spec.accept import decide
from dspark.spec.gumbel import gumbel_noise, gumbel_token

SHIPPED = "dspark/assets/default"
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])


# ---- the sampler --------------------------------------------------------------------------

def _chi2_pvalue(counts, probs, n):
    from scipy.stats import chi2
    stat, dof, rest_o, rest_e = 0.0, -1, 0, 0.0
    for cell, p in probs.items():
        e = p * n
        if e >= 5:
            stat += (counts.get(cell, 0) - e) ** 2 / e
            dof += 1
        else:
            rest_o, rest_e = rest_o + counts.get(cell, 0), rest_e + e
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / rest_e
        dof += 1
    return chi2.sf(stat, max(dof, 1))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (1.3, 3, 1.0), (0.7, 0, 0.8),
                                                     (1.0, 5, 0.9)])
def test_gumbel_token_has_the_law_of_probs_from_logits(temperature, top_k, top_p):
    """Pairs of tokens at consecutive positions of many seeds: the joint law is the product of
    the two rows' laws (each exactly probs_from_logits', so top-k / top-p drop the same
    tokens, and consecutive positions are independent)."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(2, 8, generator=gen) * 1.5
    law = probs_from_logits(rows, torch.full((2,), temperature), torch.full((2,), top_k),
                            torch.full((2,), top_p)).double()
    probs = {(a, b): float(law[0, a] * law[1, b]) for a in range(8) for b in range(8)}
    n, counts = 3000, {}
    for s in range(n):
        seed, pos = s * 7919 - 3000, 11 + s % 5
        a = int(gumbel_token(rows[0], temperature, top_k, top_p, seed, pos))
        b = int(gumbel_token(rows[1], temperature, top_k, top_p, seed, pos + 1))
        counts[a, b] = counts.get((a, b), 0) + 1
    assert all(law[0, a] > 0 and law[1, b] > 0 for a, b in counts)     # filtered: never drawn
    assert _chi2_pvalue(counts, probs, n) > 1e-4


def test_gumbel_noise_is_standard_gumbel_and_keyed():
    g = torch.cat([gumbel_noise(seed, 5, 4096) for seed in range(8)])
    assert abs(g.mean().item() - 0.5772156649) < 0.03       # Euler-Mascheroni
    assert abs(g.std().item() - math.pi / math.sqrt(6)) < 0.03
    assert torch.equal(gumbel_noise(-1, 7, 64), gumbel_noise(-1, 7, 64))
    assert not torch.equal(gumbel_noise(1, 7, 64), gumbel_noise(1, 8, 64))
    assert not torch.equal(gumbel_noise(1, 7, 64), gumbel_noise(2, 7, 64))
    assert torch.isfinite(g).all()


def _request(rid, seed, params, drafts=None):
    req = Request(rid, [1, 2, 3], params, seed)
    if drafts is not None:
        req.draft = DraftBlock(torch.tensor(drafts), None, torch.zeros(len(drafts)))
    return req


def test_batched_gumbel_draws_are_the_per_row_draws():
    """`gumbel_draws` (the draft pass's device-side sampler: no host values, so a CUDA graph can
    hold it) keys each row exactly as `gumbel_token` does (negative seeds, positions past 2**32
    included) and draws the same tokens, with greedy rows and per-row top-k / top-p."""
    from dspark.spec.gumbel import _key, gumbel_draws
    torch.manual_seed(0)
    seeds = [7, -4, 2 ** 40 + 3, 0, 123, -(2 ** 62)]
    positions = [5, 0, 2 ** 33 + 1, 17, 64, 3]
    temps, top_k, top_p = [1.0, 0.0, 0.7, 1.3, 1.0, 2.0], [0, 0, 5, 0, 3, 0], [1.0, 1.0, 1.0, 0.8, 1.0, 0.9]
    st, pt = torch.tensor(seeds), torch.tensor(positions)
    assert _key(st, pt).tolist() == [_key(s & (2 ** 64 - 1), p) for s, p in zip(seeds, positions)]
    for trial in range(20):
        rows = torch.randn(6, 50) * 3
        got = gumbel_draws(rows, torch.tensor(temps), torch.tensor(top_k), torch.tensor(top_p),
                           st, pt)
        want = [int(gumbel_token(rows[i], temps[i], top_k[i], top_p[i], seeds[i], positions[i]))
                for i in range(6)]
        assert got.tolist() == want, trial


def test_verify_emits_plain_decodings_tokens():
    """decide(deterministic) on random logits: a verify block accepts exactly the leading drafts
    equal to the tokens plain decoding draws at those positions and then emits plain decoding's
    next token, whatever the drafts and ℓ; greedy, sampled and filtered requests in one batch."""
    gen = torch.Generator().manual_seed(0)
    V, g = 16, 4
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=5),
              SamplingParams(temperature=0.8, top_k=4, top_p=0.9, seed=6),
              SamplingParams(temperature=1.0, seed=7)]
    rng = random.Random(1)
    for trial in range(6):
        logits = torch.randn(len(params) * (g + 1), V, generator=gen) * 2
        anchors = [rng.randrange(3, 40) for _ in params]
        plain = []                 # what plain decoding draws from each row, position by position
        for i, (sp, P) in enumerate(zip(params, anchors)):
            plain.append([int(gumbel_token(logits[i * (g + 1) + j], sp.temperature, sp.top_k,
                                           sp.top_p, sp.seed or 0, P + 1 + j))
                          for j in range(g + 1)])
        reqs, lengths = [], []
        for i, sp in enumerate(params):
            n = rng.randrange(0, g + 1)
            right = rng.randrange(0, n + 1)        # drafts equal to plain's up to `right`
            drafts = plain[i][:g]
            drafts = drafts[:right] + [(t + 1) % V for t in drafts[right:]]
            reqs.append(_request(str(i), sp.seed or 0, sp, drafts)), lengths.append(n)
        dec = decide(reqs, logits, [i * (g + 1) for i in range(len(params))], lengths, anchors,
                     g, deterministic=True)
        for i, (a, y) in enumerate(dec.head.tolist()):
            want_a = 0
            while want_a < lengths[i] and reqs[i].draft.tokens[want_a] == plain[i][want_a]:
                want_a += 1
            assert (a, y) == (want_a, plain[i][want_a]), (trial, i)
        # a plain decode step of the same rows (no drafts) draws the same first tokens
        rows = [i * (g + 1) for i in range(len(params))]
        plain_step = decide([_request(str(i), sp.seed or 0, sp) for i, sp in enumerate(params)],
                            logits[rows], list(range(len(params))), [0] * len(params), anchors,
                            1, deterministic=True)
        assert plain_step.head[:, 1].tolist() == [p[0] for p in plain]


def test_batched_acceptance_equals_the_per_row_acceptance():
    """The CUDA path of decide(deterministic): every request without filters or adjustments
    decided by one `gumbel_draws` over all the round's rows (rows past ℓ padded) gives the
    [a, y] of the per-row path, for any ℓ, drafts right up to any point, greedy and sampled
    requests mixed (here on CPU, where the two can differ only in a noise value's last bit);
    an all-greedy round takes decide's greedy path, with the same a and y."""
    from dspark.spec.accept import _gumbel_heads_batched, decide_gumbel
    gen = torch.Generator().manual_seed(3)
    V, g = 64, 5
    mixed = [SamplingParams(temperature=t, seed=s)
             for t, s in [(0, 1), (1.0, 2), (0.7, -3), (1.3, 2 ** 40), (1.0, 9)]]
    greedy = [SamplingParams(temperature=0, seed=s) for s in range(3)]   # argmaxes only
    rng = random.Random(4)
    for trial in range(10):
        params = mixed if trial % 2 else greedy
        logits = torch.randn(len(params) * (g + 1), V, generator=gen) * 3
        anchors = [rng.randrange(0, 3000) for _ in params]
        reqs, lengths = [], []
        for i, sp in enumerate(params):
            n = rng.randrange(0, g + 1)
            plain = [int(gumbel_token(logits[i * (g + 1) + j], sp.temperature, 0, 1.0, sp.seed,
                                      anchors[i] + 1 + j)) for j in range(g)]
            right = rng.randrange(0, g + 1)
            drafts = plain[:right] + [(t + 1) % V for t in plain[right:]]
            reqs.append(_request(str(i), sp.seed, sp, drafts)), lengths.append(n)
        first = [i * (g + 1) for i in range(len(params))]
        want = decide_gumbel(reqs, logits, first, lengths, anchors, g).head
        drafts = torch.stack([r.draft.tokens for r in reqs])
        got = _gumbel_heads_batched(reqs, logits, first, lengths, anchors, drafts,
                                    list(range(len(reqs))), g)
        assert got.tolist() == want.tolist(), trial
        # what the engine's decide gives (greedy rounds: the greedy layout, the same a and y)
        dec = decide(reqs, logits, first, lengths, anchors, g, deterministic=True)
        assert torch.stack(dec.accepted_next(), 1).tolist() == want.tolist(), trial


# ---- the engine ---------------------------------------------------------------------------

def _params(n):
    """Alternating greedy / seeded T=1 requests; logprobs: the raw logits' log-softmax of every
    emitted token, so equal logprobs mean bit-equal target logits at every emitted position."""
    return [SamplingParams(temperature=0 if i % 2 == 0 else 1.0, seed=100 + i, max_tokens=7,
                           ignore_eos=True, logprobs=1) for i in range(n)]


def _outputs(outs):
    return [(o.token_ids, [[(t, lp.logprob) for t, lp in sorted(d.items())] for d in
                           o.outputs[0].logprobs]) for o in outs]


def _engine(path, device, **kw):
    return Engine(path, device=device, dtype="fp32", deterministic=True, **kw)


def _invariance(path, device, lengths, configs, seed=0):
    eng = _engine(path, device, speculative="none")
    rng = random.Random(seed)
    V = eng.cfg.vocab_size
    prompts = [[rng.randrange(3, V) for _ in range(n)] for n in lengths]
    params = _params(len(prompts))
    alone = _outputs([eng.generate(p, sp) for p, sp in zip(prompts, params)])
    for kw in configs:
        got = _outputs(_engine(path, device, **kw).generate(prompts, params))
        for i in range(len(prompts)):
            assert got[i] == alone[i], (kw, i, lengths[i])
    return alone


# batched with speculation off / on under every verify policy, chunked prefills interleaved
# with verify blocks (at most 3 requests per round), the dense per-request layout
SPS = [[1, 1.0], [8, 1.2], [64, 2.0]]
CONFIGS = [dict(speculative="none", kv_layout="dense"),
           dict(speculative="none", overlap_decode=True),
           dict(max_num_batched_tokens=7, max_num_seqs=2),
           dict(verify_policy="threshold", threshold=0.5),
           dict(verify_policy="scheduled", sps_table=SPS),
           dict(verify_policy="scheduled-async", sps_table=SPS)]


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_tiny_checkpoint_batched_alone_chunked_speculative_agree(tiny_ckpt, device):
    """Random tiny checkpoint (every layer type, window 8, compression 4 and 16), fp8 KV cache:
    prompts of 1-19 tokens, greedy and seeded T=1 in one batch."""
    # on CUDA the dense layout attends with the torch reference and the paged one with the
    # Triton kernels: two implementations, each invariant on its own, not equal to each other
    # (the guarantee is per engine configuration, README "Deterministic mode")
    configs = CONFIGS if device == "cpu" else [c for c in CONFIGS if c.get("kv_layout") != "dense"]
    _invariance(tiny_ckpt, device, [1, 6, 19], configs)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_shipped_pair_batched_alone_chunked_speculative_agree(device):
    """The shipped pair (window 128, compression 4 and 128), fp8 KV cache: a prompt past the
    window and the first 128-token compressed entry among short ones, chunked, with speculation
    off and under every verify policy (CPU); on CUDA 16 prompts, chunked and in batches of 16
    with speculation on and off."""
    configs = [dict(max_num_batched_tokens=16, max_num_seqs=2)]
    lengths = [2, 17, 133]
    if device == "cpu":
        configs += [c for c in CONFIGS if c.get("kv_layout") != "dense"
                    and "max_num_batched_tokens" not in c]
    else:               # batches of 16 (graph buckets up to 16), speculation on and off
        lengths += [1, 3, 5, 8, 9, 30, 64, 100, 127, 128, 129, 200, 250]
        configs += [dict(max_num_seqs=16), dict(max_num_seqs=16, speculative="none")]
    _invariance(SHIPPED, device, lengths, configs)


@pytest.fixture(scope="module")
def three_layer_ckpt(tmp_path_factory):
    """The tiny architecture cut to its first three layers (window, compression 4 and 16), vocab
    8: a quarter of the one-token forwards' time for the long prompts preemption needs."""
    from dspark.tools.make_checkpoint import make_checkpoint
    out = str(tmp_path_factory.mktemp("tiny3"))
    make_checkpoint(out, preset="tiny", layers=3, seed=4, dspark=True, vocab=8, progress=False)
    return out


@pytest.mark.slow
def test_preemption_and_recompute_change_nothing(three_layer_ckpt):
    """Two requests crossing into their second 256-token page in a 2-page cache: one is
    preempted and recomputed from its tokens; both still equal their runs alone."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=8, ignore_eos=True, logprobs=0)
              for s in (1, 2)]
    prompts = [[3, 5, 7] * 83 + [2], [6, 4] * 125 + [1, 2, 3]]         # 250, 253 tokens
    ref = _engine(three_layer_ckpt, "cpu", speculative="none")
    alone = _outputs([ref.generate(p, sp) for p, sp in zip(prompts, params)])
    eng = _engine(three_layer_ckpt, "cpu", num_kv_blocks=2, max_num_seqs=2)
    assert _outputs(eng.generate(prompts, params)) == alone
    assert eng.scheduler.num_preemptions > 0, "the cache was sized to force preemption"


@pytest.mark.slow
def test_shipped_pair_preemption_changes_nothing():
    """The shipped pair with the default fp8 cache: two requests crossing into their second
    256-token page of a 2-page cache; one is preempted and recomputed, both equal their runs
    alone (speculation on, greedy and seeded T=1)."""
    params = [SamplingParams(temperature=t, seed=s, max_tokens=8, ignore_eos=True, logprobs=0)
              for t, s in ((0.0, 1), (1.0, 2))]
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (250, 253)]
    alone = _outputs([_engine(SHIPPED, "cpu", speculative="none").generate(p, sp)
                      for p, sp in zip(prompts, params)])
    eng = _engine(SHIPPED, "cpu", num_kv_blocks=2, max_num_seqs=2)
    assert _outputs(eng.generate(prompts, params)) == alone
    assert eng.scheduler.num_preemptions > 0, "the cache was sized to force preemption"


def test_tokens_are_the_gumbel_draws_of_the_scored_logits(small_vocab_ckpt):
    """Every emitted token is gumbel_token of the target's logits row before it, keyed by the
    request's seed and the token's position (score() recomputes the rows), also with top-k /
    top-p: the engine wires the sampler as documented, under speculation."""
    eng = _engine(small_vocab_ckpt, "cpu")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 0, 1], [3]]
    params = [SamplingParams(temperature=1.0, seed=9, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=4, top_p=0.9, seed=-4, max_tokens=8,
                             ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    outs = eng.generate(prompts, params)
    for prompt, sp, out in zip(prompts, params, outs):
        rows = eng.score(prompt + out.token_ids[:-1])
        for i, tok in enumerate(out.token_ids):
            pos = len(prompt) + i
            assert tok == int(gumbel_token(rows[pos - 1], sp.temperature, sp.top_k, sp.top_p,
                                           sp.seed or 0, pos))
    assert sum(o.metrics.accepted for o in outs) > 0       # some tokens came from accepted drafts


def _cache_records(cache) -> list:
    """Every persistent record of a paged cache: window rings (not the staging pages, scratch
    of one forward), compressed entries, indexer keys, compressor rings."""
    rings = cache.num_slots if cache.fp8 else cache.num_slots * cache.capacity
    return ([t[:rings] for t in cache.swa.values()] + list(cache.entries.values())
            + list(cache.index_keys.values()) + [t for pair in cache.comp_rows.values()
                                                 for t in pair])


@pytest.mark.parametrize("split", ["verify", "chunked"])
def test_one_forward_writes_the_records_of_single_token_steps(tiny_ckpt, split):
    """A verify block of 5 tokens at positions 14-18 (split="verify": it completes a ratio-4 and
    the first ratio-16 entry) or a 21-token prefill (split="chunked", as chunks of 5) in one
    forward gives the logits and the cache records (fp8 window rows, compressed entries,
    indexer keys, compressor rows) of the same tokens fed one by one."""
    block = [7, 8, 9, 10, 11]
    prompt = list(range(3, 17)) if split == "verify" else list(range(3, 24))
    engines = [_engine(tiny_ckpt, "cpu", speculative="none", max_num_seqs=2) for _ in range(2)]
    got = []
    for k, eng in enumerate(engines):
        run = eng.runner.target_forward
        eng.cache.add_request("r")
        eng.cache.reserve("r", len(prompt) + len(block))
        if split == "chunked":
            chunks = [prompt] if k == 0 else [prompt[i:i + 5] for i in range(0, len(prompt), 5)]
            starts = [0] if k == 0 else list(range(0, len(prompt), 5))
        else:
            run([("r", 0, prompt)])
            chunks = [block] if k == 0 else [[t] for t in block]
            starts = [len(prompt) + i * len(c) for i, c in enumerate(chunks)]
        got.append(torch.cat([run([("r", s, c)])[0] for s, c in zip(starts, chunks)]))
    assert torch.equal(got[0], got[1])
    a, b = (_cache_records(e.cache) for e in engines)
    assert len(a) > 10 and all(torch.equal(x, y) for x, y in zip(a, b))
    assert any(x.any() for x in a[len(engines[0].cache.swa):])     # entries were written


def test_token_serial_logits_match_the_batched_forward(tiny_ckpt):
    """The deterministic forward computes the same model: its logits equal the default batched
    forward's up to rounding (fp32 weights and cache)."""
    ids = list(range(3, 40))
    det = _engine(tiny_ckpt, "cpu", kv_cache_dtype="fp32").score(ids)
    ref = Engine(tiny_ckpt, device="cpu", dtype="fp32", kv_cache_dtype="fp32").score(ids)
    torch.testing.assert_close(det, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("setting", [dict(tensor_parallel_size=2)])
def test_settings_deterministic_mode_cannot_honour_fail_at_construction(setting):
    name = next(iter(setting))
    with pytest.raises(EngineConfigError, match=f"{name}.*deterministic"):
        EngineConfig(deterministic=True, **setting)
    EngineConfig(deterministic=False, **setting)             # fine without the mode


def test_deterministic_must_be_a_bool():
    with pytest.raises(EngineConfigError, match="deterministic=1 .*True or False"):
        EngineConfig(deterministic=1)


def test_deterministic_mode_rejects_a_qwen3_checkpoint(tmp_path):
    from dspark.tools.make_qwen3_checkpoint import make_qwen3_checkpoint
    make_qwen3_checkpoint(str(tmp_path), "tiny", "target", dtype="fp32", seed=1, vocab=8)
    with pytest.raises(EngineConfigError, match="deterministic=True .*DeepSeek-V4.*Qwen3"):
        Engine(str(tmp_path), device="cpu", deterministic=True)


def test_sps_profile_cache_keys_tell_the_mode_apart():
    """The scheduled policies' SPS profile is cached on disk per engine setup: a deterministic
    engine's step costs (one-token forwards) must never be read by a default engine."""
    from dspark.spec.profile import cache_key
    assert cache_key(_engine(SHIPPED, "cpu")) != cache_key(Engine(SHIPPED, device="cpu",
                                                                  dtype="fp32"))


def test_bench_runs_both_engines_deterministic(tmp_path, capsys):
    """`python -m dspark.bench --deterministic`: both engines built with deterministic=True."""
    from dspark.bench.__main__ import main
    built = []

    class Recording(Engine):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            built.append(self.config.deterministic)

    import dspark.bench.__main__ as bench
    real, bench.Engine = bench.Engine, Recording
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "def f(x):"}\n{"prompt": "import os"}\n')
    try:
        main(["--quick", "--deterministic", "--dataset", str(data), "--max-tokens", "4",
              "--device", "cpu", "--json", str(tmp_path / "r.json")])
    finally:
        bench.Engine = real
    assert built == [True, True]
    assert "deterministic" in capsys.readouterr().err


@pytest.fixture(scope="module")
def flash_width_ckpt(tmp_path_factory):
    """V4-Flash widths (hidden 4096, 64 heads, vocab 129280), 4 layers (window, window, CSA,
    HCA), FP8 weights + FP4 experts (16 of them, to keep it to ~4.5 GiB), DSpark stages."""
    from dspark.tools.make_checkpoint import make_checkpoint
    out = str(tmp_path_factory.mktemp("flash4"))
    make_checkpoint(out, preset="flash", layers=4, seed=7, dtype="fp8", fp4_experts=True,
                    dspark=True, overrides={"n_routed_experts": 16}, progress=False)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_width_batches_of_16_agree_on_cuda(flash_width_ckpt):
    """16 requests of 1-300 tokens on the H200 (quantized weights, fp8 cache, default attention
    backend): batched with speculation == each alone without it == chunked, greedy and T=1."""
    rng = random.Random(5)
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 129, 130, 144, 200, 233, 300]
    prompts = [[rng.randrange(3, 129280) for _ in range(n)] for n in lengths]
    params = _params(len(prompts))
    kw = dict(device="cuda", dtype="bf16", deterministic=True)
    ref = Engine(flash_width_ckpt, speculative="none", **kw)
    alone = _outputs([ref.generate(p, sp) for p, sp in zip(prompts, params)])
    del ref
    for cfg in (dict(max_num_seqs=16), dict(max_num_seqs=16, max_num_batched_tokens=64),
                dict(max_num_seqs=16, speculative="none")):
        eng = Engine(flash_width_ckpt, **cfg, **kw)
        got = _outputs(eng.generate(prompts, params))
        assert got == alone, cfg
        del eng
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_width_rows_are_batch_invariant_module_by_module(flash_width_ckpt):
    """Request A's prompt rows (one piece of q_max = 8 tokens) in one deterministic step alone,
    next to two other pieces at the same context (another batch bucket), and next to a piece at
    position 25 q_max (another page bucket): every block's input, its MoE's input and output,
    the block's output and the logits have the same bits in the three steps. The fixed-shape steps run eagerly
    (capture off) with the mode's kernels, so module hooks see them; on a failure the message
    names the first module that differs and in which step."""
    eng = Engine(flash_width_ckpt, device="cuda", dtype="bf16", deterministic=True,
                 speculative="none", max_num_seqs=8)
    r = eng.runner
    r.target_graphs.capture = False
    n = r.target_graphs.qmax                    # tokens per piece
    seen = []                                   # (module name, rows of A) in call order

    def record(name, pick):
        def hook(mod, args, out=None):
            seen.append((name, pick(args, out)[:n].clone()))
        return hook

    for i, blk in enumerate(r.model.layers):
        blk.register_forward_pre_hook(record(f"layer {i} input", lambda a, o: a[0]))
        blk.ffn.register_forward_pre_hook(record(f"layer {i} moe input", lambda a, o: a[0]))
        blk.ffn.register_forward_hook(record(f"layer {i} moe output", lambda a, o: o))
        blk.register_forward_hook(record(f"layer {i} output", lambda a, o: o))
    rng = random.Random(3)
    toks = lambda k: [rng.randrange(3, eng.cfg.vocab_size) for _ in range(k)]  # noqa: E731
    a, c, d, long = toks(n), toks(n), toks(n), toks(26 * n)

    def step(items):
        for rid, start, t in items:
            if not eng.cache.has_request(rid):
                eng.cache.add_request(rid)
            eng.cache.reserve(rid, start + len(t) + 1)
        del seen[:]
        logits, _ = r.target_forward(items)
        return list(seen) + [("logits", logits[:n].clone())]

    alone = step([("A", 0, a)])
    others = step([("A2", 0, a), ("C", 0, c), ("D", 0, d)])
    step([("L", 0, long[:25 * n])])                    # L's context, in 25 pieces
    far = step([("A3", 0, a), ("L", 25 * n, long[25 * n:])])
    diffs = []
    for tag, got in (("next to two pieces", others), (f"next to a piece at {25 * n}", far)):
        assert [n for n, _ in got] == [n for n, _ in alone]
        bad = [n for (n, x), (_, y) in zip(got, alone) if not torch.equal(x, y)]
        if bad:
            diffs.append(f"{tag}: first {bad[0]} ({len(bad)} of {len(alone)} differ)")
    assert not diffs, "; ".join(diffs)


def _graph_path_engine(path, monkeypatch, uniform: bool):
    """A CPU deterministic engine; uniform: on the target-graph path (`_invariant_forward`), its
    fixed-shape steps run eagerly with the torch kernels (q_max = the cache's lookahead + 1)."""
    from dspark.models.deepseek_v4.graph import V4DecodeGraphs
    eng = _engine(path, "cpu", max_num_seqs=4)
    r = eng.runner
    if uniform:
        r.target_graphs = V4DecodeGraphs(r.model, eng.cache, "torch", max_batch=3,
                                         q_lens=range(1, eng.cache.lookahead + 2),
                                         tap_layers=r.tap_layers, capture=False)
        r.token_serial = False
        monkeypatch.setattr(r, "_kernels", contextlib.nullcontext)
    return eng


def test_the_graph_path_feeds_each_request_as_uniform_pieces(three_layer_ckpt, monkeypatch):
    """Deterministic mode on the target-graph path (`ModelRunner._invariant_forward`, CUDA's):
    a ragged forward (prompts of 1, 9 and 20 tokens: pieces of up to q_max = 7) runs as uniform
    steps, piece k of every request in step k, and returns the eager forward's logits for the
    asked rows in flat order and its taps for every row. Here the fixed-
    shape step runs eagerly on CPU with the torch kernels (the products at CPU speed: the logic,
    not the batch invariance, is under test; that needs the GPU's kernels)."""
    from dspark.models.step_graphs import StepGraphs

    def engine(uniform: bool):
        return _graph_path_engine(three_layer_ckpt, monkeypatch, uniform)

    steps = []
    real_run = StepGraphs.run

    def recording(self, items, snapshot=True):
        steps.append([(rid, start, len(t)) for rid, start, t in items])
        return real_run(self, items, snapshot)

    monkeypatch.setattr(StepGraphs, "run", recording)
    prompts = {"a": [3], "b": [5, 6, 7, 1, 2, 0, 4, 4, 1], "c": [2, 7, 1, 3] * 5}
    rows = [0, 3, 9, 12, 29, 3]               # flat rows (b's 3rd twice), out of order
    got = []
    for uniform in (False, True):
        eng = engine(uniform)
        for rid, p in prompts.items():
            eng.cache.add_request(rid)
            eng.cache.reserve(rid, len(p) + 1)
        items = [(rid, 0, p) for rid, p in prompts.items()]
        logits, taps = eng.runner.target_forward(items, logit_rows=rows)
        got.append((logits, taps))
    q = engine(True).runner.target_graphs.qmax
    assert q == 7
    assert steps == [[("a", 0, 1)], [("b", 0, 7), ("c", 0, 7)],
                     [("b", 7, 2)], [("c", 7, 7)], [("c", 14, 6)]]
    # (c's later pieces read the records its earlier ones wrote: their rows check those too)
    (l0, t0), (l1, t1) = got
    assert l1.shape == (len(rows), l0.shape[1]) and t1.shape == t0.shape == (30, t0.shape[1])
    torch.testing.assert_close(l1, l0, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(t1, t0, rtol=1e-4, atol=1e-4)


def test_a_uniform_forward_is_one_graph_step(three_layer_ckpt, monkeypatch):
    """Items that are one uniform step already (a decode / verify round: every request the same
    number of tokens, at most q_max) go to the target graphs as they are, in one step, and the
    asked rows (out of order, one twice) and every row's taps come back as the eager forward's.
    The fixed-shape step runs eagerly on CPU with the torch kernels, as above."""
    from dspark.models.step_graphs import StepGraphs
    steps = []
    real_run = StepGraphs.run
    monkeypatch.setattr(StepGraphs, "run", lambda self, items, snapshot=True: steps.append(
        [(rid, start, len(t)) for rid, start, t in items]) or real_run(self, items, snapshot))
    rows = [5, 0, 11, 5]                       # (two requests of q_max = 7 tokens: 14 rows)
    got = []
    for uniform in (False, True):
        eng = _graph_path_engine(three_layer_ckpt, monkeypatch, uniform)
        r = eng.runner
        q = eng.cache.lookahead + 1
        V = eng.cfg.vocab_size
        items = [(rid, 0, [(7 * i + j) % (V - 3) + 3 for j in range(q)]) for i, rid in
                 enumerate("xy")]
        for rid, _, t in items:
            eng.cache.add_request(rid)
            eng.cache.reserve(rid, len(t) + 1)
        got.append(r.target_forward(items, logit_rows=rows))
    assert steps == [[(rid, 0, q) for rid in "xy"]]
    (l0, t0), (l1, t1) = got
    assert l1.shape == (len(rows), l0.shape[1]) and t1.shape == t0.shape == (2 * q, t0.shape[1])
    torch.testing.assert_close(l1, l0, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(t1, t0, rtol=1e-4, atol=1e-4)
