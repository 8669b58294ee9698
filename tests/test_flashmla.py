"""FlashMLA backend (dspark/attention/flashmla.py).

CPU: backend selection and its error messages, the in-place record view and the index / head
padding helpers, and the whole adapter end to end with a torch stand-in for ``flash_mla`` that
checks FlashMLA's argument contract (dtypes, shapes, strides, 64-multiples, scheduler-metadata
reuse rules) and reads the pools with FlashMLA's own byte addressing (data row at
``page*stride0 + row*576``, scales at ``page*stride0 + N*576 + row*8``), against the reference
backend.

GPU (``-m gpu``, skipped unless ``import flash_mla`` works on an SM90 / SM100 device): the real
kernel against the reference backend on identical caches (decode, verify blocks, prefill chunks
crossing compressed-entry boundaries, CSA top-k, HCA), against the torch oracle at V4-Flash
shapes, and greedy Engine output with attention_backend="flashmla" vs "reference".
"""
import copy
import os
import sys
import types

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import dspark.attention as A  # noqa: E402
from dspark.attention import get_backend, resolve_backend  # noqa: E402
from dspark.formats import layouts as L  # noqa: E402
from dspark.kvcache.paged import PagedKVCache  # noqa: E402
from dspark.models.deepseek_v4.model import Batch  # noqa: E402
from dspark.runner import ModelRunner  # noqa: E402
from paged_helpers import load_model, rel_err, row_rel_err  # noqa: E402

F = pytest.importorskip("dspark.attention.flashmla")
from dspark.attention.reference import ReferenceBackend  # noqa: E402


def _flashmla_gpu_reason():
    if not torch.cuda.is_available():
        return "needs CUDA"
    return A.flashmla_unavailable_reason("cuda")


GPU_REASON = _flashmla_gpu_reason()
needs_flashmla = pytest.mark.skipif(GPU_REASON is not None, reason=str(GPU_REASON))


# ---- a torch stand-in for flash_mla (contract checks + FlashMLA's byte addressing) ------------
class FakeSched:
    def __init__(self):
        self.config = None


