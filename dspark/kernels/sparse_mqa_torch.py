"""Pure-torch references of the sparse MQA kernels (dspark/kernels/sparse_mqa.py), same contracts:
the records are decoded with the layout module's torch decoder, so a reference shares no code
with the kernels' in-register decode."""
from __future__ import annotations

import torch

from dspark.formats.layouts import dequantize_fp8_ds_mla
from dspark.kernels.sparse_mqa import D_HEAD, RECORD_STRIDE, SCALE_STRIDE


def _dequant_fp8_ds_mla_rows(cache: torch.Tensor, N: int, ent: torch.Tensor) -> torch.Tensor:
    """De-quantise records at global entry ids ``ent`` (int64, any shape, all ≥ 0) -> fp32 [..., 512].

    Gathers the raw data/scale rows (any page_bytes ≥ N·584) and decodes them with the layout
    module's torch decoder, so the reference shares no code with the kernel's in-register decode."""
    flat = cache.reshape(-1)
    page, row = ent // N, ent % N
    base = page * cache.shape[1]
    data = flat[(base + row * RECORD_STRIDE).unsqueeze(-1)
                + torch.arange(RECORD_STRIDE, device=cache.device)]
    scales = flat[(base + N * RECORD_STRIDE + row * SCALE_STRIDE).unsqueeze(-1)
                  + torch.arange(SCALE_STRIDE, device=cache.device)]
    out = dequantize_fp8_ds_mla(data.reshape(-1, RECORD_STRIDE), scales.reshape(-1, SCALE_STRIDE))
    return out.view(*ent.shape, D_HEAD)


def _gather(rows_fn, indices: torch.Tensor, lengths):
    """Gather keys for an index list: returns (kv fp32 [T, K, 512], valid bool [T, K])."""
    idx = indices.long()
    valid = idx >= 0
    if lengths is not None:
        pos = torch.arange(idx.shape[1], device=idx.device)
        valid &= pos[None, :] < lengths.long()[:, None]
    kv = rows_fn(torch.where(valid, idx, 0))
    return kv, valid


def _attend_torch(q, sink, scale, kv, valid):
    """fp32 softmax-with-sink over gathered keys. q [T,H,512], kv [T,K,512], valid [T,K]."""
    q = q.float()
    sink = sink.float()
    logits = torch.einsum("thd,tkd->thk", q, kv) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    m = torch.maximum(logits.amax(dim=-1), sink[None, :])           # finite: sink is finite
    p = torch.exp(logits - m[..., None])
    denom = p.sum(dim=-1) + torch.exp(sink[None, :] - m)
    return torch.einsum("thk,tkd->thd", p, kv) / denom[..., None]


def sparse_mqa_fp8_torch(q, cache, entries_per_page, indices, sink, scale, *, lengths=None,
                         extra_cache=None, extra_entries_per_page=None, extra_indices=None,
                         extra_lengths=None, **_tuning) -> torch.Tensor:
    """Pure-torch reference of :func:`sparse_mqa_fp8` (same arguments; tuning knobs ignored)."""
    kv, valid = _gather(lambda e: _dequant_fp8_ds_mla_rows(cache, entries_per_page, e),
                        indices, lengths)
    if extra_indices is not None:
        c2 = cache if extra_cache is None else extra_cache
        n2 = entries_per_page if extra_entries_per_page is None else extra_entries_per_page
        kv2, valid2 = _gather(lambda e: _dequant_fp8_ds_mla_rows(c2, n2, e), extra_indices,
                              extra_lengths)
        kv, valid = torch.cat([kv, kv2], 1), torch.cat([valid, valid2], 1)
    return _attend_torch(q, sink, scale, kv, valid)


def sparse_mqa_dense_torch(q, kv, indices, sink, scale, *, lengths=None, extra_kv=None,
                           extra_indices=None, extra_lengths=None, **_tuning) -> torch.Tensor:
    """Pure-torch reference of :func:`sparse_mqa_dense` (same arguments; tuning knobs ignored)."""
    keys, valid = _gather(lambda e: kv[e].float(), indices, lengths)
    if extra_indices is not None:
        kv2 = kv if extra_kv is None else extra_kv
        keys2, valid2 = _gather(lambda e: kv2[e].float(), extra_indices, extra_lengths)
        keys, valid = torch.cat([keys, keys2], 1), torch.cat([valid, valid2], 1)
    return _attend_torch(q, sink, scale, keys, valid)
