"""Model configuration: one frozen dataclass parsed from a checkpoint's config.json.

Both key spellings are accepted: the HF `config.json` keys (`hidden_size`, `num_hidden_layers`, ...)
and the reference `inference/config.json` keys (`dim`, `n_layers`, ...). Everything downstream reads
`ModelConfig`, never the raw JSON.

Keys that differ between DeepSeek-V4 models (Flash vs Pro: widths, layer and head counts, experts)
are required (REQUIRED_KEYS); the family's constants (head_dim 512, rope dims 64, one shared
expert, ...) default to their V4 values. Every field is checked for its type and range before any
arithmetic on it, and an error names the field, the value and what is accepted.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

SUPPORTED_MODEL_TYPES = ("deepseek_v4",)


class ConfigError(ValueError):
    """A config.json field is missing, unsupported or inconsistent."""


# HF key -> reference (inference/config.json) key
_REF_ALIASES = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "qk_rope_head_dim": "rope_head_dim",
    "num_experts_per_tok": "n_activated_experts",
    "moe_intermediate_size": "moe_inter_dim",
    "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale",
    "sliding_window": "window_size",
    "num_hash_layers": "n_hash_layers",
    "rms_norm_eps": "norm_eps",
}

# shapes that differ between DeepSeek-V4 checkpoints: never defaulted (a missing hidden_size must not
# become 4096 and surface as hundreds of tensor-shape mismatches)
REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "q_lora_rank", "o_lora_rank", "o_groups", "n_routed_experts",
                 "num_experts_per_tok", "moe_intermediate_size", "index_n_heads", "index_topk")

# range of each numeric field: ">0" (positive) or ">=0"
_RANGES = {
    **{k: ">0" for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                         "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_lora_rank", "o_groups",
                         "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                         "sliding_window", "original_seq_len", "max_position_embeddings",
                         "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
                         "hc_sinkhorn_iters", "routed_scaling_factor", "compress_rope_theta",
                         "rope_theta", "rope_factor", "hc_eps", "rms_norm_eps")},
    **{k: ">=0" for k in ("n_shared_experts", "num_hash_layers", "bos_token_id", "eos_token_id",
                          "num_dspark_stages", "dspark_block_size", "dspark_markov_rank",
                          "dspark_noise_token_id", "swiglu_limit", "beta_fast", "beta_slow")},
}
_CHOICES = {"weight_dtype": ("bf16", "fp8"), "expert_dtype": ("same", "bf16", "fp8", "fp4"),
            "model_type": SUPPORTED_MODEL_TYPES}


def _bad(name, value, want):
    raise ConfigError(f"config.json: {name} = {value!r} is not supported: {want}")


def check_value(name: str, value, kind: str, rng: str | None = None, where: str = "config.json"):
    """One field's type (kind: int | float | bool | str | tuple) and range, before any use of it.
    JSON has no int/float distinction for whole numbers, so 4.0 is taken as the int 4."""
    given = value

    def bad(want):
        raise ConfigError(f"{where}: {name} = {given!r} is not supported: {want}")
    if kind == "int":
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            bad("an integer" + {">0": " > 0", ">=0": " >= 0"}.get(rng, ""))
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            bad("a number" + {">0": " > 0", ">=0": " >= 0"}.get(rng, ""))
        value = float(value)
    elif kind == "bool":
        if not isinstance(value, bool):
            bad("true or false")
    elif kind == "str":
        if not isinstance(value, str):
            bad("a string")
    elif kind == "tuple":
        if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
            bad("a list")
        value = tuple(value)
    if rng == ">0" and not value > 0:
        bad(f"a {'positive integer' if kind == 'int' else 'number > 0'}")
    if rng == ">=0" and not value >= 0:
        bad(f"{'an integer' if kind == 'int' else 'a number'} >= 0")
    return value


_LAYER_TYPE_TO_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": None,
                        "heavily_compressed_attention": None}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_lora_rank: int = 1024
    o_groups: int = 8
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    compress_ratios: tuple = ()          # one per backbone layer (draft/MTP tail entries stripped)
    compress_rope_theta: float = 160000.0
    rope_theta: float = 10000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    max_position_embeddings: int = 1048576
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    num_hash_layers: int = 3
    rms_norm_eps: float = 1e-6
    bos_token_id: int = 0
    eos_token_id: int = 1
    tie_word_embeddings: bool = False
    # checkpoint storage formats
    weight_dtype: str = "bf16"           # "fp8" when quantization_config says fp8 block scales
    expert_dtype: str = "same"           # "fp4" | "fp8" | "same" (same as weight_dtype)
    # DSpark draft module (mtp.* tensors), 0 stages when the checkpoint has none
    num_dspark_stages: int = 0
    dspark_block_size: int = 0
    dspark_target_layer_ids: tuple = ()
    dspark_markov_rank: int = 0
    dspark_noise_token_id: int = 0
    model_type: str = "deepseek_v4"

    # ---- derived ------------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    def layer_ratio(self, layer_id: int) -> int:
        """Compression ratio of backbone layer `layer_id` (0 = sliding window only)."""
        return self.compress_ratios[layer_id]

    def is_hash_layer(self, layer_id: int) -> bool:
        return layer_id < self.num_hash_layers

    @property
    def expert_format(self) -> str:
        return self.weight_dtype if self.expert_dtype == "same" else self.expert_dtype

    @property
    def has_dspark(self) -> bool:
        return self.num_dspark_stages > 0

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # ---- parsing ------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        raw = dict(raw)
        if "text_config" in raw and isinstance(raw["text_config"], dict):
            raise ConfigError(
                f"model_type {raw.get('model_type')!r} nests a text_config (DeepSeek-V4.1 style); "
                f"supported model_type: {', '.join(SUPPORTED_MODEL_TYPES)}")
        mt = raw.get("model_type", "deepseek_v4")
        if mt not in SUPPORTED_MODEL_TYPES:
            hint = ""
            if str(mt).startswith("qwen"):
                hint = " (Qwen3 targets are loaded by dspark.models.qwen3, not the DeepSeek-V4 path)"
            raise ConfigError(f"config.json: unsupported model_type {mt!r}{hint}; "
                              f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")

        if check_value("num_key_value_heads", raw.get("num_key_value_heads", 1), "int", ">0") != 1:
            raise ConfigError(f"config.json: num_key_value_heads = {raw['num_key_value_heads']!r} is not "
                              f"supported: DeepSeek-V4 has one shared 512-d KV head (1)")

        def get(key, default=None):
            if key in raw:
                return raw[key]
            alias = _REF_ALIASES.get(key)
            if alias is not None and alias in raw:
                return raw[alias]
            return default

        missing = [k for k in REQUIRED_KEYS if get(k) is None]
        if missing:
            names = [k + (f" (or {_REF_ALIASES[k]})" if k in _REF_ALIASES else "") for k in missing]
            raise ConfigError(f"config.json: missing required key(s) {', '.join(names)}: these "
                              f"shapes differ between DeepSeek-V4 checkpoints and have no default; "
                              f"add them to config.json (the checkpoint's tensors fix their values)")
        kw = {}
        for f in dataclasses.fields(cls):
            v = get(f.name, None)
            if v is not None and f.name not in ("compress_ratios", "dspark_target_layer_ids"):
                kw[f.name] = check_value(f.name, v, f.type, _RANGES.get(f.name))
        n_layers = kw["num_hidden_layers"]

        # compression schedule: legacy `compress_ratios` (may carry MTP/draft tail entries)
        # or HF `layer_types` + `compress_rates`
        ratios = get("compress_ratios")
        if ratios is None and "layer_types" in raw:
            check_value("layer_types", raw["layer_types"], "tuple")
            rates = raw.get("compress_rates") or {"compressed_sparse_attention": 4,
                                                  "heavily_compressed_attention": 128}
            if not isinstance(rates, dict):
                _bad("compress_rates", rates, "an object {layer type: compression ratio}")
            rates = {k: check_value(f"compress_rates[{k!r}]", v, "int", ">0") for k, v in rates.items()}
            short = {"csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention"}
            rates = {short.get(k, k): v for k, v in rates.items()}
            ratios = []
            for i, t in enumerate(raw["layer_types"]):
                if t == "sliding_attention":
                    ratios.append(0)
                elif t in rates:
                    ratios.append(rates[t])
                else:
                    raise ConfigError(f"config.json: layer_types[{i}] = {t!r} is not supported; "
                                      f"expected one of sliding_attention, "
                                      f"compressed_sparse_attention, heavily_compressed_attention")
        if ratios is None:
            raise ConfigError("config.json: missing `compress_ratios` (or HF `layer_types`); "
                              "DeepSeek-V4 needs one compression ratio per layer")
        ratios = [check_value(f"compress_ratios[{i}]", r, "int", ">=0")
                  for i, r in enumerate(check_value("compress_ratios", ratios, "tuple"))]
        if len(ratios) < n_layers:
            raise ConfigError(f"config.json: compress_ratios has {len(ratios)} entries but "
                              f"num_hidden_layers is {n_layers}; need at least one per layer")
        kw["compress_ratios"] = tuple(ratios[:n_layers])

        # rope / YaRN (HF rope_scaling or rope_parameters, or REF flat keys)
        rs = raw.get("rope_scaling") or {}
        rp = raw.get("rope_parameters") or {}
        for name, d in (("rope_scaling", rs), ("rope_parameters", rp)):
            if not isinstance(d, dict):
                _bad(name, d, "an object of rope settings")
        if "compress" in rp:
            rs = rp["compress"]
        if rs:
            def num(key, field, kind="float"):
                return check_value(f"rope_scaling.{key}", rs.get(key, kw.get(field, getattr(cls, field))),
                                   kind, _RANGES[field])
            kw["rope_factor"] = num("factor", "rope_factor")
            kw["original_seq_len"] = num("original_max_position_embeddings", "original_seq_len", "int")
            kw["beta_fast"] = check_value("rope_scaling.beta_fast", rs.get("beta_fast", cls.beta_fast),
                                          "float", ">=0")
            kw["beta_slow"] = check_value("rope_scaling.beta_slow", rs.get("beta_slow", cls.beta_slow),
                                          "float", ">=0")
            if "rope_theta" in rs and "compress_rope_theta" not in raw:
                kw["compress_rope_theta"] = check_value("rope_scaling.rope_theta", rs["rope_theta"],
                                                        "float", ">0")
        if isinstance(rp.get("main"), dict) and "rope_theta" not in raw:
            kw["rope_theta"] = check_value("rope_parameters.main.rope_theta",
                                           rp["main"].get("rope_theta", cls.rope_theta), "float", ">0")
        if "original_seq_len" in raw:
            kw["original_seq_len"] = check_value("original_seq_len", raw["original_seq_len"], "int", ">0")
        if "rope_factor" in raw:
            kw["rope_factor"] = check_value("rope_factor", raw["rope_factor"], "float", ">0")

        # storage formats
        qc = raw.get("quantization_config")
        if qc:
            if not isinstance(qc, dict):
                _bad("quantization_config", qc, "an object with quant_method fp8")
            if qc.get("quant_method") != "fp8":
                raise ConfigError(f"config.json: quantization_config.quant_method "
                                  f"{qc.get('quant_method')!r} is not supported; supported: fp8 "
                                  f"(e4m3 weights with UE8M0 128x128 block scales)")
            bs = list(qc.get("weight_block_size", [128, 128]))
            if bs != [128, 128]:
                raise ConfigError(f"config.json: quantization_config.weight_block_size {bs} is not "
                                  f"supported; DeepSeek-V4 uses [128, 128]")
            kw["weight_dtype"] = "fp8"
        elif raw.get("dtype") == "fp8":
            kw["weight_dtype"] = "fp8"
        else:
            kw["weight_dtype"] = "bf16"
        ed = raw.get("expert_dtype")
        kw["expert_dtype"] = {None: "same", "fp4": "fp4", "fp8": "fp8", "bf16": "bf16"}.get(ed, ed)

        # DSpark draft stages: ratios tail beyond the backbone, else n_mtp_layers, else 3
        if "dspark_block_size" in raw:
            ids = check_value("dspark_target_layer_ids", raw.get("dspark_target_layer_ids", ()), "tuple")
            kw["dspark_target_layer_ids"] = tuple(
                check_value(f"dspark_target_layer_ids[{i}]", x, "int") for i, x in enumerate(ids))
            tail = len(ratios) - n_layers
            stages = raw.get("num_dspark_stages") or (tail if tail > 0 else raw.get("n_mtp_layers") or 3)
            kw["num_dspark_stages"] = check_value("num_dspark_stages", stages, "int", ">=0")
        cfg = cls(**{k: v for k, v in kw.items() if k in {f.name for f in dataclasses.fields(cls)}})
        cfg.validate()
        return cfg

    @classmethod
    def from_path(cls, path: str) -> "ModelConfig":
        fn = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.exists(fn):
            raise ConfigError(f"no config.json found at {path!r}: pass a checkpoint directory "
                              f"(e.g. one written by `python -m dspark.tools.make_checkpoint`)")
        with open(fn) as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{fn}: not valid JSON ({e})") from None
        return cls.from_dict(raw)

    def validate(self) -> None:
        """Types and ranges of every field, then the relations between fields."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in _CHOICES and v not in _CHOICES[f.name]:
                _bad(f.name, v, f"one of {', '.join(_CHOICES[f.name])}")
            got = check_value(f.name, v, f.type, _RANGES.get(f.name))
            if f.type == "tuple":
                for i, x in enumerate(got):
                    check_value(f"{f.name}[{i}]", x, "int", ">=0")
            if got != v or type(got) is not type(v):
                object.__setattr__(self, f.name, got)      # 4.0 -> 4, [..] -> (..): frozen copy
        bad = _bad
        for name in ("bos_token_id", "eos_token_id") + (("dspark_noise_token_id",) if self.has_dspark else ()):
            if getattr(self, name) >= self.vocab_size:
                bad(name, getattr(self, name), f"a token id below vocab_size={self.vocab_size}")
        if self.scoring_func != "sqrtsoftplus":
            bad("scoring_func", self.scoring_func, "only 'sqrtsoftplus' (DeepSeek-V4)")
        if self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2 or self.qk_rope_head_dim >= self.head_dim:
            bad("qk_rope_head_dim", self.qk_rope_head_dim, f"an even number below head_dim={self.head_dim}")
        if self.num_attention_heads % self.o_groups:
            bad("o_groups", self.o_groups, f"must divide num_attention_heads={self.num_attention_heads}")
        for i, r in enumerate(self.compress_ratios):
            if r not in (0, 4) and (r < 8 or r & (r - 1)):
                bad(f"compress_ratios[{i}]", r, "0 (sliding window), 4 (CSA, overlapping) or a "
                    "power of two >= 8 (HCA, e.g. 128)")
        if self.num_experts_per_tok > self.n_routed_experts:
            bad("num_experts_per_tok", self.num_experts_per_tok,
                f"at most n_routed_experts={self.n_routed_experts}")
        if self.num_hash_layers > self.num_hidden_layers:
            bad("num_hash_layers", self.num_hash_layers, f"at most num_hidden_layers={self.num_hidden_layers}")
        if self.expert_format not in ("bf16", "fp8", "fp4"):
            bad("expert_dtype", self.expert_dtype, "fp4, fp8 or absent")
        if self.index_head_dim <= self.qk_rope_head_dim:
            bad("index_head_dim", self.index_head_dim, f"must exceed qk_rope_head_dim={self.qk_rope_head_dim}")
        if self.has_dspark:
            if self.dspark_block_size < 1:
                bad("dspark_block_size", self.dspark_block_size, "a positive block size")
            for t in self.dspark_target_layer_ids:
                if not 0 <= t < self.num_hidden_layers:
                    bad("dspark_target_layer_ids", self.dspark_target_layer_ids,
                        f"layer ids in [0, {self.num_hidden_layers})")
            if not self.dspark_target_layer_ids:
                bad("dspark_target_layer_ids", (), "at least one target layer to tap")
            if self.dspark_markov_rank < 0:
                bad("dspark_markov_rank", self.dspark_markov_rank, ">= 0")