class FakeFlashMLA:
    """get_mla_metadata / flash_mla_with_kvcache with FlashMLA's MODEL1 sparse-decode contract;
    the math in fp32 over bf16 q and bf16-exact keys."""

    def __init__(self, exact=False):
        self.calls = 0
        self.scheds = set()
        self.exact = exact      # fp32 q accepted, fp32 out: checks the plumbing, not precision

    def get_mla_metadata(self, *args, **kwargs):
        return FakeSched(), None

    @staticmethod
    def _check_kv(kv, name):
        assert kv.dtype == torch.uint8 and kv.dim() == 4, name
        assert kv.shape[2] == 1 and kv.shape[3] == 584, (name, kv.shape)
        assert kv.stride(1) == 584 and kv.stride(3) == 1, (name, kv.stride())
        assert kv.stride(0) % 576 == 0, (name, kv.stride())

    @staticmethod
    def _check_idx(idx, b, name):
        assert idx.dtype == torch.int32 and idx.dim() == 3, name
        assert idx.shape[0] == b and idx.shape[1] == 1 and idx.stride(-1) == 1, name
        assert idx.shape[2] % 64 == 0 and idx.shape[2] > 0, (name, idx.shape)

    @staticmethod
    def _rows(kv, ids, lens):
        """Decode the records at ids [b, 1, K] like the kernel does; validity mask too."""
        pages, N, stride0 = kv.shape[0], kv.shape[1], kv.stride(0)
        raw = kv.as_strided((pages * stride0,), (1,))          # the pool's bytes
        flat = ids[:, 0].long()
        valid = flat != -1
        if lens is not None:
            valid &= torch.arange(flat.shape[1])[None, :] < lens.long()[:, None]
        assert ((flat[valid] >= 0) & (flat[valid] < pages * N)).all(), "id out of the cache"
        f = torch.where(valid, flat, 0)
        page, row = f // N, f % N
        data_at = (page * stride0 + row * 576)[..., None] + torch.arange(576)
        scale_at = (page * stride0 + N * 576 + row * 8)[..., None] + torch.arange(8)
        data, scales = raw[data_at], raw[scale_at]
        x = L.dequantize_fp8_ds_mla(data.reshape(-1, 576), scales.reshape(-1, 8))
        return x.view(*flat.shape, 512).bfloat16().float(), valid

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v,
                               tile_scheduler_metadata, num_splits=None, softmax_scale=None,
                               causal=False, is_fp8_kvcache=False, indices=None, attn_sink=None,
                               extra_k_cache=None, extra_indices_in_kvcache=None,
                               topk_length=None, extra_topk_length=None):
        self.calls += 1
        assert isinstance(tile_scheduler_metadata, FakeSched) and num_splits is None
        assert q.dtype == (torch.float32 if self.exact else torch.bfloat16)
        assert q.dim() == 4 and q.stride(-1) == 1
        b, s_q, h_q, d = q.shape
        assert s_q == 1 and h_q in (64, 128) and d == 512 and head_dim_v == 512
        assert is_fp8_kvcache and not causal and block_table is None and cache_seqlens is None
        self._check_kv(k_cache, "k_cache")
        self._check_idx(indices, b, "indices")
        for lens in (topk_length, extra_topk_length):
            if lens is not None:
                assert lens.dtype == torch.int32 and lens.shape == (b,) and lens.is_contiguous()
        if attn_sink is not None:
            assert attn_sink.dtype == torch.float32 and attn_sink.shape == (h_q,)
            assert attn_sink.is_contiguous()
        if extra_k_cache is not None:
            self._check_kv(extra_k_cache, "extra_k_cache")
            self._check_idx(extra_indices_in_kvcache, b, "extra_indices")
        else:
            assert extra_indices_in_kvcache is None and extra_topk_length is None
        # the metadata may be reused only for the same shapes and length values
        cfg = (b, s_q, h_q, k_cache.shape[1], indices.shape[2],
               None if extra_k_cache is None else extra_k_cache.shape[1],
               None if extra_indices_in_kvcache is None else extra_indices_in_kvcache.shape[2],
               None if topk_length is None else tuple(topk_length.tolist()),
               None if extra_topk_length is None else tuple(extra_topk_length.tolist()))
        sched = tile_scheduler_metadata
        if sched.config is None:
            sched.config = cfg
        assert sched.config == cfg, "scheduler metadata reused for a different call"
        self.scheds.add(id(sched))

        keys, valid = self._rows(k_cache, indices, topk_length)
        if extra_k_cache is not None:
            k2, v2 = self._rows(extra_k_cache, extra_indices_in_kvcache, extra_topk_length)
            keys, valid = torch.cat([keys, k2], 1), torch.cat([valid, v2], 1)
        logits = torch.einsum("bhd,bkd->bhk", q[:, 0].float(), keys) * softmax_scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        m = logits.amax(-1, keepdim=True).clamp_min(-1e30)
        p = torch.exp(logits - m)
        den = p.sum(-1, keepdim=True)
        if attn_sink is not None:
            den = den + torch.exp(attn_sink[None, :, None] - m)
        o = torch.einsum("bhk,bkd->bhd", p, keys) / den.clamp_min(1e-30)
        lse = (m + den.log()).squeeze(-1)
        return (o if self.exact else o.bfloat16()).unsqueeze(1), lse.unsqueeze(-1)


class CPUFlashMLA(F.FlashMLABackend):
    """The FlashMLA backend with reference writes / indexer (the Triton ones need a GPU)."""
    store = ReferenceBackend.store
    select = ReferenceBackend.select


# ---- selection and errors ---------------------------------------------------------------------
def test_registered_and_resolved_names():
    assert "flashmla" in A.available_backends()
    assert get_backend("flashmla") is F.FlashMLABackend
    for name in ("reference", "triton", "flashmla"):
        assert resolve_backend(name, "cpu") == name
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        resolve_backend("flash")
    assert resolve_backend("auto", "cpu") == "reference"


