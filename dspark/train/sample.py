"""On-policy drafter data: continuations sampled from the frozen target at temperature 1.

    python -m dspark.train.sample --ckpt DIR --data DATA --out rows.npy \
        [--time-budget 90 | --rows 1024] [--prompt-len 384 --new 128 --batch 512 --device cuda:0]

At inference the drafter's context is the target's own output, not corpus text: at T = 1 that
text is noisier than the code the target was trained on, and the Markov head conditions on
sampled (not ground-truth) previous tokens. Each row here is a random train-split window of
`prompt_len` tokens followed by `new` tokens sampled from the target at T = 1, which is exactly the
situation of a held-out prompt being continued. `dspark.train.drafter --sampled rows.npy` mixes
such rows into its batches and places their anchors in the sampled part only.

Sampling is exact: with a checkpoint that has DSpark stages the continuation comes from DSpark
rounds with rejection sampling (the same distribution as the target alone, fewer target
forwards); without stages it is plain ancestral sampling. Rows are written as uint16 [N, L] with
`rows.json` beside them (prompt_len, new, seed, seconds).
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch

from .common import Timer, load_models, pick_device, setup_fast_math
from .data import PreparedData
from .evaluate import EvalQuant, _probs, spec_decode, target_logits_taps


@torch.no_grad()
def sample_plain(model, prompts: torch.Tensor, new: int, gen: torch.Generator) -> torch.Tensor:
    """Ancestral sampling at T = 1 with the full-sequence forward (no drafter needed)."""
    toks = prompts.clone()
    for _ in range(new):
        last = torch.full((toks.shape[0], 1), toks.shape[1] - 1, device=toks.device)
        logits, _ = target_logits_taps(model, toks, last, None, ())
        y = torch.multinomial(_probs(logits[:, 0], 1.0), 1, generator=gen)
        toks = torch.cat([toks, y], 1)
    return toks[:, prompts.shape[1]:]


def sample_rows(ckpt: str, data: PreparedData, rows: int = 0, time_budget: float = 0.0,
                prompt_len: int = 384, new: int = 128, batch: int = 512, seed: int = 0,
                device=None, log=print) -> np.ndarray:
    if not rows and not time_budget:
        raise ValueError("give rows or time_budget")
    dev = pick_device(device)
    setup_fast_math(dev)
    _, model, drafter = load_models(ckpt, dev)
    model.eval()
    if drafter is not None:
        drafter.eval()
    quant = EvalQuant()       # the engine's default storage rounding, as in evaluation
    gen = torch.Generator().manual_seed(seed)
    clock, out, k = Timer(), [], 0
    while True:
        done = sum(len(o) for o in out)
        if (rows and done >= rows) or (time_budget and out and clock() > time_budget):
            break
        n = min(batch, rows - done) if rows else batch
        prompts = data.train.batch(n, prompt_len - 1, gen)          # [n, prompt_len]
        if drafter is not None:
            conts, st = spec_decode(model, drafter, prompts.tolist(), new, 1.0, seed=seed * 1000 + k,
                                    quant=quant, batch_size=n, stop_at_eos=False)
            cont = torch.tensor(conts, dtype=torch.long)
            how = f"DSpark rounds, tau {st['tau']:.2f}"
        else:
            g = torch.Generator(device=dev).manual_seed(seed * 1000 + k)
            cont = sample_plain(model, prompts.to(dev), new, g).cpu()
            how = "ancestral"
        out.append(torch.cat([prompts, cont], 1).numpy().astype(np.uint16))
        k += 1
        log(f"[sample] {done + n} rows ({how}) t={clock():.0f}s")
    return np.concatenate(out)[:rows] if rows else np.concatenate(out)


def save_rows(path: str, arr: np.ndarray, meta: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    np.save(path, arr)
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump(dict(meta, rows=int(arr.shape[0]), row_len=int(arr.shape[1])), f, indent=1)


def load_rows(path: str) -> tuple[np.ndarray, dict]:
    """(rows [N, L] uint16, meta) written by `save_rows`; a clear error for a wrong file."""
    meta_path = os.path.splitext(path)[0] + ".json"
    if not os.path.exists(path) or not os.path.exists(meta_path):
        raise FileNotFoundError(f"{path} (+ {os.path.basename(meta_path)}) not found: write it with "
                                "`python -m dspark.train.sample --out {path}`")
    with open(meta_path) as f:
        meta = json.load(f)
    return np.load(path), meta


def merge_rows(paths: list, out: str) -> tuple[np.ndarray, dict]:
    parts = [load_rows(p) for p in paths]
    arr = np.concatenate([a for a, _ in parts])
    meta = dict(parts[0][1], parts=[m for _, m in parts])
    save_rows(out, arr, meta)
    return arr, meta


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m dspark.train.sample", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="target checkpoint (with or without DSpark stages)")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True, help="rows.npy (rows.json is written beside it)")
    p.add_argument("--rows", type=int, default=0)
    p.add_argument("--time-budget", type=float, default=0.0, help="seconds (whole batches)")
    p.add_argument("--prompt-len", type=int, default=384)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device")
    a = p.parse_args(argv)
    clock = Timer()
    arr = sample_rows(a.ckpt, PreparedData(a.data), a.rows, a.time_budget, a.prompt_len, a.new,
                      a.batch, a.seed, a.device)
    save_rows(a.out, arr, {"ckpt": a.ckpt, "prompt_len": a.prompt_len, "new": a.new,
                           "seed": a.seed, "seconds": round(clock(), 1)})
    print(f"[sample] wrote {a.out}: {arr.shape[0]} rows x {arr.shape[1]} tokens in {clock():.0f}s")


if __name__ == "__main__":
    main()
