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


def _reference_attention(q, ring, slots, ring_pos, starts, block, sink, scale, W, cis, rope_dim,
                         dtype):
    """Plain fp32 torch: the rings gathered, the window mask, softmax with the sink column, then
    (cis) the output rounded to dtype, its last rope_dim dims rotated by cis[P + i] as complex
    numbers and rounded again."""
    T, H, D = q.shape
    R = slots.shape[0]
    G = T // R
    pos, P = ring_pos[slots], starts[:, None]
    keys = torch.cat([ring[slots].float(), block.float().view(R, G, D)], 1)
    mask = torch.cat([(pos >= 0) & (pos >= P - W) & (pos < P),
                      torch.ones(R, G, dtype=torch.bool, device=q.device)], 1)
    logits = torch.einsum("rghd,rnd->rghn", q.float().view(R, G, H, D), keys) * scale
    logits = logits.masked_fill(~mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(torch.cat([logits, sink.float().view(1, 1, H, 1).expand(R, G, H, 1)],
                                    -1), -1)[..., :-1]
    o = torch.einsum("rghn,rnd->rghd", probs, keys).reshape(T, H, D)
    if cis is None:
        return o
    o = o.to(dtype).float()
    at = (starts[:, None] + torch.arange(G, device=q.device)).flatten()
    pairs = torch.view_as_complex(o[..., D - rope_dim:].unflatten(-1, (-1, 2)).contiguous())
    rot = torch.view_as_real(pairs * cis[at][:, None, :]).flatten(-2)
    return torch.cat([o[..., :D - rope_dim].to(dtype), rot.to(dtype)], -1)


@triton_ok
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 5, 4, 512, 40, 32), (2, 3, 3, 96, 20, 8)])
def test_draft_attention_kernel_equals_torch(dtype, shape):
    """kernels.draft_attention against the plain fp32 composition: ring entries of every kind
    (in the window, older, newer, never written; slots shared by requests, a request at P = 0),
    γ·H rows not a multiple of the program's 16, a head width not a power of two. fp32 output:
    to fp32 summation order (the probabilities' split into bf16 parts is exact); rotated and
    rounded to bf16: within one rounding step."""
    from dspark.kernels.draft_attention import draft_attention
    R, G, H, D, CAP, W = shape
    torch.manual_seed(D + R)
    q = torch.randn(R * G, H, D).to(dtype).to(DEV)
    ring = torch.randn(6, CAP, D).to(dtype).to(DEV)
    ring_pos = torch.randint(-1, 60, (6, CAP)).to(DEV)
    slots = torch.tensor([2, 0, 2][:R], device=DEV)
    starts = torch.tensor([30, 0, 55][:R], device=DEV)
    # rows outside every window are never read: NaN there must not reach the output
    seen = torch.zeros(6, CAP, dtype=torch.bool, device=DEV)
    for s, P in zip(slots.tolist(), starts.tolist()):
        pos = ring_pos[s]
        seen[s] |= (pos >= 0) & (pos >= P - W) & (pos < P)
    assert seen.any() and (~seen & (ring_pos >= 0)).any()
    ring[~seen] = float("nan")
    block = torch.randn(R * G, D).to(dtype).to(DEV)
    sink = torch.randn(H, device=DEV)
    rd = 64 if D >= 128 else 32
    ang = torch.arange(128, dtype=torch.float64)[:, None] * torch.rand(rd // 2,
                                                                        dtype=torch.float64)
    cis = torch.complex(ang.cos().float(), -ang.sin().float()).to(DEV)
    args = (q, ring, slots, ring_pos, starts, block, sink, D ** -0.5, W)
    ref = (q, ring.nan_to_num(0.0), *args[2:])     # (the einsum would spread the NaN)
    got = draft_attention(*args)
    want = _reference_attention(*ref, None, 0, dtype)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    # the interpreter's fp32 dots of the split: 1-3e-7 here (2^-16 relative per probability,
    # 1.1-1.7e-6, were its low bf16 part dropped); tensor-core sums on the GPU: a margin more
    bound = 2e-6 if DEV == "cuda" else 6e-7
    assert ((got - want).abs().max() / want.abs().max()).item() < bound
    got = draft_attention(*args, cis, rd, dtype)
    want = _reference_attention(*ref, cis, rd, dtype)
    assert got.dtype == dtype
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5
    assert ((got.float() - want.float()).abs() <= ulp * want.float().abs() + 1e-6).all()
    if dtype == torch.bfloat16:        # one rounding step apart on few elements only
        assert (got != want).float().mean() < 0.01


@triton_ok
def test_fused_block_equals_the_torch_block_in_fp32(engines, monkeypatch):
    """The whole parallel block (block_hidden_batched) with the kernels (draft attention, MoE,
    mHC, norm / RoPE) against its torch composition in fp32, requests at ring-wrapping
    positions and one without context: equal to fp32 rounding."""
    eng = engines["fp32"]
    runner, d = eng.runner, eng.drafter
    W = eng.cfg.sliding_window
    states, starts = [], [0, 5, W + 3, 3 * W - 1]
    for i, P in enumerate(starts):
        _, ds = runner.new_states()
        if P:
            gen = torch.Generator().manual_seed(i)
            taps = torch.randn(P, len(eng.cfg.dspark_target_layer_ids) * eng.cfg.hidden_size,
                               generator=gen)
            runner.commit_context(ds, taps.to(DEV), 0)
        states.append(ds)
    runner.flush_context()
    anchors = torch.tensor([3, 7, 11, 2], device=DEV)
    out = {}
    with torch.inference_mode():
        for backend in ("reference", "triton"):
            monkeypatch.setattr(N, "NORM_BACKEND", backend)
            out[backend] = d.block_hidden(eng.model.embed, anchors, starts, states)
    assert _rel(out["triton"], out["reference"]) < 1e-5, _rel(out["triton"], out["reference"])
