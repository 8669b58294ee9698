"""Shared pieces of the training code: model configs, initialisation, QAT fake-quant, checkpoint
I/O in the official layout, logging helpers."""
from __future__ import annotations

import json
import math
import os
import time

import torch
from torch import nn

from dspark.config import ModelConfig
from dspark.models.deepseek_v4.model import DeepseekV4Model
from dspark.models.drafter import DSparkDrafter

from .data import BOS_ID, EOS_ID, NOISE_ID

# ---- configs --------------------------------------------------------------------------------
# The shipped default: every DeepSeek-V4 layer type (SWA, CSA + indexer, HCA, hash-routed and
# score-routed MoE, mHC with hc_mult 4) at the real head_dim 512 / rope 64 / index_head_dim 128,
# so cache record formats are the real ones. ~6.4 M target + ~3.2 M drafter parameters.
DEFAULT = dict(vocab_size=4096, hidden_size=192, num_hidden_layers=4, num_attention_heads=4,
               head_dim=512, qk_rope_head_dim=64, q_lora_rank=96, o_lora_rank=64, o_groups=2,
               n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
               moe_intermediate_size=64, routed_scaling_factor=1.5, swiglu_limit=10.0,
               sliding_window=128, compress_ratios=(0, 4, 128, 4), compress_rope_theta=160000.0,
               rope_theta=10000.0, rope_factor=16.0, original_seq_len=65536, beta_fast=32.0,
               beta_slow=1.0, max_position_embeddings=4096, index_n_heads=8, index_head_dim=128,
               index_topk=32, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, num_hash_layers=1,
               rms_norm_eps=1e-6, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
               num_dspark_stages=3, dspark_block_size=5, dspark_markov_rank=64,
               dspark_noise_token_id=NOISE_ID, weight_dtype="bf16", expert_dtype="bf16")

# CPU-sized variant with the same code paths active within ~40 tokens (window 8, HCA 16, top-k 4).
TINY = dict(DEFAULT, vocab_size=512, hidden_size=32, num_attention_heads=4, q_lora_rank=32,
            o_lora_rank=16, n_routed_experts=4, moe_intermediate_size=16, sliding_window=8,
            compress_ratios=(0, 4, 16, 4), original_seq_len=32, rope_factor=4.0,
            index_n_heads=16, index_topk=4, dspark_markov_rank=8, max_position_embeddings=512)


def make_config(name_or_dict="default", **overrides) -> ModelConfig:
    base = {"default": DEFAULT, "tiny": TINY}[name_or_dict] if isinstance(name_or_dict, str) \
        else dict(name_or_dict)
    kw = dict(base, **overrides)
    n = kw["num_hidden_layers"]
    kw["compress_ratios"] = tuple(kw["compress_ratios"])[:n]
    kw.setdefault("dspark_target_layer_ids", tuple(range(max(0, n - 3), n)))
    kw["dspark_target_layer_ids"] = tuple(kw["dspark_target_layer_ids"])
    cfg = ModelConfig(**kw)
    cfg.validate()
    return cfg


# ---- initialisation -------------------------------------------------------------------------
def _init_block(block, n_layers_total: int, gen: torch.Generator, std: float = 0.02):
    n = block.cfg.hc_mult
    for name, p in block.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("_fn"):                       # hc_{attn,ffn}_fn
                p.normal_(0.0, 0.01, generator=gen)
            elif name.endswith("_base"):
                # pre: sigmoid(0)=0.5, post: 2*sigmoid(0)=1, comb: identity-leaning logits
                p.zero_()
                p[2 * n:].view(n, n).add_(torch.eye(n) * 2.0)
            elif name.endswith("_scale"):
                p.fill_(1.0)
            elif name.endswith("attn_sink"):
                p.zero_()
            elif name.endswith(".ape"):
                p.zero_()
            elif name.endswith("gate.bias"):
                p.zero_()
            elif name.endswith("wo_b.weight") or name.endswith(".w2.weight"):
                p.normal_(0.0, std / math.sqrt(2 * n_layers_total), generator=gen)
            elif p.dim() == 2:
                p.normal_(0.0, std, generator=gen)
            else:
                raise ValueError(f"no init rule for {name}")
    for name, b in block.named_buffers():
        if name.endswith("tid2eid"):
            V, k = b.shape
            E = block.cfg.n_routed_experts
            keys = torch.rand(V, E, generator=gen)
            b.copy_(keys.argsort(dim=1)[:, :k])


def init_target(model: DeepseekV4Model, seed: int = 0) -> DeepseekV4Model:
    gen = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    with torch.no_grad():
        model.embed.weight.normal_(0.0, 1.0, generator=gen)
        model.head.weight.normal_(0.0, 0.02, generator=gen)
        model.norm.weight.fill_(1.0)
        model.hc_head_fn.normal_(0.0, 0.01, generator=gen)
        model.hc_head_base.zero_()
        model.hc_head_scale.fill_(1.0)
    for layer in model.layers:
        _init_block(layer, cfg.num_hidden_layers, gen)
    return model


def init_drafter(drafter: DSparkDrafter, seed: int = 1) -> DSparkDrafter:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for st in drafter.stages:
            _init_block(st, len(drafter.stages), gen)
        drafter.main_proj.weight.normal_(0.0, 0.02, generator=gen)
        drafter.main_norm.weight.fill_(1.0)
        drafter.norm.weight.fill_(1.0)
        drafter.hc_head_fn.normal_(0.0, 0.01, generator=gen)
        drafter.hc_head_base.zero_()
        drafter.hc_head_scale.fill_(1.0)
        if drafter.markov_w1.numel():
            drafter.markov_w1.normal_(0.0, 1.0, generator=gen)
        drafter.markov_w2.zero_()
        drafter.confidence.weight.zero_()
    return drafter


