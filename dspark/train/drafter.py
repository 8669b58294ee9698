"""Train the DSpark drafter (`mtp.*` stages) against a frozen target.

    python -m dspark.train.drafter --data DATA --target TARGET_DIR --out CKPT_DIR \
        [--time-budget 240 | --steps N] [--ablation | --ablation-only] [--sampled rows.npy]

Per step: random [B, L] windows; the frozen target (bf16-rounded weights as shipped) gives taps
(hc-mean after `dspark_target_layer_ids`) and its next-token distributions; A anchors P per
window (1 <= P <= L-γ-1) each give a block [x_P, noise x (γ-1)] at P..P+γ-1 predicting
x_{P+1..P+γ} with the context window ctx[max(0,P-128):P] (dspark.md §3). Losses per slot k
(weight exp(-(k-1)/γ)): CE of the corrected logits (base + Markov bias of the teacher-forced
ground-truth previous token) against the ground truth, total-variation distance between the draft
and target distributions (T = 1), and BCE of the confidence logit against 1 - TV (detached).
Embedding and LM head are the target's (frozen). `--ablation` trains a second drafter without
the Markov head (rank 0) on exactly the same batches, saved as ablation.pt (not in the checkpoint);
`--ablation-only` trains just that one (run it in a second process on a second GPU: same seed,
same batches). `--sampled rows.npy` (dspark.train.sample: train windows continued by the target
at T = 1) replaces a `--sampled-frac` share of the batches by such rows, with their anchors in
the sampled part only: the context the drafter meets at inference.
Writes CKPT_DIR: full checkpoint (target + drafter), tokenizer.json, drafter_log.json,
drafter_loss.png.
"""
from __future__ import annotations

import argparse
import os
import shutil

import torch
import torch.nn.functional as F

from .common import (FP32_SUFFIXES, QATQuant, Timer, autocast, build_drafter, count_params, freeze,
                     init_drafter, load_models, lr_at, pick_device, round_bf16_, save_checkpoint,
                     setup_fast_math, write_json)
from .data import NOISE_ID, PreparedData
from .forward import drafter_forward, target_forward


def sample_anchors(B: int, L: int, A: int, gamma: int, gen: torch.Generator,
                   lo: int = 1) -> torch.Tensor:
    """A distinct anchor positions per row in [lo, L-γ-1] (labels P+1..P+γ stay inside the row)."""
    hi = L - gamma - 1
    if hi < lo:
        raise ValueError(f"no anchor fits in [{lo}, {hi}] (row length {L}, γ {gamma})")
    n = hi - lo + 1
    A = min(A, n)
    keys = torch.rand(B, n, generator=gen)
    return keys.topk(A, dim=1).indices.sort(dim=1).values + lo


def slot_weights(gamma: int, device) -> torch.Tensor:
    return torch.exp(-torch.arange(gamma, device=device, dtype=torch.float32) / gamma)


def drafter_losses(z, conf, labels, tprob, w, w_ce=0.1, w_tv=0.9, w_conf=1.0):
    """z [N, γ, V] logits, conf [N, γ] logits, labels [N, γ], tprob [N, γ, V] target probs."""
    logp = torch.log_softmax(z.float(), -1)
    ce = -logp.gather(-1, labels[..., None])[..., 0]
    tv = 0.5 * (logp.exp() - tprob).abs().sum(-1)
    bce = F.binary_cross_entropy_with_logits(conf.float(), (1 - tv).detach(), reduction="none")
    wn = w / w.sum()
    ce_m, tv_m, bce_m = [(t * wn).sum(-1).mean() for t in (ce, tv, bce)]
    loss = w_ce * ce_m + w_tv * tv_m + w_conf * bce_m
    with torch.no_grad():      # device tensors: read back only when a log line is due
        stats = {"ce": ce_m.detach(), "tv": tv_m.detach(), "bce": bce_m.detach(),
                 "accept_t1_per_slot": (1 - tv).mean(0),
                 "greedy_match_per_slot": (z.argmax(-1) == tprob.argmax(-1)).float().mean(0)}
    return loss, stats


def est_tau(rates) -> float:
    """1 + sum_k prod_{i<=k} rate_i (assumes independent slots; a training-time proxy)."""
    t, c = 1.0, 1.0
    for r in rates:
        c *= r
        t += c
    return t


