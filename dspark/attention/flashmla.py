"""FlashMLA backend: DeepSeek's MODEL1 sparse fp8 decode kernel over our paged cache, in place.

FlashMLA (github.com/deepseek-ai/FlashMLA, ``flash_mla.flash_mla_with_kvcache``) ships a sparse
decode kernel for DeepSeek-V4 ("MODEL1": d_qk = d_v = 512, 584-B fp8 records) on SM90 and SM100.
Our plan already produces what it wants (backend.py): per token a window list into the SWA pool
(FlashMLA's main ``k_cache`` / ``indices``) and a list into the layer's compressed-entry pool
(``extra_k_cache`` / ``extra_indices_in_kvcache``), global ids ``page * entries_per_page + row``
with -1 = masked, plus the attention sink. So this backend only replaces ``sparse_mqa``; writes
and the indexer top-k stay on our Triton kernels (TritonBackend).

How our tensors map onto the call (checked against FlashMLA's csrc/api/sparse_decode.h and the
SM90 / SM100 MODEL1 kernels):

* Pools: FlashMLA's MODEL1 page is exactly our fp8_ds_mla page: data rows (448 fp8 e4m3 + 64
  bf16 RoPE = 576 B) at ``row * 576``, then 8-B scale rows (7 UE8M0 + 1 pad) at
  ``N * 576 + row * 8``; pages ``k_cache.stride(0)`` bytes apart (SM100 wants a multiple of 576,
  which layouts.py guarantees). The kernel wants a ``[pages, N, 1, 584]`` uint8 tensor with
  ``stride(1) == 584`` as a shape/stride contract only (it never reads a 584-B contiguous row),
  so ``record_view`` is an ``as_strided`` view of the pool: no copy, no repacking.
* Any entries-per-page N works (the kernels divide ids by N); ids must fit int32.
* Batch: every token is its own batch element (``b = T, s_q = 1``), so ragged requests, decode,
  verify blocks and prefill chunks are all the same call; ``extra_topk_length`` is per batch
  element = per token (HCA: the plan's ``n_visible``).
* Index lists: int32, last dim a multiple of 64 (the kernels' top-k block); we pad with -1
  (``pad_index_list``). V4-Flash shapes (window 128, top-k 512) need no padding.
* Heads: the kernels exist for 64 and 128 query heads only; other counts are zero-padded
  (``head_padding``; > 128 heads run in chunks of 128). q must be bf16.
* Sink: ``attn_sink`` fp32 [h_q], a raw logit: o = sum_j e^{l_j} v_j / (sum_j e^{l_j} + e^sink),
  l = softmax_scale * q.k - the same formula as the model's ``sparse_attention_with_sink``.
* Result: (out bf16 [b, 1, h_q, 512], lse fp32 [b, h_q, 1] without the sink); we return
  ``out`` as fp32 [T, H, 512] (the backend contract) and drop lse.
* Scheduling metadata (``get_mla_metadata()``) is filled on first use and may be reused only while
  shapes and length values stay the same: one per kind of layer (SWA-only, CSA, each HCA
  ratio) per forward, as vLLM does.

Availability: ``unavailable_reason(device)`` says why FlashMLA cannot run (no CUDA, not
SM90/SM100, ``import flash_mla`` fails, an old flash_mla without the V4 arguments); the backend's
constructor raises with that reason and the fix. ``flash_mla`` is imported lazily, so importing
dspark never needs it.
"""
from __future__ import annotations

import importlib
import inspect

import torch

from dspark.formats.layouts import HEAD_DIM, NOPE_DIM, PAGE_ALIGN, RECORD_BYTES, ROPE_DIM

from .triton import TritonBackend

TOPK_BLOCK = 64                 # index lists are read in blocks of 64 ids
HEAD_SIZES = (64, 128)          # query-head counts FlashMLA has kernels for
SUPPORTED_MAJOR = {9: "SM90", 10: "SM100"}
V4_ARGS = ("indices", "attn_sink", "extra_k_cache", "extra_indices_in_kvcache", "topk_length",
           "extra_topk_length")
