"""Qwen3 dense target (reference path): embed -> N x [GQA attention + SwiGLU] -> norm -> lm_head.

Same forward interface as `DeepseekV4Model`, so `ModelRunner` drives it unchanged: a forward takes
a flattened ragged `Batch` (prefill chunks, decode tokens and verify blocks of several requests at
any positions) and returns the pre-norm residual stream plus the drafter's taps.

Per-request state is dense and position-indexed (`KVState`): a forward over positions [s, e)
writes exactly those K/V rows and attends to rows [0, e), so rolling back to length n is free: the
next forward simply starts writing at n (dspark.md §5.3).

Checkpoints are HF format: `model.`-prefixed decoder tensors, `lm_head.weight` unless
`tie_word_embeddings`. Parameter names here are the checkpoint names without `model.`, except
`embed` / `head` (= `embed_tokens` / `lm_head`), which the runner and drafter look up by name.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import config as _config
from . import loader as _loader
from ..attention.gqa import attend


class ConfigError(_config.ConfigError):
    """A Qwen3 / DSpark config.json field is missing, unsupported or inconsistent."""


class CheckpointError(_loader.CheckpointError):
    """Tensors on disk do not match what config.json says they should be."""


# ---- config ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int = 151936
    hidden_size: int = 2560
    intermediate_size: int = 9728
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 40960
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    eos_token_ids: tuple = ()
    model_type: str = "qwen3"
    # filled in from the drafter by load_qwen3_pair (the runner reads these off the target cfg)
    dspark_block_size: int = 0
    dspark_target_layer_ids: tuple = ()

    @property
    def has_dspark(self) -> bool:
        return self.dspark_block_size > 0

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    @classmethod
    def _base_kwargs(cls, raw: dict, where: str) -> dict:
        """Parse the Qwen3 backbone keys shared by the target and the DeepSpec drafter config."""
        if raw.get("model_type") != "qwen3":
            raise ConfigError(f"{where}: model_type {raw.get('model_type')!r} is not 'qwen3'")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in raw]
        if missing:
            raise ConfigError(f"{where}: missing required key(s) {missing}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported (silu only)")
        if raw.get("use_sliding_window"):
            raise ConfigError(f"{where}: use_sliding_window=true is not supported (full attention only)")
        # rope: legacy `rope_theta` (+ `rope_scaling`) or transformers-5 `rope_parameters`
        rp = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rtype = rp.get("rope_type", rp.get("type", "default"))
        if rtype not in (None, "default"):
            raise ConfigError(f"{where}: rope type {rtype!r} is not supported (plain RoPE only)")
        theta = raw.get("rope_theta") or rp.get("rope_theta") or 10000.0

        def num(key, value, kind="int", rng=">0"):
            try:
                return _config.check_value(key, value, kind, rng, where)
            except _config.ConfigError as e:
                raise ConfigError(str(e)) from None
        heads = num("num_attention_heads", raw["num_attention_heads"])
        hidden = num("hidden_size", raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        eos_ids = tuple(num("eos_token_id", e, rng=">=0") for e in eos_ids)
        bos = raw.get("bos_token_id")
        kw = dict(vocab_size=num("vocab_size", raw["vocab_size"]), hidden_size=hidden,
                  intermediate_size=num("intermediate_size", raw["intermediate_size"]),
                  num_hidden_layers=num("num_hidden_layers", raw["num_hidden_layers"]),
                  num_attention_heads=heads,
                  num_key_value_heads=num("num_key_value_heads", raw.get("num_key_value_heads") or heads),
                  head_dim=num("head_dim", raw.get("head_dim") or hidden // heads),
                  rope_theta=num("rope_theta", theta, "float"),
                  rms_norm_eps=num("rms_norm_eps", raw.get("rms_norm_eps", 1e-6), "float"),
                  attention_bias=num("attention_bias", raw.get("attention_bias", False), "bool", None),
                  tie_word_embeddings=num("tie_word_embeddings", raw.get("tie_word_embeddings", False),
                                          "bool", None),
                  max_position_embeddings=num("max_position_embeddings",
                                              raw.get("max_position_embeddings", 40960)),
                  bos_token_id=None if bos is None else num("bos_token_id", bos, rng=">=0"),
                  eos_token_id=eos_ids[0] if eos_ids else None, eos_token_ids=eos_ids)
        if kw["num_attention_heads"] % kw["num_key_value_heads"]:
            raise ConfigError(f"{where}: num_key_value_heads={kw['num_key_value_heads']} must divide "
                              f"num_attention_heads={heads}")
        return kw

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> "Qwen3Config":
        return cls(**cls._base_kwargs(raw, where))

    @classmethod
    def from_path(cls, path: str) -> "Qwen3Config":
        fn = os.path.join(path, "config.json") if os.path.isdir(path) else path
        return cls.from_dict(read_config(fn), fn)


def read_config(fn: str) -> dict:
    if os.path.isdir(fn):
        fn = os.path.join(fn, "config.json")
    if not os.path.exists(fn):
        raise ConfigError(f"no config.json at {fn!r}: pass a checkpoint directory")
    with open(fn) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{fn}: not valid JSON ({e})") from None


# ---- layers ---------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """HF Qwen3 RMSNorm: normalise in fp32, cast back, then scale (this order matters in bf16)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """fp32 (cos, sin) [T, head_dim] for NeoX rotate-half RoPE at absolute positions."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    f = positions.float()[:, None] * inv[None]
    f = torch.cat([f, f], -1)
    return f.cos(), f.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, d]; rotate halves (NeoX), not interleaved pairs (dspark.md §8.14)."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        D, d, b = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.nq, self.nkv, self.head_dim, self.theta = cfg.num_attention_heads, cfg.num_key_value_heads, d, cfg.rope_theta
        self.q_proj = nn.Linear(D, self.nq * d, bias=b)
        self.k_proj = nn.Linear(D, self.nkv * d, bias=b)
        self.v_proj = nn.Linear(D, self.nkv * d, bias=b)
        self.o_proj = nn.Linear(self.nq * d, D, bias=b)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def project_q(self, x, positions):
        cos, sin = rope_cos_sin(positions, self.head_dim, self.theta)
        return apply_rope(self.q_norm(self.q_proj(x).view(-1, self.nq, self.head_dim)), cos, sin)

    def project_kv(self, x, positions):
        """(K post k_norm + RoPE, V) [T, Hkv, d]: what gets cached per position."""
        cos, sin = rope_cos_sin(positions, self.head_dim, self.theta)
        k = apply_rope(self.k_norm(self.k_proj(x).view(-1, self.nkv, self.head_dim)), cos, sin)
        return k, self.v_proj(x).view(-1, self.nkv, self.head_dim)

    def output(self, o):
        return self.o_proj(o.reshape(o.shape[0], -1))


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm residual layer; `attn_fn(self_attn, u)` supplies the attention core, so the DSpark
    draft layers reuse this class with their context-injected attention."""

    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Qwen3MLP(cfg)

    def forward(self, h, attn_fn):
        h = h + attn_fn(self.self_attn, self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


# ---- per-request state ----------------------------------------------------------------------------

class KVState:
    """One request's target K/V per layer, [capacity, Hkv, d] indexed by absolute position."""

    def __init__(self, num_layers: int):
        self.k = [None] * num_layers
        self.v = [None] * num_layers

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        end = start + k.shape[0]
        cur = self.k[layer]
        if cur is None or cur.shape[0] < end:          # grow by doubling: amortised O(1) per token
            cap = max(end, 64 if cur is None else 2 * cur.shape[0])
            nk, nv = k.new_zeros((cap,) + k.shape[1:]), v.new_zeros((cap,) + v.shape[1:])
            if cur is not None:
                nk[:cur.shape[0]], nv[:cur.shape[0]] = cur, self.v[layer]
            self.k[layer], self.v[layer] = nk, nv
        self.k[layer][start:end], self.v[layer][start:end] = k, v

    def read(self, layer: int, end: int):
        return self.k[layer][:end], self.v[layer][:end]


def _dense_attention(attn: Qwen3Attention, x, batch, layer_id: int, quant=None):
    """Causal attention of each segment's new rows over its cached prefix + themselves."""
    q = attn.project_q(x, batch.positions)
    k, v = attn.project_kv(x, batch.positions)
    out = torch.empty_like(q)
    for seg in batch.segments:
        sl = slice(seg.offset, seg.offset + seg.length)
        end = seg.start + seg.length
        seg.state.write(layer_id, seg.start, k[sl], v[sl])
        K, V = seg.state.read(layer_id, end)
        qpos = torch.arange(seg.start, end, device=x.device)
        mask = torch.arange(end, device=x.device)[None, :] <= qpos[:, None]
        out[sl] = attend(q[sl], K, V, mask)
    return attn.output(out)


# ---- model ----------------------------------------------------------------------------------------

class Qwen3Model(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.head.weight = self.embed.weight

    def new_state(self) -> KVState:
        return KVState(self.cfg.num_hidden_layers)

    def forward_hidden(self, batch, attn_fn=None, quant=None, tap_layers=()):
        """(pre-norm residual [T, D], taps [T, len(tap_layers)*D] or None).

        Tap l = HF `hidden_states[l + 1]`: the residual stream after decoder layer l, -1 = the
        embedding output. HF's last entry is the *final-normed* state, so a tap of the last layer
        is normed too (what a DeepSpec drafter trained on)."""
        fn = attn_fn or _dense_attention
        h = self.embed(batch.token_ids)
        want, taps = set(tap_layers), {}
        if -1 in want:
            taps[-1] = h
        last = self.cfg.num_hidden_layers - 1
        for i, layer in enumerate(self.layers):
            h = layer(h, lambda attn, u, i=i: fn(attn, u, batch, i, quant))
            if i in want:
                taps[i] = self.norm(h) if i == last else h
        tap = torch.cat([taps[i] for i in tap_layers], -1) if tap_layers else None
        return h, tap

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits; the matmul runs in the weight dtype, as in HF (bf16 checkpoints)."""
        return F.linear(self.norm(hidden), self.head.weight).float()

    def forward(self, batch, attn_fn=None, quant=None) -> torch.Tensor:
        return self.logits(self.forward_hidden(batch, attn_fn, quant)[0])

    # checkpoint name <-> parameter name
    @staticmethod
    def param_name(ckpt_name: str) -> str:
        name = ckpt_name.removeprefix("model.")
        return {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight"}.get(name, name)

    def expected_tensors(self) -> dict:
        """{checkpoint name: shape} this config requires (lm_head only when untied)."""
        special = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight"}
        # remove_duplicate drops the tied head (it *is* the embedding parameter)
        return {special.get(n, f"model.{n}"): tuple(p.shape)
                for n, p in self.named_parameters(remove_duplicate=True)}


# ---- safetensors reading (shared with the drafter loader) -----------------------------------------

def tensor_headers(path: str) -> dict:
    """{name in file: (shard file, shape, safetensors dtype tag)} from headers only."""
    from safetensors import safe_open
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(path, "model.safetensors")):
        shards = ["model.safetensors"]
    else:
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
    out = {}
    for shard in shards:
        with safe_open(os.path.join(path, shard), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (shard, tuple(sl.get_shape()), sl.get_dtype())
    return out


FLOAT_TAGS = ("BF16", "F32", "F16")    # safetensors dtype tags read (and cast) as the engine dtype


def check_tensors(path: str, found: dict, expected: dict, optional=()) -> None:
    """Raise one CheckpointError listing every missing, unexpected, mis-shaped or non-float
    tensor (names and shapes strict; any of FLOAT_TAGS is accepted and cast on read)."""
    problems = []
    missing = sorted(set(expected) - set(found) - set(optional))
    extra = sorted(set(found) - set(expected))
    bad = sorted(n for n in set(found) & set(expected) if tuple(found[n][1]) != tuple(expected[n]))
    if missing:
        problems.append(f"missing {missing[:8]}" + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))
    if extra:
        problems.append(f"unexpected {extra[:8]}" + (f" (+{len(extra) - 8} more)" if len(extra) > 8 else ""))
    for n in bad[:8]:
        problems.append(f"{n}: shape {list(found[n][1])} in the file, config implies {list(expected[n])}")
    wrong = sorted(n for n in found if n in expected and found[n][2] not in FLOAT_TAGS)
    problems += [f"{n}: dtype {found[n][2]} (expected {', '.join(FLOAT_TAGS)})" for n in wrong[:8]]
    if len(wrong) > 8:
        problems.append(f"(+{len(wrong) - 8} more with a non-float dtype)")
    if wrong:
        problems.append("Qwen3 / DSpark tensors are read unquantized, cast to the engine dtype "
                        "from BF16, F32 or F16: use the checkpoint's bf16 release (FP8 / int "
                        "quantized Qwen3 exports are not supported)")
    if problems:
        raise CheckpointError(f"{path}: checkpoint does not match its config.json: " + "; ".join(problems))


def read_tensors(path: str, headers: dict, names, dtype, device) -> dict:
    """{name: tensor as `dtype` on `device`} for checked float tensors; one INFO line per stored
    dtype that differs from `dtype` (how many tensors, one example)."""
    from safetensors import safe_open
    by_shard, out = {}, {}
    names = list(names)
    for n in names:
        by_shard.setdefault(headers[n][0], []).append(n)
    _loader.log_casts(path, {n: _loader._SAFE_DTYPES[headers[n][2]] for n in names},
                      dict.fromkeys(names, dtype))
    for shard, ns in by_shard.items():
        with safe_open(os.path.join(path, shard), framework="pt") as f:
            for n in ns:
                try:
                    out[n] = _loader.cast_float(f.get_tensor(n).to(device), dtype, n)
                except _loader.CheckpointError as e:
                    raise CheckpointError(f"{path}: {e}") from None
    return out


def load_qwen3(path: str, dtype=torch.float32, device="cpu", cfg: Qwen3Config | None = None) -> Qwen3Model:
    """Strictly load an HF-format Qwen3 checkpoint (every tensor present, shaped, and consumed)."""
    cfg = cfg or Qwen3Config.from_path(path)
    with torch.device("meta"):
        model = Qwen3Model(cfg)
    expected = model.expected_tensors()
    found = tensor_headers(path)
    # a tied checkpoint may still carry lm_head.weight (some exporters write it): HF ignores it too
    if cfg.tie_word_embeddings and "lm_head.weight" in found:
        found = {k: v for k, v in found.items() if k != "lm_head.weight"}
    check_tensors(path, found, expected)
    weights = read_tensors(path, found, expected, dtype, device)
    model.load_state_dict({model.param_name(k): v for k, v in weights.items()} |
                          ({"head.weight": weights["model.embed_tokens.weight"]}
                           if cfg.tie_word_embeddings else {}), strict=True, assign=True)
    if cfg.tie_word_embeddings:               # assign=True replaced the Parameter: re-tie
        model.head.weight = model.embed.weight
    return model.eval()
