"""side_stream: the shared expert and the compressors' entries on a second CUDA stream.

On CPU the helpers run everything inline (checked here); on a GPU the decode step with side
streams must produce exactly the tokens and logits it produces with every branch inline
(dspark.debug.NO_SIDE_STREAMS), eagerly and replayed from CUDA graphs (the same kernels on the same data,
only their order across streams differs)."""
import pytest
import torch

from triton_env import DEV, gpu, needs_cuda  # noqa: F401  (sets TRITON_INTERPRET on CPU)

from dspark import debug
from dspark.cuda import side_stream


def test_cpu_runs_inline():
    side = side_stream.fork(torch.device("cpu"))
    assert side is None
    with side_stream.on(side):
        y = torch.arange(4) * 2
    side_stream.join(side)
    assert y.tolist() == [0, 2, 4, 6]


def test_switch_off(monkeypatch):
    monkeypatch.setattr(debug, "NO_SIDE_STREAMS", True)
    assert not side_stream.enabled()
    assert side_stream.fork(torch.device("cuda", 0)) is None   # no CUDA call when off
    monkeypatch.setattr(debug, "NO_SIDE_STREAMS", False)
    assert side_stream.enabled()


@pytest.fixture(scope="module")
def quant_ckpt(tmp_path_factory):
    from dspark.tools.make_checkpoint import make_checkpoint
    out = str(tmp_path_factory.mktemp("tiny_fp8_fp4"))
    # 4 layers: compress ratios 0 / 4 / 16 / 4 (both compressor kinds, the indexer), FP8
    # linears and FP4 routed experts (QuantMoE: the shared expert's branch)
    make_checkpoint(out, preset="tiny", layers=4, dtype="fp8", fp4_experts=True, progress=False)
    return out


def _generate(ckpt, graphs: bool):
    from dspark import Engine, SamplingParams
    eng = Engine(ckpt, device=DEV, speculative="none", target_cuda_graphs=graphs,
                 weight_format="quantized",
                 max_num_seqs=3)
    prompts = [[5, 9, 2, 7] * 5, [11, 3] * 9 + [4], [8] * 33]
    res = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    return [o.token_ids for o in res]


@gpu
@needs_cuda
@pytest.mark.parametrize("graphs", [False, True])
def test_side_streams_change_no_token(quant_ckpt, graphs, monkeypatch):
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setattr(debug, "NO_SIDE_STREAMS", flag == "0")
        outs[flag] = _generate(quant_ckpt, graphs)
    assert outs["1"] == outs["0"]


@gpu
@needs_cuda
def test_quant_moe_side_stream_bitwise(quant_ckpt, monkeypatch):
    """One QuantMoE layer: output with the shared expert on the side stream == inline, eager and
    inside a captured graph."""
    from dspark import Engine
    from dspark.models.qlinear import QuantMoE
    eng = Engine(quant_ckpt, device=DEV, speculative="none", weight_format="quantized")
    moe = next(m for m in eng.model.modules() if isinstance(m, QuantMoE))
    D = moe.shared_experts.w2.out_features
    x = torch.randn(2, D, device=DEV, dtype=torch.bfloat16)
    tok = torch.tensor([3, 17], device=DEV)
    monkeypatch.setattr(debug, "NO_SIDE_STREAMS", True)
    ref = moe(x, tok)
    monkeypatch.setattr(debug, "NO_SIDE_STREAMS", False)
    monkeypatch.setattr(side_stream, "_STREAMS", {})       # (lanes made anew)
    assert torch.equal(moe(x, tok), ref)                   # high-priority lanes, router on one
    assert {6, 1} <= {lane for _, lane in side_stream._STREAMS}
    assert all(s.priority < 0 for s in side_stream._STREAMS.values())
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe(x, tok)                                          # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = moe(x, tok)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)


def test_scratch_counters_per_lane(monkeypatch):
    """Kernels that keep arrival counters across launches take one buffer per stream lane."""
    from dspark.kernels import fp8_gemm, gate_route
    dev = torch.device(DEV)
    main = fp8_gemm._arrival_counters(dev, 8)
    g_main = gate_route._counters(dev, 8)
    monkeypatch.setattr(side_stream._CURRENT, "lane", 2, raising=False)
    assert side_stream.lane() == 2
    side = fp8_gemm._arrival_counters(dev, 8)
    assert side.data_ptr() != main.data_ptr()
    assert gate_route._counters(dev, 8).data_ptr() != g_main.data_ptr()
    monkeypatch.setattr(side_stream._CURRENT, "lane", 0)
    assert fp8_gemm._arrival_counters(dev, 8).data_ptr() == main.data_ptr()


@gpu
@needs_cuda
def test_split_fp8_launches_on_two_lanes_at_once():
    """Split-K skinny FP8 GEMVs (arrival counters) queued on the main stream and on a side lane
    at the same time, many times over: every result equals the one computed alone."""
    from dspark.kernels import fp8_gemm as fg
    from dspark.formats.quant import quant_fp8_blocks
    N, K = 512, 4096                                   # 8 tiles x 32 splits: counters in use
    w, s = quant_fp8_blocks(torch.randn(N, K, device=DEV) * 0.02)
    w, s = w.view(torch.uint8), s.view(torch.uint8)
    xs = [torch.randn(1, K, device=DEV, dtype=torch.bfloat16) for _ in range(2)]
    ref = [fg.fp8_skinny_triton(x, w, s, N, K, torch.bfloat16, "bf16") for x in xs]
    outs = []
    for _ in range(50):
        side = side_stream.fork(torch.device(DEV), 1)
        with side_stream.on(side):
            a = fg.fp8_skinny_triton(xs[0], w, s, N, K, torch.bfloat16, "bf16")
        b = fg.fp8_skinny_triton(xs[1], w, s, N, K, torch.bfloat16, "bf16")
        side_stream.join(side)
        outs.append((a, b))
    torch.cuda.synchronize()
    for a, b in outs:
        assert torch.equal(a, ref[0]) and torch.equal(b, ref[1])
