"""Write a random-weight Qwen3 target or DeepSpec DSpark drafter checkpoint in the HF layout.

    python -m dspark.tools.make_qwen3_checkpoint --preset tiny --kind target --out /tmp/q3
    python -m dspark.tools.make_qwen3_checkpoint --preset tiny --kind dspark --markov-head rnn --out /tmp/q3d
    python -m dspark.tools.make_qwen3_checkpoint --preset 4b --kind dspark --layers 4 --out /data/d4

Presets: `tiny` (seconds on CPU) and `4b` (Qwen3-4B widths: hidden 2560, 36 layers, 32/8 heads,
head_dim 128, inter 9728, vocab 151936, rope θ 1e6, tied embeddings; drafter dspark_qwen3_4b_block7:
5 layers, block 7, target_layer_ids [1,9,17,25,33], mask 151669, Markov rank 256).
`--layers N` is the *target* depth for both kinds, so a target and a drafter made with the same
preset, `--layers` and `--seed` fit together; the drafter's tapped layers are re-derived for N.

Target tensors are `model.`-prefixed, `lm_head.weight` only when untied; drafter tensors follow
dspark.md §2.2 (no prefix). Each tensor comes from its own generator seeded by (seed, key); the
drafter's embed_tokens / lm_head copies use the target's keys, so they equal the target's weights
(what DeepSpec's save path stores) and the loader can alias them.

`--small-dtype fp32|bf16|fp16` stores the small tensors (norms, biases, the Markov and confidence
heads: `is_small_tensor`) in that dtype instead of `--dtype`, with the values of the default
checkpoint (rounded to `--dtype`, then cast): the same model up to that cast's rounding.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os

import torch
from safetensors.torch import save_file

from dspark.models.loader import cast_float

PRESETS = {
    "tiny": dict(target=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                             tie_word_embeddings=True, bos_token_id=0, eos_token_id=1,
                             max_position_embeddings=4096),
                 draft=dict(num_hidden_layers=2, block_size=4, num_taps=3, markov_rank=8, mask_token_id=None)),
    "4b": dict(target=dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                           tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
                           max_position_embeddings=40960),
               draft=dict(num_hidden_layers=5, block_size=7, num_taps=5, markov_rank=256, mask_token_id=151669)),
}


def tap_layers(num_target_layers: int, num_taps: int) -> list:
    """Spread taps over the target, never the final layer: [1, 9, 17, 25, 33] for 36 layers / 5
    taps (and [1, 10, 19, 28, 37] for 40, the 14B drafter); small targets also use -1 (embeddings)."""
    n = num_target_layers
    if n >= num_taps + 3:
        start, end = 1, n - 3
        return [round(start + i * (end - start) / max(num_taps - 1, 1)) for i in range(num_taps)]
    cand = list(range(-1, n - 1))
    k = min(num_taps, len(cand))
    return sorted({cand[round(i * (len(cand) - 1) / max(k - 1, 1))] for i in range(k)})


def target_config(preset: str, layers: int | None = None, vocab: int | None = None,
                  tie: bool | None = None, dtype: str = "bf16") -> dict:
    t = dict(PRESETS[preset]["target"])
    t["num_hidden_layers"] = layers or t["num_hidden_layers"]
    t["vocab_size"] = vocab or t["vocab_size"]
    if tie is not None:
        t["tie_word_embeddings"] = tie
    return dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False,
                attention_dropout=0.0, hidden_act="silu", initializer_range=0.02, rms_norm_eps=1e-6,
                rope_scaling=None, sliding_window=None, use_sliding_window=False,
                max_window_layers=t["num_hidden_layers"], use_cache=True,
                torch_dtype={"bf16": "bfloat16", "fp32": "float32"}[dtype], **t)


def draft_config(preset: str, layers: int | None = None, vocab: int | None = None,
                 tie: bool | None = None, dtype: str = "bf16", draft_layers: int | None = None,
                 markov_head: str = "vanilla", markov_rank: int | None = None,
                 confidence: bool = True) -> dict:
    """The target config deep-copied, then overridden with the drafter keys (dspark.md §2.1)."""
    cfg = target_config(preset, layers, vocab, tie, dtype)
    d = PRESETS[preset]["draft"]
    n_draft = draft_layers or d["num_hidden_layers"]
    mask = d["mask_token_id"]
    if mask is None or mask >= cfg["vocab_size"]:
        mask = cfg["vocab_size"] - 1
    rank = d["markov_rank"] if markov_rank is None else markov_rank
    cfg.update(architectures=["Qwen3DSparkModel"], num_target_layers=cfg["num_hidden_layers"],
               num_hidden_layers=n_draft, max_window_layers=n_draft,
               layer_types=["full_attention"] * n_draft, block_size=d["block_size"],
               target_layer_ids=tap_layers(cfg["num_hidden_layers"], d["num_taps"]),
               mask_token_id=mask, markov_rank=rank, markov_head_type=markov_head,
               enable_confidence_head=confidence, confidence_head_with_markov=confidence and rank > 0,
               num_anchors=512, tie_word_embeddings=False)
    return cfg


def _layer_shapes(c: dict, prefix: str) -> dict:
    D, I, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    out = {}
    for i in range(c["num_hidden_layers"]):
        p = f"{prefix}layers.{i}."
        out.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                    p + "self_attn.q_proj.weight": (q, D), p + "self_attn.k_proj.weight": (kv, D),
                    p + "self_attn.v_proj.weight": (kv, D), p + "self_attn.o_proj.weight": (D, q),
                    p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                    p + "mlp.gate_proj.weight": (I, D), p + "mlp.up_proj.weight": (I, D),
                    p + "mlp.down_proj.weight": (D, I)})
    return out


def tensor_shapes(cfg: dict, kind: str, embed_copies: bool = True) -> dict:
    """{checkpoint name: shape} written for `kind` ('target' | 'dspark'), spelled per dspark.md §2.2."""
    D, V = cfg["hidden_size"], cfg["vocab_size"]
    if kind == "target":
        out = {"model.embed_tokens.weight": (V, D), **_layer_shapes(cfg, "model."), "model.norm.weight": (D,)}
        if not cfg["tie_word_embeddings"]:
            out["lm_head.weight"] = (V, D)
        return out
    r, n_taps = cfg["markov_rank"], len(cfg["target_layer_ids"])
    out = {"fc.weight": (D, n_taps * D), "hidden_norm.weight": (D,), **_layer_shapes(cfg, ""),
           "norm.weight": (D,)}
    if embed_copies:
        out.update({"embed_tokens.weight": (V, D), "lm_head.weight": (V, D)})
    if r:
        out.update({"markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (V, r)})
        if cfg["markov_head_type"] == "gated":
            out.update({"markov_head.gate_proj.weight": (r, D + r), "markov_head.gate_proj.bias": (r,)})
        elif cfg["markov_head_type"] == "rnn":
            out.update({"markov_head.joint_proj.weight": (3 * r, 2 * r + D),
                        "markov_head.joint_proj.bias": (3 * r,)})
    if cfg["enable_confidence_head"]:
        c_in = D + (r if cfg["confidence_head_with_markov"] else 0)
        out.update({"confidence_head.proj.weight": (1, c_in), "confidence_head.proj.bias": (1,)})
    return out


SMALL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def is_small_tensor(name: str, shape: tuple) -> bool:
    """Norms, biases and the drafter's Markov / confidence heads (`--small-dtype`)."""
    return len(shape) == 1 or name.startswith(("markov_head.", "confidence_head."))


