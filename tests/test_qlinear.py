"""Quantized weights in memory: fp8_linear / fp4_linear Triton kernels (TRITON_INTERPRET=1 on CPU,
small odd shapes with partial tiles) and torch paths against de-quantize-then-F.linear, the FP4
grouped MoE against the reference MoE with de-quantized experts, the quantized engine against the
de-quantized engine on the tiny FP8+FP4 checkpoint, and the start-up memory report.
GPU tests at V4-Flash shapes are marked ``gpu`` (skipped without CUDA)."""
from triton_env import DEV, needs_cuda, triton_ok  # noqa: F401 (before triton)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dspark.kernels.fp4_moe import fp4_linear, fp4_linear_triton, fp4_moe  # noqa: E402
import dspark.kernels.fp8_gemm as fp8g  # noqa: E402
from dspark.kernels.fp8_gemm import fp8_linear, fp8_linear_triton  # noqa: E402
from dspark.formats.quant import (dequant_fp4_experts, dequant_fp8_blocks, quant_fp4,  # noqa: E402
                                 quant_fp8_blocks)


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def _spread(rows, cols, gen, group):
    """Random weights whose magnitude changes per row and per column group (distinct scales)."""
    w = torch.randn(rows, cols, generator=gen)
    ng = -(-cols // group)
    mult = torch.exp2(torch.randint(-6, 6, (rows, ng), generator=gen).float())
    return w * mult.repeat_interleave(group, 1)[:, :cols]


# ---- FP8 -----------------------------------------------------------------------------------

@triton_ok
@pytest.mark.parametrize("T,N,K,block", [
    (1, 128, 128, None),           # one tile
    (5, 200, 300, None),           # partial N and K tiles, ragged scale grid
    (17, 256, 130, (16, 64, 2)),   # T > BLOCK_M, split-K with a 2-column last tile
    (3, 96, 384, (16, 32, 3)),     # three K splits
])
def test_fp8_linear_triton_matches_dequant(T, N, K, block):
    gen = torch.Generator().manual_seed(T * 1000 + N)
    w, s = quant_fp8_blocks(_spread(N, K, gen, 128))
    x = torch.randn(T, K, generator=gen)
    ref = F.linear(x.double(), dequant_fp8_blocks(w, s).double())
    y = fp8_linear_triton(x.to(DEV), w.to(DEV), s.to(DEV), precision="ieee", block=block)
    assert y.shape == (T, N) and y.dtype == torch.float32
    assert rel_err(y.cpu(), ref) < 1e-5


@triton_ok
@pytest.mark.parametrize("T,N,K,block", [
    (1, 128, 128, None),           # one tile, one split
    (3, 200, 300, (32, 16, 3)),    # partial N and K tiles, ragged scale grid, 3 K splits
    (6, 96, 384, (32, 16, 2)),     # a verify block's 6 tokens, 2 splits
    (20, 136, 260, (64, 16, 3)),   # two token tiles, last split 4 columns wide
])
def test_fp8_skinny_matches_dequant(T, N, K, block):
    """The few-token swap-AB kernel (split K reduced in-kernel by the last-arriving split): ==
    F.linear with the de-quantized weight to fp32 summation order, through fp8_linear_triton's
    dispatch too (bf16 x -> bf16 y); the arrival counters are re-armed after every launch (a
    second launch, as a graph replay would do, gives the same result)."""
    gen = torch.Generator().manual_seed(T * 100 + N)
    w, s = quant_fp8_blocks(_spread(N, K, gen, 128))
    x = torch.randn(T, K, generator=gen)
    ref = F.linear(x.double(), dequant_fp8_blocks(w, s).double())
    x2, wu, su = fp8g.flat_operands(x.to(DEV), K, w.to(DEV), s.to(DEV))
    for _ in range(2):
        y = fp8g.fp8_skinny_triton(x2, wu, su, N, K, torch.float32, "ieee", block=block)
        assert y.shape == (T, N) and rel_err(y.cpu(), ref) < 1e-5
        assert int(fp8g._arrival_counters(y.device, 1).abs().sum()) == 0
    y2 = fp8_linear_triton(x.view(1, T, K).to(DEV), w.to(DEV), s.to(DEV))
    # default precision: fp32 x runs as TF32 MMA operands on a GPU (H200: rel 4e-4)
    assert y2.shape == (1, T, N) and rel_err(y2[0].cpu(), ref) < (1e-5 if DEV == "cpu" else 2e-3)
    yb = fp8_linear_triton(x.to(DEV).bfloat16(), w.to(DEV), s.to(DEV))
    assert yb.dtype == torch.bfloat16 and rel_err(yb.float().cpu(), ref) < 1e-2
    # the split-K MMA kernel + sum (what more than SKINNY_MAX_T tokens take) on the same rows
    y3 = fp8_linear_triton(x.to(DEV), w.to(DEV), s.to(DEV), precision="ieee",
                           block=fp8g._pick_blocks(T, N, K, fp8g.interpreting()))
    assert rel_err(y3.cpu(), ref) < (1e-5 if DEV == "cpu" else 2e-3)


@triton_ok
@pytest.mark.parametrize("block", [(32, 16, 1), (32, 16, 3)])
def test_fp8_skinny_fp16_operands_and_their_overflow_rescue(block):
    """fp16 MMA operands (the default for bf16 x on CUDA): bf16 x inside fp16's range gives the
    exact sums (to fp32 order); a token whose x overflows fp16 (> 65504) has its partials redone
    with the bf16 / exact operands, so it and the other tokens stay right (no inf / nan)."""
    T, N, K = 3, 96, 384
    gen = torch.Generator().manual_seed(5)
    w, s = quant_fp8_blocks(_spread(N, K, gen, 128))
    x = (torch.randn(T, K, generator=gen) * torch.exp2(torch.randint(-20, 4, (T, K),
                                                                     generator=gen))).bfloat16()
    wd = dequant_fp8_blocks(w, s).double()
    x2, wu, su = fp8g.flat_operands(x.to(DEV), K, w.to(DEV), s.to(DEV))
    y = fp8g.fp8_skinny_triton(x2, wu, su, N, K, torch.float32, "fp16", block=block)
    assert rel_err(y.cpu(), F.linear(x.double(), wd)) < 1e-5
    x[1, 7] = 3.0e5                                       # past fp16's range
    x2, wu, su = fp8g.flat_operands(x.to(DEV), K, w.to(DEV), s.to(DEV))
    y = fp8g.fp8_skinny_triton(x2, wu, su, N, K, torch.float32, "fp16", block=block)
    ref = F.linear(x.double(), wd)
    assert torch.isfinite(y).all() and rel_err(y.cpu(), ref) < 1e-5
    assert int(fp8g._arrival_counters(y.device, 1).abs().sum()) == 0


@triton_ok
@pytest.mark.parametrize("T,G,R,K", [(1, 2, 128, 256), (5, 3, 256, 130)])
def test_fp8_grouped_skinny_matches_per_group(T, G, R, K):
    """Grouped projection (attention wo_a) in one skinny launch: group g's rows times x[:, g]
    == the einsum of the reference with the de-quantized weight; QuantLinear.grouped uses it."""
    from dspark.models.qlinear import QuantLinear
    gen = torch.Generator().manual_seed(T + G)
    w, s = quant_fp8_blocks(_spread(G * R, K, gen, 128))
    x = torch.randn(T, G, K, generator=gen)
    ref = torch.einsum("tgi,gri->tgr", x.double(), dequant_fp8_blocks(w, s).double().view(G, R, K))
    y = fp8g.fp8_linear_grouped(x.to(DEV), w.to(DEV), s.to(DEV), G, backend="triton")
    tol = 1e-5 if DEV == "cpu" else 2e-3          # fp32 x: TF32 MMA operands on a GPU
    assert y.shape == (T, G, R) and rel_err(y.cpu(), ref) < tol
    assert fp8g.fp8_linear_grouped(x, w, s, G, backend="torch") is None      # caller's loop
    ql = QuantLinear.from_tensors(w, s, "fp8", torch.float32, "triton").to(DEV)
    assert rel_err(ql.grouped(x.to(DEV), G).cpu(), ref) < tol


def test_fp8_linear_torch_path_bit_identical_and_shapes():
    gen = torch.Generator().manual_seed(1)
    w, s = quant_fp8_blocks(_spread(136, 260, gen, 128))
    x = torch.randn(2, 3, 260, generator=gen)
    y = fp8_linear(x, w, s, backend="torch")
    assert y.shape == (2, 3, 136)
    assert torch.equal(y, F.linear(x, dequant_fp8_blocks(w, s)))
    # uint8 views of codes and scales are accepted
    assert torch.equal(fp8_linear(x, w.view(torch.uint8), s.view(torch.uint8), backend="torch"), y)
    with pytest.raises(ValueError, match="scale shape"):
        fp8_linear(x, w, s[:, :1], backend="torch")
    with pytest.raises(ValueError, match="features"):
        fp8_linear(x[..., :-1], w, s, backend="torch")


# ---- FP4 -----------------------------------------------------------------------------------

@triton_ok
@pytest.mark.parametrize("T,N,K,block", [
    (5, 40, 96, None),
    (17, 33, 70, (16, 32, 64)),     # partial 32-column group, N not a multiple of BLOCK_N
    (3, 64, 256, (16, 32, 128)),
    (2, 16, 32, (16, 16, 32)),
])
def test_fp4_linear_triton_matches_dequant(T, N, K, block):
    gen = torch.Generator().manual_seed(T * 1000 + N + K)
    w, s = quant_fp4(_spread(N, K, gen, 32))
    x = torch.randn(T, K, generator=gen)
    ref = F.linear(x.double(), dequant_fp4_experts(w, s).double())
    y = fp4_linear_triton(x.to(DEV), w.to(DEV), s.to(DEV), precision="ieee", block=block)
    assert y.shape == (T, N)
    assert rel_err(y.cpu(), ref) < 1e-5


@triton_ok
def test_fp4_every_code_decodes_exactly():
    """All 16 e2m1 codes in both nibbles, scales 2^-3..2^4: one-hot x picks single weights."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8).view(8, 32)
    s = (torch.arange(8 * 2, dtype=torch.int32).view(8, 2) % 8 + 124).to(torch.uint8) \
        .view(torch.float8_e8m0fnu)
    x = torch.eye(64)
    y = fp4_linear_triton(x.to(DEV), codes.to(DEV), s.to(DEV), precision="ieee")
    assert torch.equal(y.cpu(), dequant_fp4_experts(codes, s).t())


def _moe_case(gen, T=11, D=64, I=96, E=5, k=2, limit=0.7):
    experts, deq = [], []
    for _ in range(E):
        trip = [quant_fp4(_spread(I, D, gen, 32) * 0.1), quant_fp4(_spread(I, D, gen, 32) * 0.1),
                quant_fp4(_spread(D, I, gen, 32) * 0.1)]
        experts.append(tuple(trip))
        deq.append([dequant_fp4_experts(*t) for t in trip])
    x = torch.randn(T, D, generator=gen)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen) + 0.1
    return x, idx, w, experts, deq, limit


def _moe_reference(x, idx, w, deq, limit):
    """Spec §3.8 routed sum, per (token, slot), with de-quantized experts (float64)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            w1, w3, w2 = (m.double() for m in deq[int(idx[t, j])])
            g = (w1 @ x[t].double()).clamp(max=limit)
            u = (w3 @ x[t].double()).clamp(-limit, limit)
            out[t] += w2 @ (F.silu(g) * u * float(w[t, j]))
    return out


def test_fp4_moe_torch_matches_reference_moe():
    gen = torch.Generator().manual_seed(3)
    x, idx, w, experts, deq, limit = _moe_case(gen)
    y = fp4_moe(x, idx, w, experts, limit, backend="torch")
    assert y.dtype == torch.float32
    assert rel_err(y, _moe_reference(x, idx, w, deq, limit)) < 1e-5


@triton_ok
def test_fp4_moe_triton_matches_reference_moe():
    gen = torch.Generator().manual_seed(4)
    x, idx, w, experts, deq, limit = _moe_case(gen, T=6, D=64, I=64, E=3)
    mv = lambda t: tuple(tuple(a.to(DEV) for a in p) for p in t)  # noqa: E731
    y = fp4_moe(x.to(DEV), idx.to(DEV), w.to(DEV), [mv(e) for e in experts], limit,
                backend="triton", precision="ieee")
    assert rel_err(y.cpu(), _moe_reference(x, idx, w, deq, limit)) < 1e-5


def test_quant_linear_module_and_grouped():
    from dspark.models.qlinear import QuantLinear
    gen = torch.Generator().manual_seed(5)
    G, R, In = 2, 128, 72
    W = _spread(G * R, In, gen, 128)
    m = QuantLinear.from_tensors(*quant_fp8_blocks(W), "fp8", torch.float32)
    Wd = m.dequantized()
    x = torch.randn(4, G, In, generator=gen)
    ref = torch.einsum("tgi,gri->tgr", x, Wd.view(G, R, -1))
    assert torch.allclose(m.grouped(x, G), ref, rtol=1e-5, atol=1e-5)     # aligned: per-group GEMMs
    assert torch.equal(m(x[:, 0]), F.linear(x[:, 0], Wd))
    m4 = QuantLinear.from_tensors(*quant_fp4(W[:40, :64]), "fp4", torch.float32)
    assert torch.equal(m4(x[:, 0, :64]), F.linear(x[:, 0, :64], m4.dequantized()))
    assert torch.equal(m4.grouped(x[:, :, :64], 2),             # unaligned: de-quantize per call
                       torch.einsum("tgi,gri->tgr", x[:, :, :64], m4.dequantized().view(2, 20, -1)))


# ---- engine ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engines(tiny_quant_ckpt):
    from dspark import Engine
    kw = dict(device="cpu", dtype="fp32", kv_layout="dense")
    return Engine(tiny_quant_ckpt, **kw), Engine(tiny_quant_ckpt, weight_format="quantized", **kw)


def test_quantized_engine_logits_match_dequantized(engines):
    from dspark.models.qlinear import QuantLinear, QuantMoE
    deq, q = engines
    assert any(isinstance(m, QuantMoE) for m in q.model.modules())
    kinds = {m.kind for m in q.model.modules() if isinstance(m, QuantLinear)}
    assert kinds == {"fp8", "fp4"}
    assert isinstance(q.drafter.main_proj, QuantLinear)
    ids = [(7 * i + 3) % q.cfg.vocab_size for i in range(40)]   # crosses compressed-layer blocks
    a, b = deq.score(ids), q.score(ids)
    assert rel_err(b, a) < 1e-5


def test_same_input_fp8_linears_run_row_stacked(engines):
    """wq_a + wkv and the shared experts' w1 + w3 are row-stacked at load (one GEMM each): the
    linears hold views of the stacked bytes (no extra memory), the stacked GEMM returns each
    linear's own output, and the model with the stacks gives the same logits as without."""
    from dspark.models.deepseek_v4.attention import Attention
    from dspark.models.deepseek_v4.moe import Expert
    _, q = engines
    from dspark.models.qlinear import QuantLinear, fuse_same_input_linears
    attn = [m for m in q.model.modules() if isinstance(m, Attention)]
    assert attn and all("_fused_rows" in a.__dict__ for a in attn)
    gen = torch.Generator().manual_seed(5)
    # the tiny checkpoint's shared expert is 64 wide (not 128-row tiles: left as it is); a
    # 128-wide FP8 expert is stacked and computes what it computed before
    ex = Expert(256, 128, 0.5)
    for name in ("w1", "w2", "w3"):
        lin = getattr(ex, name)
        setattr(ex, name, QuantLinear.from_tensors(
            *quant_fp8_blocks(torch.randn(lin.out_features, lin.in_features, generator=gen)),
            "fp8", torch.float32))
    x = torch.randn(4, 256, generator=gen)
    before = ex(x)
    assert fuse_same_input_linears(ex) == 1 and torch.allclose(ex(x), before, rtol=1e-5, atol=1e-6)
    shared = [ex]
    for m, (a, b) in [(a, (a.wq_a, a.wkv)) for a in attn[:2]] + [(e, (e.w1, e.w3))
                                                                 for e in shared[:2]]:
        fused = m.__dict__["_fused_rows"]
        assert a.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
        assert b.scale.untyped_storage().data_ptr() == fused.scale.untyped_storage().data_ptr()
        x = torch.randn(3, a.in_features, generator=gen)
        ya, yb = fused(x).split((a.out_features, b.out_features), dim=-1)
        assert torch.allclose(ya, a(x), rtol=1e-5, atol=1e-6)
        assert torch.allclose(yb, b(x), rtol=1e-5, atol=1e-6)
    ids = [(5 * i + 1) % q.cfg.vocab_size for i in range(24)]
    with_stacks = q.score(ids)
    saved = {m: m.__dict__.pop("_fused_rows") for m in attn}
    try:
        assert rel_err(q.score(ids), with_stacks) < 1e-5
    finally:
        for m, f in saved.items():
            m.__dict__["_fused_rows"] = f


def test_quantized_engine_generates_like_dequantized(engines):
    from dspark import SamplingParams
    deq, q = engines
    sp = SamplingParams(temperature=0, max_tokens=10)
    assert deq.generate([5, 9, 13, 2], sp).token_ids == q.generate([5, 9, 13, 2], sp).token_ids


def test_memory_report_matches_stored_bytes(engines, tiny_quant_ckpt):
    from dspark.config import ModelConfig
    from dspark.models.deepseek_v4.weights import stored_tensors, tensor_inventory
    deq, q = engines
    cfg = ModelConfig.from_path(tiny_quant_ckpt)
    want = {"fp8": 0, "fp4": 0}
    plain = 0
    for name, spec in tensor_inventory(cfg).items():
        if spec.kind in want:
            want[spec.kind] += sum(st.nbytes for st in stored_tensors(name, spec))
        else:    # bf16 kinds are held as the engine dtype (fp32 here), the rest as stored
            n = 1
            for d in spec.shape:
                n *= d
            plain += n * (8 if spec.kind == "int64" else 4)
    rep = q.memory_report()
    assert rep["fp8"] == want["fp8"] and rep["fp4"] == want["fp4"]
    assert rep["total"] == want["fp8"] + want["fp4"] + plain
    drep = deq.memory_report()
    assert "fp8" not in drep and "fp4" not in drep
    assert drep["total"] > rep["total"]
    from dspark.models.qlinear import format_memory_report
    assert format_memory_report(rep).startswith("weights: ") and "fp8" in format_memory_report(rep)


def test_quantized_rejects_bad_weight_format(tiny_quant_ckpt):
    # weight_format="quantized" with tensor_parallel_size > 1: tests/test_distributed.py
    from dspark import Engine
    with pytest.raises(ValueError, match="weight_format"):
        Engine(tiny_quant_ckpt, weight_format="fp16")


# ---- H200, V4-Flash shapes -------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
def test_row_stacked_linears_on_cuda_gpu(tiny_quant_ckpt):
    """The row-stacked wq_a + wkv GEMM (skinny kernel, other K splits) on the GPU engine: scores
    as without the stacks (fp32 activations: the kernels' tf32 rounding apart)."""
    from dspark import Engine
    from dspark.models.deepseek_v4.attention import Attention
    q = Engine(tiny_quant_ckpt, device="cuda", dtype="fp32", weight_format="quantized",
               kv_layout="dense")
    attn = [m for m in q.model.modules() if isinstance(m, Attention)]
    assert all("_fused_rows" in a.__dict__ for a in attn)
    ids = [(5 * i + 1) % q.cfg.vocab_size for i in range(24)]
    with_stacks = q.score(ids)
    for a in attn:
        del a.__dict__["_fused_rows"]
    assert rel_err(q.score(ids), with_stacks) < 2e-3


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 16, 200, 1024])
@pytest.mark.parametrize("N,K", [(1024, 4096), (32768, 1024), (4096, 8192), (4096, 4096)])
def test_fp8_linear_flash_shapes_gpu(T, N, K):
    gen = torch.Generator().manual_seed(T + N)
    w, s = quant_fp8_blocks(_spread(N, K, gen, 128) * 0.02)
    x = torch.randn(T, K, generator=gen).to(torch.bfloat16)
    ref = F.linear(x.cuda().float(), dequant_fp8_blocks(w.cuda(), s.cuda()))
    y = fp8_linear(x.cuda(), w.cuda(), s.cuda())
    assert y.dtype == torch.bfloat16 and rel_err(y.float(), ref) < 1e-2
    y32 = fp8_linear(x.cuda().float(), w.cuda(), s.cuda(), precision="ieee")
    assert rel_err(y32, ref) < 1e-5


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 16, 256])
@pytest.mark.parametrize("N,K", [(2048, 4096), (4096, 2048)])
def test_fp4_linear_flash_shapes_gpu(T, N, K):
    gen = torch.Generator().manual_seed(T + N)
    w, s = quant_fp4(_spread(N, K, gen, 32) * 0.02)
    x = torch.randn(T, K, generator=gen).to(torch.bfloat16)
    ref = F.linear(x.cuda().float(), dequant_fp4_experts(w.cuda(), s.cuda()))
    assert rel_err(fp4_linear(x.cuda(), w.cuda(), s.cuda()).float(), ref) < 1e-2
    assert rel_err(fp4_linear(x.cuda().float(), w.cuda(), s.cuda(), precision="ieee"), ref) < 1e-5


