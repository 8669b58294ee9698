"""The bytes a DSpark round reads (dspark/bench/roofline.py), against exact enumeration and the
checkpoint's own tensor sizes."""
import itertools
import math

import pytest
import torch

from dspark.bench.roofline import (distinct_experts, draft_bytes, kv_bytes, round_bytes,
                                   target_bytes)
from dspark.models.deepseek_v4.weights import tensor_inventory
from dspark.tools import make_checkpoint as mc


@pytest.mark.parametrize("E,k,n", [(5, 2, 1), (5, 2, 2), (5, 2, 3), (4, 1, 3), (6, 3, 2)])
def test_distinct_experts_is_the_mean_over_every_routing(E, k, n):
    """Every token's k-subset of E equally likely: the mean count of distinct experts over all
    C(E, k)^n routings, enumerated."""
    subsets = list(itertools.combinations(range(E), k))
    counts = [len(set().union(*r)) for r in itertools.product(subsets, repeat=n)]
    assert distinct_experts(n, k, E) == pytest.approx(sum(counts) / len(counts), rel=1e-12)


def test_round_bytes_add_up_from_the_tensors():
    cfg = mc.preset_config("tiny", dtype="fp8", fp4_experts=True, dspark=True)
    dt, B, ctx, g = torch.bfloat16, 3, 40, cfg.dspark_block_size
    inv = tensor_inventory(cfg)
    w2 = next(n for n in inv if n.endswith("markov_w2.weight"))
    w1 = next(n for n in inv if n.endswith("markov_w1.weight"))
    V, r = inv[w2].shape
    d = draft_bytes(cfg, dt, B, ctx)
    # bf16 tables read in the engine dtype: W2 once per Markov step, one W1 row per draft row
    assert d["markov"] == g * V * r * 2 + B * g * r * 2
    assert d["head"] == target_bytes(cfg, dt, 1)["head"] == cfg.vocab_size * cfg.hidden_size * 2
    assert d["context"] == cfg.num_dspark_stages * B * min(ctx, cfg.sliding_window) * cfg.head_dim * 2
    assert d["total"] == sum(v for c, v in d.items() if c != "total")
    rb = round_bytes(cfg, dt, B, ctx)
    assert rb["verify"] == (target_bytes(cfg, dt, B * (g + 1))["total"]
                            + B * kv_bytes(cfg, ctx + g)["total"])
    assert rb["draft"] == d["total"] and rb["total"] == rb["verify"] + rb["draft"]
    # more tokens touch more routed experts, never more than all of them
    t1, tn, tall = (target_bytes(cfg, dt, n)["routed_experts"] for n in (1, B * (g + 1), 10 ** 6))
    assert t1 < tn <= tall
    assert math.isclose(tall / t1, cfg.n_routed_experts / cfg.num_experts_per_tok, rel_tol=1e-6)


def test_small_unquantized_draft_experts_are_all_read():
    """A drafter whose routed experts run densely (models/drafter.py DENSE_MOE_MAX_BYTES) reads
    every expert whatever the batch; quantized ones are counted by the routing expectation."""
    dense = mc.preset_config("tiny", dspark=True)
    inv = tensor_inventory(dense)
    every = sum(math.prod(s.shape) * 2 for n, s in inv.items()
                if n.startswith("mtp.") and ".ffn.experts." in n)
    assert draft_bytes(dense, torch.bfloat16, 1)["routed_experts"] == every
    quant = mc.preset_config("tiny", dtype="fp8", fp4_experts=True, dspark=True)
    one, many = (draft_bytes(quant, torch.bfloat16, b)["routed_experts"] for b in (1, 8))
    assert one < many
