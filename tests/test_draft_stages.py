"""The drafter stages' batched pieces (dspark/models/drafter.py) against the model's own modules
computed the plain way (fp32 torch), with the torch reference and with the fused kernels (the
Triton interpreter on CPU), and the launches a stage costs with the kernels CUDA picks."""
import triton_env  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)
import copy

import pytest
import torch

from dspark import Engine
from dspark.models.deepseek_v4 import norm as N
from triton_env import DEV, interpreter_ok, triton_ok


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
    """kernels.draft_attention (fp32 operands on CUDA too, where the drafter does not pick it)
    against the plain fp32 composition: ring entries of every kind
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
    # one rounding step of the value rotated: of its pair's magnitude (the rotation's sum may
    # cancel below it), e.g. o rounded one step apart before the rotation
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5
    mag = want.float().abs()
    pair = want.float()[..., D - rd:].unflatten(-1, (-1, 2)).norm(dim=-1, keepdim=True)
    mag[..., D - rd:] = pair.expand(-1, -1, -1, 2).flatten(-2)
    assert ((got.float() - want.float()).abs() <= ulp * mag + 1e-6).all()
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


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=triton_ok)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_context_rows_equal_every_stage_projected_apart(engines, backend, dtype, monkeypatch):
    """context_rows (the stages' wkv as one GEMM, their kv norms + RoPE in one launch, the
    storage rounding once) against each stage's own `project_kv` with the fp8 record rounding,
    in the torch reference: fp32 to rounding, bf16 within one rounding step."""
    from dspark.models.draft_block import context_rows
    from dspark.runner import QuantSim
    eng = engines[dtype]
    d = eng.drafter
    torch.manual_seed(5)
    x = torch.randn(9, eng.cfg.hidden_size).to(DEV, eng.dtype)
    pos = torch.tensor([0, 1, 2, 77, 130, 131, 400, 3, 9], device=DEV)
    with torch.inference_mode():
        monkeypatch.setattr(N, "NORM_BACKEND", backend)
        with d.rope_bound(401, DEV):
            got = context_rows(d, x, pos, QuantSim())
        monkeypatch.setattr(N, "NORM_BACKEND", "reference")
        want = torch.stack([st.attn.project_kv(x, pos, QuantSim()) for st in d.stages], 1)
    assert got.shape == (9, len(d.stages), d.stages[0].attn.head_dim) and got.dtype == x.dtype
    if dtype == "fp32":
        # fp32 to rounding, except where that moved a value across an fp8 rounding boundary
        close = (got - want).abs() <= 1e-5 * want.abs() + 1e-6
        assert close.float().mean() > 0.999, close.float().mean()
    else:
        ulp = (got.float() - want.float()).abs() <= 2.0 ** -7 * want.float().abs() + 1e-6
        assert ulp.float().mean() > 0.99 and (got != want).float().mean() < 0.02


@interpreter_ok
def test_launch_census_of_the_parallel_block_and_the_context_write(tiny_ckpt):
    """benchmarks/count_draft_launches.py on the tiny pair (3 stages; bf16, fp8 records, the
    kernels CUDA picks): the draft pass's parallel block and one context write launch exactly
    what their fused form should. Per stage 17: attn hc_pre (Sinkhorn), wq_a + wkv GEMM, q_norm,
    wq_b, q norm + RoPE, kv norm + RoPE, fp8 rounding, attention (+ inverse RoPE), wo_a, wo_b,
    hc_post, ffn hc_pre, gate, w13 GEMM, SwiGLU, w2 GEMM, hc_post; per pass 6: positions, ids,
    hc_expand, hc_head, the base logits' norm and GEMM. Context write 8: main_proj, main_norm,
    the stacked wkv GEMM, every stage's norm + RoPE, the fp8 rounding, the ring index, the two
    stores. (The Markov loop after the block is not counted here.)"""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    import count_draft_launches as census
    rows = census.census(batch=1, temperature=1.0, path=tiny_ckpt)
    markov = ("markov_step", "_sample_block", "_draft")
    block = [r for r in rows if r[0] == "draft" and r[1] != "sync"
             and (r[4] or "? ?").split()[1] not in markov]
    S = 3
    assert len(block) == 17 * S + 6, _table(census, block)
    assert sum(r[0] == "context" and r[1] != "sync" for r in rows) == 8
    assert not any(r[1] == "sync" for r in rows)                 # nothing read back


def _table(census, rows) -> str:
    import io
    out = io.StringIO()
    census.report(rows, out=out)
    return out.getvalue()
