"""The drafter stages' batched pieces (dspark/models/drafter.py) against the model's own modules
computed the plain way (fp32 torch), with the torch reference and with the fused kernels (the
Triton interpreter on CPU), and the launches a stage costs with the kernels CUDA picks."""
import triton_env  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)
import copy

import pytest
import torch

from dspark import Engine
from dspark.models.deepseek_v4 import norm as N
from triton_env import DEV, triton_ok


@pytest.fixture(scope="module")
def engines(tiny_ckpt):
    """{dtype name: engine} of the tiny pair on DEV, eager."""
    return {dt: Engine(tiny_ckpt, device=DEV, dtype=dt, kv_cache_dtype="fp32", cuda_graphs=False,
                       target_cuda_graphs=False) for dt in ("fp32", "bf16")}


def _reference_moe(ffn, x, ids, monkeypatch):
    """MoE.forward of an fp32 copy in torch (the per-expert loop on CPU)."""
    monkeypatch.setattr(N, "NORM_BACKEND", "reference")
    return copy.deepcopy(ffn).float()(x.float(), ids)


def _rel(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=triton_ok)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_dense_moe_with_the_shared_expert_equals_the_moe_module(engines, backend, dtype,
                                                                monkeypatch):
    """The dense draft MoE (routed and shared experts in the same two GEMMs) against MoE.forward
    (per-expert loop, shared expert apart): fp32 to summation order, bf16 to its rounding."""
    monkeypatch.setattr(N, "NORM_BACKEND", backend)
    eng = engines[dtype]
    d, ffn = eng.drafter, eng.drafter.stages[0].ffn
    torch.manual_seed(0)
    x = torch.randn(7, eng.cfg.hidden_size).to(DEV, eng.dtype)
    ids = torch.randint(0, eng.cfg.vocab_size, (7,), device=DEV)
    with torch.inference_mode():
        got = d._moe(ffn, x, ids)
        assert d._dense_expert_weights(ffn)[2]             # the shared expert was merged
        want = _reference_moe(ffn, x, ids, monkeypatch)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert _rel(got, want) < (1e-6 if dtype == "fp32" else 1e-2), _rel(got, want)


def test_dense_moe_keeps_a_shared_expert_it_cannot_merge(engines, monkeypatch):
    """A shared expert with another clamp stays apart (its own module, added after), with the
    same result as MoE.forward."""
    eng = engines["fp32"]
    ffn = copy.deepcopy(eng.drafter.stages[1].ffn)
    ffn._draft_dense = None
    ffn.shared_experts.limit = 0.5
    torch.manual_seed(1)
    x = torch.randn(6, eng.cfg.hidden_size, device=DEV) * 4
    ids = torch.zeros(6, dtype=torch.long, device=DEV)
    with torch.inference_mode():
        got = eng.drafter._moe(ffn, x, ids)
        assert not eng.drafter._dense_expert_weights(ffn)[2]
        want = _reference_moe(ffn, x, ids, monkeypatch)
    assert _rel(got, want) < 1e-6
