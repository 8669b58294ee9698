"""Tensor-core few-token FP8 linears (`fp8_gemv_tc`, the default for 1-16 bf16 tokens on CUDA
sm_90+): inline PTX (mma.sync), so on CPU only the pure-Python parts run. On the GPU: y against
a float64 product of the de-quantized weights (every e4m3 code, 1-16 tokens, grouped rows, K
splits, warps per program, steps per asm block), the bf16 rescue of an x past fp16's range,
the dispatch from fp8_linear, and CUDA graph replay == eager, bit for bit.
"""
from triton_env import DEV, needs_cuda  # noqa: F401 (before triton)

import re  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import dspark.kernels.fp8_gemv_tc as tc  # noqa: E402
from dspark.kernels.fp8_gemm import fp8_linear  # noqa: E402
import dspark.kernels.fp8_gemm as fp8g  # noqa: E402


def test_ptx_blocks_match_their_constraints():
    """Every step block names exactly its constraint string's operands (pack 4: four registers
    per tensor, a scalar's other three unread), has 8 MMAs per n-tile and step, reads the lane
    id from the hardware, and the bf16 variant converts through fp32."""
    for nt in (1, 2):
        cons = tc._constraints(nt).split(",")
        for u in (1, 2, 4):
            for bf16 in (False, True):
                asm = tc._step_asm(nt, u, bf16)
                used = {int(i) for i in re.findall(r"\$(\d+)", asm)}
                assert max(used) + 4 == len(cons) and "%laneid" in asm and "%tid.x" in asm
                assert asm.count("mma.sync") == 8 * nt * u
                assert asm.count("cvt.rn.f16x2.e4m3x2") == 32 * u
                assert asm.count(".bf16.bf16.f32") == (8 * nt * u if bf16 else 0)
                assert asm.count("ld.global.nc.v4") == (4 + 4 * nt) * u
        given = tc._step_asm(nt, 1, given=True)          # the PDL preload's step (weights given)
        cons = tc._constraints(nt, given=True).split(",")
        used = {int(i) for i in re.findall(r"\$(\d+)", given)}
        assert max(used) + 4 == len(cons) and given.count("mma.sync") == 8 * nt
        assert given.count("ld.global.nc.v4") == 4 * nt and "ld.global.nc.u8" not in given
        store = tc._store_asm(nt)
        used = {int(i) for i in re.findall(r"\$(\d+)", store)}
        assert max(used) + 4 == len(tc._store_constraints(nt).split(","))
        assert store.count("st.global.f32") == 4 * nt
        launch = tc._launch_strings(nt, 2)               # built once per (n-tiles, steps)
        assert launch is tc._launch_strings(nt, 2) and launch["ASM"] == tc._step_asm(nt, 2)
        assert launch["ASM_BF16"] == tc._step_asm(nt, 2, True) and launch["STORE"] == store


def test_preload_block_matches_its_constraints():
    """The PDL preload: the step's 4 weight loads and its scale byte into the 20 output
    registers the given-weights step reads in the same order (words 0-15, then the scale)."""
    pre = tc._preload_asm()
    cons = tc._PRELOAD_CONS.split(",")
    used = {int(i) for i in re.findall(r"\$(\d+)", pre)}
    assert max(used) + 4 == len(cons) and cons[:20] == ["=r"] * 20
    assert pre.count("ld.global.nc.v4") == 4 and pre.count("ld.global.nc.u8 $16") == 1
    assert "mma" not in pre and "%laneid" in pre
    given = tc._step_asm(1, 1, given=True)
    for i in range(17):                                  # words then the scale, as loaded
        assert f"${8 + i};" in given


def test_plan_splits_k_to_the_target():
    # (warps, steps per block, K splits, columns per split)
    assert tc._plan(32768, 1024, 1, 1, 2, 2048) == (1, 2, 1, 1024)      # wq_b: rows suffice
    assert tc._plan(4096, 8192, 1, 1, 2, 2048) == (1, 2, 8, 1024)       # wo_b: 256 tiles x 8
    assert tc._plan(1536, 4096, 1, 1, 2, 2048) == (1, 2, 16, 256)       # wq_a + wkv
    assert tc._plan(640, 640, 1, 1, 2, 2048) == (1, 1, 5, 128)          # 5 steps: unroll 1
    assert tc._plan(8192, 4096, 8, 4, 2, 2048) == (4, 2, 4, 1024)       # wo_a, 1024 rows a group
    assert tc._plan(48, 1024, 1, 4, 4, 2048) == (1, 4, 2, 512)          # 48 rows: 1 warp


def test_applies_only_to_bf16_on_cuda():
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    w = torch.zeros(32, 256, dtype=torch.uint8)
    assert not tc.tc_applies(x, w, 32, 256)                             # CPU tensors
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        xc, wc = x.cuda(), w.cuda()
        assert tc.tc_applies(xc, wc, 32, 256)
        assert not tc.tc_applies(xc.float(), wc, 32, 256)
        assert not tc.tc_applies(torch.zeros(17, 256, dtype=torch.bfloat16, device="cuda"), wc,
                                 32, 256)
        assert not tc.tc_applies(xc[:, :200], wc[:, :200], 32, 200)     # not whole steps