def _fake_cuda(monkeypatch, cap=(9, 0), flash_mla=True, v4_api=True):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Fake GPU")
    if not flash_mla:
        monkeypatch.setitem(sys.modules, "flash_mla", None)      # import raises ImportError
        return
    mod = types.ModuleType("flash_mla")
    mod.get_mla_metadata = FakeFlashMLA().get_mla_metadata
    if v4_api:
        mod.flash_mla_with_kvcache = FakeFlashMLA().flash_mla_with_kvcache
    else:
        def old(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                num_splits, softmax_scale=None, causal=False, is_fp8_kvcache=False,
                indices=None):
            raise AssertionError
        mod.flash_mla_with_kvcache = old
    monkeypatch.setitem(sys.modules, "flash_mla", mod)


@pytest.mark.parametrize("cap,mla,v4,kv,want", [
    ((9, 0), True, True, "fp8", "flashmla"),
    ((10, 0), True, True, "auto", "flashmla"),
    ((9, 0), False, True, "fp8", "triton"),      # flash_mla not installed
    ((9, 0), True, False, "fp8", "triton"),      # flash_mla without the V4 arguments
    ((8, 0), True, True, "fp8", "triton"),       # Ampere
    ((12, 0), True, True, "fp8", "triton"),      # consumer Blackwell
    ((9, 0), True, True, "bf16", "triton"),      # FlashMLA reads fp8 records only
])
def test_auto_picks_flashmla_only_where_it_runs(monkeypatch, cap, mla, v4, kv, want):
    _fake_cuda(monkeypatch, cap, mla, v4)
    assert resolve_backend("auto", "cuda", kv) == want
    assert resolve_backend("auto", "cpu", kv) == "reference"


@pytest.mark.parametrize("cap,mla,v4,msg", [
    ((8, 6), True, True, "SM86.*SM90.*SM100"),
    ((9, 0), False, True, "import flash_mla"),
    ((9, 0), True, False, "predates the DeepSeek-V4.*extra_k_cache"),
])
def test_unavailable_reasons(monkeypatch, cap, mla, v4, msg):
    _fake_cuda(monkeypatch, cap, mla, v4)
    assert A.flashmla_unavailable_reason("cuda") is not None
    assert pytest.importorskip("re").search(msg, A.flashmla_unavailable_reason("cuda"))
    assert A.flashmla_unavailable_reason("cpu").startswith("device cpu is not a CUDA GPU")


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt)


def _cache(model, kv_dtype="fp8", **kw):
    args = dict(block_size=16, num_blocks=64, max_num_seqs=4, lookahead=3, max_batch_tokens=128)
    args.update(kw)
    return PagedKVCache(model.cfg, kv_cache_dtype=kv_dtype, **args)


def test_constructor_errors_name_problem_and_fix(model):
    if GPU_REASON is None:
        pytest.skip("FlashMLA is usable here")
    with pytest.raises(RuntimeError, match="flashmla' is unavailable: .*Fix: .*FlashMLA.*"
                                           "attention_backend='triton'"):
        F.FlashMLABackend(_cache(model))
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):
        F.FlashMLABackend(_cache(model, "bf16"), flash_mla=FakeFlashMLA())


# ---- helpers ----------------------------------------------------------------------------------
@pytest.mark.parametrize("N", [1, 4, 11, 64, 131])
def test_record_view_matches_flashmla_addressing(N):
    """The view FlashMLA gets is the pool itself, and decoding it with the kernel's addressing
    gives exactly layouts.read_fp8_ds_mla."""
    pages = 5
    pool = torch.zeros(pages, L.fp8_ds_mla_page_bytes(N), dtype=torch.uint8)
    g = torch.Generator().manual_seed(N)
    ids = torch.randperm(pages * N, generator=g)[:min(40, pages * N)]
    L.write_fp8_ds_mla(pool, N, ids, torch.randn(len(ids), 512, generator=g) * 3)
    view = F.record_view(pool, N)
    assert view.shape == (pages, N, 1, 584) and view.stride() == (pool.stride(0), 584, 584, 1)
    assert view.data_ptr() == pool.data_ptr()
    assert view.storage_offset() + (pages - 1) * view.stride(0) + (N - 1) * 584 + 583 < pool.numel()
    idx = torch.full((len(ids), 1, 64), -1, dtype=torch.int32)
    idx[:, 0, 0] = ids.int()
    rows, valid = FakeFlashMLA._rows(view, idx, None)
    assert valid[:, 0].all() and not valid[:, 1:].any()
    assert torch.equal(rows[:, 0], L.read_fp8_ds_mla(pool, N, ids).bfloat16().float())


