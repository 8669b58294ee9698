"""The Qwen3 (DeepSpec) draft pass on its fused kernels (dspark/models/dspark_qwen3_fused.py,
dspark/kernels/qwen3_draft.py, dspark/kernels/gqa_draft_attention.py), under the Triton
interpreter on CPU in fp32: the pass equals the per-request reference (block_hidden + markov_step
over per-request DraftContexts), the context write fills the pool as the torch path does, the
attention equals a brute-force softmax, and the launch census is what the fused form should be."""
import triton_env  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

import pytest
import torch

from test_dspark_qwen3_pass import PARAMS, _setup, _taps, pairs, per_request_draft  # noqa: F401
from triton_env import DEV, interpreter_ok, triton_ok

from dspark.kernels.gqa_draft_attention import gqa_draft_attention
from dspark.models.dspark_qwen3_fused import stack_projections, stacked


@triton_ok
@pytest.mark.parametrize("head", ["vanilla", "rnn"])
@torch.inference_mode()
def test_fused_pass_equals_per_request(pairs, head):
    drafter, dp, pooled, ref, ref_runner = _setup(pairs[head], PARAMS, device=DEV,
                                                  kernels="triton")
    toks, q, conf = dp(pooled)
    want = per_request_draft(ref_runner, ref)
    for i, b in enumerate(want):
        assert torch.equal(toks[i], b.tokens), (i, toks[i], b.tokens)
        torch.testing.assert_close(conf[i], b.conf_logits, rtol=1e-5, atol=1e-5)
        if b.probs is not None:
            torch.testing.assert_close(q[i], b.probs, rtol=1e-5, atol=1e-6)


@triton_ok
@torch.inference_mode()
def test_fused_context_write_equals_torch(pairs):
    drafter, fused, pooled, _, _ = _setup(pairs["vanilla"], PARAMS, device=DEV, kernels="triton")
    _, plain, _, _, _ = _setup(pairs["vanilla"], PARAMS, device=DEV, kernels="torch")
    for a, b in zip(fused.pool.kv, plain.pool.kv):        # the whole prefill, both ways
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    slots = [pooled[0].draft_state.slot] * 3 + [pooled[2].draft_state.slot] * 2
    positions, taps = [53, 54, 55, 300, 301], [_taps(drafter, 5, 7).to(DEV)]
    for dp in (fused, plain):
        dp.write_context(slots, positions, taps)
    for a, b in zip(fused.pool.kv, plain.pool.kv):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_stacked_projections_are_views_of_one_weight(pairs):
    drafter, _, _, _, _ = _setup(pairs["gated"], PARAMS[:1])
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    stack_projections(drafter)
    after = drafter.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    a = drafter.layers[1].self_attn
    w = stacked((a.q_proj, a.k_proj, a.v_proj))
    assert w is stacked((a.q_proj, a.k_proj, a.v_proj))     # made once
    assert a.k_proj.weight.data_ptr() == w[a.q_proj.weight.shape[0]:].data_ptr()


@triton_ok
@pytest.mark.parametrize("starts", [[0, 5], [130, 64]])
def test_gqa_draft_attention_equals_brute_force(starts):
    g = torch.Generator().manual_seed(0)
    R, G, Hq, Hkv, D, rows = 2, 3, 6, 2, 16, 160
    q = torch.randn(R * G, Hq, D, generator=g)
    pk, pv = torch.randn(2, 4, rows, Hkv, D, generator=g)
    qkv = torch.randn(R * G, 2 * Hkv + 1, D, generator=g)    # block k / v as strided views
    k, v = qkv[:, 1:1 + Hkv], qkv[:, 1 + Hkv:]
    slots = torch.tensor([3, 1])
    qkv_dev = qkv.to(DEV)                                    # the same strided views there
    out = gqa_draft_attention(q.to(DEV), pk.to(DEV), pv.to(DEV), slots.to(DEV),
                              torch.tensor(starts, device=DEV), qkv_dev[:, 1:1 + Hkv],
                              qkv_dev[:, 1 + Hkv:]).cpu()
    for r, (s, P) in enumerate(zip(slots.tolist(), starts)):
        blk = slice(r * G, (r + 1) * G)
        K = torch.cat([pk[s, :P], k[blk]]).double()
        V = torch.cat([pv[s, :P], v[blk]]).double()
        for h in range(Hq):
            kv = h // (Hq // Hkv)
            w = torch.softmax(q[blk, h].double() @ K[:, kv].T / D ** 0.5, -1)
            torch.testing.assert_close(out[blk, h].double(), w @ V[:, kv], rtol=1e-5, atol=1e-5)


