"""Write a random-weight DeepSeek-V4 checkpoint in exactly the official layout and formats.

    python -m dspark.tools.make_checkpoint --preset tiny --out /tmp/tiny
    python -m dspark.tools.make_checkpoint --preset flash --layers 4 --dtype fp8 --fp4-experts \
        --dspark --out /data/flash4

Presets: `tiny` (spec §9, seconds on CPU), `flash` / `pro` (real widths of spec §1.1, the first
`--layers` layers of the real compression schedule). Output: sharded `model-0000k-of-0000n.safetensors`
+ `model.safetensors.index.json` + a `config.json` that both transformers' DeepseekV4Config and
`ModelConfig` read. Every tensor is drawn from its own torch CPU generator seeded by (seed, name),
so a tensor's values do not depend on which other tensors exist (nor, for one torch version, on
the machine).

Routed experts are ~97% of the bytes of a real-width checkpoint, so their codes are drawn directly
(FP4: random bytes; FP8: a normal sample cast to e4m3) with random power-of-two block scales, no
quantization pass; the other FP8 weights are drawn as floats and quantized with
`quant_fp8_blocks`. Shards are generated and written one at a time, so memory stays around one
shard (<= 2 GiB) plus one tensor. A Flash-width 4-layer FP8+FP4 checkpoint with DSpark stages is
~27 GB.

`--small-dtype fp32|bf16|fp16` stores the small unquantized tensors (norms, `hc_*`, `attn_sink`,
`ape`, gate bias, Markov and confidence heads: `is_small_tensor`) in that dtype instead of the
format's, as other exports do. Their values are the default checkpoint's (drawn, rounded to the
format's dtype, then cast), so both describe the same model up to that cast's rounding (none when
the new dtype is wider).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from dspark.config import ModelConfig
from dspark.models.deepseek_v4.weights import (FLOAT_KINDS, TensorSpec, scale_name, stored_tensors,
                                               tensor_inventory)
from dspark.models.loader import cast_float
from dspark.formats.quant import (E2M1_VALUES, E4M3_MAX, float_to_e8m0, fp4_scale_shape,
                                 fp8_scale_shape, quant_fp8_blocks)

# ---- presets ----------------------------------------------------------------------------------

_FLASH_SCHEDULE = (0, 0) + (4, 128) * 20 + (4,)          # 43 layers
_PRO_SCHEDULE = (128, 128) + (4, 128) * 29 + (4,)        # 61 layers

_COMMON = dict(head_dim=512, qk_rope_head_dim=64, n_shared_experts=1, scoring_func="sqrtsoftplus",
               swiglu_limit=10.0, compress_rope_theta=160000.0, rope_theta=10000.0, beta_fast=32.0,
               beta_slow=1.0, index_head_dim=128, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
               rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
               dspark_block_size=5)

PRESETS = {
    # spec §9: every code path (SWA, CSA + indexer + top-k, HCA, hash + routed MoE, YaRN ramp,
    # window eviction) is active within ~70 tokens
    "tiny": dict(_COMMON, vocab_size=1024, hidden_size=256, num_attention_heads=4, q_lora_rank=128,
                 o_groups=2, o_lora_rank=64, n_routed_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=64, routed_scaling_factor=1.5, sliding_window=8,
                 compress_ratios=(0, 4, 16, 4, 16, 0), rope_factor=4.0, original_seq_len=32,
                 max_position_embeddings=65536, index_n_heads=16, index_topk=4, num_hash_layers=2,
                 dspark_markov_rank=32),
    "flash": dict(_COMMON, vocab_size=129280, hidden_size=4096, num_attention_heads=64,
                  q_lora_rank=1024, o_groups=8, o_lora_rank=1024, n_routed_experts=256,
                  num_experts_per_tok=6, moe_intermediate_size=2048, routed_scaling_factor=1.5,
                  sliding_window=128, compress_ratios=_FLASH_SCHEDULE, rope_factor=16.0,
                  original_seq_len=65536, max_position_embeddings=1048576, index_n_heads=64,
                  index_topk=512, num_hash_layers=3, dspark_markov_rank=256),
    "pro": dict(_COMMON, vocab_size=129280, hidden_size=7168, num_attention_heads=128,
                q_lora_rank=1536, o_groups=16, o_lora_rank=1024, n_routed_experts=384,
                num_experts_per_tok=6, moe_intermediate_size=3072, routed_scaling_factor=2.5,
                sliding_window=128, compress_ratios=_PRO_SCHEDULE, rope_factor=16.0,
                original_seq_len=65536, max_position_embeddings=1048576, index_n_heads=64,
                index_topk=1024, num_hash_layers=3, dspark_markov_rank=512),
}
_DEFAULT_LAYERS = {"tiny": 6, "flash": 4, "pro": 4}
_OFFICIAL_NOISE_ID = 128799
DRAFTER_STAGES = 3


def preset_config(preset: str = "tiny", layers: int | None = None, dtype: str = "bf16",
                  fp4_experts: bool = False, dspark: bool = False, vocab: int | None = None,
                  overrides: dict | None = None) -> ModelConfig:
    """The ModelConfig a `make_checkpoint` call with these arguments writes."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if dtype not in ("bf16", "fp8"):
        raise ValueError(f"dtype {dtype!r} is not supported; choose bf16 or fp8")
    kw = dict(PRESETS[preset])
    n = _DEFAULT_LAYERS[preset] if layers is None else int(layers)
    schedule = kw["compress_ratios"]
    if not 1 <= n <= len(schedule):
        raise ValueError(f"--layers {n}: preset {preset!r} has a schedule of {len(schedule)} layers; "
                         f"choose 1..{len(schedule)}")
    kw.update(num_hidden_layers=n, compress_ratios=tuple(schedule[:n]),
              num_hash_layers=min(kw["num_hash_layers"], n), weight_dtype=dtype,
              expert_dtype="fp4" if fp4_experts else dtype)
    if vocab is not None:
        kw["vocab_size"] = int(vocab)
    if dspark:
        V = kw["vocab_size"]
        kw.update(num_dspark_stages=DRAFTER_STAGES,
                  dspark_target_layer_ids=tuple(range(max(0, n - 3), n)),   # the last 3 layers
                  dspark_noise_token_id=_OFFICIAL_NOISE_ID if V > _OFFICIAL_NOISE_ID else V - 1)
    else:
        kw.update(num_dspark_stages=0, dspark_block_size=0, dspark_markov_rank=0)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides or {}) - fields)
    if unknown:
        raise ValueError(f"overrides: unknown ModelConfig field(s) {unknown}; valid: {sorted(fields)}")
    kw.update({k: tuple(v) if isinstance(v, list) else v for k, v in (overrides or {}).items()})
    cfg = ModelConfig(**kw)
    cfg.validate()
    return cfg


