"""Training corpus: the Python standard library's own `.py` sources (present offline everywhere).

* `list_corpus()` walks `sysconfig.get_paths()['stdlib']` (skipping site-packages / dist-packages /
  __pycache__), sorted by relative path.
* `is_heldout(relpath)` assigns a file to the held-out split deterministically from a hash of its
  relative path (default 5%), so the split is stable across machines and Python versions.
* `train_tokenizer()` trains a byte-level BPE (HF `tokenizers`) on the train split only and adds
  the special tokens below; `tokenizer.encode(text)` prepends `<|bos|>` by default.
* Documents are encoded as [bos] + tokens + [eos] and concatenated into one uint16 stream;
  `TokenStream.batch()` samples random windows of L+1 tokens from it.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import sysconfig
from dataclasses import dataclass

import numpy as np
import torch

# special tokens, in id order (ids 0..3); the drafter's noise token never occurs in data
BOS, EOS, NOISE, PAD = "<|bos|>", "<|eos|>", "<|noise|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, NOISE, PAD)
BOS_ID, EOS_ID, NOISE_ID, PAD_ID = 0, 1, 2, 3

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def list_corpus(root: str | None = None, max_bytes: int = 1 << 20) -> list[str]:
    """Sorted relative paths of the stdlib's .py files (UTF-8 decodable, <= max_bytes)."""
    root = root or stdlib_root()
    out = []
    for dp, dns, fns in os.walk(root):
        dns[:] = sorted(d for d in dns if d not in _SKIP_DIRS)
        for f in fns:
            if not f.endswith(".py"):
                continue
            full = os.path.join(dp, f)
            try:
                if os.path.getsize(full) > max_bytes:
                    continue
            except OSError:
                continue
            out.append(os.path.relpath(full, root).replace(os.sep, "/"))
    return sorted(out)


def is_heldout(relpath: str, heldout_permille: int = 50) -> bool:
    h = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:8], "little")
    return h % 1000 < heldout_permille


def read_text(root: str, relpath: str) -> str | None:
    try:
        with open(os.path.join(root, relpath), "rb") as f:
            return f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


