"""Fixed-shape DeepSeek-V4 decode / verify forward (dspark/models/deepseek_v4/graph.py) against the
eager paged forward (dspark/attention, itself checked against the dense path and HF elsewhere).

Two caches built identically (the eager one also holds the graph's scratch request, so slots and
pages line up), the same steps on both: decode (q = 1) and verify blocks (q = 6) of 1..5 requests
padded to the batch buckets 1/2/4/8, positions crossing ratio-4 and ratio-16 entry boundaries
(entry 0's empty overlap half included), rollback after verifies. Logits, taps and every cache
row a real request owns must agree. On CPU the fixed-shape path runs eagerly (capture=False);
the GPU tests capture and replay it.
"""
import random

import triton_env  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch

from dspark.attention import get_backend
from dspark.formats import layouts as L
from dspark.kvcache.paged import PagedKVCache
from dspark.models.deepseek_v4.graph import SCRATCH_RID, V4DecodeGraphs, reserve_scratch
from dspark.request import BlockTokens, DraftBatch, DraftBlock
from dspark.sampling import argmax_rows
from dspark.runner import ModelRunner
from paged_helpers import load_model, rel_err
from triton_env import DEV, gpu, interpreter_ok, needs_cuda, triton_ok

TAPS = (1, 3, 5)
Q_VERIFY = 6


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt)


def make_pair(model, kv_dtype, backend, max_seqs, device="cpu", max_batch=8, capture=False):
    kw = dict(kv_cache_dtype=kv_dtype, block_size=16, num_blocks=40, max_num_seqs=max_seqs + 1,
              lookahead=Q_VERIFY - 1, max_batch_tokens=64, device=device)
    ce, cg = PagedKVCache(model.cfg, **kw), PagedKVCache(model.cfg, **kw)
    reserve_scratch(ce)                                   # same slot / page numbering as cg
    be = get_backend(backend)
    eager = ModelRunner(model, None, device, None, backend=be(ce))
    eager.tap_layers = TAPS
    prefill = ModelRunner(model, None, device, None, backend=be(cg))
    graphs = V4DecodeGraphs(model, cg, prefill.backend, q_lens=(1, Q_VERIFY),
                            max_batch=max_batch, tap_layers=TAPS, capture=capture)
    return eager, ce, prefill, cg, graphs


def owned_rows_equal(ce, cg, rids, tol):
    """Every pool row a real request owns (its slot's rings, its pages) agrees: exactly for
    plain rows up to `tol`; fp8 records are compared de-quantized (float noise upstream may
    flip a bf16 / fp8 rounding)."""
    slots = [ce.slot(r) for r in rids]
    assert slots == [cg.slot(r) for r in rids]
    pages = sorted({p for r in rids for p in ce.page_table(r)})
    assert pages == sorted({p for r in rids for p in cg.page_table(r)})

    def rows(pool, units, per_unit, read):
        ids = (torch.tensor(units)[:, None] * per_unit + torch.arange(per_unit)).reshape(-1)
        ids = ids.to(pool.device)
        return read(pool, per_unit, ids) if pool.dtype == torch.uint8 else pool[ids].float()

    def cmp(a, b, units, per_unit, read, what, step=1 / 8):
        x, y = rows(a, units, per_unit, read), rows(b, units, per_unit, read)
        if a.dtype != torch.uint8:
            assert rel_err(y.cpu(), x.cpu()) <= tol, (what, rel_err(y.cpu(), x.cpu()))
            return
        # records: at most one rounding step apart (`step` relative: e4m3 1/8; indexer keys hold
        # FP4 e2m1 values, where 0 and the smallest code are neighbours: 1, which still rules out
        # sign flips), and on few elements (a misplaced row differs everywhere)
        off = (x - y).abs() > tol * x.abs().max()
        near = (x - y).abs() <= torch.maximum(x.abs(), y.abs()) * step + tol * x.abs().max()
        assert near.all(), (what, int((~near).sum()), x[~near][:8].tolist(), y[~near][:8].tolist())
        assert off.float().mean() <= 0.02, (what, off.float().mean())
    for layer in ce.swa:
        cmp(ce.swa[layer], cg.swa[layer], slots, ce.capacity, L.read_fp8_ds_mla,
            f"swa ring {layer}")
    for layer in ce.entries:
        N = ce.entries_per_page(ce.ratios[layer])
        cmp(ce.entries[layer], cg.entries[layer], pages, N, L.read_fp8_ds_mla,
            f"entries {layer}")
        if layer in ce.index_keys:
            cmp(ce.index_keys[layer], cg.index_keys[layer], pages, N, L.read_indexer_fp8,
                f"indexer keys {layer}", step=1.0)
    for key, (a, z) in ce.comp_rows.items():
        ga, gz = cg.comp_rows[key]
        R = ce.comp_ring(ce.ratios[key[0]])
        cmp(a, ga, slots, R, None, f"compressor a {key}")
        cmp(z, gz, slots, R, None, f"compressor z {key}")


