"""Offline sm_90 register / spill report (benchmarks/kernel_regs.py): compiles without a GPU, in
a subprocess (the test run's Triton is interpreted)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_fp8_skinny_kernel_does_not_spill(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "regs.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kernel_regs.py"),
                        "--kernel", "fp8", "--match", "_fp8_skinny_kernel BLOCK_N=64 BLOCK_T=16 SPLIT",
                        "--sass", "--json", str(out)], env=env, capture_output=True, text=True,
                       timeout=600)
    if "no ptxas" in r.stdout + r.stderr:
        pytest.skip("this triton wheel ships no ptxas")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    # unsplit, 8 K splits with the cp.async pipeline; the same with fp16 operands (the default
    # for bf16 x, with the unpipelined bf16 rescue loop); the vocabulary head's (16-bit weights,
    # its chunk argmax)
    assert len(rows) == 5 and not any("error" in r for r in rows), rows
    # the decode-size FP8 kernel must not spill and must leave room for several resident programs
    # (the split one with its unrolled reduction of the 8 partials too)
    assert all(not r["spill_stores"] for r in rows), rows
    assert all(r["regs"] <= 128 for r in rows), rows
    # --sass: the swap-AB loop streams weight tiles into tensor-core MMAs (HMMA in its SASS)
    assert all(r["sass_loop"]["loop"] > 0 and r["sass_loop"]["mma"] > 0 for r in rows), rows
