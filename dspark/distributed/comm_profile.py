"""The communication of one tensor-parallel step: which collectives it issues, and what they cost.

    shapes = step_collectives(cfg, world, tokens=16, input_words=n)   # [(kind, shape, dtype)]
    seconds = runner.collective_time(shapes)                           # every rank runs them

A fixed-shape decode / verify step of T tokens issues, in order: one broadcast of the step's
input buffer (token ids, positions, slots, page tables and the host plan: `input_words` int64
words, V4DecodeGraphs' layout), then per layer the all-gathers of the CSA indexer's queries and
head weights (ratio-4 layers, "gather" mode), the all-reduce of the attention output [T, D] and
the all-reduce of the MoE partials [T, D], fp32. Inside a CUDA graph the collectives cannot be
timed one by one, so the benchmark replays this list on the group by itself
(`time_collectives`); tests/test_distributed.py checks the list against the collectives a step
really issues (TPGroup.trace).
"""
from __future__ import annotations

import time

import torch


def step_collectives(cfg, world: int, tokens: int, input_words: int | None = None) -> list:
    """[(kind, shape, dtype)] of one fixed-shape target step of `tokens` tokens at `world`."""
    if world == 1:
        return []
    T, D = tokens, cfg.hidden_size
    hi = cfg.index_n_heads // world
    out = []
    if input_words is not None:
        out.append(("broadcast", (input_words,), torch.int64))
    for ratio in cfg.compress_ratios[:cfg.num_hidden_layers]:
        if ratio == 4:
            # (the order the fixed-shape layer issues them: head weights, then queries)
            out += [("all_gather", (T, hi), torch.float32),
                    ("all_gather", (T, hi, cfg.index_head_dim), torch.float32)]
        out += [("all_reduce", (T, D), torch.float32), ("all_reduce", (T, D), torch.float32)]
    return out


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def time_collectives(tp, shapes, iters: int = 20, device=None) -> float:
    """Seconds per round of the collectives `shapes` on `tp` (every rank must call this with the
    same arguments; the best of `iters` rounds, after two warm-up rounds)."""
    if tp.world == 1 or not shapes:
        return 0.0
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if (
            torch.distributed.get_backend(tp.group) == "nccl") else torch.device("cpu")
    bufs = [(kind, torch.zeros(shape, dtype=dtype, device=device)) for kind, shape, dtype in shapes]

    def one_round():
        for kind, t in bufs:
            if kind == "all_reduce":
                tp.all_reduce(t)
            elif kind == "all_gather":
                tp.all_gather(t, dim=t.dim() - 1)
            elif kind == "broadcast":
                tp.broadcast(t, src=0)
            else:
                raise ValueError(f"unknown collective {kind!r}")
    for _ in range(2):
        one_round()
    best = float("inf")
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        one_round()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best