# ---- config.json --------------------------------------------------------------------------------

def hf_config(cfg: ModelConfig) -> dict:
    """config.json content: the official keys, plus the HF keys transformers needs for non-default
    schedules (layer_types / compress_rates / mlp_layer_types), plus the DSpark keys."""
    csa, hca = "compressed_sparse_attention", "heavily_compressed_attention"
    hca_rates = sorted({r for r in cfg.compress_ratios if r not in (0, 4)})
    if len(hca_rates) > 1:
        raise ValueError(f"compress_ratios {list(cfg.compress_ratios)} mix HCA ratios {hca_rates}; "
                         f"HF layer_types / compress_rates can express only one HCA ratio")
    n, nh = cfg.num_hidden_layers, cfg.num_hash_layers
    d = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": n,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": 1,
        "head_dim": cfg.head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "q_lora_rank": cfg.q_lora_rank,
        "o_lora_rank": cfg.o_lora_rank,
        "o_groups": cfg.o_groups,
        "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": cfg.n_shared_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "scoring_func": cfg.scoring_func,
        "norm_topk_prob": True,
        "topk_method": "noaux_tc",
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "swiglu_limit": cfg.swiglu_limit,
        "hidden_act": "silu",
        "sliding_window": cfg.sliding_window,
        # official per-layer schedule; DSpark stages append one 0 (SWA) entry each
        "compress_ratios": list(cfg.compress_ratios) + [0] * cfg.num_dspark_stages,
        # HF form of the same schedule (HF maps only 0/4/128 from compress_ratios by itself)
        "layer_types": [{0: "sliding_attention", 4: csa}.get(r, hca) for r in cfg.compress_ratios],
        "compress_rates": {csa: 4, hca: hca_rates[0] if hca_rates else 128},
        "num_hash_layers": nh,
        "mlp_layer_types": ["hash_moe"] * nh + ["moe"] * (n - nh),
        "rope_theta": cfg.rope_theta,
        "compress_rope_theta": cfg.compress_rope_theta,
        "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": cfg.rope_factor,
                         "original_max_position_embeddings": cfg.original_seq_len,
                         "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow},
        "max_position_embeddings": cfg.max_position_embeddings,
        "index_n_heads": cfg.index_n_heads,
        "index_head_dim": cfg.index_head_dim,
        "index_topk": cfg.index_topk,
        "hc_mult": cfg.hc_mult,
        "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters,
        "hc_eps": cfg.hc_eps,
        "rms_norm_eps": cfg.rms_norm_eps,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "num_nextn_predict_layers": 1 if cfg.has_dspark else 0,   # official DSpark configs say 1
        "dtype": "bfloat16",
        "expert_dtype": cfg.expert_format,
    }
    if cfg.weight_dtype == "fp8":
        d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    if cfg.has_dspark:
        d.update(dspark_block_size=cfg.dspark_block_size,
                 dspark_target_layer_ids=list(cfg.dspark_target_layer_ids),
                 dspark_markov_rank=cfg.dspark_markov_rank,
                 dspark_noise_token_id=cfg.dspark_noise_token_id)
    return d