def test_check_pool_rejects_what_flashmla_cannot_read():
    good = torch.zeros(3, L.fp8_ds_mla_page_bytes(4), dtype=torch.uint8)
    F.check_pool(good, 4, "p")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):
        F.check_pool(torch.zeros(12, 512), 4, "p")
    with pytest.raises(ValueError, match="cannot hold 8"):
        F.check_pool(good, 8, "p")
    with pytest.raises(ValueError, match="576"):
        F.check_pool(torch.zeros(3, 4 * 584, dtype=torch.uint8), 4, "p")


def test_pad_index_list():
    ids = torch.tensor([[3, -1, 7], [-1, -1, -1]])
    p = F.pad_index_list(ids)
    assert p.shape == (2, 1, 64) and p.dtype == torch.int32
    assert torch.equal(p[:, 0, :3], ids.int()) and (p[:, 0, 3:] == -1).all()
    big = torch.arange(2 * 128, dtype=torch.int32).view(2, 128)
    assert F.pad_index_list(big).data_ptr() == big.data_ptr()          # no copy
    assert F.pad_index_list(torch.zeros(2, 130, dtype=torch.long)).shape == (2, 1, 192)
    assert F.pad_index_list(torch.zeros(2, 0, dtype=torch.long)).shape == (2, 1, 64)


@pytest.mark.parametrize("H,want", [(1, (64, 1)), (4, (64, 1)), (64, (64, 1)), (65, (128, 1)),
                                    (128, (128, 1)), (200, (128, 2)), (256, (128, 2))])
def test_head_padding(H, want):
    assert F.head_padding(H) == want
    q, sink = torch.randn(3, H, 512), torch.randn(H)
    qp, sp = F.pad_heads(q, sink, *want)
    assert qp.dtype == torch.bfloat16 and sp.dtype == torch.float32
    assert qp.shape == (3, want[0] * want[1], 512) and sp.shape == (want[0] * want[1],)
    assert torch.equal(qp[:, :H], q.bfloat16()) and not qp[:, H:].any()


# ---- the adapter end to end on CPU (stand-in kernel) ------------------------------------------
SEQS = {0: [(7 * i + 3) % 1024 for i in range(40)], 1: [(11 * i + 5) % 1024 for i in range(40)],
        2: [(5 * i + 1) % 1024 for i in range(40)]}
# prefill chunks, a lone decode, verify blocks; positions cross the ratio-4 / 16 boundaries and
# the window ring (window 8, capacity 8 + lookahead 3)
STEPS = [[(0, 0, 13), (1, 0, 6)], [(0, 13, 7), (2, 0, 17)], [(0, 20, 4), (1, 6, 2), (2, 17, 1)],
         [(1, 8, 9), (2, 18, 4)], [(0, 24, 1), (1, 17, 4), (2, 22, 10)]]


def _items(step):
    return [(r, s, SEQS[r][s:s + n]) for r, s, n in step]


def _runner(model, backend):
    cache = backend.cache
    for r in SEQS:
        cache.add_request(r)
        cache.reserve(r, 40)
    return ModelRunner(model, None, cache.device, None, backend=backend)


def _pad_heads_fp32(q, sink, per_call, calls):
    """pad_heads without the bf16 cast (for the exact stand-in)."""
    T, H, D = q.shape
    qp, sp = q.new_zeros(T, per_call * calls, D), sink.new_zeros(per_call * calls)
    qp[:, :H], sp[:H] = q, sink
    return qp.float(), sp.float()


