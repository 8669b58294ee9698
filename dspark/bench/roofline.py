"""Bytes a DeepSeek-V4 decode step or DSpark round reads from HBM: its roofline is those bytes
over the device's copy bandwidth (benchmarks/bench_decode_v4.py measures it; ~4.2 TB/s on an
H200), and a measured step at X% of its roofline spends (100 - X)% on something else (launches,
latency-bound kernels, the host).

What counts, per forward of n tokens (`target_bytes`): every dense target tensor once, as stored
(FP8 codes + scale tiles, packed FP4 experts; bf16 tensors in the engine dtype); the routed experts
of `distinct_experts(n)` of them per layer; the embedding and hash-router rows of the n tokens; the
KV records each request's attention reads (`kv_bytes`). A DSpark round (`round_bytes`) is the
verify forward of B·(γ+1) tokens plus the draft pass (`draft_bytes`): the stages' weights for B·γ
rows (small unquantized experts run densely: all of them), the vocabulary head once (the base logits of all γ slots in one GEMM), the Markov head's W2
once per sequential step (γ reads) and the W1 rows, the stages' context windows.

Routed experts are counted at their expectation under uniform routing: n tokens each choosing k
distinct experts of E touch E·(1 - (1 - k/E)^n) of them. Random-weight checkpoints route close to
that; trained models route with locality and touch fewer, so this is the bytes of the worst
(spread-out) batch, not a bound on every batch.
"""
from __future__ import annotations

import math

import torch

from ..models.deepseek_v4.weights import stored_tensors, tensor_inventory
from ..models.drafter import DENSE_MOE_MAX_BYTES

KV_RECORD_BYTES = 584          # fp8_ds_mla record (512-d kv)
INDEXER_ROW_BYTES = 132        # fp8 indexer key row (128-d)


def distinct_experts(tokens: int, k: int, E: int) -> float:
    """Expected distinct experts `tokens` tokens touch when each picks k distinct of E uniformly
    (exactly k for one token)."""
    if tokens <= 0:
        return 0.0
    if tokens == 1:
        return float(k)
    return E * (1.0 - (1.0 - k / E) ** tokens)


def _tensor_bytes(name: str, spec, elt: int) -> int:
    if spec.kind == "bf16":           # loaded in the engine dtype
        return math.prod(spec.shape) * elt
    return sum(st.nbytes for st in stored_tensors(name, spec))


def target_bytes(cfg, dtype: torch.dtype, tokens: int = 1) -> dict:
    """Bytes of target weights one forward of `tokens` tokens reads, by category."""
    elt = torch.empty((), dtype=dtype).element_size()
    k, E, V = cfg.num_experts_per_tok, cfg.n_routed_experts, cfg.vocab_size
    frac = distinct_experts(tokens, k, E) / E
    cats = dict(attention=0, routed_experts=0, shared_experts=0, router=0, mhc_norms=0, head=0,
                embed=0)
    for name, spec in tensor_inventory(cfg).items():
        if name.startswith("mtp."):
            continue
        nb = _tensor_bytes(name, spec, elt)
        if name == "embed.weight":
            cats["embed"] += min(tokens, V) * nb / V
        elif name == "head.weight":
            cats["head"] += nb
        elif ".ffn.experts." in name:
            cats["routed_experts"] += nb * frac
        elif ".ffn.shared_experts." in name:
            cats["shared_experts"] += nb
        elif name.endswith("gate.tid2eid"):
            cats["router"] += min(tokens, V) * nb / V
        elif ".ffn.gate." in name:
            cats["router"] += nb
        elif ".attn." in name:
            cats["attention"] += nb
        else:
            cats["mhc_norms"] += nb
    cats = {c: int(v) for c, v in cats.items()}
    cats["total"] = sum(cats.values())
    return cats