@dataclass
class Corpus:
    root: str
    train: list          # [(relpath, text)]
    heldout: list

    @classmethod
    def load(cls, root: str | None = None, heldout_permille: int = 50, limit_files: int = 0):
        root = root or stdlib_root()
        files = list_corpus(root)
        if limit_files:
            # deterministic subset for quick tests: every k-th file
            k = max(1, len(files) // limit_files)
            files = files[::k][:limit_files]
        train, held = [], []
        for rel in files:
            text = read_text(root, rel)
            if not text or not text.strip():
                continue
            (held if is_heldout(rel, heldout_permille) else train).append((rel, text))
        return cls(root, train, held)

    def stats(self) -> dict:
        return {"root": self.root, "train_files": len(self.train), "heldout_files": len(self.heldout),
                "train_bytes": sum(len(t.encode()) for _, t in self.train),
                "heldout_bytes": sum(len(t.encode()) for _, t in self.heldout)}


# ---- tokenizer ------------------------------------------------------------------------------
def train_tokenizer(texts, vocab_size: int = 4096, min_frequency: int = 2):
    """Byte-level BPE; ids 0..3 are the special tokens; encode() prepends <|bos|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts) if hasattr(texts, "__len__") else None)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, BOS_ID)])
    return tok


def load_tokenizer(path: str):
    from tokenizers import Tokenizer
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    return Tokenizer.from_file(path)


def encode_docs(tok, texts) -> list[np.ndarray]:
    """[bos] + tokens + [eos] per document, uint16."""
    encs = tok.encode_batch(list(texts), add_special_tokens=False)
    return [np.asarray([BOS_ID] + e.ids + [EOS_ID], dtype=np.uint16) for e in encs]


class TokenStream:
    """Concatenated documents; samples random [B, L+1] windows."""

    def __init__(self, docs: list[np.ndarray]):
        self.tokens = np.concatenate(docs) if docs else np.zeros(0, np.uint16)

    def __len__(self):
        return len(self.tokens)

    def batch(self, B: int, L: int, gen: torch.Generator) -> torch.Tensor:
        hi = len(self.tokens) - (L + 1)
        starts = torch.randint(0, hi + 1, (B,), generator=gen).numpy()
        rows = np.stack([self.tokens[s:s + L + 1] for s in starts]).astype(np.int64)
        return torch.from_numpy(rows)

    def chunks(self, L: int, max_tokens: int = 0) -> torch.Tensor:
        """Non-overlapping [N, L+1] windows (stride L) covering the stream (for held-out eval)."""
        n = (len(self.tokens) - 1) // L
        if max_tokens:
            n = min(n, max(1, max_tokens // L))
        rows = [self.tokens[i * L: i * L + L + 1] for i in range(n)]
        return torch.from_numpy(np.stack(rows).astype(np.int64))


# ---- held-out prompts -----------------------------------------------------------------------
def make_prompts(tok, heldout, n_prompts: int = 300, min_tokens: int = 24, max_tokens: int = 96,
                 seed: int = 0) -> list[dict]:
    """Short code prefixes from held-out files: one from each file start, one from a random line."""
    rng = random.Random(seed)
    cands = []
    for rel, text in heldout:
        lines = text.splitlines(keepends=True)
        starts = [0]
        if len(lines) > 20:
            starts += sorted(rng.sample(range(5, len(lines) - 10), min(3, len(lines) - 15)))
        for s in starts:
            # skip leading blank lines; grow line by line up to max_tokens
            while s < len(lines) and not lines[s].strip():
                s += 1
            acc, n = "", 0
            for ln in lines[s:]:
                m = len(tok.encode(acc + ln, add_special_tokens=False).ids)
                if m > max_tokens:
                    break
                acc, n = acc + ln, m
                if n >= max_tokens * 3 // 4:
                    break
            if n >= min_tokens:
                cands.append({"source": rel, "line": s + 1, "prompt": acc, "prompt_tokens": n})
    rng.shuffle(cands)
    cands = sorted(cands[:n_prompts], key=lambda d: (d["source"], d["line"]))
    for i, d in enumerate(cands):
        d["id"] = i
    return [{"id": d["id"], "source": d["source"], "line": d["line"],
             "prompt_tokens": d["prompt_tokens"], "prompt": d["prompt"]} for d in cands]


def write_jsonl(path: str, rows) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ---- command line -----------------------------------------------------------------------------
def prepare(out: str, vocab: int = 4096, heldout_permille: int = 50, limit_files: int = 0,
            n_prompts: int = 300, seed: int = 0) -> dict:
    """Corpus -> tokenizer.json, train.npy / heldout.npy (uint16 token streams),
    heldout_prompts.jsonl and data.json (sizes, split, Python version) in `out`."""
    import platform
    import time
    t0 = time.time()
    os.makedirs(out, exist_ok=True)
    corpus = Corpus.load(heldout_permille=heldout_permille, limit_files=limit_files)
    tok = train_tokenizer([t for _, t in corpus.train], vocab_size=vocab)
    tok.save(os.path.join(out, "tokenizer.json"))
    train = encode_docs(tok, [t for _, t in corpus.train])
    held = encode_docs(tok, [t for _, t in corpus.heldout])
    np.save(os.path.join(out, "train.npy"), np.concatenate(train))
    np.save(os.path.join(out, "heldout.npy"), np.concatenate(held))
    prompts = make_prompts(tok, corpus.heldout, n_prompts=n_prompts, seed=seed)
    write_jsonl(os.path.join(out, "heldout_prompts.jsonl"), prompts)
    info = dict(corpus.stats(), python=platform.python_version(), vocab_size=tok.get_vocab_size(),
                heldout_permille=heldout_permille, split="sha256(relpath)[:8] little-endian % 1000 < permille",
                train_tokens=int(sum(len(d) for d in train)), heldout_tokens=int(sum(len(d) for d in held)),
                prompts=len(prompts), seconds=round(time.time() - t0, 1),
                special_tokens={s: i for i, s in enumerate(SPECIAL_TOKENS)},
                heldout_files_list=[r for r, _ in corpus.heldout])
    with open(os.path.join(out, "data.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


class PreparedData:
    """What `prepare` wrote: tokenizer, token streams, prompts."""

    def __init__(self, path: str):
        self.path = path
        self.tokenizer = load_tokenizer(path)
        self.train = TokenStream([np.load(os.path.join(path, "train.npy"))])
        self.heldout = TokenStream([np.load(os.path.join(path, "heldout.npy"))])
        self.prompts = read_jsonl(os.path.join(path, "heldout_prompts.jsonl"))
        with open(os.path.join(path, "data.json")) as f:
            self.info = json.load(f)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(prog="python -m dspark.train.data",
                                description="Tokenizer + token streams + held-out prompts from the "
                                            "Python standard library sources.")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--heldout-permille", type=int, default=50)
    p.add_argument("--limit-files", type=int, default=0, help="use a subset of files (tests)")
    p.add_argument("--prompts", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    info = prepare(a.out, a.vocab, a.heldout_permille, a.limit_files, a.prompts, a.seed)
    print(json.dumps({k: v for k, v in info.items() if k != "heldout_files_list"}, indent=1))
    return info


if __name__ == "__main__":
    main()