def test_adapter_matches_reference_backend_on_cpu(model, monkeypatch):
    """Whole forwards (prefill chunks, decode, verify blocks; 3 requests) through the adapter
    with an fp32 stand-in: the logits match the reference backend about as closely as the
    Triton backend's do, so every id, page view, length and head mapping is right. (With bf16 q, as
    the real kernel, per-layer differences of ~1% compound through later layers' FP8 entries
    and top-k choices; test_adapter_layer_ops_on_identical_inputs checks that precision.)"""
    monkeypatch.setattr(F, "pad_heads", _pad_heads_fp32)
    fake = FakeFlashMLA(exact=True)
    ref = _runner(model, ReferenceBackend(_cache(model)))
    fla = _runner(model, CPUFlashMLA(_cache(model), flash_mla=fake))
    for step in STEPS:
        want, _ = ref.target_forward(_items(step))
        got, _ = fla.target_forward(_items(step))
        # summation-order differences re-round a few FP8 entry / key bytes, and those carry over
        # to later steps (Triton vs reference: 2e-3 for one forward; 5.1e-3 at the third step
        # on a CPU with AMX / AVX-512); a wrong id or length would show up as O(0.1 - 1) errors
        assert row_rel_err(got, want).max() <= 1e-2, step
    n_layers = model.cfg.num_hidden_layers
    assert fake.calls == len(STEPS) * n_layers
    # one scheduler metadata per kind of layer per forward (SWA, CSA, HCA-16), not per layer
    assert len(fake.scheds) <= len(STEPS) * 3 < fake.calls


def test_adapter_layer_ops_on_identical_inputs(model):
    """sparse_mqa of SWA / CSA / HCA layers on one cache state, stand-in kernel vs reference;
    also with more heads than one FlashMLA call takes (chunks of 128)."""
    cache = _cache(model)
    runner = _runner(model, ReferenceBackend(cache))
    for step in STEPS[:2]:
        runner.target_forward(_items(step))
    ref = ReferenceBackend(cache)
    fla = CPUFlashMLA(cache, flash_mla=FakeFlashMLA())
    md = ref.plan(Batch.build(_items(STEPS[2]), "cpu"))
    T = md.positions.shape[0]
    g = torch.Generator().manual_seed(0)
    ref.write_window(md, 0, torch.randn(T, 512, generator=g))
    ref.write_window(md, 1, torch.randn(T, 512, generator=g))
    ref.write_window(md, 2, torch.randn(T, 512, generator=g))
    sel = ref.select(md, 1, torch.randn(T, 16, 128, generator=g), torch.randn(T, 16, generator=g),
                     4)
    for H in (4, 64, 130):
        q = torch.randn(T, H, 512, generator=g)
        sink = torch.randn(H, generator=g)
        for layer, s in ((0, None), (1, sel), (2, None)):
            lists = ref.entry_lists(md, layer, s)
            args = (md, q, cache.swa[layer], cache.capacity, md.window_ids, *lists, sink,
                    512 ** -0.5)
            want = ref.sparse_mqa(*args)
            got = fla.sparse_mqa(*args)
            assert got.dtype == torch.float32 and got.shape == want.shape
            assert rel_err(got, want) <= 2e-2, (H, layer)
            # caller-supplied lengths (not the plan's) still work (no metadata reuse)
            if lists[3] is not None:
                lens = lists[3].clone()
                assert rel_err(fla.sparse_mqa(*args[:8], lens, sink, 512 ** -0.5), want) <= 2e-2


# ---- GPU: the real kernel ---------------------------------------------------------------------
@pytest.mark.gpu
@needs_flashmla
def test_flashmla_model_logits_match_reference(tiny_ckpt):
    """Each forward from an identical cache state (a copy of the reference's). The random tiny
    model amplifies bf16 differences (q and probabilities are bf16 in the kernel) through later
    layers' FP8 entries and top-k-of-4 choices: single rows can differ by 0.2-0.4 in the CPU
    calibration with a bf16 stand-in, the median stays near 1-3%; a wrong id / page / length
    moves the median to O(0.3)."""
    model = load_model(tiny_ckpt).cuda()
    ref = _runner(model, get_backend("reference")(_cache(model, device="cuda")))
    for step in STEPS:
        fla = copy.copy(ref)
        fla.backend = get_backend("flashmla")(copy.deepcopy(ref.backend.cache))
        got, _ = fla.target_forward(_items(step))
        want, _ = ref.target_forward(_items(step))
        assert row_rel_err(got, want).median() <= 5e-2, step


