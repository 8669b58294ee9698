"""Train a small DeepSeek-V4-architecture target on the prepared corpus.

    python -m dspark.train.target --data DATA --out TARGET_DIR [--time-budget 300 | --steps N]

Batched full-sequence forward (dspark.train.forward) over random [B, L] windows of the token
stream, bf16 autocast, AdamW with warmup + cosine (progress = max(step/steps, time/budget)),
QAT fake-quant of the reference's FP8 kv / FP4 indexer storage (straight-through), a dense-target
KL loss for the lightning indexer, and aux-loss-free load balancing of the routed experts (the
`gate.bias` selection bias is nudged towards uniform expert load after every step).
Writes TARGET_DIR: official-layout checkpoint (bf16), tokenizer.json, target_log.json,
target_loss.png.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil

import torch
import torch.nn.functional as F

from dspark.models.deepseek_v4.model import DeepseekV4Model

from .common import (QATQuant, Timer, autocast, count_params, init_target, lr_at, make_config,
                     pick_device, round_bf16_, FP32_SUFFIXES, save_checkpoint, setup_fast_math,
                     write_json)
from .data import PreparedData
from .evaluate import heldout_loss


class ExpertBalancer:
    """Aux-loss-free balancing: after each step, bias_e += rate * sign(mean load - load_e)."""

    def __init__(self, model, rate: float):
        self.rate, self.counts, self.gates = rate, {}, []
        for i, layer in enumerate(model.layers):
            gate = layer.ffn.gate
            if not gate.hash:
                self.gates.append((i, gate))
                gate.register_forward_hook(self._hook(i))

    def _hook(self, i):
        def fn(mod, inp, out):
            idx = out[0].detach().flatten()
            c = torch.bincount(idx, minlength=mod.bias.shape[0]).float()
            self.counts[i] = self.counts.get(i, 0) + c
        return fn

    @torch.no_grad()
    def step(self) -> float:
        worst = 0.0
        for i, gate in self.gates:
            c = self.counts.pop(i, None)
            if c is None or self.rate <= 0:
                continue
            gate.bias.add_(self.rate * torch.sign(c.mean() - c))
            worst = max(worst, float(c.max() / c.mean().clamp_min(1)))
        return worst            # max load / mean load over layers (1.0 = perfectly balanced)


def plot_curves(log: dict, path: str, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    tr = log["train"]
    ax.plot([r["step"] for r in tr], [r["loss"] for r in tr], label="train CE", lw=1)
    ev = log.get("eval", [])
    if ev:
        ax.plot([r["step"] for r in ev], [r["heldout_loss"] for r in ev], "o-", label="held-out CE")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def train_target(data: PreparedData, out: str, tiny: bool = False, steps: int = 0,
                 time_budget: float = 0.0, batch: int = 64, seq_len: int = 512, lr: float = 2e-3,
                 warmup: int = 100, wd: float = 0.1, seed: int = 0, eval_every: int = 250,
                 eval_tokens: int = 300_000, log_every: int = 25, qat: bool = True,
                 indexer_aux: float = 0.1, bias_rate: float = 1e-3, device=None, log=print) -> dict:
    if not steps and not time_budget:
        raise ValueError("give --steps or --time-budget")
    dev = pick_device(device)
    setup_fast_math(dev)
    torch.manual_seed(seed)
    cfg = make_config("tiny" if tiny else "default", vocab_size=data.vocab_size)
    model = init_target(DeepseekV4Model(cfg), seed=seed).to(dev)
    n_params = count_params(model)
    log(f"[target] {n_params / 1e6:.2f} M parameters, layers {list(cfg.compress_ratios)}, "
        f"d={cfg.hidden_size}, vocab={cfg.vocab_size}, device={dev}")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 and not n.endswith("gate.bias")]
    for n, p in model.named_parameters():
        if n.endswith("gate.bias"):
            p.requires_grad_(False)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95),
                            eps=1e-8, fused=dev.type == "cuda")
    bal = ExpertBalancer(model, bias_rate)
    gen = torch.Generator().manual_seed(seed)
    quant = QATQuant() if qat else None
    use_ac = dev.type == "cuda"
    ev_fixed = data.heldout                      # quick evals use the first eval_tokens//4 tokens
    logd = {"config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.__dict__.items()},
            "params": n_params, "args": dict(tiny=tiny, steps=steps, time_budget=time_budget,
                                             batch=batch, seq_len=seq_len, lr=lr, warmup=warmup,
                                             wd=wd, seed=seed, qat=qat, indexer_aux=indexer_aux,
                                             bias_rate=bias_rate),
            "train": [], "eval": []}
    clock = Timer()
    step, tokens_seen, acc, acc_aux, acc_n = 0, 0, 0.0, 0.0, 0
    model.train()
    while True:
        progress = max(step / steps if steps else 0.0, clock() / time_budget if time_budget else 0.0)
        if progress >= 1.0:
            break
        cur_lr = lr_at(step, progress, lr, warmup)
        for gp in opt.param_groups:
            gp["lr"] = cur_lr
        x = data.train.batch(batch, seq_len, gen).to(dev, non_blocking=True)
        try:
            ce, aux, gnorm = _step(model, opt, x, quant, indexer_aux)
        except torch.cuda.OutOfMemoryError:
            if batch <= 8:
                raise
            batch //= 2
            opt.zero_grad(set_to_none=True)
            bal.counts.clear()
            torch.cuda.empty_cache()
            log(f"[target] out of memory: batch -> {batch}")
            logd["args"]["batch"] = batch
            continue
        imbalance = bal.step()
        step += 1
        tokens_seen += x[:, 1:].numel()
        acc += ce.item()
        acc_aux += aux.item()
        acc_n += 1
        if step % log_every == 0 or step == 1:
            rec = {"step": step, "loss": acc / acc_n, "indexer_kl": acc_aux / acc_n, "lr": cur_lr,
                   "grad_norm": float(gnorm), "expert_load_max_over_mean": imbalance,
                   "tokens": tokens_seen, "time": round(clock(), 1),
                   "tok_per_s": round(tokens_seen / max(clock(), 1e-9))}
            logd["train"].append(rec)
            log(f"[target] step {step:5d} loss {rec['loss']:.4f} idxKL {rec['indexer_kl']:.3f} "
                f"lr {cur_lr:.2e} gnorm {rec['grad_norm']:.2f} load {imbalance:.2f} "
                f"{rec['tok_per_s'] / 1e3:.0f}k tok/s t={rec['time']:.0f}s")
            acc = acc_aux = 0.0
            acc_n = 0
        if eval_every and step % eval_every == 0:
            model.eval()
            r = heldout_loss(model, ev_fixed, seq_len, max(eval_tokens // 4, seq_len), quant=quant,
                             use_autocast=use_ac)
            model.train()
            bal.counts.clear()
            logd["eval"].append({"step": step, "heldout_loss": r["loss"], "time": round(clock(), 1)})
            log(f"[target] step {step:5d} held-out loss {r['loss']:.4f} (ppl {r['ppl']:.2f})")
    train_time = clock()
    # final: round to the stored precision, evaluate what ships
    model.eval()
    round_bf16_(model, keep_fp32=FP32_SUFFIXES)
    final = heldout_loss(model, data.heldout, seq_len, eval_tokens, quant=quant, use_autocast=use_ac)
    logd["eval"].append({"step": step, "heldout_loss": final["loss"], "time": round(clock(), 1)})
    logd["final"] = {"steps": step, "tokens": tokens_seen, "train_seconds": round(train_time, 1),
                     "train_loss_last": logd["train"][-1]["loss"] if logd["train"] else None,
                     "heldout_loss": final["loss"], "heldout_ppl": final["ppl"],
                     "heldout_tokens": final["tokens"],
                     "heldout_bits_per_byte": _bits_per_byte(final["loss"], data)}
    log(f"[target] done: {step} steps, {tokens_seen / 1e6:.1f} M tokens in {train_time:.0f}s; "
        f"held-out loss {final['loss']:.4f} ppl {final['ppl']:.2f}")
    os.makedirs(out, exist_ok=True)
    info = save_checkpoint(out, cfg, model)
    logd["final"]["checkpoint_bytes"] = info["total_bytes"]
    shutil.copy(os.path.join(data.path, "tokenizer.json"), os.path.join(out, "tokenizer.json"))
    write_json(os.path.join(out, "target_log.json"), logd)
    plot_curves(logd, os.path.join(out, "target_loss.png"), "target")
    return logd


def _bits_per_byte(loss: float, data: PreparedData) -> float:
    info = data.info
    tpb = info["heldout_tokens"] / max(info["heldout_bytes"], 1)      # tokens per byte
    return loss / math.log(2) * tpb


def _step(model, opt, x, quant, indexer_aux):
    dev = x.device
    with autocast(dev, dev.type == "cuda"):
        X, _, tb = _forward(model, x[:, :-1], quant, indexer_aux > 0)
        logits = model.logits(X)
    ce = F.cross_entropy(logits.float(), x[:, 1:].reshape(-1))
    aux = torch.stack(tb.aux_losses).mean() if tb.aux_losses else ce.new_zeros(())
    loss = ce + indexer_aux * aux
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return ce.detach(), aux.detach(), gnorm


def _forward(model, tokens, quant, indexer_aux):
    from .forward import target_forward
    return target_forward(model, tokens, quant=quant, indexer_aux=indexer_aux)


def add_args(p):
    p.add_argument("--data", required=True, help="dir written by `python -m dspark.train.data`")
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true", help="tiny CPU config (tests)")
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--time-budget", type=float, default=0.0, help="seconds of training")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-tokens", type=int, default=300_000)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--no-qat", action="store_true")
    p.add_argument("--indexer-aux", type=float, default=0.1)
    p.add_argument("--bias-rate", type=float, default=1e-3)
    p.add_argument("--device")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m dspark.train.target", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    a = p.parse_args(argv)
    data = PreparedData(a.data)
    return train_target(data, a.out, a.tiny, a.steps, a.time_budget, a.batch, a.seq_len, a.lr,
                        a.warmup, a.wd, a.seed, a.eval_every, a.eval_tokens, a.log_every,
                        not a.no_qat, a.indexer_aux, a.bias_rate, a.device)


if __name__ == "__main__":
    main()
