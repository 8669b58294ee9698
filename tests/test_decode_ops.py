"""The few-launch forms of the decode-path ops against their spec formulas: gathered MoE vs the
per-expert loop, complex-multiply RoPE vs the cos/sin formula, F.rms_norm-based RMSNorm vs the
explicit formula. All on CPU; exact where the op order is the same."""
import pytest
import torch

from dspark.config import ModelConfig
from dspark.engine import default_model_path
from dspark.models.deepseek_v4.moe import MoE
from dspark.models.deepseek_v4.norm import RMSNorm, rms_normalize
from dspark.models.deepseek_v4.rope import Rope, rope_for_layer


def make_moe(hash_layer: bool, dtype=torch.float32, seed=0, swiglu_limit=None):
    cfg = ModelConfig.from_path(default_model_path())
    if swiglu_limit is not None:
        cfg = cfg.replace(swiglu_limit=swiglu_limit)
    torch.manual_seed(seed)
    moe = MoE(cfg, hash_layer)
    moe.gathered_devices = ("cpu", "cuda")     # the CPU default is the per-expert loop
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
        if hash_layer:
            moe.gate.tid2eid.copy_(torch.randint(0, cfg.n_routed_experts, moe.gate.tid2eid.shape))
    return cfg, moe.to(dtype)


def assert_close_to_scale(got, want, rel=1e-5):
    """Max |Δ| relative to the output's scale: sums of signed terms cancel element-wise."""
    err = (got.double() - want.double()).abs().max().item()
    assert err <= rel * want.double().abs().max().item(), err


def routed_both_ways(moe, x, ids, fixed=lambda m: m._routed_gathered):
    idx, w = moe.gate(x, ids)
    stack = moe._expert_stack()
    assert stack is not None
    return fixed(moe)(x, idx, w, *stack), moe._routed_per_expert(x, idx, w)


def test_moe_gathered_equals_per_expert_loop():
    for hash_layer in (False, True):
        for limit in (None, 0.3):           # 0.3: the SwiGLU clamps are active
            cfg, moe = make_moe(hash_layer, swiglu_limit=limit)
            for T in (1, 6, 40):
                x = torch.randn(T, cfg.hidden_size)
                ids = torch.randint(0, cfg.vocab_size, (T,))
                with torch.no_grad():
                    got, want = routed_both_ways(moe, x, ids)
                assert_close_to_scale(got, want)


def test_moe_dense_equals_per_expert_loop():
    """Every expert on every token (zero off the route): the fixed-shape path of large batches."""
    for hash_layer in (False, True):
        for limit in (None, 0.3):
            cfg, moe = make_moe(hash_layer, swiglu_limit=limit)
            for T in (1, 7, 300):
                x = torch.randn(T, cfg.hidden_size)
                ids = torch.randint(0, cfg.vocab_size, (T,))
                with torch.no_grad():
                    got, want = routed_both_ways(moe, x, ids, lambda m: m._routed_dense)
                assert_close_to_scale(got, want)


def test_moe_dense_bf16_rounds_like_the_loop():
    cfg, moe = make_moe(False, torch.bfloat16)
    x = torch.randn(40, cfg.hidden_size).bfloat16()
    with torch.no_grad():
        got, want = routed_both_ways(moe, x, torch.zeros(40, dtype=torch.long),
                                     lambda m: m._routed_dense)
    assert_close_to_scale(got, want, 1e-6)


def test_moe_gathered_bf16_rounds_like_the_loop():
    cfg, moe = make_moe(False, torch.bfloat16)
    x = torch.randn(6, cfg.hidden_size).bfloat16()
    with torch.no_grad():
        got, want = routed_both_ways(moe, x, torch.zeros(6, dtype=torch.long))
    # per-expert outputs are rounded to bf16 before the fp32 sum in both forms
    assert_close_to_scale(got, want, 1e-6)