def schedule(seed, n_req, n_steps, vocab):
    """Per step: a subset of requests (sizes 1..n_req), each decoding 1 token or verifying a
    block of Q_VERIFY with `a` accepted drafts (then rolled back to P + a + 1)."""
    rng = random.Random(seed)
    steps = []
    for s in range(n_steps):
        k = [1, 2, 3, n_req, n_req][s % 5] if n_req >= 3 else 1 + s % n_req
        who = sorted(rng.sample(range(n_req), min(k, n_req)))
        kind = "verify" if s % 2 else "decode"
        steps.append((kind, who, [rng.randrange(Q_VERIFY) for _ in who]))
    seqs = [[rng.randrange(vocab) for _ in range(200)] for _ in range(n_req)]
    return seqs, steps


def drive(model, kv_dtype, backend, prefill_lens, n_steps, tol, seed=0, device="cpu",
          capture=False, log=None, device_tokens=False):
    """Prefill eagerly, then run the same decode / verify steps through the eager paged path
    and the fixed-shape path on two caches; compare every step (``log``: a list that collects
    (kind, items, logits rel err, per-row rel errs) instead of asserting)."""
    n_req = len(prefill_lens)
    eager, ce, prefill, cg, graphs = make_pair(model, kv_dtype, backend, n_req, device,
                                               capture=capture)
    seqs, steps = schedule(seed, n_req, n_steps, model.cfg.vocab_size)
    P = list(prefill_lens)
    for r, n in enumerate(prefill_lens):            # prefill: eager on both caches
        for c in (ce, cg):
            c.add_request(r)
            c.reserve(r, n)
        le, _ = eager.target_forward([(r, 0, seqs[r][:n])])
        lg, _ = prefill.target_forward([(r, 0, seqs[r][:n])])
        assert rel_err(lg.cpu(), le.cpu()) <= 1e-6      # same eager path, same cache layout
    buckets, verifies = set(), 0
    for kind, who, accept in steps:
        q = 1 if kind == "decode" else Q_VERIFY
        items = [(r, P[r], seqs[r][P[r]:P[r] + q]) for r in who]
        for r in who:
            ce.reserve(r, P[r] + q)
            cg.reserve(r, P[r] + q)
        buckets.add(graphs.bucket(items))
        if device_tokens and kind != "decode":
            # drafts as device tensors (BlockTokens): the fixed-shape path copies them on the
            # device, the eager runner reads them back. Every other verify step they are the
            # rows of one draft pass's batch (DraftBlock.of_batch), in order (the step copies a
            # slice of the batch) or reversed (one stack of the rows)
            verifies += 1
            if verifies % 2:
                lazy = [(r, p, BlockTokens(t[0], torch.tensor(t[1:], device=device)))
                        for r, p, t in items]
            else:
                drafts = torch.tensor([t[1:] for _, _, t in items], device=device)
                rev = verifies % 4 == 0
                batch = DraftBatch(drafts.flip(0) if rev else drafts, None,
                                   torch.zeros(drafts.shape, device=device))
                R = len(items)
                lazy = [(r, p, BlockTokens.of_block(t[0], DraftBlock(
                    batch=batch, row=R - 1 - i if rev else i, has_probs=False), q - 1))
                    for i, (r, p, t) in enumerate(items)]
            le, te = eager.target_forward(lazy)
            out = graphs.run(lazy)
        else:
            le, te = eager.target_forward(items)
            out = graphs.run(items)
        assert out is not None, items
        lg, tg = out
        assert lg.shape == le.shape and tg.shape == te.shape
        # the rows' argmax computed in the same forward (decide reads it): argmax_rows' values
        assert torch.equal(lg.row_argmax.cpu(), argmax_rows(lg, two_pass=True).cpu())
        if log is not None:
            rows = [rel_err(a, b) for a, b in zip(lg.cpu(), le.cpu())]
            log.append((kind, [(r, p, len(t)) for r, p, t in items], rel_err(lg.cpu(), le.cpu()),
                        rows))
        else:
            # on failure: the step, and each row's error (one bad row = a flipped selection or
            # rounding; every row bad = a wrong plan)
            assert rel_err(lg.cpu(), le.cpu()) <= tol, (
                kind, [(r, p, len(t)) for r, p, t in items], rel_err(lg.cpu(), le.cpu()),
                [round(rel_err(a, b), 5) for a, b in zip(lg.cpu(), le.cpu())])
            assert rel_err(tg.cpu(), te.cpu()) <= tol
        for r, a in zip(who, accept):
            P[r] += 1 if kind == "decode" else a + 1
            ce.truncate(r, P[r])
            cg.truncate(r, P[r])
    if log is None:
        owned_rows_equal(ce, cg, list(range(n_req)), tol)
    return graphs, buckets