def _generator(seed: int, key: str, device="cpu") -> torch.Generator:
    h = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return torch.Generator(device).manual_seed(int.from_bytes(h[:8], "little") & ((1 << 63) - 1))


def _draw(key: str, shape: tuple, seed: int, device="cpu") -> torch.Tensor:
    """Scales keep every activation O(1) and logits spread (std ~2), so random models make
    non-degenerate, testable predictions; norms are 1 +- 0.2 so a skipped norm is visible."""
    g = _generator(seed, key, device)
    if len(shape) == 1:
        if key.endswith("norm.weight"):
            return 0.8 + 0.4 * torch.rand(shape, generator=g, device=device)
        return 0.1 * torch.randn(shape, generator=g, device=device)         # biases
    if key.endswith(("embed_tokens.weight", "lm_head.weight")):
        std = 2.0 / math.sqrt(shape[1])
    elif key.endswith("markov_w1.weight"):
        std = 1.0                                                           # lookup table
    else:
        std = 1.0 / math.sqrt(shape[1])                                     # fan-in
    return torch.randn(shape, generator=g, device=device) * std


def _key(name: str, kind: str, cfg: dict) -> str:
    """Generator key: shared by the target and the drafter's frozen embedding / head copies."""
    if kind == "target":
        return name.removeprefix("model.")
    if name == "lm_head.weight" and cfg.get("_target_tied", True):
        return "embed_tokens.weight"          # tied target: its lm_head *is* the embedding
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return name
    return "dspark." + name


