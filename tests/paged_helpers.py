"""Shared builders for the paged-cache tests (test_paged, test_rollback, test_cache_stress,
test_backends): the tiny model, a dense reference runner and a paged runner over it."""
import torch

from dspark import Engine
from dspark.attention import get_backend
from dspark.kvcache.paged import PagedKVCache
from dspark.runner import ModelRunner, QuantSim


def load_model(path, dtype="fp32", device="cpu"):
    return Engine(path, device=device, dtype=dtype, kv_cache_dtype="fp32",
                  speculative="none").model


def dense_runner(model, quant=False, device="cpu"):
    """The dense reference path (DenseState per request), QuantSim on for fp8 comparisons."""
    return ModelRunner(model, None, device, QuantSim() if quant else None)


def paged_runner(model, kv_cache_dtype="fp32", backend="reference", **cache_kw):
    kw = dict(block_size=16, num_blocks=64, max_num_seqs=4, lookahead=4, max_batch_tokens=128)
    kw.update(cache_kw)
    cache = PagedKVCache(model.cfg, kv_cache_dtype=kv_cache_dtype, **kw)
    return ModelRunner(model, None, "cpu", None, backend=get_backend(backend)(cache)), cache


def dense_logits(model, tokens, quant=False):
    """Logits of a fresh request fed `tokens` in one prefill (the 'never fed anything else'
    oracle)."""
    r = dense_runner(model, quant)
    return r.target_forward([(r.new_states()[0], 0, list(tokens))])[0]


def rel_err(a, b) -> float:
    """Max abs difference relative to the reference's largest magnitude (per call)."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


def row_rel_err(a, b) -> torch.Tensor:
    """Per-row version of rel_err: [N]."""
    a, b = a.double(), b.double()
    return (a - b).abs().amax(-1) / b.abs().amax(-1).clamp_min(1e-12)