# prompts ending just before / on ratio-4 and ratio-16 boundaries, and one of 2 tokens (its
# first ratio-4 entry, without a previous window, completes inside a graphed step)
PREFILLS = [2, 13, 15, 30, 7]


@pytest.mark.parametrize("device_tokens", [False, True])
def test_fixed_shape_forward_equals_eager_reference_fp32(model, device_tokens):
    graphs, buckets = drive(model, "fp32", "reference", PREFILLS, n_steps=12, tol=1e-5,
                            device_tokens=device_tokens)
    assert {b for b, _, _ in buckets} >= {1, 2, 4, 8} and {q for _, q, _ in buckets} == {1, 6}
    assert graphs.num_replays == 12


def test_fixed_shape_forward_equals_eager_reference_fp8(model):
    # fp8 records: the fixed-shape attention sums in another order than the reference backend
    # (float noise ~1e-7), enough to flip a bf16 / fp8 rounding now and then; such a flip moves
    # the logits by ~1e-3 and later flips add up, while a wrong row or entry moves them by O(1)
    drive(model, "fp8", "reference", PREFILLS[:3], n_steps=6, tol=2e-2, seed=1)


@interpreter_ok
def test_fixed_shape_forward_equals_eager_triton_fp8(model):
    # the Triton kernels on the CPU model, interpreted; on a GPU the same comparison runs on the
    # device with capture (test_cuda_graph_replay_equals_eager)
    drive(model, "fp8", "triton", [3, 14], n_steps=4, tol=2e-2, seed=2)


def test_decode_plans_computed_ahead(model):
    """Consecutive decode steps reuse the plan computed during the previous step (every request
    one position on, same pages) and stay equal to the eager path; a step that differs from the
    guess (a verify block, a rollback, a request leaving) computes its own."""
    eager, ce, prefill, cg, graphs = make_pair(model, "fp32", "reference", 2)
    rng = random.Random(5)
    seqs = [[rng.randrange(model.cfg.vocab_size) for _ in range(80)] for _ in range(2)]
    P = [11, 14]
    for r, n in enumerate(P):
        for c in (ce, cg):
            c.add_request(r)
            c.reserve(r, 64)
        eager.target_forward([(r, 0, seqs[r][:n])])
        prefill.target_forward([(r, 0, seqs[r][:n])])

    def step(who, q=1):
        items = [(r, P[r], seqs[r][P[r]:P[r] + q]) for r in who]
        le, _ = eager.target_forward(items)
        lg, _ = graphs.run(items)
        assert rel_err(lg, le) <= 1e-5, (items, rel_err(lg, le))
        for r in who:
            P[r] += q

    for _ in range(8):                  # (request 1 crosses a page: reserved ahead, guessed)
        step([0, 1])
    assert graphs.plans_ahead_used == 7
    step([0, 1], q=Q_VERIFY)            # a verify block: not the guess
    step([0])                           # request 1 left the batch: not the guess
    assert graphs.plans_ahead_used == 7
    for r in (0, 1):                    # rollback by two positions: not the guess
        P[r] -= 2
        ce.truncate(r, P[r])
        cg.truncate(r, P[r])
    step([0, 1])
    step([0, 1])
    assert graphs.plans_ahead_used == 8
    owned_rows_equal(ce, cg, [0, 1], 1e-5)