# ---- random tensors -----------------------------------------------------------------------------

def _rng(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _normal(g, shape, std=1.0) -> torch.Tensor:
    return torch.randn(shape, generator=g).mul_(std)


def _uniform(g, shape, lo, hi) -> torch.Tensor:
    return torch.empty(shape).uniform_(lo, hi, generator=g)


def _init_float(name: str, spec: TensorSpec, g) -> torch.Tensor:
    """Spec §9's recommended init, chosen by the tensor's role."""
    shape = spec.shape
    if re.search(r"hc_(attn|ffn|head)_fn$", name):
        return _normal(g, shape, 0.05)
    if re.search(r"hc_(attn|ffn|head)_base$", name):
        return _normal(g, shape, 0.5)
    if re.search(r"hc_(attn|ffn|head)_scale$", name) or name.endswith("norm.weight"):
        return _uniform(g, shape, 0.9, 1.1)
    if name.endswith(".ape"):
        return _normal(g, shape, 0.5)
    if name.endswith("attn_sink"):
        return _normal(g, shape, 1.0)
    if name.endswith("gate.bias"):
        return _normal(g, shape, 0.1)
    if name == "embed.weight" or name.endswith("markov_w1.weight"):
        return _normal(g, shape, 1.0)                         # embedding tables: unit rows
    if len(shape) == 2:
        return _normal(g, shape, 1.0 / math.sqrt(shape[1]))   # linear: N(0, 1/in)
    raise ValueError(f"no init rule for {name} {shape}")


# rms of the 16 e2m1 values: the std of uniformly random FP4 codes
_E2M1_RMS = math.sqrt(sum(v * v for v in E2M1_VALUES) / 16)
_FP8_CODE_STD = 64.0     # FP8 expert codes ~ N(0, 64^2), clamped to e4m3's +-448


def _scales(g, grid, std: float, code_std: float) -> torch.Tensor:
    """E8M0 scales 2^e, e = round(log2(std / code_std)) jittered by -1/0/+1 per block so that
    every block's own scale matters."""
    e = round(math.log2(std / code_std)) + torch.randint(-1, 2, grid, generator=g, dtype=torch.int32)
    return float_to_e8m0(e)


def _expert_codes(kind: str, rows: int, cols: int, g) -> tuple[torch.Tensor, torch.Tensor]:
    """Random quantized expert weights with std ~ 1/sqrt(in), drawn as codes (no quantization)."""
    std = 1.0 / math.sqrt(cols)
    if kind == "fp4":   # every random byte is two uniformly random e2m1 codes
        packed = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
        return packed.view(torch.int8), _scales(g, fp4_scale_shape(rows, cols), std, _E2M1_RMS)
    codes = _normal(g, (rows, cols), _FP8_CODE_STD).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, _scales(g, fp8_scale_shape(rows, cols), std, _FP8_CODE_STD)


def generate_tensor(name: str, spec: TensorSpec, cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The stored tensor(s) of one logical tensor: {name: data} plus {name.scale: scale} if quantized."""
    g = _rng(seed, name)
    if spec.kind == "int64":        # hash routing: distinct random experts per token id
        keys = torch.rand((cfg.vocab_size, cfg.n_routed_experts), generator=g)
        return {name: keys.argsort(dim=1)[:, : cfg.num_experts_per_tok].contiguous()}
    if spec.kind in ("fp8", "fp4") and ".ffn.experts." in name:
        w, s = _expert_codes(spec.kind, *spec.shape, g)
        return {name: w, scale_name(name): s}
    w = _init_float(name, spec, g)
    if spec.kind == "fp8":
        codes, s = quant_fp8_blocks(w)
        return {name: codes, scale_name(name): s}
    if spec.kind == "fp4":
        raise ValueError(f"{name}: FP4 storage is only used for routed experts")
    return {name: w.to(torch.bfloat16 if spec.kind == "bf16" else torch.float32)}


# ---- small tensors in another float dtype ---------------------------------------------------------

SMALL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SMALL = re.compile(r"(norm\.weight|hc_(attn|ffn|head)_(fn|base|scale)|attn_sink|\.ape|gate\.bias|"
                    r"markov_head\.\S+|confidence_head\.\S+)$")


def is_small_tensor(name: str, spec: TensorSpec) -> bool:
    """The unquantized tensors whose stored dtype varies between exports (`--small-dtype`)."""
    return spec.kind in FLOAT_KINDS and bool(_SMALL.search(name))


# ---- writing ------------------------------------------------------------------------------------

def _plan_shards(inventory: dict[str, TensorSpec], shard_bytes: int) -> list[list[str]]:
    """Greedy, in file order; a weight and its scale always share a shard."""
    shards, cur, cur_bytes = [], [], 0
    for name, spec in inventory.items():
        size = sum(st.nbytes for st in stored_tensors(name, spec))
        if cur and cur_bytes + size > shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(name)
        cur_bytes += size
    return shards + [cur] if cur else shards


def make_checkpoint(out: str, preset: str = "tiny", layers: int | None = None, seed: int = 0,
                    dtype: str = "bf16", fp4_experts: bool = False, dspark: bool = False,
                    vocab: int | None = None, overrides: dict | None = None,
                    shard_bytes: int | None = None, progress: bool = True,
                    small_dtype: str | None = None) -> ModelConfig:
    """Write a random checkpoint to directory `out`; returns the ModelConfig it describes.

    `small_dtype` ("fp32" | "bf16" | "fp16"): store the `is_small_tensor` tensors in that dtype
    (module docstring); None keeps the format's dtypes.
    `overrides` replaces ModelConfig fields after the preset is applied (e.g. {"swiglu_limit": 0.5}).
    `shard_bytes` defaults to a quarter of the total (so even `tiny` has several shards), capped
    at 2 GiB.
    """
    if small_dtype is not None and small_dtype not in SMALL_DTYPES:
        raise ValueError(f"small_dtype {small_dtype!r} is not supported; choose one of "
                         f"{', '.join(SMALL_DTYPES)} (or None for the format's dtypes)")
    cfg = preset_config(preset, layers, dtype, fp4_experts, dspark, vocab, overrides)
    config_json = hf_config(cfg)
    inventory = tensor_inventory(cfg)
    total = sum(st.nbytes for n, s in inventory.items() for st in stored_tensors(n, s))
    shard_bytes = shard_bytes or min(2 << 30, max(1, math.ceil(total / 4)))
    shards = _plan_shards(inventory, shard_bytes)

    os.makedirs(out, exist_ok=True)
    weight_map, written = {}, 0
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {preset}", disable=not progress)
    for k, names in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            for key, t in generate_tensor(name, inventory[name], cfg, seed).items():
                if small_dtype is not None and is_small_tensor(key, inventory[name]):
                    t = cast_float(t, SMALL_DTYPES[small_dtype], key)
                tensors[key] = t
                weight_map[key] = fname
                written += t.numel() * t.element_size()
                bar.update(t.numel() * t.element_size())
        save_file(tensors, os.path.join(out, fname), metadata={"format": "pt"})
        del tensors
    bar.close()
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": written}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config_json, f, indent=2)
    return cfg


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m dspark.tools.make_checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--layers", type=int, help="backbone layers (default: tiny 6, flash/pro 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16",
                   help="storage of the dense projections (fp8 = e4m3 + 128x128 UE8M0 scales)")
    p.add_argument("--fp4-experts", action="store_true",
                   help="routed experts as packed FP4 with per-32 UE8M0 scales (default: like --dtype)")
    p.add_argument("--dspark", action="store_true", help="add the 3 DSpark draft stages (mtp.*)")
    p.add_argument("--vocab", type=int, help="override the vocabulary size")
    p.add_argument("--small-dtype", choices=sorted(SMALL_DTYPES),
                   help="store norms, hc_*, attn_sink, ape, gate bias and the Markov / confidence "
                        "heads in this dtype (default: the format's, bf16 or fp32 per tensor)")
    p.add_argument("--shard-mb", type=int, help="max shard size in MiB (default: total/4, <= 2048)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                   help="override a ModelConfig field, e.g. --set swiglu_limit=0.5 (repeatable)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    overrides = {}
    for item in a.set:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--set {item!r}: expected FIELD=JSON, e.g. swiglu_limit=0.5")
        overrides[key] = json.loads(value)
    cfg = make_checkpoint(a.out, a.preset, a.layers, a.seed, a.dtype, a.fp4_experts, a.dspark, a.vocab,
                          overrides, a.shard_mb << 20 if a.shard_mb else None,
                          small_dtype=a.small_dtype)
    print(f"wrote {a.out}: {cfg.num_hidden_layers} layers, weights {cfg.weight_dtype}, "
          f"experts {cfg.expert_format}, {cfg.num_dspark_stages} DSpark stages"
          + (f", small tensors {a.small_dtype}" if a.small_dtype else ""))


if __name__ == "__main__":
    main()