def plot_curves(log: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, recs in log["train"].items():
        st = [r["step"] for r in recs]
        axes[0].plot(st, [r["tv"] for r in recs], label=f"{name}: TV")
        axes[0].plot(st, [r["ce"] for r in recs], "--", label=f"{name}: CE")
        axes[1].plot(st, [r["est_tau_t1"] for r in recs], label=f"{name}: τ est. T=1")
        axes[1].plot(st, [r["est_tau_greedy"] for r in recs], "--", label=f"{name}: τ est. greedy")
    axes[0].set_xlabel("step"), axes[0].set_title("drafter losses"), axes[0].legend(), axes[0].grid(alpha=.3)
    axes[1].set_xlabel("step"), axes[1].set_title("teacher-forced τ estimate"), axes[1].legend()
    axes[1].grid(alpha=.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def train_drafter(data: PreparedData, target: str, out: str, steps: int = 0,
                  time_budget: float = 0.0, batch: int = 64, seq_len: int = 512, anchors: int = 64,
                  lr: float = 2e-3, warmup: int = 100, wd: float = 0.1, gamma: int = 5,
                  markov_rank: int = 64, ablation: bool = False, w_ce: float = 0.1,
                  w_tv: float = 0.9, w_conf: float = 1.0, qat: bool = True, seed: int = 0,
                  log_every: int = 25, device=None, log=print, updates_per_batch: int = 1,
                  ablation_only: bool = False, sampled: str | None = None,
                  sampled_frac: float = 0.25, init_from: str | None = None,
                  init_ablation: str | None = None) -> dict:
    if not steps and not time_budget:
        raise ValueError("give --steps or --time-budget")
    rows = prompt_len = None
    if sampled:
        from .sample import load_rows
        rows, smeta = load_rows(sampled)
        prompt_len = int(smeta["prompt_len"])
        if rows.shape[1] != seq_len:
            raise ValueError(f"sampled rows are {rows.shape[1]} tokens long but --seq-len is {seq_len}: "
                             f"sample with --prompt-len + --new = {seq_len}")
        rows = torch.from_numpy(rows.astype("int64"))
    dev = pick_device(device)
    setup_fast_math(dev)
    torch.manual_seed(seed)
    tcfg, model, _ = load_models(target, dev, with_drafter=False)
    freeze(model)
    n = tcfg.num_hidden_layers
    cfg = tcfg.replace(num_dspark_stages=3, dspark_block_size=gamma,
                       dspark_target_layer_ids=tuple(range(max(0, n - 3), n)),
                       dspark_markov_rank=markov_rank, dspark_noise_token_id=NOISE_ID)
    cfg.validate()
    variants = {} if ablation_only else {"markov": build_drafter(cfg, markov=True)}
    if ablation or ablation_only:
        variants["no_markov"] = build_drafter(cfg, markov=False)
    opts, logd = {}, {"config": {k: (list(v) if isinstance(v, tuple) else v)
                                 for k, v in cfg.__dict__.items()},
                      "args": dict(steps=steps, time_budget=time_budget, batch=batch, seq_len=seq_len,
                                   anchors=anchors, lr=lr, warmup=warmup, wd=wd, gamma=gamma,
                                   markov_rank=markov_rank, w_ce=w_ce, w_tv=w_tv, w_conf=w_conf,
                                   qat=qat, seed=seed, updates_per_batch=updates_per_batch,
                                   sampled=sampled, sampled_frac=sampled_frac if sampled else 0.0,
                                   sampled_rows=0 if rows is None else int(rows.shape[0]),
                                   sampled_prompt_len=prompt_len, init_from=init_from,
                                   init_ablation=init_ablation),
                      "params": {}, "train": {k: [] for k in variants}}
    warm = _warm_starts(variants, init_from, init_ablation, dev)
    for name, d in variants.items():
        if name in warm:
            d.load_state_dict(warm[name], strict=True)     # continue an earlier run
        else:
            init_drafter(d, seed=seed + 1)
        d.to(dev).train()
        for pn, p in d.named_parameters():
            if pn.endswith("gate.bias"):
                p.requires_grad_(False)
        decay = [p for pn, p in d.named_parameters() if p.dim() >= 2]
        rest = [p for pn, p in d.named_parameters() if p.dim() < 2 and p.requires_grad]
        opts[name] = torch.optim.AdamW([{"params": decay, "weight_decay": wd},
                                        {"params": rest, "weight_decay": 0.0}], lr=lr,
                                       betas=(0.9, 0.95), fused=dev.type == "cuda")
        logd["params"][name] = count_params(d)
    log(f"[drafter] target {target}: taps {list(cfg.dspark_target_layer_ids)}, γ={gamma}, "
        f"Markov rank {markov_rank}; params " +
        ", ".join(f"{k} {v / 1e6:.2f} M" for k, v in logd["params"].items()))
    quant = QATQuant() if qat else None
    gen = torch.Generator().manual_seed(seed + 17)
    w = slot_weights(gamma, dev)
    clock = Timer()
    step = 0
    accs = {k: [] for k in variants}
    while True:
        progress = max(step / steps if steps else 0.0, clock() / time_budget if time_budget else 0.0)
        if progress >= 1.0:
            break
        cur_lr = lr_at(step, progress, lr, warmup)
        on_policy = rows is not None and torch.rand((), generator=gen).item() < sampled_frac
        if on_policy:
            x = rows[torch.randint(0, rows.shape[0], (batch,), generator=gen)]
        else:
            x = data.train.batch(batch, seq_len, gen)[:, :seq_len]
        x = (x.pin_memory() if dev.type == "cuda" else x).to(dev, non_blocking=True)
        ancs = [sample_anchors(batch, seq_len, anchors, gamma, gen,
                               lo=prompt_len if on_policy else 1).to(dev, non_blocking=True)
                for _ in range(updates_per_batch)]
        try:
            stats = _step(model, variants, opts, x, ancs, cfg, quant, w, (w_ce, w_tv, w_conf), cur_lr)
        except torch.cuda.OutOfMemoryError:
            if batch <= 4:
                raise
            batch //= 2
            for o in opts.values():
                o.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            log(f"[drafter] out of memory: batch -> {batch}")
            logd["args"]["batch"] = batch
            continue
        for name, sts in stats.items():
            accs[name].extend(sts)
        prev_step, step = step, step + len(ancs)
        if step // log_every != prev_step // log_every or prev_step == 0:
            for name in variants:
                recs = accs[name]
                k = len(recs)
                rec = {"step": step, "time": round(clock(), 1), "lr": cur_lr}
                for key in ("ce", "tv", "bce", "grad_norm", "accept_t1_per_slot",
                            "greedy_match_per_slot"):
                    v = (torch.stack([r[key] for r in recs]).float().mean(0)).tolist()
                    rec[key] = v
                rec["est_tau_t1"] = est_tau(rec["accept_t1_per_slot"])
                rec["est_tau_greedy"] = est_tau(rec["greedy_match_per_slot"])
                logd["train"][name].append(rec)
                log(f"[drafter] step {step:5d} {name:9s} ce {rec['ce']:.3f} tv {rec['tv']:.3f} "
                    f"bce {rec['bce']:.3f} est.τ T1 {rec['est_tau_t1']:.2f} greedy "
                    f"{rec['est_tau_greedy']:.2f} lr {cur_lr:.2e} t={rec['time']:.0f}s")
                accs[name] = []
    logd["final"] = {"steps": step, "train_seconds": round(clock(), 1)}
    os.makedirs(out, exist_ok=True)
    info = {"total_bytes": 0}
    if "markov" in variants:
        main_d = variants["markov"].eval()
        round_bf16_(main_d, keep_fp32=FP32_SUFFIXES)
        info = save_checkpoint(out, cfg, model, main_d)
        logd["final"]["checkpoint_bytes"] = info["total_bytes"]
    if "no_markov" in variants:
        abl = variants["no_markov"].eval()
        round_bf16_(abl, keep_fp32=FP32_SUFFIXES)
        torch.save(abl.state_dict(), os.path.join(out, "ablation.pt"))
    tok = os.path.join(target, "tokenizer.json")
    if os.path.exists(tok):
        shutil.copy(tok, os.path.join(out, "tokenizer.json"))
    write_json(os.path.join(out, "drafter_log.json"), logd)
    plot_curves(logd, os.path.join(out, "drafter_loss.png"))
    saved = (f"checkpoint {info['total_bytes'] / 1e6:.2f} MB" if "markov" in variants
             else "ablation.pt")
    log(f"[drafter] done: {step} steps in {clock():.0f}s; {saved}")
    return logd


def _warm_starts(variants: dict, init_from: str | None, init_ablation: str | None, dev) -> dict:
    """State dicts to continue from: the Markov drafter from a DSpark checkpoint dir (its mtp.*
    stages), the no-Markov ablation from an ablation.pt. The shapes must match the new drafters
    (same target, γ and Markov rank), else load_state_dict names the mismatching tensors."""
    warm = {}
    if init_from and "markov" in variants:
        _, _, d = load_models(init_from, dev, with_drafter=True)
        if d is None:
            raise ValueError(f"--init-from {init_from}: the checkpoint has no DSpark drafter (mtp.*)")
        warm["markov"] = d.state_dict()
    if init_ablation and "no_markov" in variants:
        warm["no_markov"] = torch.load(init_ablation, map_location=dev)
    return warm


def _step(model, variants, opts, x, ancs, cfg, quant, w, loss_w, cur_lr):
    """One frozen-target forward over the windows x, then one optimizer update per anchor set
    in `ancs` (the target forward is the expensive, launch-bound part: reusing it for several
    sets of blocks from the same windows buys drafter updates at little cost)."""
    dev = x.device
    use_ac = dev.type == "cuda"
    gamma = cfg.dspark_block_size
    B, L = x.shape
    with torch.no_grad(), autocast(dev, use_ac):
        X, taps, _ = target_forward(model, x, quant=quant, tap_layers=cfg.dspark_target_layer_ids)
    stats = {name: [] for name in variants}
    for anc in ancs:
        bpos = anc[..., None] + torch.arange(gamma, device=dev)          # [B, A, γ]
        with torch.no_grad(), autocast(dev, use_ac):
            Xb = X.view(B, L, *X.shape[1:])[torch.arange(B, device=dev)[:, None], bpos.view(B, -1)]
            tprob = torch.softmax(model.logits(Xb.flatten(0, 1)).float(), -1)
            tprob = tprob.view(B * anc.shape[1], gamma, -1)
            del Xb
        labels = x.gather(1, (bpos + 1).view(B, -1)).view(-1, gamma)
        for name, d in variants.items():
            for gp in opts[name].param_groups:
                gp["lr"] = cur_lr
            with autocast(dev, use_ac):
                z, conf, _ = drafter_forward(d, model.embed, model.head, taps, x, anc, quant=quant,
                                             markov=(name == "markov"))
            loss, st = drafter_losses(z.flatten(0, 1), conf.flatten(0, 1), labels, tprob, w,
                                      *loss_w)
            opts[name].zero_grad(set_to_none=True)
            loss.backward()
            del z, conf, loss
            st["grad_norm"] = torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0).detach()
            opts[name].step()
            stats[name].append(st)
        del tprob
    return stats


def add_args(p):
    p.add_argument("--data", required=True)
    p.add_argument("--target", required=True, help="target checkpoint dir (dspark.train.target)")
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true", help="accepted for symmetry; sizes come from the target")
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--time-budget", type=float, default=0.0)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--anchors", type=int, default=64, help="blocks per sequence")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--gamma", type=int, default=5)
    p.add_argument("--markov-rank", type=int, default=64)
    p.add_argument("--ablation", action="store_true", help="also train the no-Markov drafter")
    p.add_argument("--ablation-only", action="store_true",
                   help="train only the no-Markov drafter (-> OUT/ablation.pt)")
    p.add_argument("--sampled", help="rows.npy from dspark.train.sample (on-policy windows)")
    p.add_argument("--sampled-frac", type=float, default=0.25,
                   help="share of batches drawn from --sampled")
    p.add_argument("--w-ce", type=float, default=0.1)
    p.add_argument("--w-tv", type=float, default=0.9)
    p.add_argument("--w-conf", type=float, default=1.0)
    p.add_argument("--no-qat", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--updates-per-batch", type=int, default=1,
                   help="drafter updates (fresh anchors each) per frozen-target forward")
    p.add_argument("--init-from", help="continue training: start the drafter from this checkpoint's mtp.*")
    p.add_argument("--init-ablation", help="continue training: start the ablation from this ablation.pt")
    p.add_argument("--device")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m dspark.train.drafter", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    a = p.parse_args(argv)
    data = PreparedData(a.data)
    return train_drafter(data, a.target, a.out, a.steps, a.time_budget, a.batch, a.seq_len, a.anchors,
                         a.lr, a.warmup, a.wd, a.gamma, a.markov_rank, a.ablation, a.w_ce, a.w_tv,
                         a.w_conf, not a.no_qat, a.seed, a.log_every, a.device,
                         updates_per_batch=a.updates_per_batch, ablation_only=a.ablation_only,
                         sampled=a.sampled, sampled_frac=a.sampled_frac, init_from=a.init_from,
                         init_ablation=a.init_ablation)


if __name__ == "__main__":
    main()
