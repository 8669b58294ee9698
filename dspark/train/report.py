"""TRAINING.md + loss_curves.png from the results.json of `python -m dspark.train all`.

    python -m dspark.train.report --results results.json --out dspark/assets/default
"""
from __future__ import annotations

import argparse
import json
import os


def plot(results: dict, path: str, extra_points=()) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    t = results.get("target")
    if t:
        ax = axes[0]
        ax.plot([r["step"] for r in t["train"]], [r["loss"] for r in t["train"]], lw=1,
                label="train CE")
        ev = t.get("eval", [])
        fin = t.get("final", {})
        quick = ev[:-1] if fin and ev and ev[-1]["step"] == fin.get("steps") else ev
        n_quick = t.get("args", {}).get("eval_tokens", 300_000) // 4
        ax.plot([r["step"] for r in quick], [r["heldout_loss"] for r in quick], "o-", ms=3,
                label=f"held-out CE (first {n_quick // 1000}k tokens)")
        if fin:
            ax.plot([fin["steps"]], [fin["heldout_loss"]], "*", ms=10,
                    label=f"final held-out CE ({fin['heldout_tokens'] // 1000}k tokens, bf16 weights)")
        for x, y, lab in extra_points:
            ax.plot([x], [y], "s", ms=5, label=lab)
        ax.set_title("target: next-token cross-entropy")
        ax.set_xlabel("step"), ax.set_ylabel("nats / token"), ax.grid(alpha=.3), ax.legend()
        ax.set_ylim(top=min(ax.get_ylim()[1], 4.0))
    d = results.get("drafter")
    if d:
        for name, recs in d["train"].items():
            st = [r["step"] for r in recs]
            axes[1].plot(st, [r["tv"] for r in recs], label=f"{name}: TV(draft, target)")
            axes[1].plot(st, [r["ce"] for r in recs], "--", label=f"{name}: CE (ground truth)")
            axes[1].plot(st, [r["bce"] for r in recs], ":", label=f"{name}: confidence BCE")
            axes[2].plot(st, [r["est_tau_t1"] for r in recs], label=f"{name}: T=1")
            axes[2].plot(st, [r["est_tau_greedy"] for r in recs], "--", label=f"{name}: greedy")
        axes[1].set_title("drafter losses (slot-weighted)")
        axes[1].set_xlabel("step"), axes[1].grid(alpha=.3), axes[1].legend(fontsize=7)
        axes[2].set_title("drafter: teacher-forced τ estimate 1+Σ_k Π_i≤k acc_i")
        axes[2].set_xlabel("step"), axes[2].grid(alpha=.3), axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _fmt_slots(xs):
    return ", ".join(f"{x:.3f}" for x in xs)


FILE_NOTES = {
    "config.json": "HF-style DeepSeek-V4 config + `compress_ratios` (with the 3 draft-stage zeros) + `dspark_*` keys",
    "model-00001-of-00002.safetensors": "weights, official tensor names (target, then `mtp.*`)",
    "model-00002-of-00002.safetensors": "weights, official tensor names (rest of `mtp.*`)",
    "model.safetensors.index.json": "safetensors index (`weight_map`)",
    "tokenizer.json": "byte-level BPE (HF `tokenizers`), adds `<|bos|>`",
    "heldout_prompts.jsonl": "held-out code prefixes for τ / speed benchmarks",
    "training_log.json": "everything the GPU run logged: args, curves, eval results, samples",
    "loss_curves.png": "target CE, drafter losses, drafter τ estimate",
    "dspark_sts.json": "per-position confidence temperatures (STS, `python -m dspark.calibrate`), loaded by the engine",
    "dspark_sts_reliability.png": "confidence reliability diagram before/after STS (held-out half)",
    "TRAINING.md": "this file",
}


