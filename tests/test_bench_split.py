"""python -m dspark.bench on CPU: several policies against one off engine, the per-run counts of
compiles / captures / eager fallbacks, the round split per batch and its projection."""
import json

import pytest

from dspark.bench.__main__ import main as bench_main, median_run, print_table
from dspark.bench.split import PAPER_ACCEPTANCE, tokens_per_round


def test_tokens_per_round_is_one_plus_the_survivals():
    assert tokens_per_round([0.5, 0.25], 2) == 1.75
    assert tokens_per_round(PAPER_ACCEPTANCE, 5) == pytest.approx(4.33, abs=1e-9)
    assert tokens_per_round(PAPER_ACCEPTANCE, 3) == pytest.approx(1 + 0.896 + 0.776 + 0.656)
    for bad in ([0.5, 0.7], [1.2], [-0.1]):
        with pytest.raises(ValueError, match="non-increasing"):
            tokens_per_round(bad, 5)


def test_bench_policies_counts_and_split_on_a_random_checkpoint(tiny_quant_ckpt, tmp_path,
                                                                monkeypatch, capsys):
    """A random FP8 + FP4 checkpoint without a tokenizer (token-id prompts, weights kept
    quantized): one row per (concurrency, policy), each with its counts and ℓ; the split rows'
    projection is E · decode / round."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    out = tmp_path / "bench.json"
    bench_main(["--model", tiny_quant_ckpt, "--dataset",
                "dspark/assets/default/heldout_prompts.jsonl", "--num-prompts", "2",
                "--max-tokens", "4", "--ignore-eos", "--concurrency", "1,2", "--policies",
                "fixed,scheduled", "--device", "cpu", "--repeats", "2", "--json", str(out),
                "--plot", str(tmp_path / "bench.png")])
    text = capsys.readouterr().out
    assert "round split per batch" in text and "WARNING" not in text
    assert "SPS profile of scheduled (B verify tokens: step ms): 1: " in text
    d = json.loads(out.read_text())
    assert d["args"]["weight_format"] == "auto"
    rows = d["results"]
    assert [(r["concurrency"], r["policy"]) for r in rows] == \
        [(1, "fixed"), (1, "scheduled"), (2, "fixed"), (2, "scheduled")]
    for r in rows:
        s = r["dspark"]
        assert s["output_tokens"] == 8 and r["off"]["output_tokens"] == 8
        assert 0 <= s["mean_verify_len"] <= 5 and r["off"]["mean_verify_len"] == 0
        # two timed runs of each engine; the row reports the lower middle one of each
        for run in (s, r["off"]):
            assert len(run["tok_s_runs"]) == 2 and run["tok_s"] == min(run["tok_s_runs"])
        assert r["speedup"] == s["tok_s"] / r["off"]["tok_s"]
        # CPU: no graph-capable runner, interpreted Triton compiles nothing
        assert s["compile_stats"] == {"triton_compiles": 0, "graph_captures": 0,
                                      "eager_fallbacks": {}}
    e = tokens_per_round(PAPER_ACCEPTANCE, 5)
    for sr in d["split"]:
        sp, off = sr["split"], sr["off_split"]
        assert sp["steps"] > 0 and off["steps"] > 0 and sp["batch"] == off["batch"]
        assert all(v >= 0 for v in sp["ms"].values()) and sp["ms"]["draft"] > 0
        assert sr["projected_speedup"] == pytest.approx(e * off["round_ms"] / sp["round_ms"])
    assert list(d["sps_ms"]) == ["scheduled"] and d["sps_ms"]["scheduled"][0][0] == 1
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_median_run_reports_the_middle_run_and_sums_what_every_run_did():
    def run(tok_s, compiles, captures, falls):
        return {"tok_s": tok_s, "tau": tok_s / 100, "gc": {"collections": 1, "ms": 0.5},
                "compile_stats": {"triton_compiles": compiles, "graph_captures": captures,
                                  "eager_fallbacks": falls}}
    runs = [run(300.0, 0, 0, {}), run(100.0, 2, 0, {"target: ragged lengths": 1}),
            run(200.0, 0, 1, {"target: ragged lengths": 2, "draft: top-k": 1})]
    m = median_run(runs)
    assert m["tok_s"] == 200.0 and m["tau"] == 2.0 and m["tok_s_runs"] == [300.0, 100.0, 200.0]
    assert m["compile_stats"] == {"triton_compiles": 2, "graph_captures": 1, "eager_fallbacks":
                                  {"target: ragged lengths": 3, "draft: top-k": 1}}
    assert m["gc"] == {"collections": 3, "ms": 1.5}
    assert median_run(runs[:2])["tok_s"] == 100.0          # an even count: the lower middle
    runs[0]["compile_stats"]["triton_compiles"] = "unavailable"
    assert median_run(runs)["compile_stats"]["triton_compiles"] == "unavailable"


def test_table_warns_about_compiles_inside_a_timed_run(capsys):
    clean = {"triton_compiles": 0, "graph_captures": 0, "eager_fallbacks": {}}
    dirty = {"triton_compiles": 3, "graph_captures": 1,
             "eager_fallbacks": {"target: ragged lengths": 7}}
    run = dict(tau=2.0, mean_verify_len=4.0, accept_rate=0.5, tok_s=100.0, ttft_ms=1.0,
               tpot_ms=1.0, cond_accept=[0.5])
    print_table([{"concurrency": 4, "policy": "fixed", "speedup": 1.0,
                  "dspark": {**run, "compile_stats": dirty}, "off": {**run, "compile_stats": clean}}])
    out = capsys.readouterr().out
    assert "3/1/7" in out and "0/0/0" in out
    warn = [l for l in out.splitlines() if l.startswith("WARNING")]
    assert len(warn) == 1 and "c=4 fixed" in warn[0] and "ragged lengths" in warn[0]
    assert "warm-up missed" in warn[0]


def test_table_says_why_prompt_steps_run_eagerly(capsys):
    """Eager prompt steps alone (wider than any captured step) are not called a warm-up miss;
    with any other fallback, compile or capture beside them they are."""
    run = dict(tau=2.0, mean_verify_len=4.0, accept_rate=0.5, tok_s=100.0, ttft_ms=1.0,
               tpot_ms=1.0, cond_accept=[0.5])
    prompts = {"triton_compiles": 0, "graph_captures": 0,
               "eager_fallbacks": {"target: prefill / mixed step": 4}}
    mixed = {"triton_compiles": 0, "graph_captures": 2,
             "eager_fallbacks": {"target: prefill / mixed step": 4}}
    print_table([{"concurrency": 1, "policy": "fixed", "speedup": 1.0,
                  "dspark": {**run, "compile_stats": mixed}, "off": {**run, "compile_stats": prompts}}])
    warn = [l for l in capsys.readouterr().out.splitlines() if l.startswith("WARNING")]
    assert len(warn) == 2
    assert "c=1 fixed" in warn[0] and "warm-up missed" in warn[0]
    assert "c=1 off" in warn[1] and "prompt steps wider than the captured widths" in warn[1]