@pytest.mark.gpu
@needs_flashmla
def test_flashmla_layer_ops_match_reference_on_identical_inputs(tiny_ckpt):
    model = load_model(tiny_ckpt).cuda()
    cache = _cache(model, device="cuda")
    runner = _runner(model, get_backend("reference")(cache))
    for step in STEPS[:2]:
        runner.target_forward(_items(step))
    ref, fla = get_backend("reference")(cache), get_backend("flashmla")(cache)
    md = ref.plan(Batch.build(_items(STEPS[2]), "cuda"))
    T = md.positions.shape[0]
    g = torch.Generator(device="cuda").manual_seed(0)
    for layer in range(3):
        ref.write_window(md, layer, torch.randn(T, 512, generator=g, device="cuda"))
    sel = ref.select(md, 1, torch.randn(T, 16, 128, generator=g, device="cuda"),
                     torch.randn(T, 16, generator=g, device="cuda"), 4)
    for H in (4, 64, 128):
        q = torch.randn(T, H, 512, generator=g, device="cuda")
        sink = torch.randn(H, generator=g, device="cuda")
        for layer, s in ((0, None), (1, sel), (2, None)):
            args = (md, q, cache.swa[layer], cache.capacity, md.window_ids,
                    *ref.entry_lists(md, layer, s), sink, 512 ** -0.5)
            assert rel_err(fla.sparse_mqa(*args), ref.sparse_mqa(*args)) <= 2e-2, (H, layer)


@pytest.mark.gpu
@needs_flashmla
@pytest.mark.parametrize("batch,page", [(4, 64), (33, 64), (16, 37)])
def test_flashmla_v4_flash_shapes_match_torch_oracle(batch, page):
    """64 heads, 2 query tokens per request, 128 window + 512 top-k keys (some -1)."""
    from dspark.kernels.sparse_mqa_torch import sparse_mqa_fp8_torch
    g = torch.Generator().manual_seed(batch)
    T, dev = 2 * batch, "cuda"
    pools = []
    for n_rows in (batch * 128, batch * 2048):
        pages = -(-n_rows // page)
        pool = torch.zeros(pages, L.fp8_ds_mla_page_bytes(page), dtype=torch.uint8, device=dev)
        L.write_fp8_ds_mla(pool, page, torch.arange(pages * page, device=dev),
                           torch.randn(pages * page, 512, generator=g).to(dev))
        pools.append(pool)
    req = torch.arange(T) // 2
    win = (req[:, None] * 128 + torch.arange(128)).int()
    comp = (req[:, None] * 2048 + torch.argsort(torch.rand(T, 2048, generator=g), 1)[:, :512])
    comp = torch.where(torch.rand(T, 512, generator=g) < 0.1, -1, comp).int()
    q = torch.randn(T, 64, 512, generator=g).bfloat16().to(dev)
    sink = torch.randn(64, generator=g).to(dev)
    want = sparse_mqa_fp8_torch(q, pools[0], page, win.to(dev), sink, 512 ** -0.5,
                                extra_cache=pools[1], extra_entries_per_page=page,
                                extra_indices=comp.to(dev))
    fm = F.import_flash_mla()
    out, lse = fm.flash_mla_with_kvcache(
        q=q.unsqueeze(1), k_cache=F.record_view(pools[0], page), block_table=None,
        cache_seqlens=None, head_dim_v=512, tile_scheduler_metadata=fm.get_mla_metadata()[0],
        softmax_scale=512 ** -0.5, is_fp8_kvcache=True,
        indices=F.pad_index_list(win.to(dev)), attn_sink=sink,
        extra_k_cache=F.record_view(pools[1], page),
        extra_indices_in_kvcache=F.pad_index_list(comp.to(dev)))
    assert out.shape == (T, 1, 64, 512) and out.dtype == torch.bfloat16
    assert rel_err(out[:, 0].float(), want) <= 2e-2


@pytest.mark.gpu
@needs_flashmla
def test_engine_greedy_flashmla_equals_reference():
    """The shipped default pair (trained: confident logits, so bf16 noise cannot flip a greedy
    choice), DSpark on: verify blocks of several tokens go through FlashMLA too."""
    from dspark import Engine, SamplingParams
    prompts = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def"]
    sp = SamplingParams(temperature=0, max_tokens=48)
    outs = {}
    for name in ("reference", "flashmla"):
        eng = Engine(device="cuda", attention_backend=name)
        assert eng.runner.backend.name == name
        outs[name] = [o.token_ids for o in eng.generate(prompts, sp)]
    assert outs["flashmla"] == outs["reference"]
