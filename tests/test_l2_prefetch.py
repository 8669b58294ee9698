"""L2 prefetch of weights ahead of their GEMV (dspark.kernels.l2_prefetch), evict-first weight
loads, high-priority side lanes: the chunk table covers exactly the asked bytes (aligned, capped,
in order), everything is off where it cannot run, the kernels compile to the intended PTX
(offline sm_90, no GPU needed), and on the GPU greedy tokens with all three on equal those
without (they may change timing only)."""
from triton_env import DEV, needs_cuda  # noqa: F401 (before triton)

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from dspark.kernels import l2_prefetch as lp  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_chunks_cover_the_bytes_in_order_aligned_and_capped():
    a = torch.empty(100_000, dtype=torch.uint8)
    b = torch.empty(3000, dtype=torch.float32)
    view = torch.empty(64, 64)[:, :3]                    # not one range: skipped
    pieces = lp.chunks([a[1:], view, b], 1 << 30, chunk=4096)
    for addr, n in pieces:
        assert addr % 16 == 0 and n % 16 == 0 and 0 < n <= 4096
    a0, a1 = a.data_ptr() + 1, a.data_ptr() + a.numel()
    first = [p for p in pieces if a0 <= p[0] < a1]
    second = [p for p in pieces if b.data_ptr() <= p[0] < b.data_ptr() + b.numel() * 4]
    assert first + second == pieces                      # a's pieces first, nothing else
    assert first[0][0] == (a0 + 15) // 16 * 16 and first[-1][0] + first[-1][1] == a1 // 16 * 16
    for (x, n), (y, _) in zip(first, first[1:]):
        assert x + n == y                                 # contiguous, no gap or overlap
    assert sum(n for _, n in second) == b.numel() * 4     # aligned tensor: whole
    capped = lp.chunks([a, b], 10_000, chunk=4096)
    assert sum(n for _, n in capped) == 10_000 // 16 * 16
    assert [p[0] for p in capped] == [p[0] for p in lp.chunks([a], 1 << 30, chunk=4096)[:3]]
    assert lp.chunks([b], 8) == []


