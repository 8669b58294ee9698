"""One readable line per saved benchmark result (benchmarks/results/*.json), for the index that
`python -m dspark.bench --profile` prints after the round profile.

Each benchmark writes its own JSON layout; `summarize(d)` recognises them by their keys (a file's
own "summary" string wins) and says what a reader wants first: speed-ups, ratios to the anchors,
roofline shares. An unknown layout gets its top-level keys.
"""
from __future__ import annotations

import json


def _f(x, nd=1) -> str:
    return f"{x:.{nd}f}"


def _sweep(d: dict) -> str:
    """sweep_attention.py: the best config per batch, vs the FlashMLA anchors."""
    per_req = d.get("args", {}).get("tokens_per_req", 2)
    anchors = d.get("flashmla_us", {})
    parts = []
    for t, best in sorted(d["best"].items(), key=lambda kv: int(kv[0])):
        batch = int(t) // per_req
        us = best["median_us"]
        a = anchors.get(str(batch))
        parts.append(f"b{batch} {_f(us)} us" + (f" = {us / a:.2f}x FlashMLA" if a else ""))
    return "sparse MQA best per batch: " + ", ".join(parts)


def _attention(d: dict) -> str:
    """bench_attention.py: the default config per batch, vs FlashMLA."""
    parts = [f"b{r['batch']} {_f(r['median_us'])} us"
             + (f" = {r['ratio_vs_flashmla']:.2f}x FlashMLA" if r.get("ratio_vs_flashmla") else "")
             for r in d["results"]]
    return "sparse MQA: " + ", ".join(parts)


def _step_us(d: dict) -> str:
    """bench_decode_kernels.py: the few-token kernels' time per decode step at T = 1."""
    return "per decode step at T=1 (4 layers): " + ", ".join(
        f"{k} {v:.0f} us" for k, v in d["step_us"].items() if v)


def _engine_bench(d: dict) -> str:
    """python -m dspark.bench: tau and speed-up over speculation off per concurrency."""
    t = d.get("args", {}).get("temperature")
    parts = []
    for r in d["results"]:
        ds, off = r["dspark"], r["off"]
        pol = f" {r['policy']}" if r.get("policy") else ""
        parts.append(f"c{r['concurrency']}{pol}: tau {ds['tau']:.2f}, {ds['tok_s']:.1f} vs "
                     f"{off['tok_s']:.1f} tok/s = {r['speedup']:.2f}x")
    return (f"T={t} " if t is not None else "") + "; ".join(parts)


def _profile(d: dict) -> str:
    """python -m dspark.bench --profile: the round split."""
    p = d["profile"]
    split = ", ".join(f"{k} {v:.2f}" for k, v in p["ms_per_round"].items())
    return (f"round {p['round_ms']:.2f} ms (tau {p['tau']:.2f}): {split} ms"
            + (f"; T={p['temperature']}" if "temperature" in p else ""))


def _draft(d: dict) -> str:
    """bench_draft.py: batch-1 rounds with / without speculation."""
    parts = [f"{k} {v['tokens_per_s']:.1f} tok/s ({v['speedup_vs_none']:.2f}x)"
             for k, v in d["rounds_batch1"].items()]
    return "batch-1 rounds: " + ", ".join(parts)


def _qwen3(d: dict) -> str:
    """bench_qwen3.py: target-only decode vs transformers."""
    parts = []
    for b, r in sorted(d["batches"].items(), key=lambda kv: int(kv[0])):
        s = f"batch {b}: {r['ours_graphs_tokens_per_s']:.1f} tok/s with graphs"
        if r.get("hf_tokens_per_s"):
            s += f" vs HF {r['hf_tokens_per_s']:.1f} = {r['speedup_graphs_vs_hf']:.2f}x"
        parts.append(s)
    return f"Qwen3 {d.get('layers', '?')}L: " + "; ".join(parts)


