"""Verify policies inside the engine: lossless greedy output, SPS profiling, STS calibration CLI."""
import json
import os
import random

import pytest

from dspark import Engine, SamplingParams


def _prompts(n, seed, vocab=8):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(2, 12))] for _ in range(n)]


JAGGED_SPS = [[1, 10.0], [4, 10.5], [8, 14.0], [16, 15.0], [32, 30.0], [64, 31.0]]


@pytest.mark.parametrize("policy,kw", [("threshold", {"threshold": 0.3}),
                                       ("scheduled", {"sps_table": JAGGED_SPS}),
                                       ("scheduled-async", {"sps_table": JAGGED_SPS})])
def test_policies_keep_greedy_output_and_prune_before_the_target(small_vocab_ckpt, policy, kw):
    prompts = _prompts(6, seed=5)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    off = Engine(small_vocab_ckpt, device="cpu", dtype="fp32", kv_cache_dtype="fp32", speculative="none")
    ref = [o.token_ids for o in off.generate(prompts, sp)]
    eng = Engine(small_vocab_ckpt, device="cpu", dtype="fp32", kv_cache_dtype="fp32",
                 verify_policy=policy, **kw)
    outs = eng.generate(prompts, sp)
    assert [o.token_ids for o in outs] == ref
    # the policy's cut is what the target saw: batch tokens = Σ(1 + ℓ) + prefill tokens
    verified = sum(o.metrics.verified for o in outs)
    proposed = sum(o.metrics.proposed for o in outs)
    assert verified < proposed, "random drafts have low confidence: some must be pruned"
    for t in eng.telemetry:
        assert t["batch_tokens"] == t["num_verify"] + sum(t["verify_tokens"]) + t["prefill_tokens"]


def test_sps_profile_is_measured_cached_and_monotone(small_vocab_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    eng = Engine(small_vocab_ckpt, device="cpu", dtype="fp32", kv_cache_dtype="fp32",
                 verify_policy="scheduled", max_num_seqs=2)
    table = eng.policy.sps
    assert table.buckets[-1] == 2 * (eng.cfg.dspark_block_size + 1)
    assert all(a <= b for a, b in zip(table.ms, table.ms[1:]))
    files = list((tmp_path / "dspark" / "sps").iterdir())
    assert len(files) == 1
    # a second engine reuses the cached profile instead of measuring again
    data = json.loads(files[0].read_text())
    data["points"] = [[b, 1.0 + b] for b, _ in data["points"]]
    files[0].write_text(json.dumps(data))
    eng2 = Engine(small_vocab_ckpt, device="cpu", dtype="fp32", kv_cache_dtype="fp32",
                  verify_policy="scheduled", max_num_seqs=2)
    assert eng2.policy.sps.ms[0] == 2.0


def test_calibrate_cli_writes_sts_that_the_engine_loads(small_vocab_ckpt, tmp_path):
    import shutil
    from dspark.calibrate.__main__ import main
    model = str(tmp_path / "model")
    shutil.copytree(small_vocab_ckpt, model)
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p}) for p in _prompts(12, seed=7)))
    main(["--model", model, "--dataset", str(data), "--max-tokens", "12", "--device", "cpu"])
    sts = json.loads(open(os.path.join(model, "dspark_sts.json")).read())
    assert len(sts["temperatures"]) == 5 and sts["num_rounds"] > 0
    assert os.path.exists(os.path.join(model, "dspark_sts_reliability.png"))
    eng = Engine(model, device="cpu", dtype="fp32", verify_policy="threshold")
    assert eng.policy.temperatures == sts["temperatures"]
