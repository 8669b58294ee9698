"""Attention backends over the paged KV cache (see backend.py for the interface).

    from dspark.attention import get_backend
    backend = get_backend("reference")(cache)       # cache: dspark.kvcache.paged.PagedKVCache
    attn_fn = backend.forward_fn(batch)             # DeepseekV4Model.forward_hidden(attn_fn=...)

Backends: "reference" (torch), "triton" (dspark/kernels), "flashmla" (FlashMLA's MODEL1 sparse
fp8 decode for the attention itself, Triton for writes and the indexer; needs ``flash_mla`` on an
SM90 / SM100 GPU). ``resolve_backend("auto", device, kv_cache_dtype)`` picks one. Backends are
imported on first use, so asking for "reference" never imports Triton or flash_mla.
"""
from __future__ import annotations

import importlib

import torch

from .backend import AttentionBackend
from .plan import AttnMetadata

_BACKENDS = {
    "reference": ("dspark.attention.reference", "ReferenceBackend"),
    "triton": ("dspark.attention.triton", "TritonBackend"),
    "flashmla": ("dspark.attention.flashmla", "FlashMLABackend"),
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered as ``name``; instantiate it with a PagedKVCache."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: "
                         f"{', '.join(available_backends())}")
    module, cls = _BACKENDS[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise ImportError(f"attention backend {name!r} cannot be imported ({e}); use "
                          f"'reference' or install its dependencies") from e


def flashmla_unavailable_reason(device=None) -> str | None:
    """None when the "flashmla" backend can run on ``device``, else why not (no CUDA, not
    SM90/SM100, ``import flash_mla`` fails, triton missing, ...)."""
    try:
        from .flashmla import unavailable_reason
    except ImportError as e:
        return f"dspark.attention.flashmla cannot be imported ({e})"
    return unavailable_reason(device)


def resolve_backend(name: str, device=None, kv_cache_dtype: str = "fp8") -> str:
    """The backend name to use: ``name`` itself unless it is "auto". "auto": "flashmla" on a CUDA
    SM90 / SM100 device with an fp8 cache when ``import flash_mla`` works, else "triton" on CUDA
    and "reference" elsewhere. ``device`` defaults to CUDA when available."""
    if name != "auto":
        if name not in _BACKENDS:
            raise ValueError(f"unknown attention backend {name!r}; available: "
                             f"{', '.join(['auto'] + available_backends())}")
        return name
    device = torch.device(device if device is not None
                          else "cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        return "reference"
    if kv_cache_dtype in ("fp8", "auto") and flashmla_unavailable_reason(device) is None:
        return "flashmla"
    return "triton"


__all__ = ["AttentionBackend", "AttnMetadata", "available_backends", "flashmla_unavailable_reason",
           "get_backend", "resolve_backend"]