def build_drafter(cfg: ModelConfig, markov: bool = True) -> DSparkDrafter:
    """The DSpark drafter; markov=False is the ablation (Markov rank 0: no bias, confidence from
    the hidden state alone)."""
    return DSparkDrafter(cfg if markov else cfg.replace(dspark_markov_rank=0))


def freeze(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        p.requires_grad_(False)
    return module.eval()


def round_bf16_(module: nn.Module, keep_fp32=()) -> nn.Module:
    """Round the parameters that the checkpoint stores as bf16 in place (values stay fp32)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if not any(name.endswith(k) for k in keep_fp32):
                p.copy_(p.to(torch.bfloat16).float())
    return module


# names the official layout stores in fp32 (weights.py inventory kinds); everything else is bf16
FP32_SUFFIXES = ("_fn", "_base", "_scale", "attn_sink", ".ape", "gate.bias")


# ---- QAT fake quantisation ------------------------------------------------------------------
class QATQuant:
    """The reference's storage rounding (FP8 fp8_ds_mla records for every cached 512-d kv and
    compressed entry; Hadamard + FP4 on indexer queries and keys) in the forward pass, with
    straight-through gradients. Forward values equal `dspark.runner.QuantSim`."""

    def kv(self, x):
        from dspark.formats.layouts import fp8_ds_mla_roundtrip
        return x + (fp8_ds_mla_roundtrip(x.detach()) - x.detach())

    def indexer(self, x):
        from dspark.formats.layouts import fp4_roundtrip, hadamard128
        h = hadamard128(x.float())
        return h + (fp4_roundtrip(h.detach()) - h.detach())


# ---- checkpoint I/O (official layout) -------------------------------------------------------
def _target_tensors(model: DeepseekV4Model) -> dict:
    return {k: v for k, v in model.state_dict().items()}


def _drafter_tensors(drafter: DSparkDrafter) -> dict:
    sd = drafter.state_dict()
    return {ckpt: sd[name] for name, ckpt in drafter.ckpt_names().items()}


def save_checkpoint(out: str, cfg: ModelConfig, model: DeepseekV4Model,
                    drafter: DSparkDrafter | None = None, shard_bytes: int = 15 << 20) -> dict:
    """Write config.json + sharded safetensors in the official layout (names and storage dtypes
    from `weights.tensor_inventory`). Without a drafter, `cfg` must have no DSpark stages."""
    from safetensors.torch import save_file

    from dspark.models.deepseek_v4.weights import tensor_inventory
    from dspark.tools.make_checkpoint import hf_config

    if drafter is None and cfg.has_dspark:
        cfg = cfg.replace(num_dspark_stages=0, dspark_block_size=0, dspark_markov_rank=0,
                          dspark_target_layer_ids=())
    inv = tensor_inventory(cfg)
    tensors = _target_tensors(model)
    if drafter is not None:
        tensors.update(_drafter_tensors(drafter))
    missing = sorted(set(inv) - set(tensors))
    extra = sorted(set(tensors) - set(inv))
    if missing or extra:
        raise ValueError(f"checkpoint names do not match the inventory: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}")
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32, "int64": torch.int64}
    # shard boundaries: target tensors first, mtp.* last, greedy by size
    shards, cur, cur_b = [], [], 0
    for name, spec in inv.items():
        t = tensors[name].detach().to("cpu", dt[spec.kind]).contiguous()
        b = t.numel() * t.element_size()
        if cur and cur_b + b > shard_bytes:
            shards.append(cur)
            cur, cur_b = [], 0
        cur.append((name, t))
        cur_b += b
    if cur:
        shards.append(cur)
    os.makedirs(out, exist_ok=True)
    weight_map, total = {}, 0
    for i, items in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(dict(items), os.path.join(out, fn), metadata={"format": "pt"})
        for name, t in items:
            weight_map[name] = fn
            total += t.numel() * t.element_size()
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config(cfg), f, indent=2)
    return {"total_bytes": total, "shards": len(shards)}


def load_models(path: str, device="cpu", with_drafter: bool = True):
    """(cfg, target, drafter or None) from a checkpoint directory, fp32 parameters."""
    from dspark.models.loader import load_checkpoint
    cfg = ModelConfig.from_path(path)
    w = load_checkpoint(path, cfg, dtype=torch.float32, device=device, progress=False)
    model = DeepseekV4Model(cfg).to(device)
    model.load_state_dict({k: v for k, v in w.items() if not k.startswith("mtp.")}, strict=True)
    drafter = None
    if with_drafter and cfg.has_dspark:
        drafter = DSparkDrafter(cfg).to(device)
        drafter.load_state_dict({DSparkDrafter.param_name(k): v for k, v in w.items()
                                 if k.startswith("mtp.")}, strict=True)
    return cfg, model, drafter


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ---- misc -------------------------------------------------------------------------------------
class Timer:
    def __init__(self):
        self.t0 = time.time()

    def __call__(self) -> float:
        return time.time() - self.t0


def pick_device(name: str | None = None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def setup_fast_math(device: torch.device) -> None:
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def autocast(device: torch.device, enabled: bool = True):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled)


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def lr_at(step: int, progress: float, base: float, warmup: int, final_frac: float = 0.1) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    p = min(max(progress, 0.0), 1.0)
    return base * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * p)))
