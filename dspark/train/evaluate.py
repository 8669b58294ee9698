"""Standalone DSpark evaluation: mean accepted length τ on held-out prompts, held-out perplexity.

    python -m dspark.train.evaluate --ckpt DIR --data DATA [--ablation ablation.pt]

The loop is the DSpark round of dspark.md §1 with no KV cache (every round re-runs the target
over the whole sequence with the batched training forward, which is exact because the target is
causal), batched over prompts:

  prefill: target over the prompt -> first anchor y sampled at the last prompt position (P = N)
  round:   draft [y, noise x (γ-1)] at P..P+γ-1 from the context window of taps 0..P-1, Markov
           sampling left to right (q_k kept) -> target over seq + drafts -> logits at P..P+γ
           -> accept left to right (greedy: draft == target argmax; T = 1: exact rejection
           sampling u < p/q, residual max(0, p - q) on rejection, bonus from p at P+γ)
           -> commit a accepted drafts + 1 corrected/bonus token; taps of the verify forward at
           positions <= P+a are the next round's context.

τ = tokens emitted / rounds (prefill token not counted). Storage rounding follows the engine's
default (`kv_cache_dtype="fp8"`: FP8 kv records, FP4 indexer); `--no-quant` turns it off.
"""
from __future__ import annotations

import argparse
import json
import math

import torch

from .common import autocast, load_models, pick_device, setup_fast_math
from .data import EOS_ID, PAD_ID, PreparedData
from .forward import context_kv, drafter_hidden, target_forward


class EvalQuant:
    """Forward values of `dspark.runner.QuantSim` (no gradients needed here)."""

    def kv(self, x):
        from dspark.formats.layouts import fp8_ds_mla_roundtrip
        return fp8_ds_mla_roundtrip(x)

    def indexer(self, x):
        from dspark.formats.layouts import fp4_roundtrip, hadamard128
        return fp4_roundtrip(hadamard128(x.float()))


