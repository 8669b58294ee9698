"""benchmarks/bench_decode_v4.py helpers and `python -m dspark.bench --profile` (CPU, seconds):
the shard-parallel checkpoint writer reproduces make_checkpoint byte for byte, the strict HF fill
equals transformers' own from_pretrained of the same checkpoint, the byte accounting counts only
the routed experts, and the round profiler's phases add up to the round."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_decode_v4 as bd  # noqa: E402

from dspark.tools import make_checkpoint as mc  # noqa: E402


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """The same tiny FP8 + FP4 checkpoint written by make_checkpoint and by the parallel writer."""
    base = tmp_path_factory.mktemp("bd")
    ref, par = str(base / "ref"), str(base / "par")
    shard = 1 << 20
    mc.make_checkpoint(ref, "tiny", None, 0, "fp8", True, False, shard_bytes=shard, progress=False)
    cfg, _, reused = bd.write_checkpoint(par, "tiny", None, workers=2, shard_bytes=shard)
    assert not reused
    return ref, par, cfg


def test_parallel_writer_matches_make_checkpoint(tiny_pair):
    ref, par, cfg = tiny_pair
    files = sorted(f for f in os.listdir(ref) if f.endswith(".safetensors"))
    assert files == sorted(f for f in os.listdir(par) if f.endswith(".safetensors"))
    for fn in files:
        a, b = load_file(os.path.join(ref, fn)), load_file(os.path.join(par, fn))
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8),
                                                            b[k].view(torch.uint8)), k
    for fn in ("config.json", "model.safetensors.index.json"):
        with open(os.path.join(ref, fn)) as f, open(os.path.join(par, fn)) as g:
            assert json.load(f) == json.load(g)
    assert bd.write_checkpoint(par, "tiny", None, workers=2)[2]      # reused when complete


def test_hf_fill_equals_from_pretrained(tiny_pair):
    pytest.importorskip("transformers")
    from hf_oracle import hf_model
    _, par, _ = tiny_pair
    ours = bd.build_hf_model(par, "cpu", torch.float32).state_dict()
    ref = hf_model(par, torch.float32).state_dict()
    assert ours.keys() == ref.keys()
    for k in ref:
        assert ours[k].dtype == ref[k].dtype and torch.equal(ours[k], ref[k]), k


def test_byte_accounting():
    cfg = mc.preset_config("flash", 4, "fp8", True, False)
    w = bd.target_bytes(cfg, torch.bfloat16)
    k, D, I = cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    per_expert = 3 * (D * I // 2 + D * I // 32)                 # packed FP4 + one e8m0 per 32
    assert w["routed_experts"] == cfg.num_hidden_layers * k * per_expert
    assert w["head"] == cfg.vocab_size * D * 2 and w["embed"] == D * 2
    assert w["total"] == sum(v for c, v in w.items() if c != "total")
    kv = bd.kv_bytes(cfg, 4096)
    # ratios (0, 0, 4, 128): 4 windows of 128, CSA top-512 of 1024 entries + 1024 indexer keys,
    # HCA 32 entries
    assert kv["window"] == 4 * 128 * 584
    assert kv["compressed"] == (512 + 32) * 584 and kv["indexer"] == 1024 * 132


def test_profile_phases_add_up():
    from dspark import Engine, SamplingParams
    from dspark.bench.profile import PHASES, profile_rounds

    eng = Engine(max_num_seqs=1)
    res = profile_rounds(eng, [[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=12,
                                                             ignore_eos=True))
    assert set(res["phases_wrapped"]) == set(PHASES)
    assert res["rounds"] >= 1 and res["prefill_steps"] == 1 and res["output_tokens"] == 12
    assert abs(sum(res["ms_per_round"].values()) - res["round_ms"]) < 1e-6
    assert all(v >= 0 for v in res["ms_per_round"].values())
    assert "step" not in vars(eng) and "draft" not in vars(eng.runner)   # wrappers removed


def test_profile_at_a_batch_counts_only_full_rounds():
    """--profile --concurrency 3: a group of 3 requests runs together; its prefill step and the
    rounds after the first request finished (their acceptance differs, so they end apart) are
    left out and counted: every step of the run is one of the three kinds."""
    from dspark import Engine, SamplingParams
    from dspark.bench.profile import profile_batch, profile_rounds

    eng = Engine(max_num_seqs=3)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    before = len(eng.telemetry)
    res = profile_rounds(eng, [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]], sp, batch=3)
    assert res["batch"] == 3 and res["output_tokens"] == 72 and res["prefill_steps"] == 1
    steps = list(eng.telemetry)[before:]
    assert len(steps) == res["prefill_steps"] + res["rounds"] + res["partial_rounds"]
    assert res["rounds"] == sum(t["num_verify"] == 3 and not t["prefill_tokens"] for t in steps)
    assert res["rounds"] >= 1 and res["partial_rounds"] >= 1
    assert abs(sum(res["ms_per_round"].values()) - res["round_ms"]) < 1e-6
    assert profile_batch("16") == 16
    for bad in ("1,4", "0", "x"):
        with pytest.raises(SystemExit, match="one batch size"):
            profile_batch(bad)


def test_kernel_profile_splits_a_decode_step(tiny_pair):
    """(c) on CPU: the profiled decode steps of the tiny FP8 + FP4 checkpoint are split over
    categories that add up to the total, the MoE and attention ops show up as such, and the
    engine keeps no request behind."""
    from dspark import Engine
    ref = tiny_pair[0]
    eng = Engine(ref, device="cpu", dtype="fp32", speculative="none", weight_format="quantized")
    kp = bd.kernel_profile(eng, steps=2, context=12)
    assert kp["steps"] == 2 and kp["total_us_per_step"] > 0
    assert abs(sum(kp["categories"].values()) - kp["total_us_per_step"]) < 1e-6 * kp["total_us_per_step"] + 1e-6
    assert kp["top"] and all(r["category"] == bd.kernel_category(r["name"]) for r in kp["top"])
    assert not eng.has_unfinished()
    assert bd.kernel_category("_sparse_mqa_v3_kernel") == "attention"
    assert bd.kernel_category("_fp4_moe_grouped_kernel") == "fp4 MoE"
    assert bd.kernel_category("sm90_xmma_gemm_bf16bf16_bf16f32") == "GEMM / GEMV (bf16)"


class _Ev:
    def __init__(self, name, start_us, dur_us, corr):
        self._n, self._s, self._d, self._c = name, int(start_us * 1e3), int(dur_us * 1e3), corr

    def name(self):
        return self._n

    def start_ns(self):
        return self._s

    def duration_ns(self):
        return self._d

    def correlation_id(self):
        return self._c


def test_loop_timeline_splits_replays_and_the_gaps_between():
    from loop_timeline import split_steps
    ev = []
    for r, t0 in enumerate((0.0, 100.0, 205.0)):       # 3 replays of 10 kernels, 90 us each
        ev += [_Ev(f"k{i}", t0 + 9 * i, 9.0, 1000 + r) for i in range(10)]
    ev += [_Ev("Memcpy HtoD", 92.0, 1.5, 1), _Ev("Memcpy DtoD", 95.0, 1.0, 2),
           _Ev("Memcpy DtoH", 195.0, 2.0, 3)]
    out = split_steps(ev)
    assert out["replays"] == 3 and out["kernels_per_replay"] == 10
    assert out["median_span_us"] == 90.0 and out["median_period_us"] == 102.5
    assert [g["gap_us"] for g in out["gaps"]] == [10.0, 15.0]
    assert [op["name"] for op in out["gaps"][0]["ops"]] == ["Memcpy HtoD", "Memcpy DtoD"]
    assert [op["name"] for op in out["gaps"][1]["ops"]] == ["Memcpy DtoH"]
    assert out["gaps"][0]["ops"][0]["start_us"] == 2.0
