"""Programmatic dependent launch (dspark.cuda.pdl): off where it cannot run, compiled into the
FP8 skinny kernel with its wait / trigger (offline sm_90 PTX, no GPU needed),
and on the GPU a chain norm -> GEMV -> GEMV, eager and inside a CUDA graph, equal to the same
chain without PDL bit for bit (a kernel that read its input before the wait would see the
previous replay's values)."""
from triton_env import DEV, needs_cuda  # noqa: F401 (before triton)

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from dspark import debug  # noqa: E402
from dspark.cuda import pdl  # noqa: E402
from dspark.kernels.fp8_gemm import fp8_linear  # noqa: E402
from dspark.kernels.norm_rope import norm_rope  # noqa: E402
from dspark.formats.quant import quant_fp8_blocks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_off_on_cpu_and_by_switch(monkeypatch):
    monkeypatch.setattr(debug, "NO_PDL", False)
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch_kwargs(False) == {} and pdl.launch_kwargs(True) == {"launch_pdl": True}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(torch.device("cuda", 0))     # the interpreter has no PDL
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(debug, "NO_PDL", True)            # the debug switch turns it off
    assert not pdl.enabled(torch.device("cuda", 0))


# what both offline-compile scripts below start with: sm_90 compiles of the FP8 GEMV kernels
# (the signature of their common arguments; `split` names the per-split K argument)
_COMPILE = r"""
import inspect, os, re, subprocess, sys, tempfile
sys.path.insert(0, {root!r})
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile90(fn, split, ce, warps, stages):
    sig = {{"x_ptr": "*bf16", "stride_xt": "i32", "stride_xg": "i32", "w_ptr": "*u8",
            "stride_wn": "i32", "s_ptr": "*u8", "stride_sn": "i32", "y_ptr": "*bf16",
            "stride_yt": "i32", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "T": "i32", "N": "i32",
            "K": "i32", split: "i32", "GROUP_ROWS": "i32"}}
    s = dict(sig, **{{k: "constexpr" for k in ce}})
    attrs = {{(fn.arg_names.index(a),): [["tt.divisibility", 16]]
             for a in sig if sig[a].startswith("*") or a.startswith("stride")}}
    return triton.compile(ASTSource(fn=fn, signature=s, constexprs=ce, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={{"num_warps": warps, "num_stages": stages}})
"""

_PTX = _COMPILE + r"""
import dspark.kernels.fp8_gemm as fg
fn = fg._fp8_skinny_kernel
for name, pdl_on in (("off", False), ("on", True)):
    ce = {{"BLOCK_N": 64, "BLOCK_T": 16, "BLOCK_K": 128, "PRECISION": "fp16", "SPLIT": 8,
          "PDL": pdl_on}}
    for p in fn.params:     # defaults: constexprs, and optional pointers (None) as constexprs
        if ((p.is_constexpr or p.default is None) and p.name not in ce
                and p.default is not inspect.Parameter.empty):
            ce[p.name] = p.default
    ptx = compile90(fn, "K_PER_SPLIT", ce, 4, 3).asm["ptx"]
    print("row", name, ptx.count("griddepcontrol.wait"),
          ptx.count("griddepcontrol.launch_dependents"))
"""


