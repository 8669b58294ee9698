"""Attention backends over the paged KV cache (see backend.py for the interface).

    from dspark.attention import get_backend
    backend = get_backend("reference")(cache)       # cache: dspark.kvcache.paged.PagedKVCache
    attn_fn = backend.forward_fn(batch)             # DeepseekV4Model.forward_hidden(attn_fn=...)

Backends are imported on first use, so asking for "reference" never imports Triton.
"""
from __future__ import annotations

import importlib

from .backend import AttentionBackend
from .plan import AttnMetadata

_BACKENDS = {
    "reference": ("dspark.attention.reference", "ReferenceBackend"),
    "triton": ("dspark.attention.triton", "TritonBackend"),
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


__all__ = ["AttentionBackend", "AttnMetadata", "available_backends", "get_backend"]