@interpreter_ok
@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_launch_census_of_the_qwen3_draft_pass_and_context_write(tmp_path, head):
    """benchmarks/count_draft_launches.py --qwen3 (5 draft layers, γ = 7, bf16, batch 1, T = 1):
    the block 2 + 9 per layer (block_embed, first norm; per layer the stacked q|k|v GEMM,
    q/k norm + RoPE, attention, o GEMM, add + norm, gate|up GEMM, SwiGLU, down GEMM, add + norm);
    the context write 2 + 2 per layer (fc GEMM, hidden norm; per layer the k|v GEMM and the
    norm + RoPE + pool store). The whole pass, vanilla head: the block, the base logits (GEMM,
    cast), the confidences' hidden part (cast, GEMM), the uniforms (positions, a copy, the hash),
    2 per Markov step (markov_step, fused_sample) and the outputs' 3 stacks. Gated / rnn heads
    keep the torch head step (their totals pinned here so that a change shows)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    import count_draft_launches as census
    rows = census.census(batch=1, temperature=1.0, path=census.qwen3_pair(str(tmp_path), head))
    block = [r for r in rows if r[0] == "draft" and r[1] != "sync"
             and (r[4] or "").endswith("block_hidden_fused")]
    assert len(block) == 2 + 9 * 5, _table(census, block)
    draft = [r for r in rows if r[0] == "draft" and r[1] != "sync"]
    assert len(draft) == {"vanilla": 47 + 2 + 2 + 3 + 2 * 7 + 3, "gated": 160, "rnn": 196}[head], \
        _table(census, draft)
    assert sum(r[0] == "context" and r[1] != "sync" for r in rows) == 2 + 2 * 5
    assert not any(r[1] == "sync" for r in rows)                 # nothing read back


def _table(census, rows) -> str:
    import io
    out = io.StringIO()
    census.report(rows, out=out)
    return out.getvalue()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.inference_mode()
def test_gpu_bf16_fused_pass_equals_the_torch_pass(pairs):
    """bf16 on CUDA (the interpreter's fp32 -> bf16 casts do not round to nearest, so the CPU
    tests run fp32): the fused pass against the torch pass on the same pool contents. bf16
    roundings in another order through 5 layers: confidences and q to a few percent of their
    block together; greedy rows' slot 0 the same token (a sampled draw of these near-uniform
    random weights may move with q's last bits: one of 6 did on the H200)."""
    runs = {}
    for kernels in ("triton", "torch"):
        _, dp, pooled, _, _ = _setup(pairs["vanilla"], PARAMS, device="cuda", kernels=kernels,
                                     dtype=torch.bfloat16)
        runs[kernels] = dp(pooled)
    (toks, q, conf), (toks_t, q_t, conf_t) = runs["triton"], runs["torch"]
    greedy = torch.tensor([PARAMS[i % len(PARAMS)].greedy for i in range(toks.shape[0])])
    assert greedy.any() and torch.equal(toks[greedy.to(toks.device), 0],
                                        toks_t[greedy.to(toks.device), 0])
    assert (toks != toks_t).float().mean() <= 0.2
    for got, want in ((conf, conf_t), (q, q_t)):
        if want is None:
            continue
        got, want = got[:, 0].float(), want[:, 0].float()
        assert (got - want).norm() <= 5e-2 * want.norm(), ((got - want).norm(), want.norm())