def _pad(seqs, device, extra: int = 0) -> torch.Tensor:
    Lm = max(len(s) for s in seqs) + extra
    t = torch.full((len(seqs), Lm), PAD_ID, dtype=torch.long)
    for i, s in enumerate(seqs):
        t[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    return t.to(device)


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


@torch.no_grad()
def target_logits_taps(model, tokens, rows, quant, tap_layers, use_autocast=True):
    """Logits at flat rows `rows` [B, k] of tokens [B, L] and taps [B, L, taps*D]."""
    dev = tokens.device
    with autocast(dev, use_autocast):
        X, taps, _ = target_forward(model, tokens, quant=quant, tap_layers=tap_layers)
        B, L = tokens.shape
        X = X.view(B, L, *X.shape[1:])
        sel = X[torch.arange(B, device=dev)[:, None], rows]                 # [B, k, n, D]
        logits = model.logits(sel.flatten(0, 1)).float().view(B, rows.shape[1], -1)
    return logits, (taps.view(B, L, -1) if taps is not None else None)


@torch.no_grad()
def draft_block(drafter, model, tokens, taps, P, temperature, gen, quant, markov=True,
                use_autocast=True):
    """Drafts [B, γ], their distributions q [B, γ, V] (None for greedy), confidences [B, γ]."""
    dev = tokens.device
    B, L = tokens.shape
    with autocast(dev, use_autocast):
        ctx = context_kv(drafter, taps, B, L, quant)
        h = drafter_hidden(drafter, model.embed, tokens, P[:, None], ctx, quant)[:, 0]   # [B, γ, D]
        base = drafter.base_logits(model.head, h.flatten(0, 1)).float().view(B, drafter.gamma, -1)
    prev = tokens.gather(1, P[:, None])[:, 0]
    toks, qs, confs = [], [], []
    for k in range(drafter.gamma):
        bias, conf = drafter.markov_step(h[:, k].float(), prev)
        z = base[:, k] + bias if markov else base[:, k]
        if temperature == 0:
            prev = z.argmax(-1)
        else:
            q = _probs(z, temperature)
            prev = torch.multinomial(q, 1, generator=gen)[:, 0]
            qs.append(q)
        toks.append(prev)
        confs.append(torch.sigmoid(conf))
    return (torch.stack(toks, 1), torch.stack(qs, 1) if qs else None, torch.stack(confs, 1))


@torch.no_grad()
def spec_decode(model, drafter, prompts, max_new: int, temperature: float, seed: int = 0,
                quant=None, markov: bool = True, batch_size: int = 512, stop_at_eos: bool = True,
                use_autocast: bool = True):
    """Run DSpark rounds on token-id prompts. Returns (outputs [list of new-token lists], stats)."""
    dev = next(model.parameters()).device
    g = drafter.gamma
    taps_ids = tuple(model.cfg.dspark_target_layer_ids)
    gen = torch.Generator(device=dev).manual_seed(seed)
    outputs = [None] * len(prompts)
    rounds = emitted = 0
    acc_slot = torch.zeros(g, dtype=torch.float64)       # drafts accepted at slot k
    reach_slot = torch.zeros(g, dtype=torch.float64)     # rounds that reached slot k
    conf_sum = torch.zeros(g, dtype=torch.float64)
    conf_acc = []                                         # (confidence, accepted) pairs for slot 1
    per_round = []
    for b0 in range(0, len(prompts), batch_size):
        idx = list(range(b0, min(len(prompts), b0 + batch_size)))
        seqs = [list(prompts[i]) for i in idx]
        new = [[] for _ in idx]
        # prefill: first anchor from the last prompt position
        tokens = _pad(seqs, dev)
        last = torch.tensor([len(s) - 1 for s in seqs], device=dev)
        logits, taps = target_logits_taps(model, tokens, last[:, None], quant, taps_ids, use_autocast)
        if temperature == 0:
            y = logits[:, 0].argmax(-1)
        else:
            y = torch.multinomial(_probs(logits[:, 0], temperature), 1, generator=gen)[:, 0]
        for j, t in enumerate(y.tolist()):
            seqs[j].append(t)
            new[j].append(t)
        tap_row = {j: j for j in range(len(idx))}      # request -> row of `taps`
        active = [j for j in range(len(idx)) if not (stop_at_eos and new[j][-1] == EOS_ID)
                  and len(new[j]) < max_new]
        while active:
            sub = [seqs[j] for j in active]
            P = torch.tensor([len(s) - 1 for s in sub], device=dev)
            tokens = _pad(sub, dev, extra=g)
            # context taps 0..P-1 are valid in the last forward over this request's sequence
            act_taps = taps[torch.tensor([tap_row[j] for j in active], device=dev)]
            Lt = act_taps.shape[1]
            if Lt < tokens.shape[1]:
                act_taps = torch.cat([act_taps, act_taps.new_zeros(len(active), tokens.shape[1] - Lt,
                                                                   act_taps.shape[2])], 1)
            else:
                act_taps = act_taps[:, :tokens.shape[1]]
            drafts, q, conf = draft_block(drafter, model, tokens, act_taps, P, temperature, gen,
                                          quant, markov, use_autocast)
            # verify: seq + drafts, logits at P..P+γ
            ver = [s + d for s, d in zip(sub, drafts.tolist())]
            vt = _pad(ver, dev)
            rows = P[:, None] + torch.arange(g + 1, device=dev)
            logits, vtaps = target_logits_taps(model, vt, rows, quant, taps_ids, use_autocast)
            if temperature == 0:
                tgt = logits.argmax(-1)                                        # [b, γ+1]
                ok = drafts == tgt[:, :g]
            else:
                p = _probs(logits, temperature)                                # [b, γ+1, V]
                pd = p[:, :g].gather(-1, drafts[..., None])[..., 0]
                qd = q.gather(-1, drafts[..., None])[..., 0]
                u = torch.rand(drafts.shape, generator=gen, device=dev)
                ok = u * qd < pd                                               # u < p/q
            a = torch.cumprod(ok.long(), 1).sum(1)                             # accepted drafts
            if temperature == 0:
                y = tgt.gather(1, a[:, None])[:, 0]
            else:
                rows_p = p.gather(1, a[:, None, None].expand(-1, 1, p.shape[-1]))[:, 0]
                qa = torch.cat([q, torch.zeros_like(q[:, :1])], 1)
                rows_q = qa.gather(1, a[:, None, None].expand(-1, 1, q.shape[-1]))[:, 0]
                resid = (rows_p - rows_q).clamp_min(0)
                resid = torch.where((a < g)[:, None], resid, rows_p)
                s = resid.sum(-1, keepdim=True)
                resid = torch.where(s > 0, resid / s.clamp_min(1e-30), rows_p)
                y = torch.multinomial(resid, 1, generator=gen)[:, 0]
            a_l, y_l, d_l = a.tolist(), y.tolist(), drafts.tolist()
            reached = torch.arange(g)[None, :] <= a.cpu()[:, None]             # slot k reached
            acc_slot += (ok.cpu() & reached).sum(0).double()
            reach_slot += reached.sum(0).double()
            conf_sum += (conf.float().cpu() * reached).sum(0).double()
            conf_acc += list(zip(conf[:, 0].float().tolist(), ok[:, 0].tolist()))
            # commit
            for i, j in enumerate(active):
                toks = d_l[i][:a_l[i]] + [y_l[i]]
                room = max_new - len(new[j])
                toks = toks[:room]
                if stop_at_eos and EOS_ID in toks:
                    toks = toks[:toks.index(EOS_ID) + 1]
                seqs[j] += toks
                new[j] += toks
                rounds += 1
                emitted += len(toks)
                per_round.append(len(toks))
            taps, tap_row = vtaps, {j: i for i, j in enumerate(active)}
            active = [j for j in active if not (stop_at_eos and new[j][-1] == EOS_ID)
                      and len(new[j]) < max_new]
        for j, i in enumerate(idx):
            outputs[i] = new[j]
    stats = {"tau": emitted / max(rounds, 1), "rounds": rounds, "emitted": emitted,
             "accept_rate_per_slot": (acc_slot / reach_slot.clamp_min(1)).tolist(),
             "mean_conf_per_slot": (conf_sum / reach_slot.clamp_min(1)).tolist(),
             "slot1_conf_calibration": _calibration(conf_acc)}
    return outputs, stats


def _calibration(pairs, bins: int = 5):
    out = []
    for i in range(bins):
        lo, hi = i / bins, (i + 1) / bins
        sel = [a for c, a in pairs if lo <= c < hi or (i == bins - 1 and c == 1.0)]
        if sel:
            out.append({"conf": [round(lo, 2), round(hi, 2)], "n": len(sel),
                        "accept": round(sum(sel) / len(sel), 4)})
    return out


@torch.no_grad()
def greedy_decode(model, prompts, max_new: int, quant=None, use_autocast=True, stop_at_eos=True):
    """Plain target greedy decoding (one full forward per token), for the losslessness check."""
    dev = next(model.parameters()).device
    seqs = [list(p) for p in prompts]
    new = [[] for _ in prompts]
    for _ in range(max_new):
        act = [j for j in range(len(seqs)) if not (stop_at_eos and new[j] and new[j][-1] == EOS_ID)]
        if not act:
            break
        tok = _pad([seqs[j] for j in act], dev)
        last = torch.tensor([len(seqs[j]) - 1 for j in act], device=dev)
        logits, _ = target_logits_taps(model, tok, last[:, None], quant, (), use_autocast)
        for j, t in zip(act, logits[:, 0].argmax(-1).tolist()):
            seqs[j].append(t)
            new[j].append(t)
    return new


@torch.no_grad()
def heldout_loss(model, stream, L: int, max_tokens: int, batch: int = 32, quant=None,
                 use_autocast=True) -> dict:
    """Mean next-token cross-entropy (nats) over non-overlapping L-token windows of `stream`."""
    dev = next(model.parameters()).device
    chunks = stream.chunks(L, max_tokens)
    tot, n = 0.0, 0
    for i in range(0, len(chunks), batch):
        c = chunks[i:i + batch].to(dev)
        with autocast(dev, use_autocast):
            X, _, _ = target_forward(model, c[:, :-1], quant=quant)
            logits = model.logits(X).float()
        tot += torch.nn.functional.cross_entropy(logits, c[:, 1:].reshape(-1), reduction="sum").item()
        n += c[:, 1:].numel()
    loss = tot / max(n, 1)
    return {"loss": loss, "ppl": math.exp(loss), "tokens": n}


def distinct_ngrams(seqs, n: int = 4) -> float:
    grams, total = set(), 0
    for s in seqs:
        for i in range(len(s) - n + 1):
            grams.add(tuple(s[i:i + n]))
            total += 1
    return len(grams) / max(total, 1)


def evaluate(ckpt: str, data: PreparedData, ablation: str | None = None, max_new: int = 128,
             max_prompts: int = 0, greedy_check: int = 32, seed: int = 0, quant: bool = True,
             device=None, n_samples: int = 4, use_autocast: bool = True, log=print,
             on_result=None) -> dict:
    from .common import build_drafter
    dev = pick_device(device)
    setup_fast_math(dev)
    cfg, model, drafter = load_models(ckpt, dev)
    model.eval()
    drafter.eval()
    tok = data.tokenizer
    prompts_meta = data.prompts[:max_prompts] if max_prompts else data.prompts
    prompts = [tok.encode(p["prompt"]).ids for p in prompts_meta]
    q = EvalQuant() if quant else None
    drafters = {"markov": (drafter, True)}
    if ablation:
        abl = build_drafter(cfg, markov=False).to(dev)
        abl.load_state_dict(torch.load(ablation, map_location=dev))
        drafters["no_markov"] = (abl.eval(), False)
    res = {"prompts": len(prompts), "max_new": max_new, "gamma": cfg.dspark_block_size,
           "quant": "fp8 kv + fp4 indexer (engine default)" if quant else "none"}
    for name, (d, mk) in drafters.items():
        res[name] = {}
        for mode, T in (("greedy", 0.0), ("t1", 1.0)):
            outs, st = spec_decode(model, d, prompts, max_new, T, seed=seed, quant=q, markov=mk,
                                   use_autocast=use_autocast)
            st["distinct_4grams"] = distinct_ngrams(outs)
            st["mean_new_tokens"] = sum(map(len, outs)) / max(len(outs), 1)
            res[name][mode] = st
            log(f"[eval] {name:9s} {mode:6s} tau={st['tau']:.3f} rounds={st['rounds']} "
                f"accept/slot={[round(x, 3) for x in st['accept_rate_per_slot']]} "
                f"distinct-4grams={st['distinct_4grams']:.3f}")
            if name == "markov":
                res.setdefault("samples", {})[mode] = [
                    {"source": prompts_meta[i]["source"], "prompt": prompts_meta[i]["prompt"],
                     "completion": tok.decode(outs[i])} for i in range(min(n_samples, len(outs)))]
                if mode == "greedy" and greedy_check:
                    k = min(greedy_check, len(prompts))
                    ref = greedy_decode(model, prompts[:k], max_new, q, use_autocast)
                    match = sum(r == o for r, o in zip(ref, outs[:k])) / k
                    prefix = [sum(1 for _ in _common_prefix(r, o)) / max(len(r), 1)
                              for r, o in zip(ref, outs[:k])]
                    st["greedy_check_match"] = match
                    st["greedy_check_prefix_frac"] = sum(prefix) / k
                    log(f"[eval] greedy spec output == plain target greedy: {match:.3f} of {k} "
                        f"(mean common-prefix fraction {st['greedy_check_prefix_frac']:.3f})")
            if on_result is not None:
                on_result(res)
    if "no_markov" in res:
        res["markov_over_no_markov_t1"] = res["markov"]["t1"]["tau"] / res["no_markov"]["t1"]["tau"]
        res["markov_over_no_markov_greedy"] = (res["markov"]["greedy"]["tau"] /
                                               res["no_markov"]["greedy"]["tau"])
    return res


def _common_prefix(a, b):
    for x, y in zip(a, b):
        if x != y:
            return
        yield x


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m dspark.train.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint dir (target + mtp.* drafter)")
    p.add_argument("--data", required=True, help="dir written by `python -m dspark.train.data`")
    p.add_argument("--ablation", help="no-Markov drafter state_dict (.pt) from the drafter trainer")
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--max-prompts", type=int, default=0)
    p.add_argument("--greedy-check", type=int, default=32,
                   help="compare greedy spec output with plain target greedy on this many prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-quant", action="store_true", help="no FP8/FP4 storage rounding")
    p.add_argument("--no-autocast", action="store_true", help="fp32 math instead of bf16 autocast")
    p.add_argument("--device")
    p.add_argument("--out", help="write the results JSON here")
    a = p.parse_args(argv)
    data = PreparedData(a.data)
    res = evaluate(a.ckpt, data, a.ablation, a.max_new, a.max_prompts, a.greedy_check, a.seed,
                   not a.no_quant, a.device, use_autocast=not a.no_autocast)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