def test_off_where_it_cannot_run(monkeypatch):
    monkeypatch.delenv("DSPARK_L2_PREFETCH", raising=False)
    monkeypatch.delenv("DSPARK_EVICT_FIRST", raising=False)
    assert not lp.enabled(torch.device("cuda", 0))       # opt-in
    assert lp.weight_eviction() == ""
    monkeypatch.setenv("DSPARK_L2_PREFETCH", "last")
    assert not lp.enabled(torch.device("cpu"))
    assert lp.prefetch_during([torch.zeros(64)], torch.device("cpu")) is None
    monkeypatch.setenv("DSPARK_EVICT_FIRST", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not lp.enabled(torch.device("cuda", 0)) and lp.weight_eviction() == ""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert lp.weight_eviction() == "evict_first"
    monkeypatch.setenv("DSPARK_L2_PREFETCH", "yes")
    with pytest.raises(ValueError, match="DSPARK_L2_PREFETCH"):
        lp.mode()


def test_linear_tensors_and_the_attention_read_order():
    from dspark.models.qlinear import QuantLinear, stack_rows
    from dspark.models.quant import quant_fp8_blocks
    from torch import nn
    w, s = quant_fp8_blocks(torch.randn(256, 128))
    q = QuantLinear.from_tensors(w, s, "fp8")
    dense = nn.Linear(128, 64, bias=False)
    got = lp.linear_tensors(q, None, dense)
    assert [t.data_ptr() for t in got] == [q.weight.data_ptr(), q.scale.data_ptr(),
                                           dense.weight.data_ptr()]

    from dspark.models.deepseek_v4.attention import Attention
    from dspark.tools.make_checkpoint import preset_config
    attn = Attention(preset_config("tiny"), 0, 0)
    assert attn.input_linears() == (attn.wq_a, attn.wkv, attn.wq_b)
    attn.__dict__["_fused_rows"] = fused = stack_rows([q, q])
    assert attn.input_linears() == (fused, attn.wq_b)


_PTX = r"""
import inspect, sys
sys.path.insert(0, {root!r})
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import dspark.kernels.l2_prefetch as lp
import dspark.kernels.fp8_gemm as fg

def ptx(fn, sig, ce, warps, stages):
    for p in fn.params:
        if p.is_constexpr and p.name not in ce and p.default is not inspect.Parameter.empty:
            ce[p.name] = p.default
    s = dict(sig, **{{k: "constexpr" for k in ce}})
    attrs = {{(fn.arg_names.index(a),): [["tt.divisibility", 16]]
             for a in sig if sig[a].startswith("*") or a.startswith("stride")}}
    return triton.compile(ASTSource(fn=fn, signature=s, constexprs=ce, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={{"num_warps": warps, "num_stages": stages}}).asm["ptx"]

for last in (False, True):
    p = ptx(lp._l2_prefetch_kernel, {{"addr_ptr": "*i64", "size_ptr": "*i32"}},
            {{"BLOCK": 32, "EVICT_LAST": last}}, 1, 1)
    print("row prefetch", int(last), p.count("cp.async.bulk.prefetch.L2.global"),
          p.count("L2::evict_last"))
sig = {{"x_ptr": "*bf16", "stride_xt": "i32", "stride_xg": "i32", "w_ptr": "*u8",
        "stride_wn": "i32", "s_ptr": "*u8", "stride_sn": "i32", "y_ptr": "*bf16",
        "stride_yt": "i32", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "T": "i32", "N": "i32",
        "K": "i32", "K_PER_SPLIT": "i32", "GROUP_ROWS": "i32"}}
for ev in ("", "evict_first"):
    p = ptx(fg._fp8_skinny_kernel, sig, {{"BLOCK_N": 64, "BLOCK_T": 16, "BLOCK_K": 128,
            "PRECISION": "fp16", "SPLIT": 1, "EVICT": ev}}, 4, 3)
    print("row skinny", int(bool(ev)), p.count("L2::evict_first"), p.count("L2::cache_hint"))
"""


def test_ptx_prefetch_and_evict_first_only_when_asked():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _PTX.format(root=ROOT)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {tuple(line.split()[1:3]): [int(v) for v in line.split()[3:]]
            for line in r.stdout.splitlines() if line.startswith("row ")}
    assert rows["prefetch", "0"] == [1, 0], rows
    assert rows["prefetch", "1"] == [1, 1], rows
    assert rows["skinny", "0"] == [0, 0], rows
    first, hinted = rows["skinny", "1"]
    assert first >= 1 and hinted >= 1, rows


@pytest.fixture(scope="module")
def quant_ckpt(tmp_path_factory):
    from dspark.tools.make_checkpoint import make_checkpoint
    out = str(tmp_path_factory.mktemp("tiny_fp8_fp4_l2"))
    make_checkpoint(out, preset="tiny", layers=4, dtype="fp8", fp4_experts=True, progress=False)
    return out


@needs_cuda
@pytest.mark.gpu
def test_prefetch_evict_and_priority_change_no_token(quant_ckpt, monkeypatch):
    """The quantized tiny model (every layer kind) through the Engine with its CUDA graphs:
    greedy tokens with the L2 prefetch (evict-last lines), evict-first weight loads and
    high-priority side lanes == without."""
    from dspark import Engine, SamplingParams
    from dspark.models import side_stream
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("DSPARK_L2_PREFETCH", "last" if flag == "1" else "0")
        monkeypatch.setenv("DSPARK_EVICT_FIRST", flag)
        monkeypatch.setenv("DSPARK_SIDE_PRIORITY", flag)
        monkeypatch.setattr(side_stream, "_STREAMS", {})   # lanes made anew, with the priority
        eng = Engine(quant_ckpt, device=DEV, speculative="none", target_cuda_graphs=True,
                     weight_format="quantized", max_num_seqs=3)
        res = eng.generate([[5, 9, 2, 7] * 5, [11, 3] * 9 + [4], [8] * 33],
                           SamplingParams(temperature=0, max_tokens=24))
        outs[flag] = [o.token_ids for o in res]
        if flag == "1":
            assert side_stream._STREAMS and all(s.priority < 0 for s in
                                                side_stream._STREAMS.values())
            assert lp._PLANS                                 # the prefetch did run
    assert outs["1"] == outs["0"]
