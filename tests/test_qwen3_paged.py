"""Qwen3 target on the paged GQA KV cache (dspark/kvcache/paged_gqa.py): paged logits equal the
dense reference (mixed batches, chunked prefill, rollback), the cache API behaves like
PagedKVCache's (no side effects on OutOfPages, CacheTooSmall), and the engine gives identical
greedy output on it, leaks no pages, and survives preemption with a tiny cache."""
import functools
import os
import random

import pytest
import torch

import dspark.qwen3_runner as qwen3_runner
from dspark import Engine, SamplingParams
from dspark.kvcache.block_manager import CacheFull, OutOfPages
from dspark.kvcache.paged import CacheTooSmall
from dspark.attention.gqa import PagedGQABackend
from dspark.kvcache.paged_gqa import PagedGQACache
from dspark.models.deepseek_v4.model import Batch
from dspark.models.qwen3 import load_qwen3
from dspark.tools.make_qwen3_checkpoint import make_qwen3_checkpoint


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("q3_paged"))
    t, d = os.path.join(root, "target"), os.path.join(root, "draft")
    make_qwen3_checkpoint(t, "tiny", "target", dtype="fp32", seed=2, vocab=8)
    make_qwen3_checkpoint(d, "tiny", "dspark", dtype="fp32", seed=2, vocab=8, markov_head="rnn")
    return t, d


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("q3_paged_t"))
    make_qwen3_checkpoint(path, "tiny", "target", dtype="fp32", seed=5)
    return load_qwen3(path)


def _check_empty(cache):
    assert cache.num_free_pages == cache.num_blocks
    assert cache.num_free_slots == cache.num_slots
    assert not cache._reqs


# ---- cache API ----------------------------------------------------------------------------------

def test_cache_api(target):
    c = PagedGQACache(target.cfg, num_blocks=3, block_size=4, max_num_seqs=2)
    assert c.k[0].shape == (12, target.cfg.num_key_value_heads, target.cfg.head_dim)
    assert c.can_admit(12) and not c.has_request("a")
    with pytest.raises(CacheTooSmall):
        c.can_admit(13)
    c.add_request("a")
    with pytest.raises(ValueError):
        c.add_request("a")
    c.reserve("a", 9)
    assert c.num_free_pages == 0 and c.page_table("a") == [0, 1, 2]
    c.add_request("b")
    assert c.num_free_slots == 0 and not c.can_admit(1)
    with pytest.raises(OutOfPages):
        c.reserve("b", 1)
    assert isinstance(OutOfPages(1, 0, ""), CacheFull)
    assert c.page_table("b") == [] and c.num_free_pages == 0        # no side effects
    with pytest.raises(CacheTooSmall):
        c.reserve("a", 13)
    assert c.page_table("a") == [0, 1, 2]
    c.begin_forward("a", 0, 9)
    c.truncate("a", 4)
    assert c.length("a") == 4 and c.page_table("a") == [0] and c.num_free_pages == 2
    with pytest.raises(ValueError):
        c.truncate("a", 5)
    with pytest.raises(ValueError):           # not contiguous with the cached length
        c.check_forward("a", 5, 6)
    with pytest.raises(ValueError):           # pages do not cover the forward
        c.check_forward("a", 4, 5)
    c.free("a"), c.free("b")
    with pytest.raises(KeyError):
        c.free("a")
    _check_empty(c)


# ---- paged logits == dense logits ---------------------------------------------------------------

def test_paged_logits_equal_dense(target):
    """Mixed batches (prefill chunks + decode + verify blocks) over scattered pages, then a
    rollback and different continuation: every step's logits equal the dense KVState path."""
    cfg = target.cfg
    cache = PagedGQACache(cfg, num_blocks=40, block_size=4, max_num_seqs=4)
    be = PagedGQABackend(cache)
    rng = random.Random(0)
    seqs = {r: [rng.randrange(cfg.vocab_size) for _ in range(n)] for r, n in
            (("a", 23), ("b", 9), ("c", 30))}
    dense = {r: target.new_state() for r in seqs}
    pos = {r: 0 for r in seqs}
    for r in seqs:
        cache.add_request(r)

    def step(chunks):
        """chunks: {rid: tokens} fed at pos[rid]; compare paged vs dense logits."""
        items_p, items_d = [], []
        for r, toks in chunks.items():
            cache.reserve(r, pos[r] + len(toks))
            items_p.append((r, pos[r], toks)), items_d.append((dense[r], pos[r], toks))
        with torch.inference_mode():
            bp = Batch.build(items_p, "cpu")
            lp = target.logits(target.forward_hidden(bp, attn_fn=be.forward_fn(bp))[0])
            ld = target.logits(target.forward_hidden(Batch.build(items_d, "cpu"))[0])
        assert torch.equal(lp, ld), (lp - ld).abs().max()
        for r, toks in chunks.items():
            pos[r] += len(toks)
            assert cache.length(r) == pos[r]

    # interleaved chunked prefills: pages of the three requests alternate in the pools
    for lo, hi in ((0, 5), (5, 9), (9, 17), (17, 23)):
        step({r: s[lo:hi] for r, s in seqs.items() if s[lo:hi]})
    step({"c": seqs["c"][23:30], "a": [3], "b": [1, 2, 3, 4, 5]})      # verify blocks + decode
    assert len(set(cache.page_table("a")) & set(cache.page_table("c"))) == 0
    # rollback: drop rejected rows (crossing a page boundary), continue with other tokens
    for r, n in (("a", 21), ("b", 11), ("c", 28)):
        cache.truncate(r, n)
        pos[r] = n
    assert len(cache.page_table("a")) == 6 and len(cache.page_table("b")) == 3
    step({"b": [7, 7, 7], "a": [0, 1, 2, 3, 4, 5], "c": [9]})
    step({"a": [6], "b": [1], "c": [2, 4]})
    for r in seqs:
        cache.free(r)
    _check_empty(cache)