def kv_bytes(cfg, context: int, kv_cache_dtype: str = "fp8") -> dict:
    """Bytes of KV cache one request's decode step at position `context` reads: the sliding
    window of every layer, the compressed records its attention gathers (CSA: the indexer's
    top-k of them, after scoring every indexer row; HCA: all)."""
    rec = {"fp8": KV_RECORD_BYTES, "bf16": 1024, "fp32": 2048}[kv_cache_dtype]
    irow = {"fp8": INDEXER_ROW_BYTES, "bf16": 256, "fp32": 512}[kv_cache_dtype]
    p = context
    out = dict(window=0, compressed=0, indexer=0)
    for i in range(cfg.num_hidden_layers):
        m = cfg.layer_ratio(i)
        out["window"] += min(p + 1, cfg.sliding_window) * rec
        if m == 4:
            n = (p + 1) // 4
            out["indexer"] += n * irow
            out["compressed"] += min(n, cfg.index_topk) * rec
        elif m > 0:
            out["compressed"] += (p + 1) // m * rec
    out["total"] = sum(out.values())
    return out


def draft_bytes(cfg, dtype: torch.dtype, batch: int = 1, context: int = 0) -> dict:
    """Bytes one batched draft pass of `batch` requests at position `context` reads (γ =
    cfg.dspark_block_size rows each), by category; the head is the target's (read again here,
    after the verify)."""
    elt = torch.empty((), dtype=dtype).element_size()
    gamma, V = cfg.dspark_block_size, cfg.vocab_size
    rows = batch * gamma
    frac = distinct_experts(rows, cfg.num_experts_per_tok, cfg.n_routed_experts) / cfg.n_routed_experts
    cats = dict(stages=0, routed_experts=0, head=0, markov=0, context=0)
    inv = tensor_inventory(cfg)
    # a stage whose routed experts are small unquantized tensors runs them densely (every row
    # through every expert, models/drafter.py DENSE_MOE_MAX_BYTES): all of them are read
    experts = {}
    for name, spec in inv.items():
        if name.startswith("mtp.") and ".ffn.experts." in name:
            st = experts.setdefault(name.split(".")[1], [0, True])
            st[0] += _tensor_bytes(name, spec, elt)
            st[1] &= spec.kind == "bf16"
    dense = {s for s, (nb, plain) in experts.items() if plain and nb <= DENSE_MOE_MAX_BYTES}
    for name, spec in inv.items():
        if name == "head.weight":
            cats["head"] += _tensor_bytes(name, spec, elt)
        if not name.startswith("mtp."):
            continue
        nb = _tensor_bytes(name, spec, elt)
        if ".ffn.experts." in name:
            cats["routed_experts"] += nb * (1.0 if name.split(".")[1] in dense else frac)
        elif name.endswith("markov_w2.weight"):
            cats["markov"] += gamma * nb                       # once per sequential step
        elif name.endswith("markov_w1.weight"):
            cats["markov"] += min(rows, V) * nb / V            # the previous tokens' rows
        else:
            cats["stages"] += nb
    # each stage attends over its request's context window (rows of head_dim in the engine dtype)
    cats["context"] = (cfg.num_dspark_stages * batch * min(context, cfg.sliding_window)
                       * cfg.head_dim * elt)
    cats = {c: int(v) for c, v in cats.items()}
    cats["total"] = sum(cats.values())
    return cats


def round_bytes(cfg, dtype: torch.dtype, batch: int = 1, context: int = 0,
                kv_cache_dtype: str = "fp8") -> dict:
    """{"verify": bytes, "draft": bytes, "total": bytes} of one DSpark round of `batch` requests
    at position `context` (a verify of γ + 1 tokens each, then the draft pass)."""
    gamma = cfg.dspark_block_size
    verify = (target_bytes(cfg, dtype, batch * (gamma + 1))["total"]
              + batch * kv_bytes(cfg, context + gamma, kv_cache_dtype)["total"])
    draft = draft_bytes(cfg, dtype, batch, context)["total"]
    return {"verify": verify, "draft": draft, "total": verify + draft}


def decode_bytes(cfg, dtype: torch.dtype, batch: int = 1, context: int = 0,
                 kv_cache_dtype: str = "fp8") -> int:
    """Bytes of one plain decode step of `batch` requests at position `context`."""
    return (target_bytes(cfg, dtype, batch)["total"]
            + batch * kv_bytes(cfg, context, kv_cache_dtype)["total"])