def test_steps_that_do_not_fit_return_none_and_change_nothing(model):
    eager, ce, prefill, cg, graphs = make_pair(model, "fp32", "reference", 3, max_batch=2)
    for r in range(3):
        cg.add_request(r)
        cg.reserve(r, 40)
        prefill.target_forward([(r, 0, [1, 2, 3])])
    assert graphs.run([(0, 3, [4, 5])]) is None                       # q = 2 not a bucket
    assert graphs.run([(0, 3, [4]), (1, 3, [4, 5, 6, 7, 8, 9])]) is None   # unequal lengths
    assert graphs.run([(r, 3, [4]) for r in range(3)]) is None        # more than max_batch
    assert graphs.run([(0, 3, [4]), (0, 3, [4])]) is None             # duplicates
    assert [cg.length(r) for r in range(3)] == [3, 3, 3]
    with pytest.raises(ValueError, match="contiguously"):
        graphs.run([(0, 5, [4])])
    assert cg.length(0) == 3
    assert cg.has_request(SCRATCH_RID) and graphs.scratch_page in cg.page_table(SCRATCH_RID)


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8"])
def test_padding_only_forwards_touch_no_request(model, kv_dtype):
    """What the warm-up captures on (capture_bucket): a forward of padding rows alone, for
    every bucket, writes only the scratch request's state: the requests' rows stay those of a
    cache that never ran it, and their next steps agree."""
    eager, ce, prefill, cg, graphs = make_pair(model, kv_dtype, "reference", 3, max_batch=4)
    rng = random.Random(3)
    seqs = [[rng.randrange(model.cfg.vocab_size) for _ in range(40)] for _ in range(3)]
    P = [5, 17, 30]
    for r, n in enumerate(P):
        for c, runner in ((ce, eager), (cg, prefill)):
            c.add_request(r)
            c.reserve(r, n + Q_VERIFY)
            runner.target_forward([(r, 0, seqs[r][:n])])
    for B in graphs.batch_buckets:
        for q in sorted(graphs.q_lens):
            for pages in graphs.page_buckets[:3]:
                assert graphs.capture_bucket(B, q, pages) is False     # ran eagerly, no graph
    owned_rows_equal(ce, cg, [0, 1, 2], 0.0)
    items = [(r, P[r], seqs[r][P[r]:P[r] + Q_VERIFY]) for r in range(3)]
    le, _ = eager.target_forward(items)
    lg, _ = graphs.run(items)
    # fixed-shape vs eager attention sum in other orders: fp32 noise, or with fp8 records a
    # flipped rounding now and then (test_fixed_shape_forward_equals_eager_reference_fp8); a
    # request row the padding forward had written would move the logits by O(1)
    assert rel_err(lg.cpu(), le.cpu()) <= (1e-5 if kv_dtype == "fp32" else 2e-2)


def test_fixed_shape_forward_has_no_host_sync(model, monkeypatch):
    """What a capture needs: no device->host read anywhere in the fixed-shape forward (derive
    plan, layers, head), counted on CPU as in test_host_sync.py, MoE on its gathered (CUDA)
    path, fp32 cache (torch kernels)."""
    from dspark.models.deepseek_v4.moe import MoE
    from test_host_sync import SyncGuard
    eager, ce, prefill, cg, graphs = make_pair(model, "fp32", "reference", 2)
    for r, n in enumerate((3, 14)):
        cg.add_request(r)
        cg.reserve(r, n + Q_VERIFY)
        prefill.target_forward([(r, 0, list(range(1, n + 1)))])
    monkeypatch.setattr(MoE, "gathered_devices", ("cuda", "cpu"))
    guard = SyncGuard()
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist",
                        lambda self: (guard.record("Tensor.tolist"), tolist(self))[1])
    fwd = graphs._forward

    def armed(*a):
        guard.armed = True
        try:
            return fwd(*a)
        finally:
            guard.armed = False
    monkeypatch.setattr(graphs, "_forward", armed)
    with guard:
        assert graphs.run([(0, 3, [5]), (1, 14, [6])]) is not None
        assert graphs.run([(0, 4, [5] * Q_VERIFY), (1, 15, [6] * Q_VERIFY)]) is not None
    assert guard.hits == [], f"{len(guard.hits)} host syncs; first:\n{guard.hits[0]}"


def test_needs_lookahead_for_verify_blocks(model):
    cache = PagedKVCache(model.cfg, kv_cache_dtype="fp32", block_size=16, num_blocks=8,
                         max_num_seqs=2, lookahead=2)
    with pytest.raises(ValueError, match="lookahead"):
        V4DecodeGraphs(model, cache, "reference", q_lens=(1, 6))


# ---- GPU: capture + replay == eager -------------------------------------------------------------

