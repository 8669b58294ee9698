"""Rollback after speculative verification: truncate(rid, committed) then continuing must give
the logits of a request that never saw the rejected drafts (spec §4.5, dspark.md §5.3).

Each verify round feeds [anchor, d_1..d_k] at positions P..P+k; the first `a` drafts are the
true next tokens, the rest are wrong; then truncate to P+a+1. Rejections are placed so that the
rejected positions straddle ratio-4 and ratio-16/128 entry boundaries (p % ratio == ratio-1) and
the wrap-around of the SWA ring.
"""
import random

import pytest

from dspark.tools.make_checkpoint import make_checkpoint
from paged_helpers import dense_logits, dense_runner, load_model, paged_runner, rel_err

LOOKAHEAD = 4        # verify blocks of up to 4 drafts + anchor; ring = window + 4


def wrong_token(rng, true_tok, vocab):
    t = rng.randrange(vocab - 1)
    return t + (t >= true_tok)


def drive(runner, cache, seqs, plans, vocab, seed=0, dense=None):
    """Run requests side by side in shared forwards. plans[r] = (prefill chunk sizes,
    [(k, a), ...] verify rounds). Returns {r: {position: logits row}} of committed positions.
    With `dense`, the dense reference runner is fed the identical forwards (drafts included)
    and must agree row by row (returns the worst relative error as well)."""
    rng = random.Random(seed)
    todo = {r: [("prefill", n) for n in plans[r][0]] + [("verify", *ka) for ka in plans[r][1]]
            for r in seqs}
    P = dict.fromkeys(seqs, 0)
    rows = {r: {} for r in seqs}
    states = {r: dense.new_states()[0] for r in seqs} if dense else None
    worst = 0.0
    for r in seqs:
        cache.add_request(r)
    while any(todo.values()):
        items, meta = [], []
        for r in seqs:
            if not todo[r]:
                continue
            op = todo[r].pop(0)
            if op[0] == "prefill":
                toks = seqs[r][P[r]:P[r] + op[1]]
            else:
                k, a = op[1], op[2]
                true = seqs[r][P[r]:P[r] + k + 1]
                toks = true[:a + 1] + [wrong_token(rng, t, vocab) for t in true[a + 1:]]
            cache.reserve(r, P[r] + len(toks))
            items.append((r, P[r], toks))
            meta.append(op)
        logits, _ = runner.target_forward(items)
        if dense:
            ld, _ = dense.target_forward([(states[r], s, t) for r, s, t in items])
            worst = max(worst, rel_err(logits, ld))
        off = 0
        for (r, s, toks), op in zip(items, meta):
            keep = len(toks) if op[0] == "prefill" else op[2] + 1
            for i in range(keep):
                rows[r][s + i] = logits[off + i]
            off += len(toks)
            P[r] = s + keep
            cache.truncate(r, P[r])
    return rows, worst


def check_against_never_fed(model, rows, seqs, tol):
    for r, by_pos in rows.items():
        n = max(by_pos) + 1
        assert sorted(by_pos) == list(range(n))
        ref = dense_logits(model, seqs[r][:n])
        for p, row in by_pos.items():
            assert rel_err(row, ref[p]) <= tol, (r, p, rel_err(row, ref[p]))


# (prompt chunks, verify rounds (k drafts, a accepted)); tiny model: window 8, ring 12,
# CSA entries complete at p = 3, 7, 11, ..., HCA (ratio 16) at p = 15, 31
CASES = {
    "first-entries": ([3], [(4, 0), (4, 1), (4, 4), (3, 0), (4, 2)]),     # 3..7, overlap entry 0
    "ratio16-at-15": ([13], [(4, 0), (4, 1), (4, 4), (4, 0), (2, 1)]),    # 13..17 straddles 15
    "wrap-and-31": ([9, 20], [(4, 1), (4, 0), (2, 2), (4, 3), (4, 0)]),   # ring wrapped; 31
    "decode-only": ([1] * 10, [(4, 0)] * 3 + [(1, 0), (4, 4), (4, 0)]),
}


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt)


@pytest.fixture(scope="module")
def seqs(model):
    rng = random.Random(7)
    return {name: [rng.randrange(model.cfg.vocab_size) for _ in range(64)] for name in CASES}


def test_rollback_equals_never_fed_fp32(model, seqs):
    runner, cache = paged_runner(model, "fp32", lookahead=LOOKAHEAD)
    rows, _ = drive(runner, cache, seqs, CASES, model.cfg.vocab_size)
    check_against_never_fed(model, rows, seqs, tol=1e-5)
    assert cache.num_free_pages + sum(len(cache.page_table(r)) for r in seqs) == cache.num_blocks


def test_rollback_fp8_matches_dense_quantsim_schedule(model, seqs):
    # fp8: against the dense path fed the very same forwards (position-indexed dense state
    # overwrites rejected rows by construction); comparing with a never-fed run would mostly
    # measure how FP4 index-key rounding amplifies last-bit differences of other batch shapes
    runner, cache = paged_runner(model, "fp8", lookahead=LOOKAHEAD)
    _, worst = drive(runner, cache, seqs, CASES, model.cfg.vocab_size,
                     dense=dense_runner(model, quant=True))
    assert worst <= 1e-5


def test_rollback_beyond_lookahead_is_refused(model, seqs):
    runner, cache = paged_runner(model, "fp32", lookahead=1)       # ring = window + 1
    cache.add_request("x")
    cache.reserve("x", 12)
    runner.target_forward([("x", 0, seqs["decode-only"][:12])])
    with pytest.raises(ValueError, match="lookahead"):
        cache.truncate("x", 9)                                      # 3 dropped > 1 + 1
    assert cache.length("x") == 12
    cache.truncate("x", 10)                                         # 2 dropped: fine
    cache.reserve("x", 11)
    row = runner.target_forward([("x", 10, seqs["decode-only"][10:11])])[0][0]
    assert rel_err(row, dense_logits(model, seqs["decode-only"][:11])[10]) <= 1e-5


@pytest.fixture(scope="module")
def prod_model(tmp_path_factory):
    """Production constants: window 128, HCA ratio 128, index_topk 8 (spec §9 variant)."""
    out = str(tmp_path_factory.mktemp("prod_consts"))
    make_checkpoint(out, preset="tiny", seed=3, progress=False,
                    overrides={"sliding_window": 128, "compress_ratios": [0, 4, 128, 4, 128, 0],
                               "index_topk": 8})
    return load_model(out)


def test_rollback_production_constants(prod_model):
    rng = random.Random(11)
    seqs = {0: [rng.randrange(prod_model.cfg.vocab_size) for _ in range(272)],
            1: [rng.randrange(prod_model.cfg.vocab_size) for _ in range(272)]}
    # request 0: the ring (132 rows) has wrapped; rejected drafts straddle p = 255 (HCA entry 1
    # and a CSA entry); request 1 prefills alongside in chunks
    plans = {0: ([120, 130], [(4, 0), (4, 1), (4, 2), (4, 0), (4, 4), (4, 1)]),
             1: ([100, 100, 60, 1, 1], [])}
    runner, cache = paged_runner(prod_model, "fp32", block_size=256, num_blocks=4,
                                 lookahead=LOOKAHEAD, max_batch_tokens=256)
    rows, _ = drive(runner, cache, seqs, plans, prod_model.cfg.vocab_size, seed=5)
    assert max(rows[0]) >= 256
    check_against_never_fed(prod_model, rows, seqs, tol=1e-5)