def _tp(d: dict) -> str:
    """bench_tp.py: per run (single device or TP world N) and batch, the decode step and the
    DSpark round (older files: decode tok/s only)."""
    parts = []
    for run in d["runs"]:
        name = f"{run.get('kind', 'tp')} world {run['world']}"
        if "batches" in run:
            cells = []
            for b, x in run["batches"].items():
                cell = f"b{b} decode {x['decode']['step_ms']:.2f} ms"
                if x.get("round"):
                    cell += f", round {x['round']['round_ms']:.2f} ms"
                cells.append(cell)
            parts.append(f"{name}: " + "; ".join(cells))
        else:
            parts.append(f"{name}: " + ", ".join(
                f"b{x['batch']} {x['decode_tok_s']:.1f}" for x in run["decode"]) + " tok/s")
    return "tensor parallel: " + " | ".join(parts)


def _timeline(d: dict) -> str:
    """benchmarks/round_timeline.py: the batch-1 round plain vs synced per step, and the
    device's busy time in the traced run."""
    tr = d["traced"]
    return (f"batch-1 round T={d['temperature']}: {d['plain']['round_ms']:.2f} ms "
            f"({d['synced']['round_ms']:.2f} ms synced per step); traced: device busy "
            f"{tr['device_busy_ms']:.2f} of {tr['round_ms']:.2f} ms per round")


def _moe_paths(d: dict) -> str:
    """benchmarks/bench_moe_paths.py: the dispatched MoE path's time per token count, against
    the per-pair tensor-core kernels."""
    by_t: dict = {}
    for r in d["rows"]:
        by_t.setdefault(r["T"], {})[r["path"]] = r["us"]
    parts = []
    for t, paths in sorted(by_t.items()):
        chosen = paths.get("fp4_moe_grouped (dispatch)")
        if chosen is None:
            continue
        pp = paths.get("per-pair tc")
        parts.append(f"T{t} {chosen:.0f} us" + (f" ({pp / chosen:.2f}x per-pair)" if pp else ""))
    return "MoE layer, dispatched path: " + ", ".join(parts)


def _matches(d: dict) -> list:
    """[(test, summariser)] in the order tried."""
    res = d.get("results")
    row = res[0] if isinstance(res, list) and res and isinstance(res[0], dict) else {}
    return [
        ("best" in d and "flashmla_us" in d, _sweep),
        ("ratio_vs_flashmla" in row or ("median_us" in row and "batch" in row), _attention),
        (isinstance(d.get("step_us"), dict), _step_us),
        ("dspark" in row and "off" in row and "speedup" in row, _engine_bench),
        (isinstance(d.get("profile"), dict) and "ms_per_round" in d["profile"], _profile),
        (isinstance(d.get("rounds_batch1"), dict), _draft),
        (isinstance(d.get("batches"), dict) and "layers" in d, _qwen3),
        (isinstance(d.get("runs"), list) and "world" in (d["runs"][0] if d["runs"] else {}), _tp),
        (all(isinstance(d.get(k), dict) for k in ("plain", "synced", "traced")), _timeline),
        (isinstance(d.get("rows"), list) and "shape" in d and d["rows"]
         and "path" in d["rows"][0], _moe_paths),
    ]


def summarize(d) -> str:
    """One line about a loaded benchmark result (see the module docstring)."""
    if not isinstance(d, dict):
        return f"{type(d).__name__} of {len(d)}" if hasattr(d, "__len__") else "?"
    dev = d.get("device")
    dev = dev.get("name") if isinstance(dev, dict) else dev
    tail = f"  [{dev}]" if isinstance(dev, str) else ""
    if d.get("summary"):
        return f"{d['summary']}{tail}"
    for ok, fn in _matches(d):
        if ok:
            try:
                return fn(d) + tail
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
                return f"unreadable {fn.__name__[1:]} result ({type(e).__name__}: {e}){tail}"
    return f"keys {sorted(d)[:6]}{tail}"


def summarize_file(path: str) -> str:
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        return f"unreadable ({type(e).__name__})"
    return summarize(d)