def training_md(results: dict, commands: list[str], sizes: dict, extra: dict | None = None) -> str:
    data, t, d, ev = results["data"], results["target"], results["drafter"], results.get("eval", {})
    extra = extra or {}
    cfg = d["config"]
    tf, df = t["final"], d["final"]
    L = []
    w = L.append
    w("# The default model: a small DeepSeek-V4 target + DSpark drafter trained on the Python stdlib\n")
    w("This directory is the engine's default checkpoint (`dspark.engine.default_model_path()`). "
      "No DeepSeek weights are involved: both models were trained from scratch by `dspark.train` "
      "on the `.py` sources of the Python standard library. It exists so that speculative decoding "
      "has something real to accept: random weights accept nothing.\n")
    w("## Files\n")
    w("| file | size | what |\n|---|---|---|")
    for fn, size in sizes.items():
        w(f"| `{fn}` | {size} | {FILE_NOTES.get(fn, '')} |")
    w("")
    w("## Exact commands\n")
    w("```bash")
    for c in commands:
        w(c)
    w("```\n")
    w(f"Seed {results['args']['seed']} everywhere (model init, batch sampling, anchors, evaluation "
      f"sampling). The GPU run was one process on {results['env'].get('device')} "
      f"(torch {results['env'].get('torch')}, python {results['env'].get('python')}); "
      f"it took {results.get('total_seconds', '?')} s in total. Training is time-budgeted "
      f"(`--target-time`, `--drafter-time`): the cosine schedule follows wall-clock progress, so a "
      f"rerun on other hardware gives a different step count.\n")
    w("## Corpus and tokenizer\n")
    w(f"- Corpus: every `.py` file (UTF-8, ≤ 1 MiB) under `sysconfig.get_paths()['stdlib']` of "
      f"Python {data['python']}, excluding site-packages / dist-packages / `__pycache__`: "
      f"{data['train_files'] + data['heldout_files']} files.")
    w(f"- Split: a file is held out iff `int.from_bytes(sha256(relpath)[:8], 'little') % 1000 < "
      f"{data['heldout_permille']}` (5%): train {data['train_files']} files / "
      f"{data['train_bytes'] / 1e6:.1f} MB / {data['train_tokens'] / 1e6:.2f} M tokens; held-out "
      f"{data['heldout_files']} files / {data['heldout_bytes'] / 1e6:.2f} MB / "
      f"{data['heldout_tokens'] / 1e3:.0f} k tokens.")
    w(f"- Tokenizer: byte-level BPE (HF `tokenizers`), vocab {data['vocab_size']}, trained on the "
      f"train split only. Special tokens: " +
      ", ".join(f"`{k}` = {v}" for k, v in data["special_tokens"].items()) +
      ". `tokenizer.encode(text)` prepends `<|bos|>` (post-processor); documents are "
      "`[bos] + tokens + [eos]`, concatenated and cut into random 512-token training windows.")
    w(f"- Held-out prompts: `heldout_prompts.jsonl`, {data['prompts']} code prefixes (24–96 tokens, "
      f"whole lines) from held-out files only: each file's start and up to three random line "
      f"offsets; fields `id, source, line, prompt_tokens, prompt` (prompt_tokens excludes bos).\n")
    w("## Architecture (config.json)\n")
    ratios = cfg["compress_ratios"]
    w(f"DeepSeek-V4 with every layer type: {cfg['num_hidden_layers']} layers with "
      f"`compress_ratios` {list(ratios)} (+ `[0, 0, 0]` for the 3 DSpark stages in config.json): "
      f"layer 0 sliding-window only (SWA, window {cfg['sliding_window']}) with hash-routed MoE "
      f"(`num_hash_layers` = {cfg['num_hash_layers']}), CSA layers (ratio 4, overlapping compressor, "
      f"lightning indexer with {cfg['index_n_heads']} heads × {cfg['index_head_dim']}, "
      f"top-{cfg['index_topk']}) and an HCA layer (ratio "
      f"{max(r for r in ratios)}); score-routed MoE with "
      f"{cfg['n_routed_experts']} experts (top-{cfg['num_experts_per_tok']}, "
      f"moe_inter {cfg['moe_intermediate_size']}, 1 shared expert, sqrtsoftplus, route scale "
      f"{cfg['routed_scaling_factor']}); mHC hc_mult {cfg['hc_mult']} with "
      f"{cfg['hc_sinkhorn_iters']} Sinkhorn iterations.\n")
    w("| key | value | key | value |\n|---|---|---|---|")
    keys = ["vocab_size", "hidden_size", "num_attention_heads", "head_dim", "qk_rope_head_dim",
            "q_lora_rank", "o_lora_rank", "o_groups", "n_routed_experts", "num_experts_per_tok",
            "moe_intermediate_size", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
            "hc_mult", "rope_theta", "compress_rope_theta", "max_position_embeddings",
            "bos_token_id", "eos_token_id", "dspark_block_size", "dspark_markov_rank",
            "dspark_noise_token_id", "dspark_target_layer_ids"]
    for i in range(0, len(keys), 2):
        k1 = keys[i]
        k2 = keys[i + 1] if i + 1 < len(keys) else ""
        w(f"| `{k1}` | {cfg[k1]} | " + (f"`{k2}` | {cfg[k2]} |" if k2 else " | |"))
    w("")
    w(f"Parameters: target {t['params'] / 1e6:.2f} M, drafter {d['params']['markov'] / 1e6:.2f} M "
      f"(3 stages, `main_proj`, Markov head rank {cfg['dspark_markov_rank']}, confidence head; "
      f"embedding and LM head are the target's). Storage: official names, bf16 except the fp32 "
      f"tensors of the official inventory (mHC `hc_*`, `attn_sink`, compressor `ape`, `gate.bias`) "
      f"and the int64 `tid2eid`; {df['checkpoint_bytes'] / 1e6:.2f} MB of tensors.\n")
    w("## Target training\n")
    a = t["args"]
    w(f"Batched full-sequence forward (`dspark/train/forward.py`, the reference modules with a "
      f"batched attention core; equal to `DeepseekV4Model` within 1e-4 in fp32, "
      f"`tests/test_train.py`), bf16 autocast, AdamW (β 0.9/0.95, wd {a['wd']}, peak lr {a['lr']}, "
      f"{a['warmup']} warmup steps, cosine to 10%), batch {a['batch']} × {a['seq_len']} tokens, "
      f"grad clip 1.0. QAT: the reference's storage rounding (FP8 `fp8_ds_mla` kv / compressed "
      f"entries, Hadamard + FP4 indexer q/k) is applied in the forward with straight-through "
      f"gradients, so the engine's default `kv_cache_dtype=\"fp8\"` path matches training. The "
      f"indexer (whose top-k selection is not differentiable) learns from a KL loss towards the "
      f"main attention's mass over the visible compressed entries (weight {a['indexer_aux']}); "
      f"routed experts are balanced aux-loss-free through `gate.bias` (rate {a['bias_rate']}).\n")
    w(f"- {tf['steps']} steps, {tf['tokens'] / 1e6:.1f} M tokens "
      f"({tf['tokens'] / data['train_tokens']:.1f} epochs) in {tf['train_seconds']:.0f} s")
    w(f"- final train loss (last logging window): {tf['train_loss_last']:.4f} nats/token")
    w(f"- **held-out loss {tf['heldout_loss']:.4f} nats/token, perplexity {tf['heldout_ppl']:.2f}, "
      f"{tf['heldout_bits_per_byte']:.3f} bits/byte** ({tf['heldout_tokens']} held-out tokens, "
      f"bf16-rounded weights as shipped, FP8/FP4 storage rounding on)\n")
    w("## Drafter training\n")
    da = d["args"]
    w(f"Frozen target (the shipped bf16 weights). Per step {da['batch']} windows of "
      f"{da['seq_len']} tokens, {da['anchors']} anchors per window (P uniform in [1, L−γ−1], "
      f"distinct): block [x_P, noise×{da['gamma'] - 1}] at P..P+{da['gamma'] - 1} predicting "
      f"x_(P+1..P+{da['gamma']}); context = the drafter's window of the last 128 positions' context "
      f"kv from the target taps (layers {cfg['dspark_target_layer_ids']}). Losses per slot k, "
      f"weighted exp(−(k−1)/γ): {da['w_ce']} × CE of the corrected logits (base + Markov bias of "
      f"the teacher-forced ground-truth previous token), {da['w_tv']} × TV(draft, target at T=1), "
      f"{da['w_conf']} × BCE(confidence, 1 − TV). AdamW lr {da['lr']}, same schedule as the target. "
      f"The no-Markov ablation (Markov rank 0) trains on the same batches; it is not shipped.\n")
    w(f"- {df['steps']} steps in {df['train_seconds']:.0f} s"
      + (f" (the no-Markov ablation: {d['final_no_markov']['steps']} steps in "
         f"{d['final_no_markov']['train_seconds']:.0f} s on {d['final_no_markov']['device']}, "
         f"concurrently)" if "final_no_markov" in d else ""))
    w("\n| drafter | CE | TV | conf BCE | teacher-forced accept (T=1) per slot | greedy match per slot |")
    w("|---|---|---|---|---|---|")
    for name, recs in d["train"].items():
        r = recs[-1]
        slots = [_fmt_slots(r[k]) if k in r else "— (not in the log)"
                 for k in ("accept_t1_per_slot", "greedy_match_per_slot")]
        w(f"| {name} | {r['ce']:.3f} | {r['tv']:.3f} | {r['bce']:.3f} | {slots[0]} | {slots[1]} |")
    w("")
    if ev:
        w("## Speculative decoding on the held-out prompts (γ = 5)\n")
        w(f"`dspark/train/evaluate.py`: {ev['prompts']} prompts, up to {ev['max_new']} new tokens "
          f"each (stop at `<|eos|>`), exact DSpark rounds (draft block with Markov sampling → target "
          f"verify → greedy match or exact rejection sampling u < p/q with residual max(0, p−q), "
          f"bonus token), storage rounding: {ev['quant']}. τ = tokens emitted per round "
          f"(accepted drafts + 1 corrected/bonus token).\n")
        w("| drafter | τ greedy | τ T=1 | accept per slot, greedy | accept per slot, T=1 |")
        w("|---|---|---|---|---|")
        for name in ("markov", "no_markov"):
            if name in ev:
                g, s = ev[name]["greedy"], ev[name]["t1"]
                w(f"| {name}{' (shipped)' if name == 'markov' else ' (ablation)'} | "
                  f"**{g['tau']:.3f}** | **{s['tau']:.3f}** | {_fmt_slots(g['accept_rate_per_slot'])} | "
                  f"{_fmt_slots(s['accept_rate_per_slot'])} |")
        w("")
        if "markov_over_no_markov_t1" in ev:
            w(f"Markov / no-Markov τ ratio: {ev['markov_over_no_markov_t1']:.3f} at T=1, "
              f"{ev['markov_over_no_markov_greedy']:.3f} greedy.\n")
        if "markov_over_no_markov_t1" in ev:
            m = ev["markov"]
            ok = lambda c: "met" if c else "**not met**"   # noqa: E731
            w("| goal (issue) | wanted | measured | |\n|---|---|---|---|")
            w(f"| τ greedy | ≥ 3.0 | {m['greedy']['tau']:.3f} | {ok(m['greedy']['tau'] >= 3.0)} |")
            w(f"| τ T=1 | ≥ 2.5 | {m['t1']['tau']:.3f} | {ok(m['t1']['tau'] >= 2.5)} |")
            w(f"| τ(Markov) / τ(no Markov), T=1 | ≥ 1.10 | {ev['markov_over_no_markov_t1']:.3f} | "
              f"{ok(ev['markov_over_no_markov_t1'] >= 1.1)} |")
            w("")
        for para in extra.get("after_tau", []):
            w(para + "\n")
        g = ev["markov"]["greedy"]
        if "greedy_check_match" in g:
            w(f"Losslessness check: greedy speculative output equals plain target greedy decoding on "
              f"{g['greedy_check_match'] * 100:.1f}% of the first prompts checked (mean common-prefix "
              f"fraction {g['greedy_check_prefix_frac']:.3f}; both in bf16 autocast, so a rare "
              f"near-tie can flip an argmax).\n")
        w("Confidence head (slot 1, T=1): " + "; ".join(
            f"conf {c['conf'][0]:.1f}–{c['conf'][1]:.1f}: n={c['n']}, accepted {c['accept']:.2f}"
            for c in ev["markov"]["t1"]["slot1_conf_calibration"]) + "\n")
        w(f"Distinct 4-grams in the generated continuations: greedy "
          f"{ev['markov']['greedy']['distinct_4grams']:.3f}, T=1 {ev['markov']['t1']['distinct_4grams']:.3f} "
          f"(1.0 = no repeated 4-gram).\n")
        w("## Sample generations (held-out prompts; completion after the marker)\n")
        for mode, title in (("greedy", "greedy"), ("t1", "temperature 1.0")):
            for smp in ev.get("samples", {}).get(mode, [])[:3]:
                w(f"**{title}**, `{smp['source']}`:\n")
                w("```python")
                w(smp["prompt"].rstrip("\n"))
                w("# ---- model continues ----")
                w(smp["completion"].rstrip("\n"))
                w("```\n")
    for title, paras in extra.get("sections", []):
        w(f"## {title}\n")
        for para in paras:
            w(para + "\n")
    w("## Notes for the engine\n")
    w(f"- bos id {cfg['bos_token_id']} (`<|bos|>`, added by the tokenizer), eos id "
      f"{cfg['eos_token_id']} (`<|eos|>`, ends every training document), pad id 3 (`<|pad|>`, never "
      f"in data; the evaluation only uses it as right padding, which causal attention never sees), "
      f"DSpark noise token id {cfg['dspark_noise_token_id']} (`<|noise|>`, never in data).")
    w(f"- γ = `dspark_block_size` = {cfg['dspark_block_size']}; 3 draft stages (compress_ratios tail); "
      f"taps = hc-mean after layers {cfg['dspark_target_layer_ids']}; Markov rank "
      f"{cfg['dspark_markov_rank']}.")
    w("- Trained on 512-token windows: quality beyond ~512 positions is untested "
      "(`max_position_embeddings` 4096 is a cap, not a promise). HCA (ratio 128) entries appear from "
      "position 127 on; CSA top-k selection bites once a query sees more than "
      f"{cfg['index_topk']} entries (position ≥ {4 * cfg['index_topk'] + 3}).")
    for para in extra.get("engine_notes", []):
        w("- " + para)
    return "\n".join(L) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m dspark.train.report")
    p.add_argument("--results", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--commands", help="text file with the exact commands (one per line)")
    p.add_argument("--extra", help="JSON with extra paragraphs: {after_tau: [..], sections: [[title, [..]]]}")
    a = p.parse_args(argv)
    with open(a.results) as f:
        results = json.load(f)
    os.makedirs(a.out, exist_ok=True)
    commands = open(a.commands).read().splitlines() if a.commands else []
    extra = json.load(open(a.extra)) if a.extra else None
    plot(results, os.path.join(a.out, "loss_curves.png"),
         [tuple(p) for p in (extra or {}).get("target_points", [])])
    sizes = {}
    for fn in sorted(os.listdir(a.out)):
        if fn != "TRAINING.md":
            sizes[fn] = f"{os.path.getsize(os.path.join(a.out, fn)) / 1e6:.2f} MB"
    sizes["TRAINING.md"] = "—"
    with open(os.path.join(a.out, "TRAINING.md"), "w") as f:
        f.write(training_md(results, commands, sizes, extra))


if __name__ == "__main__":
    main()