def _weights(gen, N, K, lo=100, hi=140):
    """Random e4m3 codes (every finite one: 0x7F / 0xFF are NaN) and UE8M0 scales in [lo, hi]."""
    codes = torch.randint(0, 256, (N, K), generator=gen, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes).to(torch.uint8)
    scales = torch.randint(lo, hi + 1, ((N + 127) // 128, (K + 127) // 128), generator=gen,
                           dtype=torch.int32).to(torch.uint8)
    return codes, scales


def _dequant64(codes, scales):
    w = codes.view(torch.float8_e4m3fn).double()
    s = torch.exp2(scales.double() - 127)
    return w * s.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]]


def _reference(x, codes, scales, groups):
    """float64 y [T, N] and the sum of |terms| per output (the accumulation error's scale)."""
    w = _dequant64(codes, scales)
    T, N = x.shape[0], w.shape[0]
    xd = x.double().cpu().reshape(T, groups, -1)
    wg = w.view(groups, N // groups, -1)
    y = torch.einsum("tgk,gnk->tgn", xd, wg).reshape(T, N)
    mag = torch.einsum("tgk,gnk->tgn", xd.abs(), wg.abs()).reshape(T, N)
    return y, mag


def _close(y, ref, mag):
    """Within half a bf16 step of ref (the output rounding) plus fp32 accumulation error."""
    y = y.double().cpu()
    return bool(((y - ref).abs() <= ref.abs() * 2 ** -8 + mag * 2 ** -20 + 1e-30).all())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("N,K,groups", [(256, 1024, 1), (1536, 4096, 1), (384, 640, 1),
                                        (1024, 512, 4)])
@pytest.mark.parametrize("T", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("plan", [dict(), dict(unroll=1, target=64), dict(warps=2, unroll=4),
                                  dict(warps=4, target=100000)])
def test_matches_float64_gpu(N, K, groups, T, plan):
    gen = torch.Generator().manual_seed(N + K + T)
    codes, scales = _weights(gen, N, K)
    x = torch.randn(T, groups, K, generator=gen).to(torch.bfloat16)
    x2 = x.cuda() if groups > 1 else x[:, 0].cuda()
    y = tc.fp8_gemv_tc(x2, codes.cuda(), scales.cuda(), N, K, groups, **plan)
    assert y.shape == (T, N) and y.dtype == torch.bfloat16
    ref, mag = _reference(x, codes, scales, groups)
    assert _close(y, ref, mag), (y.double().cpu() - ref).abs().max()


@pytest.mark.gpu
@needs_cuda
def test_rescue_past_fp16_range_gpu():
    """An x of 1e5 (inf in fp16): the program redoes its sums with bf16 operands."""
    gen = torch.Generator().manual_seed(1)
    N, K = 512, 2048
    codes, scales = _weights(gen, N, K, 110, 125)
    x = torch.randn(2, 1, K, generator=gen)
    x[1, 0, 77] = 1e5
    x[0, 0, 1500] = -7e4
    x = x.to(torch.bfloat16)
    y = tc.fp8_gemv_tc(x[:, 0].cuda(), codes.cuda(), scales.cuda(), N, K, target=256)
    assert torch.isfinite(y).all()
    ref, mag = _reference(x, codes, scales, 1)
    assert _close(y, ref, mag)


@pytest.mark.gpu
@needs_cuda
def test_dispatch_and_graph_replay_gpu():
    """fp8_linear takes this kernel for 1-8 bf16 tokens (bit-equal to calling it), the skinny
    kernel on the same operands equals it up to summation order; a CUDA graph of split launches
    replays bit-equal to eager, and repeated calls are deterministic."""
    gen = torch.Generator().manual_seed(2)
    N, K = 2048, 4096
    codes, scales = _weights(gen, N, K)
    w = codes.cuda().view(torch.float8_e4m3fn)
    s = scales.cuda().view(torch.float8_e8m0fnu) if hasattr(torch, "float8_e8m0fnu") \
        else scales.cuda()
    x = torch.randn(4, K, generator=gen).to(torch.bfloat16).cuda()
    y = fp8_linear(x, w, s)
    direct = tc.fp8_gemv_tc(x, codes.cuda(), scales.cuda(), N, K)
    assert torch.equal(y, direct)
    skinny = fp8g.fp8_skinny_triton(x, codes.cuda(), scales.cuda(), N, K, x.dtype, "fp16",
                                    tc=False)
    ref, mag = _reference(x.cpu()[:, None], codes, scales, 1)
    assert _close(skinny, ref, mag) and _close(y, ref, mag)
    assert tc._plan(N, K, 1, None, None, None)[2] > 1              # split launches
    eager = [tc.fp8_gemv_tc(x, codes.cuda(), scales.cuda(), N, K) for _ in range(3)]
    assert all(torch.equal(e, eager[0]) for e in eager)
    wc, sc = codes.cuda(), scales.cuda()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tc.fp8_gemv_tc(x, wc, sc, N, K)                             # warm-up / compile
        with torch.cuda.graph(g, stream=side):
            out = tc.fp8_gemv_tc(x, wc, sc, N, K)
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager[0])
