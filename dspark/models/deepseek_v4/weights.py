"""The official DeepSeek-V4 checkpoint layout (spec §5.1, DSpark stages: dspark.md §3.2).

`tensor_inventory(cfg)` lists every logical tensor of a checkpoint by its official (REF) name,
without a `model.` prefix, with its logical (de-quantized) shape and its storage kind:

  "bf16"  bfloat16, held as the engine dtype   "fp32"  float32, held as float32
  "int64" stored int64 (hash-routing table)
  "fp8"   e4m3 weight + `<name minus .weight>.scale` e8m0 [ceil(O/128), ceil(I/128)]
  "fp4"   int8 [O, I/2] (two e2m1 codes/byte) + `.scale` e8m0 [O, ceil(I/32)]

Unquantized float tensors ("bf16" / "fp32") may be stored as bfloat16, float32 or float16 (exports
differ: the reference DSpark code declares the confidence head fp32, for instance); the loader casts
them to the dtype they are held in. Quantized codes and their scales have exactly one format.

`stored_tensors(name, spec)` expands one logical tensor into the (name, shape, dtypes) entries that
are physically in the safetensors files. The loader and the checkpoint generator both read these
two functions, so the layout is defined once. Module parameters are named exactly like the keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.config import ModelConfig
from dspark.formats.quant import fp4_scale_shape, fp8_scale_shape

KINDS = ("bf16", "fp32", "int64", "fp8", "fp4")


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple        # logical shape (what the engine sees after de-quantization)
    kind: str           # one of KINDS


@dataclass(frozen=True)
class StoredTensor:
    name: str
    shape: tuple
    dtypes: tuple       # accepted on load; dtypes[0] is what the generator writes

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtypes[0]).element_size()
        for d in self.shape:
            n *= d
        return n


# Raw uint8 views of the same bits are accepted too: some converters store e8m0 scales and packed
# FP4 bytes as uint8.
_E8M0 = (torch.float8_e8m0fnu, torch.uint8)
_FP4 = (torch.int8, torch.uint8)
FLOAT_KINDS = ("bf16", "fp32")
_PLAIN = {"bf16": (torch.bfloat16, torch.float32, torch.float16),
          "fp32": (torch.float32, torch.bfloat16, torch.float16),
          "int64": (torch.int64, torch.int32)}


def scale_name(name: str) -> str:
    """`layers.0.attn.wq_a.weight` -> `layers.0.attn.wq_a.scale` (the official scale key)."""
    if not name.endswith(".weight"):
        raise ValueError(f"quantized tensor {name!r} must end with '.weight'")
    return name[: -len(".weight")] + ".scale"


def stored_tensors(name: str, spec: TensorSpec) -> list[StoredTensor]:
    if spec.kind in _PLAIN:
        return [StoredTensor(name, spec.shape, _PLAIN[spec.kind])]
    rows, cols = spec.shape
    if spec.kind == "fp8":
        return [StoredTensor(name, spec.shape, (torch.float8_e4m3fn,)),
                StoredTensor(scale_name(name), fp8_scale_shape(rows, cols), _E8M0)]
    if spec.kind == "fp4":
        return [StoredTensor(name, (rows, cols // 2), _FP4),
                StoredTensor(scale_name(name), fp4_scale_shape(rows, cols), _E8M0)]
    raise ValueError(f"{name}: unknown storage kind {spec.kind!r}; expected one of {KINDS}")


def _block(cfg: ModelConfig, p: str, ratio: int, hash_routed: bool) -> dict[str, TensorSpec]:
    """One transformer block (attention + MoE sub-blocks, each wrapped by mHC) under prefix `p`."""
    d, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    Q, G, R, n = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank, cfg.hc_mult
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    dense = "fp8" if cfg.weight_dtype == "fp8" else "bf16"
    T = TensorSpec
    out = {}
    for sub in ("attn", "ffn"):
        out[f"{p}{sub}_norm.weight"] = T((d,), "bf16")
        out[f"{p}hc_{sub}_fn"] = T(((2 + n) * n, n * d), "fp32")
        out[f"{p}hc_{sub}_base"] = T(((2 + n) * n,), "fp32")
        out[f"{p}hc_{sub}_scale"] = T((3,), "fp32")

    a = f"{p}attn."
    out[a + "attn_sink"] = T((H,), "fp32")
    out[a + "wq_a.weight"] = T((Q, d), dense)
    out[a + "q_norm.weight"] = T((Q,), "bf16")
    out[a + "wq_b.weight"] = T((H * hd, Q), dense)
    out[a + "wkv.weight"] = T((hd, d), dense)
    out[a + "kv_norm.weight"] = T((hd,), "bf16")
    out[a + "wo_a.weight"] = T((G * R, H * hd // G), dense)
    out[a + "wo_b.weight"] = T((d, G * R), dense)
    if ratio > 0:
        out.update(_compressor(a + "compressor.", d, hd, ratio))
    if ratio == 4:  # the lightning indexer exists on CSA layers only
        HI, dI = cfg.index_n_heads, cfg.index_head_dim
        out[a + "indexer.wq_b.weight"] = T((HI * dI, Q), dense)
        out[a + "indexer.weights_proj.weight"] = T((HI, d), "bf16")
        out.update(_compressor(a + "indexer.compressor.", d, dI, ratio))

    f = f"{p}ffn."
    out[f + "gate.weight"] = T((E, d), "bf16")
    if hash_routed:
        out[f + "gate.tid2eid"] = T((cfg.vocab_size, cfg.num_experts_per_tok), "int64")
    else:
        out[f + "gate.bias"] = T((E,), "fp32")
    for e in range(E):
        out.update(_swiglu(f"{f}experts.{e}.", d, I, cfg.expert_format))
    out.update(_swiglu(f + "shared_experts.", d, I * cfg.n_shared_experts, dense))
    return out


def _compressor(p: str, d: int, d_c: int, ratio: int) -> dict[str, TensorSpec]:
    c = 2 if ratio == 4 else 1      # ratio 4 compresses with overlapping windows: two halves
    return {p + "wkv.weight": TensorSpec((c * d_c, d), "bf16"),
            p + "wgate.weight": TensorSpec((c * d_c, d), "bf16"),
            p + "ape": TensorSpec((ratio, c * d_c), "fp32"),
            p + "norm.weight": TensorSpec((d_c,), "bf16")}


def _swiglu(p: str, d: int, inter: int, kind: str) -> dict[str, TensorSpec]:
    return {p + "w1.weight": TensorSpec((inter, d), kind),
            p + "w2.weight": TensorSpec((d, inter), kind),
            p + "w3.weight": TensorSpec((inter, d), kind)}


def _hc_head(p: str, cfg: ModelConfig) -> dict[str, TensorSpec]:
    n, d = cfg.hc_mult, cfg.hidden_size
    return {p + "hc_head_fn": TensorSpec((n, n * d), "fp32"),
            p + "hc_head_base": TensorSpec((n,), "fp32"),
            p + "hc_head_scale": TensorSpec((1,), "fp32")}


def tensor_inventory(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every logical tensor of a checkpoint for `cfg`, in file order (embed, layers, head, mtp)."""
    d, V = cfg.hidden_size, cfg.vocab_size
    inv = {"embed.weight": TensorSpec((V, d), "bf16")}
    for i in range(cfg.num_hidden_layers):
        inv.update(_block(cfg, f"layers.{i}.", cfg.layer_ratio(i), cfg.is_hash_layer(i)))
    inv["norm.weight"] = TensorSpec((d,), "bf16")
    inv.update(_hc_head("", cfg))
    inv["head.weight"] = TensorSpec((V, d), "bf16")

    # DSpark draft stages: full SWA-only (ratio 0), score-routed blocks (layer id >= n_layers, so
    # never hash-routed); stage 0 owns the tap combiner, the last stage owns the heads.
    S, r = cfg.num_dspark_stages, cfg.dspark_markov_rank
    dense = "fp8" if cfg.weight_dtype == "fp8" else "bf16"
    for s in range(S):
        p = f"mtp.{s}."
        inv.update(_block(cfg, p, ratio=0, hash_routed=False))
        if s == 0:
            inv[p + "main_proj.weight"] = TensorSpec((d, len(cfg.dspark_target_layer_ids) * d), dense)
            inv[p + "main_norm.weight"] = TensorSpec((d,), "bf16")
        if s == S - 1:
            inv[p + "norm.weight"] = TensorSpec((d,), "bf16")
            inv.update(_hc_head(p, cfg))
            inv[p + "markov_head.markov_w1.weight"] = TensorSpec((V, r), "bf16")
            inv[p + "markov_head.markov_w2.weight"] = TensorSpec((V, r), "bf16")
            inv[p + "confidence_head.proj.weight"] = TensorSpec((1, d + r), "bf16")
    return inv


def stored_inventory(cfg: ModelConfig) -> dict[str, StoredTensor]:
    """Every physical tensor (weights and `.scale`s) of a checkpoint for `cfg`, in file order."""
    return {st.name: st for name, spec in tensor_inventory(cfg).items()
            for st in stored_tensors(name, spec)}