def make_qwen3_checkpoint(out: str, preset: str = "tiny", kind: str = "target", layers: int | None = None,
                          seed: int = 0, dtype: str = "bf16", vocab: int | None = None,
                          tie: bool | None = None, markov_head: str = "vanilla",
                          markov_rank: int | None = None, draft_layers: int | None = None,
                          confidence: bool = True, embed_copies: bool = True,
                          shard_bytes: int = 2 << 30, device: str = "cpu",
                          small_dtype: str | None = None) -> dict:
    """Write config.json + safetensors (sharded with an index past `shard_bytes`); return config.

    small_dtype ("fp32" | "bf16" | "fp16"): store the `is_small_tensor` tensors in that dtype
    (module docstring); None stores every tensor as `dtype`.

    device: where the random draws run. "cuda" makes the 4b preset in seconds instead of about a
    minute of CPU time; the values then differ from the CPU draws (another generator), but are
    just as deterministic per (seed, tensor name) on that device type."""
    if kind == "target":
        cfg = target_config(preset, layers, vocab, tie, dtype)
    elif kind == "dspark":
        cfg = draft_config(preset, layers, vocab, tie, dtype, draft_layers, markov_head, markov_rank,
                           confidence)
    else:
        raise ValueError(f"kind={kind!r}: use 'target' or 'dspark'")
    if small_dtype is not None and small_dtype not in SMALL_DTYPES:
        raise ValueError(f"small_dtype {small_dtype!r} is not supported; choose one of "
                         f"{', '.join(SMALL_DTYPES)} (or None for --dtype)")
    tdtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    shapes = tensor_shapes(cfg, kind, embed_copies)
    tied = target_config(preset, layers, vocab, tie, dtype)["tie_word_embeddings"]
    kcfg = dict(cfg, _target_tied=tied)
    esize = torch.finfo(tdtype).bits // 8
    shards, cur, size = [], [], 0
    for name, shape in shapes.items():                 # plan shards of <= shard_bytes
        n = math.prod(shape) * esize
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += n
    shards.append(cur)
    os.makedirs(out, exist_ok=True)
    weight_map, written = {}, 0
    for i, names in enumerate(shards):                 # one shard in memory at a time
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: _draw(_key(n, kind, kcfg), shapes[n], seed, device).to(tdtype).cpu()
                   for n in names}
        if small_dtype is not None:
            tensors = {n: cast_float(t, SMALL_DTYPES[small_dtype], n) if is_small_tensor(n, t.shape)
                       else t for n, t in tensors.items()}
        written += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, os.path.join(out, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
        del tensors
    if len(shards) > 1:
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": written}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return cfg


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m dspark.tools.make_qwen3_checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--kind", choices=("target", "dspark"), default="target")
    p.add_argument("--layers", type=int, help="target depth (tiny 4, 4b 36); for --kind dspark the "
                   "depth of the target it pairs with")
    p.add_argument("--draft-layers", type=int, help="drafter depth (tiny 2, 4b 5)")
    p.add_argument("--markov-head", choices=("vanilla", "gated", "rnn"), default="vanilla")
    p.add_argument("--markov-rank", type=int, help="0 = no Markov head (DFlash-style)")
    p.add_argument("--no-confidence", action="store_true", help="drafter without a confidence head")
    p.add_argument("--no-embed-copies", action="store_true",
                   help="drafter without its embed_tokens / lm_head copies (uses the target's)")
    p.add_argument("--untied", action="store_true", help="target with its own lm_head.weight")
    p.add_argument("--vocab", type=int, help="override the vocabulary size")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--small-dtype", choices=sorted(SMALL_DTYPES),
                   help="store norms, biases and the Markov / confidence heads in this dtype "
                        "(default: --dtype)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-mb", type=int, default=2048)
    p.add_argument("--device", default="cpu", help="where to draw the random values ('cuda': "
                   "much faster for --preset 4b; values differ from CPU draws)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    cfg = make_qwen3_checkpoint(a.out, a.preset, a.kind, a.layers, a.seed, a.dtype, a.vocab,
                                False if a.untied else None, a.markov_head, a.markov_rank,
                                a.draft_layers, not a.no_confidence, not a.no_embed_copies,
                                a.shard_mb << 20, a.device, a.small_dtype)
    extra = (f", block {cfg['block_size']}, taps {cfg['target_layer_ids']}, markov "
             f"{cfg['markov_head_type']} r={cfg['markov_rank']}") if a.kind == "dspark" else ""
    print(f"wrote {a.out}: {a.kind} {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
          f"vocab {cfg['vocab_size']}, {a.dtype}{extra}"
          + (f", small tensors {a.small_dtype}" if a.small_dtype else ""))


if __name__ == "__main__":
    main()
