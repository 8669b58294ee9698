"""Fixed-shape Qwen3 decode path (dspark/models/qwen3_graph.py) and its kernels
(dspark/kernels/paged_gqa_decode.py, qwen3_norm.py).

On CPU the fixed-shape forward runs uncaptured and must give the eager paged path's logits and
taps (batch padding, positions crossing page boundaries, verify blocks, rollback); the Triton
kernels run under TRITON_INTERPRET=1 against their torch twins. Tests marked ``gpu`` capture and
replay real CUDA graphs and check greedy Engine output with graphs on and off.
"""
import os
import random

import pytest
import torch
import triton

from dspark import Engine, SamplingParams
from dspark.kernels.paged_gqa_decode import paged_gqa_attention, paged_gqa_attention_torch
from dspark.kernels.qwen3_norm import head_norm_rope, rms_norm
from dspark.attention.gqa import PagedGQABackend
from dspark.kvcache.paged_gqa import PagedGQACache
from dspark.models.deepseek_v4.model import Batch
from dspark.models.qwen3 import RMSNorm, apply_rope, load_qwen3, rope_cos_sin
from dspark.models.qwen3_graph import Qwen3DecodeGraphs
from dspark.request import BlockTokens
from dspark.tools.make_qwen3_checkpoint import make_qwen3_checkpoint

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# triton's own @jit helpers are interpretable only if TRITON_INTERPRET was set at its import
triton_ok = pytest.mark.skipif(
    not (HAS_CUDA or (INTERPRET and type(triton.language.zeros).__name__ == "InterpretedFunction")),
    reason="needs CUDA, or TRITON_INTERPRET=1 set before triton is first imported")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
DEV = "cuda" if HAS_CUDA else "cpu"
TAPS = (-1, 1, 3)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("q3_graph"))
    t, d = os.path.join(root, "target"), os.path.join(root, "draft")
    make_qwen3_checkpoint(t, "tiny", "target", dtype="fp32", seed=3)
    make_qwen3_checkpoint(d, "tiny", "dspark", dtype="fp32", seed=3, markov_head="rnn")
    return t, d


@pytest.fixture(scope="module")
def target(paths):
    return load_qwen3(paths[0])


# ---- kernels against their torch twins ----------------------------------------------------------

def _random_pool(num_blocks, bs, Hkv, d, gen, dtype=torch.float32):
    rows = num_blocks * bs + 1
    return (torch.randn(rows, Hkv, d, generator=gen).to(DEV, dtype),
            torch.randn(rows, Hkv, d, generator=gen).to(DEV, dtype))


@triton_ok
@pytest.mark.parametrize("Hq,Hkv,bs,q_len", [(4, 2, 4, 1), (4, 2, 4, 3), (2, 2, 16, 1), (8, 1, 8, 2)])
def test_paged_gqa_attention_matches_torch(Hq, Hkv, bs, q_len):
    gen = torch.Generator().manual_seed(Hq * 100 + bs + q_len)
    d, num_blocks, B, width = 16, 24, 3, 12
    K, V = _random_pool(num_blocks, bs, Hkv, d, gen)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(B, width, dtype=torch.long)
    for r in range(B):                          # scattered pages; padding entries stay 0
        tables[r, :8] = perm[r * 8:(r + 1) * 8]
    # last rows of a block at positions 0.., mid-page, and across a page boundary
    ends = [q_len, 2 * bs + 1, 5 * bs + q_len - 1]
    pos = torch.tensor([e - q_len + i for e in ends for i in range(q_len)])
    q = torch.randn(B * q_len, Hq, d, generator=gen).to(DEV)
    tables, pos = tables.to(DEV), pos.to(DEV)
    P = -(-max(ends) // bs)
    out = paged_gqa_attention(q, K, V, tables[:, :P], pos, q_len, bs, block_n=16)
    ref = paged_gqa_attention_torch(q, K, V, tables[:, :P], pos, q_len, bs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # the padded table width does not matter to the kernel (it only reads keys 0..pos)
    torch.testing.assert_close(paged_gqa_attention(q, K, V, tables, pos, q_len, bs, block_n=16), out)


@triton_ok
def test_fused_norms_match_modules():
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(48, 1e-6)
    norm.weight.data = 0.5 + torch.rand(48, generator=gen)
    x = torch.randn(5, 48, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x.to(DEV), norm.weight.to(DEV), norm.eps).cpu(), norm(x),
                                   rtol=1e-5, atol=1e-5)
        head = RMSNorm(16, 1e-6)
        head.weight.data = 0.5 + torch.rand(16, generator=gen)
        xh = torch.randn(5, 3, 16, generator=gen)
        cos, sin = rope_cos_sin(torch.tensor([0, 1, 7, 300, 4095]), 16, 1e6)
        ref = apply_rope(head(xh), cos, sin)
        out = head_norm_rope(xh.to(DEV), head.weight.to(DEV), head.eps, cos.to(DEV), sin.to(DEV))
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)


# ---- fixed-shape forward == eager paged forward ---------------------------------------------------