@pytest.mark.gpu
@needs_cuda
def test_fp4_moe_flash_shapes_gpu():
    gen = torch.Generator().manual_seed(9)
    x, idx, w, experts, deq, limit = _moe_case(gen, T=64, D=4096, I=2048, E=8, k=6, limit=10.0)
    mv = lambda t: tuple(tuple(a.cuda() for a in p) for p in t)  # noqa: E731
    y = fp4_moe(x.cuda(), idx.cuda(), w.cuda(), [mv(e) for e in experts], limit, precision="ieee")
    ref = fp4_moe(x, idx, w, experts, limit, backend="torch")
    assert rel_err(y.cpu(), ref) < 1e-5


@triton_ok
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear16_skinny_equals_fp32_linear(dtype):
    """16-bit weights through the skinny kernel (the compressor projections of a decode step):
    x @ w^T with exact products and fp32 sums, partial row / column tiles and K splits."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 300, generator=gen).to(dtype)
    w = (torch.randn(80, 300, generator=gen) * 0.1).to(dtype)
    want = F.linear(x.float(), w.float())
    got = fp8g.linear16_skinny(x.to(DEV), w.to(DEV), torch.float32).cpu()
    assert got.dtype == torch.float32 and rel_err(got, want) < 1e-6
    got16 = fp8g.linear16_skinny(x.to(DEV)[None], w.to(DEV), dtype).cpu()
    # (the interpreter's fp32 -> bf16 cast truncates: one bf16 ulp there)
    assert got16.shape == (1, 3, 80) and rel_err(got16[0], want.to(dtype)) < 2 ** -7


@triton_ok
@pytest.mark.parametrize("K", [128, 384])                 # one K split / three (last arriver)
def test_linear16_skinny_argmax_and_out(K):
    """argmax_out (the vocabulary head): each program's chunk argmax in the GEMV's launch, then
    the second pass: equal to torch's argmax of the logits it wrote, ties to the first index
    (rows 5 and 70 equal, and the maximum there), the logits in `out` in place.
    Inputs are small integers: every product and partial sum (|sum| <= 12 K < 2^24) is exact in
    fp32 in any order, so the tie is a tie on every processor and BLAS kernel."""
    gen = torch.Generator().manual_seed(K)
    x = torch.randint(-2, 3, (3, K), generator=gen).to(torch.bfloat16)
    w = torch.randint(-2, 3, (100, K), generator=gen).to(torch.bfloat16)
    w[70] = w[5] = x[1] * 3            # token 1: 3 sum(x^2) >= 3 sum|x| > 2 sum|x| >= other rows
    out = torch.full((3, 100), float("nan"), device=DEV)
    am = torch.full((3,), -1, dtype=torch.long, device=DEV)
    y = fp8g.linear16_skinny(x.to(DEV), w.to(DEV), torch.float32, argmax_out=am, out=out)
    want = F.linear(x.float(), w.float())
    assert y.data_ptr() == out.data_ptr()
    assert torch.equal(out.cpu(), want)
    assert torch.equal(am.cpu(), want.argmax(-1)) and int(am[1]) == 5


def test_linear_fp32_argmax_and_out_on_the_torch_path():
    """linear_fp32(argmax_out=, out=) where no kernel applies: the same contract."""
    from dspark.models.deepseek_v4.norm import linear_fp32
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 64, generator=gen), torch.randn(50, 64, generator=gen)
    out, am = torch.empty(2, 50), torch.empty(2, dtype=torch.long)
    y = linear_fp32(x, w, head=True, argmax_out=am, out=out)
    assert y is out and torch.equal(out, F.linear(x, w)) and torch.equal(am, out.argmax(-1))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 5, 16])
def test_head_linear_skinny_at_vocabulary_size_gpu(T):
    """The vocabulary head of a decode / verify step (linear_fp32(head=True)) on the skinny
    kernel at V4-Flash's size (129280 x 4096 bf16, past LINEAR16_MAX_BYTES): fp32 logits within
    fp32 summation order of a float64 product (K = 4096 fp32 sums: ~2e-6 measured at 16 tokens),
    written in place into `out`, and the argmax of every row (argmax_out: its first pass in the
    GEMV's launch) equal to the float64 one."""
    from dspark.models.deepseek_v4.norm import linear_fp32
    gen = torch.Generator(device="cuda").manual_seed(T)
    w = (torch.randn(129280, 4096, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(T, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    assert fp8g.linear16_skinny_applies(x, w, head=True)
    assert not fp8g.linear16_skinny_applies(x, w)              # no other caller takes 1 GB
    out = torch.empty(T, 129280, device="cuda")
    am = torch.empty(T, dtype=torch.long, device="cuda")
    got = linear_fp32(x, w, head=True, argmax_out=am, out=out)
    want = (x.double() @ w.double().t())
    assert got.data_ptr() == out.data_ptr()
    assert got.dtype == torch.float32 and rel_err(got.double(), want) < 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1)) and torch.equal(am, got.argmax(-1))
