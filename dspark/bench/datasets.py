"""Prompt sets for the bench: JSONL with {"prompt": ...} or DeepSpec-style {"turns": [...]}."""
from __future__ import annotations

import json
import os


def load_prompts(path: str, limit: int | None = None) -> list:
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset {path!r} not found; pass a JSONL file with one "
                                f'{{"prompt": ...}} or {{"turns": [...]}} object per line')
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
            if "prompt" in row:
                prompts.append(row["prompt"])
            elif row.get("turns"):
                prompts.append(row["turns"][0])          # first user turn, as DeepSpec does
            else:
                raise ValueError(f"{path}:{n}: expected a 'prompt' string or a non-empty 'turns' list")
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        raise ValueError(f"{path}: no prompts found")
    return prompts


def token_prompts(prompts: list, vocab: int, seed: int = 0) -> list:
    """Token-id prompts for a checkpoint without a tokenizer (random-weight checkpoints): one
    per text prompt, ~4 characters per token (8..256 tokens), ids drawn uniformly, reproducible."""
    import random
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(min(max(len(p) // 4, 8), 256))] for p in prompts]
