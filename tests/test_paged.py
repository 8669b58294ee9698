"""PagedKVCache: sizing, request lifecycle and errors, and logits through the paged cache
(reference backend) against the dense reference path for mixed ragged batches."""
import random

import pytest
import torch

from dspark.attention import get_backend
from dspark.formats import layouts as L
from dspark.kvcache.block_manager import OutOfPages, OutOfSlots
from dspark.kvcache.paged import CacheTooSmall, PagedKVCache, copy_rows
from dspark.models.deepseek_v4.model import Batch
from dspark.tools.make_checkpoint import preset_config
from paged_helpers import dense_runner, load_model, paged_runner, rel_err

CFG = preset_config("tiny")          # ratios (0, 4, 16, 4, 16, 0), window 8


# ---- sizing ---------------------------------------------------------------------------------

def test_sizing_matches_page_layouts_and_allocation():
    # fp8, block 16: CSA layers hold 4 entries/page (4*584 -> 2880 B at 576 alignment) and
    # 4 indexer rows (4*132 -> 576 B); HCA layers 1 entry (584 -> 1152 B)
    per_block = 2 * (2880 + 576) + 2 * 1152
    # 2 slots, ring 8 + 2 = 10 rows (10*584 -> 6336 B/page), staging 32 tokens = 4 pages,
    # 6 layers; compressor rings fp32 (a and z): CSA 8+2 rows x 1024 (+ indexer 10 x 256),
    # HCA 16+2 rows x 512
    fixed = 6 * 6 * 6336 + 2 * 8 * 2 * (10 * 1024 + 10 * 256) + 2 * 8 * 2 * 18 * 512
    kw = dict(kv_cache_dtype="fp8", block_size=16, max_num_seqs=2, lookahead=2, max_batch_tokens=32)
    cache = PagedKVCache(CFG, memory_bytes=fixed + 10 * per_block + per_block - 1, **kw)
    assert cache.num_blocks == 10 and cache.capacity == 10
    assert cache.entries[1].shape == (10, 2880) and cache.entries[2].shape == (10, 1152)
    assert cache.index_keys[3].shape == (10, 576) and 0 not in cache.entries
    allocated = sum(t.numel() * t.element_size() for t in
                    [*cache.swa.values(), *cache.entries.values(), *cache.index_keys.values(),
                     *(x for pair in cache.comp_rows.values() for x in pair)])
    assert allocated == fixed + 10 * per_block
    with pytest.raises(ValueError, match="too small"):
        PagedKVCache(CFG, memory_bytes=fixed + per_block - 1, **kw)


def test_unquantized_cache_uses_plain_rows_with_the_same_pages():
    cache = PagedKVCache(CFG, kv_cache_dtype="bf16", block_size=32, num_blocks=3, max_num_seqs=2)
    assert cache.entries[1].shape == (3 * 8, 512) and cache.entries[1].dtype == torch.bfloat16
    assert cache.index_keys[1].shape == (3 * 8, 128) and cache.entries[2].shape == (3 * 2, 512)
    assert cache.capacity == 8                      # no speculation: the ring is the window


@pytest.mark.parametrize("kw, match", [
    (dict(kv_cache_dtype="int4", num_blocks=4), "kv_cache_dtype"),
    (dict(block_size=8, num_blocks=4), "multiple of every compression ratio"),
    (dict(), "num_blocks=... or memory_bytes"),
    (dict(num_blocks=4, lookahead=-1), "lookahead"),
])
def test_constructor_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        PagedKVCache(CFG, **kw)


# ---- lifecycle ------------------------------------------------------------------------------

def test_request_lifecycle_and_errors():
    cache = PagedKVCache(CFG, kv_cache_dtype="fp32", block_size=16, num_blocks=4, max_num_seqs=2,
                         lookahead=2)
    cache.add_request("a")
    with pytest.raises(ValueError, match="already"):
        cache.add_request("a")
    with pytest.raises(KeyError, match="add_request"):
        cache.reserve("zz", 3)
    cache.reserve("a", 40)                                   # 3 blocks
    assert cache.num_free_pages == 1
    cache.add_request("b")
    with pytest.raises(OutOfSlots):
        cache.add_request("c")
    with pytest.raises(OutOfPages):                          # needs 2, 1 free: nothing changes
        cache.reserve("b", 17)
    assert cache.num_free_pages == 1 and cache.page_table("b") == []
    with pytest.raises(CacheTooSmall, match="whole KV cache has 4"):
        cache.reserve("b", 65)
    with pytest.raises(CacheTooSmall):
        cache.can_admit(100)
    assert cache.can_admit(16) is False                      # no free slot
    # a forward over [0, 33) then rollback to 32 frees the third block
    cache.check_forward("a", 0, 33)
    cache.begin_forward("a", 0, 33)
    cache.truncate("a", 32)
    assert len(cache.page_table("a")) == 2 and cache.length("a") == 32
    with pytest.raises(ValueError, match="lookahead"):       # 33 - 29 = 4 > lookahead + 1
        cache.truncate("a", 29)
    with pytest.raises(ValueError, match=r"\[0, 32\]"):
        cache.truncate("a", 33)
    cache.free("a")
    cache.free("b")
    assert cache.num_free_pages == 4 and cache.num_free_slots == 2 and cache.can_admit(64)
    with pytest.raises(KeyError, match="already freed"):
        cache.free("a")