@pytest.fixture(scope="module")
def wide_topk_ckpt(tmp_path_factory):
    """The tiny config with index_topk 64: in these <= 48-position runs the CSA selection never
    bites (every visible entry is attended), so the forward is a continuous function of its
    inputs and TF32-level rounding differences between two layouts stay small."""
    from dspark.tools.make_checkpoint import make_checkpoint
    out = str(tmp_path_factory.mktemp("tiny_wide_topk"))
    make_checkpoint(out, preset="tiny", seed=0, dspark=True, overrides={"index_topk": 64},
                    progress=False)
    return out


def _replay_vs_eager(ckpt, kv_dtype, tol):
    from dspark import Engine
    m = Engine(ckpt, device=DEV, dtype="fp32", kv_cache_dtype="fp32", speculative="none").model
    graphs, buckets = drive(m, kv_dtype, "triton", PREFILLS, n_steps=12, tol=tol, device=DEV,
                            capture=True)
    assert not graphs.disabled and set(graphs.graphs) == buckets


@gpu
@needs_cuda
@pytest.mark.parametrize("kv_dtype", ["fp8", "fp32"])
def test_cuda_graph_replay_equals_eager(wide_topk_ckpt, kv_dtype):
    # fp32 operands run as TF32 in the Triton dots on a GPU (exact 'ieee' under the interpreter,
    # where the same schedule agrees to 1e-6): 5e-3 covers TF32 rounding, not a wrong entry
    _replay_vs_eager(wide_topk_ckpt, kv_dtype, 2e-2 if kv_dtype == "fp8" else 5e-3)


@gpu
@needs_cuda
@pytest.mark.xfail(strict=False, reason=(
    "with index_topk 4 the CSA top-k bites from position 19 on; on the H200 one "
    "verify step (request 2 at positions 33-38) differed on 4 rows (rel 0.2 fp32 / 0.35 fp8 "
    "cache), with capture on and off alike, while every other step agreed to ~1e-3 (TF32). "
    "Most likely near-tie top-k flips: the indexer scores of the fixed-shape and the eager "
    "layout round differently under TF32, and random weights give near-ties; the interpreter "
    "(exact fp32 dots) agrees to 1e-6 on the same schedule"))
@pytest.mark.parametrize("kv_dtype", ["fp8", "fp32"])
def test_cuda_graph_replay_equals_eager_topk_bites(tiny_ckpt, kv_dtype):
    _replay_vs_eager(tiny_ckpt, kv_dtype, 2e-2 if kv_dtype == "fp8" else 5e-3)


@gpu
@needs_cuda
@pytest.mark.parametrize("policy", ["fixed", "scheduled"])
def test_engine_greedy_identical_with_target_graphs(policy):
    """The shipped pair through the Engine: target graphs on (decode / verify replayed) == off."""
    from dspark import Engine, SamplingParams
    prompts = ["def fibonacci(n):\n", "import os\n\n\ndef main():\n", "class Stack:\n    def ",
               "for i in range(10):\n    "]
    outs = {}
    for graphs in (False, True):
        eng = Engine(device=DEV, dtype="fp32", target_cuda_graphs=graphs, verify_policy=policy,
                     max_num_seqs=4)
        res = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=48))
        outs[graphs] = [o.token_ids for o in res]
        if graphs:
            assert eng.runner.target_graphs is not None
            assert eng.runner.target_graphs.num_replays > 0 and not eng.runner.target_graphs.disabled
    assert outs[True] == outs[False]


@gpu
@needs_cuda
def test_greedy_speculation_equals_off_at_batch_1_for_every_policy():
    """The shipped pair at the CUDA defaults (bf16, fp8 KV, graphs), one request at a time:
    greedy tokens with speculation under each verify policy == speculation off."""
    from dspark import Engine, SamplingParams
    from dspark.spec.policy import POLICIES
    prompts = ["def fibonacci(n):\n", "import os\n\n\ndef main():\n", "class Stack:\n    def "]
    params = SamplingParams(temperature=0, max_tokens=48)

    def one_by_one(eng):
        return [eng.generate([p], params)[0].token_ids for p in prompts]

    want = one_by_one(Engine(device=DEV, speculative="none", max_num_seqs=4))
    for policy in sorted(POLICIES):
        eng = Engine(device=DEV, verify_policy=policy, max_num_seqs=4)
        assert one_by_one(eng) == want, policy