def _rows_of(script: str) -> dict:
    """Run an offline-compile script (no GPU; outside the interpreter) -> its 'row' lines."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", script.format(root=ROOT)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return {line.split()[1]: [int(v) for v in line.split()[2:]]
            for line in r.stdout.splitlines() if line.startswith("row ")}


def test_fp8_skinny_ptx_has_wait_and_trigger_only_with_pdl():
    rows = _rows_of(_PTX)
    assert rows["off"] == [0, 0], rows
    wait, trigger = rows["on"]
    assert wait >= 1 and trigger >= 1, rows


def _chain(x, nw, w1, s1, w2, s2):
    h = norm_rope(x, nw, 1e-6)                  # triggers the GEMV's early start
    return fp8_linear(fp8_linear(h, w1, s1), w2, s2)


@needs_cuda
@pytest.mark.gpu
def test_pdl_chain_equals_plain_launches_eager_and_in_a_graph(monkeypatch):
    monkeypatch.setattr(debug, "NO_PDL", False)
    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("PDL not available on this GPU / Triton")
    gen = torch.Generator().manual_seed(3)
    K, N1, N2 = 4096, 1024, 4096                # the second GEMV splits K (arrival counters)
    w1, s1 = quant_fp8_blocks(torch.randn(N1, K, generator=gen) * 0.05)
    w2, s2 = quant_fp8_blocks(torch.randn(N2, N1, generator=gen) * 0.05)
    w1, s1, w2, s2 = (t.cuda() for t in (w1, s1, w2, s2))
    nw = (1 + 0.1 * torch.randn(K, generator=gen)).to(torch.bfloat16).cuda()
    xs = [torch.randn(1, K, generator=gen).to(torch.bfloat16).cuda() * (i + 1) for i in range(4)]

    monkeypatch.setattr(debug, "NO_PDL", True)
    want = [_chain(x, nw, w1, s1, w2, s2) for x in xs]
    monkeypatch.setattr(debug, "NO_PDL", False)
    for x, y in zip(xs, want):
        assert torch.equal(_chain(x, nw, w1, s1, w2, s2), y)
    static = xs[0].clone()
    _chain(static, nw, w1, s1, w2, s2)          # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = _chain(static, nw, w1, s1, w2, s2)
    for _ in range(3):
        for x, y in zip(xs, want):
            static.copy_(x)
            g.replay()
            assert torch.equal(out, y)


@pytest.fixture(scope="module")
def quant_ckpt(tmp_path_factory):
    from dspark.tools.make_checkpoint import make_checkpoint
    out = str(tmp_path_factory.mktemp("tiny_fp8_fp4_pdl"))
    make_checkpoint(out, preset="tiny", layers=4, dtype="fp8", fp4_experts=True, progress=False)
    return out


@needs_cuda
@pytest.mark.gpu
def test_pdl_changes_no_token(quant_ckpt, monkeypatch):
    """The quantized tiny model (FP8 linears, FP4 experts, every layer kind) through the Engine
    with its decode / verify CUDA graphs: greedy tokens with PDL == without."""
    from dspark import Engine, SamplingParams
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setattr(debug, "NO_PDL", flag == "0")
        eng = Engine(quant_ckpt, device=DEV, speculative="none", target_cuda_graphs=True,
                     weight_format="quantized", max_num_seqs=3)
        res = eng.generate([[5, 9, 2, 7] * 5, [11, 3] * 9 + [4], [8] * 33],
                           SamplingParams(temperature=0, max_tokens=24))
        outs[flag] = [o.token_ids for o in res]
    assert outs["1"] == outs["0"]


_TC_SASS = _COMPILE + r"""
import dspark.kernels.fp8_gemv_tc as tc
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
for name, on, pre in (("off", False, False), ("wait", True, False), ("preload", True, True)):
    ce = dict(tc._launch_strings(1, 1), SPLIT=8, WARPS=1, NT=1, UNROLL=1, PDL=on, PRELOAD=pre)
    k = compile90(tc._fp8_gemv_tc_kernel, "KCH", ce, 1, 1)
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    ops = [m.group(1).split()[0] for m in
           re.finditer(r"/\*[0-9a-f]{{4,}}\*/\s+(?:@!?U?P\w+\s+)?([^;]*);", sass)]
    first_wait = next((i for i, o in enumerate(ops) if o == "ACQBULK"), len(ops))
    before = sum(1 for o in ops[:first_wait] if o.startswith("LDG"))
    print("row", name, ops.count("ACQBULK"), ops.count("PREEXIT"), before)
"""


def test_fp8_tc_gemv_preload_loads_come_before_the_wait():
    """The tensor-core GEMV compiled for sm_90 (offline SASS, cuobjdump from the triton wheel):
    no PDL instruction without PDL; with it a trigger and the wait; with the preload all five of
    the first step's weight loads (4 x 16 bytes + the scale byte) are issued before the first
    wait (ptxas hoists a plain wait above independent loads: the predicated wait forbids it)."""
    rows = _rows_of(_TC_SASS)
    assert rows["off"][:2] == [0, 0], rows
    waits, triggers, _ = rows["wait"]
    assert waits >= 1 and triggers >= 1, rows
    waits, triggers, before = rows["preload"]
    assert waits >= 1 and triggers >= 1 and before >= 5, rows
