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
    # a truncated file (a crash mid-write) is measured again, with a warning, and rewritten whole
    files[0].write_text(json.dumps(data)[:20])
    with pytest.warns(UserWarning, match="unreadable SPS profile"):
        eng3 = Engine(small_vocab_ckpt, device="cpu", dtype="fp32", kv_cache_dtype="fp32",
                      verify_policy="scheduled", max_num_seqs=2)
    assert eng3.policy.sps.ms[0] != 2.0                   # measured, not the truncated file
    assert json.loads(files[0].read_text())["points"] and len(list(files[0].parent.iterdir())) == 1


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


@pytest.fixture(scope="module")
def sps_cache_dir(tmp_path_factory):
    """One on-disk SPS cache for this module's default-settings engines (profiled once), kept
    away from the user's and other tests' caches."""
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def default_off_tokens():
    from dspark.bench.datasets import load_prompts
    from dspark.engine import default_model_path
    prompts = load_prompts(default_model_path() + "/heldout_prompts.jsonl", 3)
    off = Engine(device="cpu", speculative="none")
    sp = SamplingParams(temperature=0, max_tokens=8)
    return prompts, [o.token_ids for o in off.generate(prompts, sp)]


@pytest.mark.parametrize("policy", ["fixed", "threshold", "scheduled", "scheduled-async",
                                    "full", "alg1", "zos"])
def test_every_policy_starts_at_the_default_settings(policy, sps_cache_dir, default_off_tokens):
    """Engine(verify_policy=...) with every other setting left at its default (max_num_seqs=64,
    max_num_batched_tokens=2048, paged fp8 cache) on the shipped pair builds (the SPS profile
    fits the cache) and generates the speculation-off tokens."""
    prompts, ref = default_off_tokens
    eng = Engine(device="cpu", verify_policy=policy)
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    assert [o.token_ids for o in outs] == ref
    assert all(o.metrics.rounds > 0 for o in outs)


@pytest.mark.parametrize("kw", [{"num_kv_blocks": 3, "max_num_batched_tokens": 5},
                                {"max_num_seqs": 3, "max_num_batched_tokens": 4},
                                {"num_kv_blocks": 1, "max_num_seqs": 5}])
def test_sps_profile_fits_small_caches(small_vocab_ckpt, tmp_path, monkeypatch, kw):
    """Few pages / slots / a small token budget: the profile measures what fits (fewer
    requests, prefill chunked by the budget), says so, and stays monotone; the engine serves."""
    from dspark.spec.profile import plan_profile
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    eng = Engine(small_vocab_ckpt, device="cpu", dtype="fp32", verify_policy="scheduled", **kw)
    g1 = eng.cfg.dspark_block_size + 1
    plan = plan_profile(eng, eng.scheduler.max_num_seqs * g1)
    cache = eng.cache
    assert plan.requests <= min(eng.scheduler.max_num_seqs, cache.num_blocks)
    assert all(b == r * q and r <= plan.requests and (r == 1 or q == g1) for b, r, q in plan.steps)
    assert plan.requests * g1 <= cache.max_batch_tokens
    if plan.requests < eng.scheduler.max_num_seqs:
        assert f"{plan.requests} requests instead of {eng.scheduler.max_num_seqs}" in plan.note
    table = eng.policy.sps
    assert table.buckets == plan.buckets and table.buckets[-1] == plan.requests * g1
    assert all(a <= b for a, b in zip(table.ms, table.ms[1:]))
    prompts = _prompts(3, seed=3)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    off = Engine(small_vocab_ckpt, device="cpu", dtype="fp32", speculative="none", **kw)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == \
        [o.token_ids for o in off.generate(prompts, sp)]


def test_scheduler_may_verify_no_draft(small_vocab_ckpt):
    """An SPS table where every extra verify token costs more than it can return: the policy
    verifies ℓ = 0 for every request (plain decode rounds), and the output is speculation off's."""
    steep = [[b, 10.0 * b * b] for b in range(1, 200)]     # every B: no free tokens in a bucket
    prompts = _prompts(5, seed=9)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    off = Engine(small_vocab_ckpt, device="cpu", dtype="fp32", speculative="none")
    for policy in ("scheduled", "scheduled-async"):
        eng = Engine(small_vocab_ckpt, device="cpu", dtype="fp32", verify_policy=policy,
                     sps_table=steep)
        outs = eng.generate(prompts, sp)
        assert [o.token_ids for o in outs] == [o.token_ids for o in off.generate(prompts, sp)]
        assert all(o.metrics.verified == 0 and o.metrics.rounds == 11 for o in outs), policy
        assert all(t["verify_tokens"] == [0] * t["num_verify"] for t in eng.telemetry)