@gpu
@needs_cuda
@pytest.mark.parametrize("policy", ["fixed", "threshold"])
def test_warmup_captures_every_round_graph(policy):
    """Engine.warmup() captures every graph a round replays (target batch x width x pages on
    padding rows, draft pass and context writes): traffic afterwards captures nothing, replays
    its steps, and gives the tokens of the engine without graphs."""
    from dspark import Engine, SamplingParams
    prompts = ["def fibonacci(n):\n", "import os\n\n\ndef main():\n", "class Stack:\n    def "]
    sp = [SamplingParams(temperature=0, max_tokens=n) for n in (40, 23, 31)]
    kw = dict(device=DEV, dtype="fp32", verify_policy=policy, max_num_seqs=4)
    ref = [o.token_ids for o in Engine(target_cuda_graphs=False, cuda_graphs=False, **kw)
           .generate(prompts, sp)]
    eng = Engine(**kw)
    info = eng.warmup(prompt_lengths=[1, 8], batch_sizes=[2])
    tg, dp = eng.runner.target_graphs, eng.runner.draft_pass
    gamma = eng.drafter.gamma
    widths = {gamma + 1} if policy == "fixed" else set(range(1, gamma + 2))
    every = {(B, q, P) for q in widths for B in tg.batch_buckets for P in tg.page_buckets}
    assert info["graphs"]["target"] == len(tg.graphs) and every <= set(tg.graphs), \
        sorted(every - set(tg.graphs))
    held = (set(tg.graphs), set(dp._graphs))
    replays = tg.num_replays
    assert [o.token_ids for o in eng.generate(prompts, sp)] == ref
    assert (set(tg.graphs), set(dp._graphs)) == held and not tg.disabled
    assert tg.num_replays > replays


@triton_ok
def test_engine_through_the_fixed_shape_path_on_cpu():
    """The default GPU decode path's engine-level plumbing on CPU: the shipped pair with the
    Triton backend (interpreted) and the fixed-shape V4 step run eagerly (capture=False), drafts
    handed over as device tensors (BlockTokens), the scratch request, rollback; greedy tokens ==
    the same engine without the fixed-shape path, and with max_num_seqs 2 < 3 prompts the
    batch changes between steps. (Short prompts and 6 tokens: every step costs ~0.3 s per token
    in the interpreter, and these already give verify blocks of two requests with a rejected
    draft (rollback), clipped blocks, and a step after the third request came in.)"""
    from dspark import Engine, SamplingParams
    from dspark.engine import default_model_path
    prompts = ["def f(n):\n", "import os\n", "class A:\n"]
    sp = SamplingParams(temperature=0, max_tokens=6)
    outs = {}
    for fixed in (False, True):
        # one cache slot and page more than the scheduler hands out: the scratch request's
        # (what Engine reserves itself when it turns the graphs on, on CUDA)
        eng = Engine(default_model_path(), device="cpu", dtype="fp32", attention_backend="triton",
                     max_num_seqs=3, num_kv_blocks=13)
        eng.scheduler.max_num_seqs = 2
        if fixed:
            r = eng.runner
            reserve_scratch(eng.cache)
            r.target_graphs = V4DecodeGraphs(r.model, eng.cache, "triton",
                                             q_lens=range(1, r.drafter.gamma + 2), max_batch=2,
                                             tap_layers=r.tap_layers, capture=False)
            assert r.takes_device_tokens
            r.uniform_verify = True        # verify blocks padded to one width, prompts in chunks of it
            replayed, run = [], r.target_graphs.run

            def run_and_log(items, *a, **kw):
                out = run(items, *a, **kw)
                if out is not None:
                    replayed.append(([rid for rid, _, _ in items], len(items[0][2])))
                return out
            r.target_graphs.run = run_and_log
        res = eng.generate(prompts, sp)
        outs[fixed] = [o.token_ids for o in res]
        assert any(o.metrics.accepted < o.metrics.verified for o in res)   # a draft rejected
        if fixed:
            assert r.target_graphs.num_replays > 0
            assert max(t["num_verify"] for t in eng.telemetry) == 2     # two requests per step
            # verify blocks (q > 1) of two requests went through the fixed-shape path, and so
            # did steps of all three requests (the third admitted when one of the first finished)
            assert any(len(rids) == 2 and q > 1 for rids, q in replayed), replayed
            assert len({rid for rids, _ in replayed for rid in rids}) == 3, replayed
            # the prompts too: every forward of this run replayed the fixed-shape step
            assert r.target_graphs.num_replays == len(eng.telemetry), (replayed, len(eng.telemetry))
    assert outs[True] == outs[False]