class Twin:
    """The same request histories in an eager paged cache and in a Qwen3DecodeGraphs-driven one
    (requests added in a different order, so page placement differs)."""

    def __init__(self, target, kernels, q_lens=(1, 3), max_batch=8, capture=False, device="cpu"):
        cfg, self.target = target.cfg, target
        dtype = target.embed_tokens.weight.dtype if hasattr(target, "embed_tokens") else \
            next(target.parameters()).dtype         # the cache stores k/v in the model's dtype
        self.eager = PagedGQACache(cfg, device=device, dtype=dtype, num_blocks=64, block_size=4,
                                   max_num_seqs=8)
        self.static = PagedGQACache(cfg, device=device, dtype=dtype, num_blocks=64, block_size=4,
                                    max_num_seqs=8, scratch_rows=1)
        self.graphs = Qwen3DecodeGraphs(target, self.static, q_lens, max_batch, TAPS, capture=capture,
                                   kernels=kernels)
        self.device = device

    def _eager(self, cache, items):
        b = Batch.build(items, self.device)
        with torch.inference_mode():
            X, taps = self.target.forward_hidden(b, attn_fn=PagedGQABackend(cache).forward_fn(b),
                                                 tap_layers=TAPS)
            return self.target.logits(X), taps

    def add(self, prompts):
        for cache, order in ((self.eager, list(prompts)), (self.static, list(prompts)[::-1])):
            for rid in order:
                cache.add_request(rid)
                cache.reserve(rid, len(prompts[rid]))
        for cache in (self.eager, self.static):
            self._eager(cache, [(rid, 0, toks) for rid, toks in prompts.items()])

    def step(self, feeds, tol=1e-5, on_device=False):
        """feeds {rid: tokens} at each request's current length: static == eager. on_device:
        the static step gets them as BlockTokens (the drafts a device tensor)."""
        items = []
        for rid, toks in feeds.items():
            n = self.eager.length(rid)
            for c in (self.eager, self.static):
                c.reserve(rid, n + len(toks))
            items.append((rid, n, toks))
        ref_logits, ref_taps = self._eager(self.eager, items)
        if on_device:
            items = [(rid, n, BlockTokens(toks[0], torch.tensor(toks[1:], device=self.device)))
                     for rid, n, toks in items]
        out = self.graphs.run(items)
        assert out is not None
        # each row's argmax comes with the logits, computed in the step (first index on ties)
        assert torch.equal(out[0].row_argmax, out[0].argmax(-1))
        for got, want in ((out[0], ref_logits), (out[1], ref_taps)):
            if want.dtype == torch.bfloat16 or tol >= 1e-2:
                # bf16: the fused kernels and the eager modules round in different places, so
                # compare at the tensor's scale: no element further than tol from the eager one,
                # relative to the tensor's largest magnitude. (The whole-tensor relative error
                # measured above 1.5% on the H200 for the tiny random model: bf16 noise after a few
                # layers. The exact check is the fp32 case, 1e-4, and greedy identity in fp32.)
                d, scale = (got.float() - want.float()).abs(), want.float().abs()
                assert d.max() <= tol * scale.max(), (d.max(), scale.max())
            else:
                torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        for rid in feeds:
            assert self.static.length(rid) == self.eager.length(rid)

    def truncate(self, rid, n):
        self.eager.truncate(rid, n), self.static.truncate(rid, n)


def _scenario(tw: Twin, vocab: int, tol: float):
    rng = random.Random(7)
    prompts = {r: [rng.randrange(vocab) for _ in range(n)] for r, n in
               zip("abcde", (3, 4, 9, 1, 14))}
    tw.add(prompts)
    tok = lambda n=1: [rng.randrange(vocab) for _ in range(n)]       # noqa: E731
    for rids in ("a", "abc", "abcde", "bd", "e", "abcde", "ace"):     # batch 1..5, padded to 1/2/4/8
        tw.step({r: tok() for r in rids}, tol)                         # a, b cross pages 4 -> 8
    tw.step({r: tok(3) for r in "bce"}, tol)                           # verify blocks (q = 3)
    for r, keep in (("b", 2), ("c", 1), ("e", 3)):                     # rollback across a page
        tw.truncate(r, tw.eager.length(r) - 3 + keep)
    tw.step({r: tok() for r in "bcea"}, tol)
    tw.step({r: tok(3) for r in "edcba"}, tol)
    tw.step({r: tok(3) for r in "bd"}, tol, on_device=True)           # drafts left on the device
    # a capture ahead of traffic runs on padding rows alone: no request's state changes
    n = {r: tw.static.length(r) for r in "abcde"}
    tw.graphs.capture_bucket(4, 3, tw.graphs.page_buckets[-1])
    assert {r: tw.static.length(r) for r in "abcde"} == n
    tw.step({r: tok(3) for r in "abcd"}, tol)
    # shapes the fixed path does not take: nothing changes, the caller runs eagerly
    n = {r: tw.static.length(r) for r in "abcde"}
    assert tw.graphs.run([("a", n["a"], tok(2)), ("b", n["b"], tok(1))]) is None    # unequal
    assert tw.graphs.run([("a", n["a"], tok(2))]) is None                           # q not served
    assert tw.graphs.run([("a", n["a"], tok()), ("a", n["a"], tok())]) is None      # duplicate
    assert {r: tw.static.length(r) for r in "abcde"} == n