def test_moe_path_choice_and_stale_stack():
    cfg, moe = make_moe(False)
    x = torch.randn(3, cfg.hidden_size)
    ids = torch.zeros(3, dtype=torch.long)
    with torch.no_grad():
        assert MoE(cfg, False)._expert_stack() is None     # CPU default: the per-expert loop
        assert MoE(cfg, False).routed_path(3, 2) == ("loop", None)
        assert moe.routed_path(3, 2)[0] == "gathered"
        first = moe(x, ids)
        w13, _ = moe._expert_stack()
        moe.experts[2].w3.weight.mul_(2)           # in place: the cached stack must not be used
        assert moe._expert_stack()[0] is not w13
        moe.gather_max_bytes = 0                   # too many tokens to gather: every expert
        assert moe.routed_path(3, 2)[0] == "dense"
        dense = moe(x, ids)
        moe.dense_max_bytes = 0                    # and too many for that: the per-expert loop
        assert moe.routed_path(3, 2) == ("loop", None)
        looped = moe(x, ids)
        moe.gather_max_bytes, moe.dense_max_bytes = MoE.gather_max_bytes, MoE.dense_max_bytes
        assert moe._expert_stack() is not None
        assert_close_to_scale(moe(x, ids), looped)
        assert_close_to_scale(dense, looped)
    assert not torch.equal(first, looped)
    # with gradients wanted the loop runs (the stack is detached), and experts get gradients
    assert moe._expert_stack() is None
    moe(x, ids).sum().backward()
    assert any(e.w1.weight.grad is not None for e in moe.experts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_moe_gathered_is_the_default_and_matches_loop():
    cfg, moe = make_moe(False, torch.bfloat16)
    moe = moe.cuda()
    moe.gathered_devices = MoE.gathered_devices
    x = torch.randn(6, cfg.hidden_size, device="cuda").bfloat16()
    with torch.no_grad():
        got, want = routed_both_ways(moe, x, torch.zeros(6, dtype=torch.long, device="cuda"))
    assert_close_to_scale(got, want, 1e-3)      # bf16 per-expert outputs may round differently


def rope_formula(rope, x, positions, inverse=False):
    """Interleaved rotation of the last rope_dim dims, angles in float64 (spec §3.3)."""
    ang = positions.double()[:, None] * rope.freqs[None, :]
    cos, sin = ang.cos().float(), ang.sin().float()
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if inverse:
        sin = -sin
    r = rope.rope_dim
    pairs = x[..., -r:].float().unflatten(-1, (r // 2, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    out = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-r], out.to(x.dtype)), dim=-1)


def test_rope_complex_multiply_equals_formula():
    yarn = dict(factor=16.0, original_seq_len=65536, beta_fast=32.0, beta_slow=1.0)
    for rope in (Rope(64, 10000.0), Rope(64, 160000.0, yarn)):
        for dtype in (torch.float32, torch.bfloat16):
            for shape in ((7, 4, 512), (7, 512), (7, 128)):
                x = torch.randn(*shape).to(dtype)
                pos = torch.randint(0, 5000, (7,))
                for inverse in (False, True):
                    torch.testing.assert_close(rope.apply(x, pos, inverse),
                                               rope_formula(rope, x, pos, inverse),
                                               rtol=1e-6, atol=1e-6)
        odd = torch.randn(3, 2, 513)[..., 1:]          # odd storage offset: needs a copy
        pos = torch.tensor([0, 300, 9000])              # beyond the first table size: it grows
        torch.testing.assert_close(rope.apply(odd, pos), rope_formula(rope, odd, pos))


def test_rope_shared_per_layer_kind():
    cfg = ModelConfig.from_path(default_model_path())
    assert rope_for_layer(cfg, 0) is rope_for_layer(cfg, 0)
    assert rope_for_layer(cfg, 4) is rope_for_layer(cfg, 128)
    assert rope_for_layer(cfg, 0) is not rope_for_layer(cfg, 4)
    assert rope_for_layer(cfg.replace(compress_rope_theta=1e5), 4) is not rope_for_layer(cfg, 4)


def test_rms_norm_equals_formula():
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(5, 3, 96) * 3).to(dtype)
        xf = x.float()
        want = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        torch.testing.assert_close(rms_normalize(x, 1e-6), want, rtol=1e-6, atol=1e-6)
        norm = RMSNorm(96, 1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(96))
        norm = norm.to(dtype)
        torch.testing.assert_close(norm(x), (want * norm.weight.float()).to(dtype),
                                   rtol=1e-6, atol=1e-6)


def test_gated_pool_equals_slot_softmax_formula():
    from dspark.models.deepseek_v4.compressor import gated_pool
    a, z = torch.randn(3, 8, 40), torch.randn(3, 8, 40) * 4
    z[0, :4] = float("-inf")                   # entry 0's empty overlap half
    torch.testing.assert_close(gated_pool(a, z), (torch.softmax(z, dim=1) * a).sum(1),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_moe_dense_matches_loop_and_captures():
    """The dense path (batches past the gather's limit) matches the loop and runs inside a CUDA
    graph capture (no host sync), where the loop's `.tolist()` cannot."""
    cfg, moe = make_moe(False, torch.bfloat16)
    moe = moe.cuda()
    moe.gathered_devices = MoE.gathered_devices
    T = 384
    x = torch.randn(T, cfg.hidden_size, device="cuda").bfloat16()
    ids = torch.zeros(T, dtype=torch.long, device="cuda")
    moe.gather_max_bytes = 0
    with torch.no_grad():
        assert moe.routed_path(T, cfg.num_experts_per_tok)[0] == "dense"
        got, want = routed_both_ways(moe, x, ids, lambda m: m._routed_dense)
        assert_close_to_scale(got, want, 1e-3)
        eager = moe(x, ids)
        from dspark.cuda.graph_capture import capture, warm_up
        warm_up(lambda: moe(x, ids))
        graph, out = capture(lambda: moe(x, ids), torch.cuda.graph_pool_handle())
        graph.replay()
        assert torch.equal(out, eager)