def test_forward_validation(target):
    cache = PagedGQACache(target.cfg, num_blocks=4, block_size=4, max_num_seqs=2)
    be = PagedGQABackend(cache)
    cache.add_request("a")
    with pytest.raises(ValueError, match="reserve"):
        be.forward_fn(Batch.build([("a", 0, [1, 2])], "cpu"))
    cache.reserve("a", 2)
    with pytest.raises(ValueError, match="contiguously"):
        be.forward_fn(Batch.build([("a", 1, [1])], "cpu"))
    assert cache.length("a") == 0


# ---- engine -------------------------------------------------------------------------------------

def _prompts(n, seed=1):
    rng = random.Random(seed)
    return [[rng.randrange(8) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


SP = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_engine_paged_by_default_greedy_identity(pair):
    t, d = pair
    spec = Engine(t, draft=d, device="cpu", dtype="fp32")
    assert isinstance(spec.cache, PagedGQACache) and spec.runner.backend.cache is spec.cache
    dense_off = Engine(t, device="cpu", dtype="fp32", kv_layout="dense")
    dense_spec = Engine(t, draft=d, device="cpu", dtype="fp32", kv_layout="dense")
    assert dense_off.cache is None and dense_spec.cache is None
    prompts = _prompts(6)
    ref = [o.token_ids for o in dense_off.generate(prompts, SP)]
    assert [o.token_ids for o in dense_spec.generate(prompts, SP)] == ref
    outs = spec.generate(prompts, SP)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.metrics.accepted for o in outs) > 0
    _check_empty(spec.cache)
    # target-only paged engine and chunked prefill mixed with verify blocks
    off = Engine(t, device="cpu", dtype="fp32")
    assert isinstance(off.cache, PagedGQACache)
    assert [o.token_ids for o in off.generate(prompts, SP)] == ref
    _check_empty(off.cache)
    chunked = Engine(t, draft=d, device="cpu", dtype="fp32", max_num_batched_tokens=7, max_num_seqs=3)
    assert [o.token_ids for o in chunked.generate(prompts, SP)] == ref
    _check_empty(chunked.cache)
    # what the Qwen3 graphs say on CUDA: verify blocks padded to one width, short prompts fed
    # in padded chunks of it next to them (rolled back like rejected drafts)
    uniform = Engine(t, draft=d, device="cpu", dtype="fp32", max_num_seqs=3)
    uniform.runner.uniform_verify = True
    assert [o.token_ids for o in uniform.generate(prompts, SP)] == ref
    _check_empty(uniform.cache)
    # score(): temporary id added, reserved and freed
    s = spec.score(prompts[0])
    torch.testing.assert_close(s, dense_off.score(prompts[0]), rtol=0, atol=0)
    _check_empty(spec.cache)
    with pytest.raises(ValueError, match="kv_layout"):
        Engine(t, draft=d, device="cpu", dtype="fp32", kv_layout="ring")


def test_engine_preemption_tiny_cache(pair, monkeypatch):
    """8-token pages and 10 of them for 4 requests that need ~7 each: requests are preempted
    and recomputed, and the greedy output is still identical to the dense reference."""
    t, d = pair
    monkeypatch.setattr(qwen3_runner, "build_engine_components",
                        functools.partial(qwen3_runner.build_engine_components, kv_block_size=8))
    prompts = _prompts(4, seed=3)
    sp = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)
    ref = [o.token_ids for o in Engine(t, device="cpu", dtype="fp32", kv_layout="dense")
           .generate(prompts, sp)]
    for draft in (d, None):
        eng = Engine(t, draft=draft, device="cpu", dtype="fp32", num_kv_blocks=10, max_num_seqs=4)
        assert eng.cache.block_size == 8 and eng.cache.num_blocks == 10
        assert [o.token_ids for o in eng.generate(prompts, sp)] == ref
        assert eng.scheduler.num_preemptions > 0
        _check_empty(eng.cache)
    assert eng.max_model_len == 80            # one request alone always fits the cache
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request(list(range(8)) * 11)