def test_static_forward_equals_eager_paged(target):
    tw = Twin(target, "torch")
    _scenario(tw, target.cfg.vocab_size, 1e-5)
    assert tw.graphs.num_replays == 12
    # the torch attention gathers the bucketed table width, not the maximum
    assert tw.graphs.page_buckets[:4] == [1, 2, 4, 8]


@triton_ok
def test_static_forward_triton_kernels_equal_eager(paths):
    """Fused kernels inside the fixed-shape forward (interpreter on CPU), fp32, uncaptured."""
    target = load_qwen3(paths[0], device=DEV)
    tw = Twin(target, "triton", device=DEV)
    _scenario(tw, target.cfg.vocab_size, 1e-4)


def test_bucket_and_validation(target):
    cache = PagedGQACache(target.cfg, num_blocks=8, block_size=4, max_num_seqs=4, scratch_rows=1)
    g = Qwen3DecodeGraphs(target, cache, (1,), max_batch=6, capture=False)
    assert g.batch_buckets == [1, 2, 4, 6] and g.max_pages == 8
    cache.add_request("a"), cache.reserve("a", 3)
    with pytest.raises(ValueError, match="contiguously"):             # same checks as eager
        g.run([("a", 1, [5])])
    assert cache.length("a") == 0
    assert g.bucket([("a", 32, [5])]) is None                          # past the table width
    with pytest.raises(ValueError, match="scratch_rows"):
        Qwen3DecodeGraphs(target, PagedGQACache(target.cfg, num_blocks=8, block_size=4), (1,))


# ---- engine wiring --------------------------------------------------------------------------------

def _prompts(n, vocab, seed=1):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


def test_engine_static_path_greedy_identity(paths):
    """cuda_graphs=True on CPU: the fixed-shape path uncaptured, wired into Engine.step."""
    t, d = paths
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = _prompts(5, 256)
    ref = [o.token_ids for o in Engine(t, device="cpu", dtype="fp32", cuda_graphs=False)
           .generate(prompts, sp)]
    for draft in (None, d):
        eng = Engine(t, draft=draft, device="cpu", dtype="fp32", cuda_graphs=True, max_num_seqs=4)
        assert [o.token_ids for o in eng.generate(prompts, sp)] == ref
        assert eng.runner.target_graphs.num_replays > 0
        assert eng.cache.num_free_pages == eng.cache.num_blocks
    assert Engine(t, device="cpu", dtype="fp32").runner.target_graphs is None      # CPU default: off
    with pytest.raises(ValueError, match="cuda_graphs"):
        Engine(t, device="cpu", dtype="fp32", kv_layout="dense", cuda_graphs=True)


# ---- CUDA graphs ----------------------------------------------------------------------------------

@gpu
@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_gpu_graph_replay_equals_eager(paths, dtype, tol):
    target = load_qwen3(paths[0], dtype=dtype, device="cuda")
    tw = Twin(target, "triton", capture=True, device="cuda")
    _scenario(tw, target.cfg.vocab_size, tol)
    assert len(tw.graphs.graphs) >= 4 and tw.graphs.num_replays == 12


@gpu
@needs_cuda
def test_gpu_engine_greedy_identity_graphs_on_off(paths):
    t, d = paths
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = _prompts(6, 256, seed=4)
    ref = [o.token_ids for o in Engine(t, dtype="fp32", cuda_graphs=False).generate(prompts, sp)]
    for draft in (None, d):
        eng = Engine(t, draft=draft, dtype="fp32")                 # CUDA default: graphs on
        assert eng.runner.target_graphs is not None and eng.runner.target_graphs.capture
        for batch in (prompts[:1], prompts):
            assert [o.token_ids for o in eng.generate(batch, sp)] == ref[:len(batch)]
        assert eng.runner.target_graphs.num_replays > 0 and eng.runner.target_graphs.graphs


@gpu
@needs_cuda
def test_gpu_warmup_captures_every_target_bucket(paths):
    """Engine.warmup() captures the Qwen3 target's buckets ahead of traffic (StepGraphs, as for
    the V4 target): steps afterwards replay and capture no target graph."""
    t, d = paths
    eng = Engine(t, draft=d, dtype="fp32", max_num_seqs=4)
    tg = eng.runner.target_graphs
    eng.warmup()
    # the verify width the default (fixed) policy feeds, every batch bucket
    assert set(tg.graphs) == set(tg.capture_keys({eng.drafter.gamma + 1}))
    before = len(tg.graphs)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eng.generate(_prompts(3, 256, seed=5), sp)
    assert len(tg.graphs) == before and tg.num_replays > 0 and not tg.disabled