def test_plan_rejects_bad_batches():
    cache = PagedKVCache(CFG, kv_cache_dtype="fp32", block_size=16, num_blocks=8, max_num_seqs=2,
                         max_batch_tokens=8)
    be = get_backend("reference")(cache)
    cache.add_request(0)
    with pytest.raises(ValueError, match=r"reserve\(0, 3\)"):
        be.plan(Batch.build([(0, 0, [1, 2, 3])], "cpu"))
    cache.reserve(0, 16)
    with pytest.raises(ValueError, match="contiguously"):
        be.plan(Batch.build([(0, 2, [1])], "cpu"))
    with pytest.raises(ValueError, match="twice"):
        be.plan(Batch.build([(0, 0, [1]), (0, 1, [2])], "cpu"))
    with pytest.raises(ValueError, match="max_batch_tokens"):
        be.plan(Batch.build([(0, 0, list(range(9)))], "cpu"))
    assert cache.length(0) == 0                              # failed plans change nothing


def test_copy_rows_moves_fp8_records_byte_for_byte():
    N, g = 5, torch.Generator().manual_seed(0)
    pool = torch.zeros(4, L.fp8_ds_mla_page_bytes(N), dtype=torch.uint8)
    L.write_fp8_ds_mla(pool, N, torch.arange(20), torch.randn(20, 512, generator=g) * 3)
    before = pool.clone()
    src, dst = torch.tensor([17, 3, 9]), torch.tensor([0, 11, 14])
    copy_rows(pool, N, src, dst)
    assert torch.equal(L.read_fp8_ds_mla(pool, N, dst), L.read_fp8_ds_mla(before, N, src))
    untouched = torch.tensor([i for i in range(20) if i not in dst.tolist()])
    assert torch.equal(L.read_fp8_ds_mla(pool, N, untouched),
                       L.read_fp8_ds_mla(before, N, untouched))


# ---- logits: paged (reference backend) vs dense reference path --------------------------------

def mixed_schedule(seed, n_requests=3, max_len=44):
    """Forwards as lists of (request, start, tokens): random prompt lengths, random chunk sizes
    (1 = decode-like, up to 13 > ring capacity), requests skipping steps, all mixed."""
    rng = random.Random(seed)
    seqs = {r: [rng.randrange(1024) for _ in range(rng.randrange(20, max_len))]
            for r in range(n_requests)}
    pos = dict.fromkeys(seqs, 0)
    steps = []
    while any(pos[r] < len(seqs[r]) for r in seqs):
        step = []
        for r in seqs:
            if pos[r] < len(seqs[r]) and rng.random() < 0.8:
                n = min(rng.choice([1, 1, 2, 3, 5, 9, 13]), len(seqs[r]) - pos[r])
                step.append((r, pos[r], seqs[r][pos[r]:pos[r] + n]))
                pos[r] += n
        if step:
            steps.append(step)
    return steps


def run_both(model, kv_dtype, steps, quant):
    paged, cache = paged_runner(model, kv_dtype, block_size=16, lookahead=2)   # ring 10 rows
    dense = dense_runner(model, quant)
    states = {}
    worst = 0.0
    for step in steps:
        for r, s, toks in step:
            if r not in states:
                cache.add_request(r)
                states[r] = dense.new_states()[0]
            cache.reserve(r, s + len(toks))
        lp, _ = paged.target_forward(step)
        ld, _ = dense.target_forward([(states[r], s, t) for r, s, t in step])
        worst = max(worst, rel_err(lp, ld))
    return worst


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt)


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8"])
def test_paged_logits_equal_dense_path(model, kv_dtype):
    # fp8: the dense path with QuantSim applies the same roundings the records apply, and the
    # reference backend lays keys out as the dense path does, so both agree to float precision
    # (not merely to fp8 tolerance: one flipped FP4 tie would otherwise blur everything after it)
    assert run_both(model, kv_dtype, mixed_schedule(seed=1), quant=kv_dtype == "fp8") <= 1e-5


def test_paged_bf16_cache_equals_dense_bf16_model(tiny_ckpt):
    model = load_model(tiny_ckpt, dtype="bf16")
    assert run_both(model, "bf16", mixed_schedule(seed=2, n_requests=2, max_len=30), False) <= 1e-5