FIX = ("build FlashMLA from https://github.com/deepseek-ai/FlashMLA on this machine "
       "(`git clone --recursive ... && cd FlashMLA && pip install --no-build-isolation -v .`), "
       "or use attention_backend='triton'")


def import_flash_mla():
    """The ``flash_mla`` module (ImportError when it is not installed)."""
    return importlib.import_module("flash_mla")


def unavailable_reason(device=None) -> str | None:
    """None when FlashMLA's MODEL1 sparse decode can run on ``device`` (default: the current CUDA
    device), else a sentence naming the problem."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type != "cuda":
        return f"device {device} is not a CUDA GPU (FlashMLA runs on NVIDIA SM90 / SM100)"
    if not torch.cuda.is_available():
        return "no CUDA GPU is available (FlashMLA runs on NVIDIA SM90 / SM100)"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in SUPPORTED_MAJOR:
        return (f"{torch.cuda.get_device_name(device)} is SM{major}{minor}; FlashMLA's sparse fp8 "
                f"decode has kernels for SM90 (Hopper) and SM100 (Blackwell) only")
    try:
        fm = import_flash_mla()
    except ImportError as e:
        return f"`import flash_mla` failed ({e})"
    fn = getattr(fm, "flash_mla_with_kvcache", None)
    if fn is None or not hasattr(fm, "get_mla_metadata"):
        return "the installed flash_mla has no flash_mla_with_kvcache / get_mla_metadata"
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None                           # a compiled wrapper: trust it
    missing = [a for a in V4_ARGS if a not in params]
    if missing:
        return (f"the installed flash_mla predates the DeepSeek-V4 (MODEL1) sparse decode API "
                f"(flash_mla_with_kvcache has no {', '.join(missing)})")
    return None


# ---- layout / index helpers (pure torch, CPU-testable) ----------------------------------------
def record_view(pool: torch.Tensor, per_page: int) -> torch.Tensor:
    """The ``[pages, N, 1, 584]`` uint8 view FlashMLA's MODEL1 kernels take for a pool of
    fp8_ds_mla pages ``[pages, page_bytes]`` (no copy). Only the shape and strides matter: the
    kernels address data rows at ``page * stride(0) + row * 576`` and scale rows at
    ``page * stride(0) + N * 576 + row * 8`` themselves, which is our page layout."""
    check_pool(pool, per_page, "pool")
    pages = pool.shape[0]
    return pool.as_strided((pages, per_page, 1, RECORD_BYTES),
                           (pool.stride(0), RECORD_BYTES, RECORD_BYTES, 1))


def check_pool(pool: torch.Tensor, per_page: int, name: str) -> None:
    """Raise ValueError unless ``pool`` is a fp8_ds_mla page pool FlashMLA can read in place."""
    if pool.dtype != torch.uint8 or pool.dim() != 2:
        raise ValueError(f"{name}: FlashMLA reads uint8 fp8_ds_mla pages [pages, page_bytes], got "
                         f"{pool.dtype} {tuple(pool.shape)} (use kv_cache_dtype='fp8')")
    pages, page_bytes = pool.shape
    if page_bytes < per_page * RECORD_BYTES or page_bytes % PAGE_ALIGN:
        raise ValueError(f"{name}: pages of {page_bytes} B cannot hold {per_page} fp8_ds_mla "
                         f"records at FlashMLA's {PAGE_ALIGN}-B page alignment")
    if pool.stride(1) != 1 or pool.stride(0) % PAGE_ALIGN:
        raise ValueError(f"{name}: page stride {pool.stride(0)} B must be a multiple of "
                         f"{PAGE_ALIGN} B and rows contiguous (FlashMLA's TMA row stride)")
    if pool.data_ptr() % 16:
        raise ValueError(f"{name}: base address must be 16-B aligned for FlashMLA")
    if pages * per_page >= 2 ** 31:
        raise ValueError(f"{name}: {pages} pages x {per_page} entries exceed FlashMLA's int32 "
                         f"global ids; use a smaller cache")


def pad_index_list(ids: torch.Tensor, block: int = TOPK_BLOCK) -> torch.Tensor:
    """Global ids [T, K] (-1 = masked, any int dtype) -> int32 [T, 1, Kp], Kp = K rounded up to a
    multiple of ``block`` (at least one block), padded with -1. A view when nothing changes."""
    T, K = ids.shape
    Kp = max(block, -(-K // block) * block)
    if Kp == K and ids.dtype == torch.int32 and ids.stride(1) == 1:
        return ids.unsqueeze(1)
    out = torch.full((T, Kp), -1, dtype=torch.int32, device=ids.device)
    out[:, :K] = ids
    return out.unsqueeze(1)


def head_padding(h: int) -> tuple[int, int]:
    """(heads per FlashMLA call, number of calls) for ``h`` query heads: 64 or 128 heads per call,
    zero-padded; more than 128 heads run in chunks of 128."""
    if h <= HEAD_SIZES[0]:
        return HEAD_SIZES[0], 1
    return HEAD_SIZES[1], -(-h // HEAD_SIZES[1])


def pad_heads(q: torch.Tensor, sink: torch.Tensor, per_call: int, calls: int):
    """q [T, H, 512] -> bf16 [T, calls*per_call, 512] (zero heads appended), sink -> fp32
    [calls*per_call]. Views/no-ops when H already fits."""
    T, H, D = q.shape
    Hp = per_call * calls
    qb = q.to(torch.bfloat16)
    sk = sink.to(torch.float32)
    if Hp != H:
        qp = qb.new_zeros(T, Hp, D)
        qp[:, :H] = qb
        qb = qp
        sp = sk.new_zeros(Hp)
        sp[:H] = sk
        sk = sp
    return qb.contiguous(), sk.contiguous()


# ---- the backend --------------------------------------------------------------------------------
class FlashMLABackend(TritonBackend):
    """Sparse MQA with FlashMLA's MODEL1 decode kernel; everything else as TritonBackend.

    ``flash_mla``: the module to call (default: ``import flash_mla`` after checking the device);
    tests pass a stand-in with the same two functions (``get_mla_metadata``,
    ``flash_mla_with_kvcache``) to exercise the adapter without a GPU.
    """
    name = "flashmla"

    def __init__(self, cache, flash_mla=None):
        super().__init__(cache)
        if not cache.fp8:
            raise ValueError("attention_backend='flashmla' reads fp8_ds_mla records in place; "
                             "use kv_cache_dtype='fp8' (or attention_backend='triton' / "
                             "'reference' for a bf16 / fp32 cache)")
        cfg = cache.cfg
        if cfg.head_dim != HEAD_DIM or cfg.qk_rope_head_dim != ROPE_DIM:
            raise ValueError(f"FlashMLA's MODEL1 kernel needs head_dim {HEAD_DIM} with "
                             f"{NOPE_DIM} fp8 + {ROPE_DIM} RoPE dims; this model has head_dim "
                             f"{cfg.head_dim}, qk_rope_head_dim {cfg.qk_rope_head_dim}")
        if flash_mla is None:
            why = unavailable_reason(cache.device)
            if why is not None:
                raise RuntimeError(f"attention_backend='flashmla' is unavailable: {why}. Fix: "
                                   f"{FIX}.")
            flash_mla = import_flash_mla()
        self.fm = flash_mla
        # geometry: every pool must be readable in place (all true by construction of
        # PagedKVCache; checked here so a layout change fails loudly, not in the kernel)
        self._views = {}
        for layer, pool in cache.swa.items():
            self._view(pool, cache.capacity, f"SWA pool of layer {layer}")
        for layer, pool in cache.entries.items():
            self._view(pool, cache.entries_per_page(cache.ratios[layer]),
                       f"compressed-entry pool of layer {layer}")
        self._md, self._memo = None, {}

    def _view(self, pool, per_page, name="pool"):
        hit = self._views.get(id(pool))
        if hit is None or hit[0] is not pool or hit[1] != per_page:
            check_pool(pool, per_page, name)
            hit = self._views[id(pool)] = (pool, per_page, record_view(pool, per_page))
        return hit[2]

    def _forward_memo(self, md) -> dict:
        """A dict that lives for one planned forward (padded plan lists, scheduler metadata)."""
        if self._md is not md:
            self._md, self._memo = md, {}
        return self._memo

    def sparse_mqa(self, md, q, window_pool, capacity, window_ids, entry_pool, per_page, entry_ids,
                   entry_lens, sink, scale):
        memo = self._forward_memo(md)
        T, H, _ = q.shape
        # index lists: the plan's own lists are padded once per forward, per-layer ones per call
        if window_ids is md.window_ids:
            win = memo.get("win")
            if win is None:
                win = memo["win"] = pad_index_list(
                    md.window_ids_i32 if md.window_ids_i32 is not None else window_ids)
        else:
            win = pad_index_list(window_ids)
        kind, ext, ext_lens = ("swa",), None, None
        if entry_ids is not None and entry_ids.shape[1] > 0:
            plan_m = next((m for m, rp in md.ratios.items()
                           if entry_ids is rp.all_visible_ids), None)
            if plan_m is not None:             # HCA: every visible entry, padded once
                rp = md.ratios[plan_m]
                ext = memo.get(("hca", plan_m))
                if ext is None:
                    ext = memo[("hca", plan_m)] = pad_index_list(
                        rp.all_visible_ids_i32 if rp.all_visible_ids_i32 is not None
                        else entry_ids)
                kind = ("hca", plan_m)
                if entry_lens is rp.n_visible:
                    ext_lens = rp.n_visible_i32 if rp.n_visible_i32 is not None \
                        else rp.n_visible.to(torch.int32)
                elif entry_lens is not None:
                    ext_lens, kind = entry_lens.to(torch.int32).contiguous(), None
                else:
                    kind = ("hca-nolen", plan_m)
            else:                              # CSA: this layer's top-k (order unspecified)
                ext = pad_index_list(entry_ids)
                if entry_lens is not None:
                    ext_lens = entry_lens.to(torch.int32).contiguous()
                    kind = None                # caller's lengths: no metadata reuse
                else:
                    kind = ("csa",)
        per_call, calls = head_padding(H)
        qp, sp = pad_heads(q, sink, per_call, calls)
        kv = self._view(window_pool, capacity)
        ekv = self._view(entry_pool, per_page) if ext is not None else None
        sched = None
        if kind is not None:
            key = ("sched", kind, T, per_call, win.shape[-1],
                   None if ext is None else ext.shape[-1])
            sched = memo.get(key)
            if sched is None:
                sched = memo[key] = self.fm.get_mla_metadata()[0]
        outs = []
        for c in range(calls):
            hs = slice(c * per_call, (c + 1) * per_call)
            qc = qp[:, hs].unsqueeze(1) if calls > 1 else qp.unsqueeze(1)
            out, _lse = self.fm.flash_mla_with_kvcache(
                q=qc.contiguous(), k_cache=kv, block_table=None, cache_seqlens=None,
                head_dim_v=HEAD_DIM,
                tile_scheduler_metadata=sched if sched is not None
                else self.fm.get_mla_metadata()[0],
                softmax_scale=scale, causal=False, is_fp8_kvcache=True, indices=win,
                attn_sink=sp[hs].contiguous() if calls > 1 else sp,
                extra_k_cache=ekv, extra_indices_in_kvcache=ext, topk_length=None,
                extra_topk_length=ext_lens)
            outs.append(out[:, 0])
        o = outs[0] if calls == 1 else torch.cat(outs, 1)
        return o[:, :H].float()
