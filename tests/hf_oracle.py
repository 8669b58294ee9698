"""Independent oracle: full-sequence logits of a REF-named DeepSeek-V4 checkpoint, computed by
transformers' `DeepseekV4ForCausalLM`.

Nothing from `dspark` is used here. transformers maps the official (REF) tensor names onto its own
modules through its `conversion_mapping` rules for model_type "deepseek_v4" (renames, and the merge
of per-expert w1/w3/w2 into `gate_up_proj` / `down_proj`). Its FP8 path needs `accelerate` and a
GPU, so quantized tensors are de-quantized here first, with NumPy bit formulas written from spec
§5.2 (not dspark.formats.quant), into a temporary plain-float copy of the checkpoint that
`from_pretrained` then loads. `mtp.*` (DSpark / MTP) tensors are left out: HF has no module for them.

Loading is strict: any HF parameter or buffer not filled from the checkpoint (missing key, shape
mismatch, conversion error) or any checkpoint tensor HF did not consume raises, so no randomly
initialised HF weight can leak into the logits.
"""
from __future__ import annotations

import functools
import json
import os
import tempfile

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file


# ---- NumPy de-quantization (bit formulas, spec §5.2) ---------------------------------------------

def np_e4m3(u8: np.ndarray) -> np.ndarray:
    """OCP e4m3fn bytes -> float64: sign | 4-bit exponent (bias 7) | 3-bit mantissa; S.1111.111 = NaN."""
    u = u8.astype(np.int64)
    sign = np.where(u >> 7, -1.0, 1.0)
    exp, man = (u >> 3) & 0xF, u & 0x7
    normal = (1.0 + man / 8.0) * np.exp2(exp - 7.0)
    subnormal = (man / 8.0) * 2.0 ** -6
    val = sign * np.where(exp == 0, subnormal, normal)
    return np.where((exp == 15) & (man == 7), np.nan, val)


def np_e2m1(nibble: np.ndarray) -> np.ndarray:
    """e2m1 codes 0..15 -> float64: sign | 2-bit exponent (bias 1) | 1-bit mantissa, no NaN/inf."""
    n = nibble.astype(np.int64)
    sign = np.where(n >> 3, -1.0, 1.0)
    exp, man = (n >> 1) & 0x3, n & 0x1
    return sign * np.where(exp == 0, man * 0.5, (1.0 + man / 2.0) * np.exp2(exp - 1.0))


def np_e8m0(u8: np.ndarray) -> np.ndarray:
    """UE8M0 bytes -> float64 2^(b-127); 0xFF = NaN."""
    b = u8.astype(np.int64)
    return np.where(b == 255, np.nan, np.ldexp(1.0, b - 127))


def _tile(scale: np.ndarray, rows: int, cols: int, br: int, bc: int) -> np.ndarray:
    """Broadcast a per-block scale grid to [rows, cols] (last blocks may be partial)."""
    return np.repeat(np.repeat(scale, br, axis=0), bc, axis=1)[:rows, :cols]


def np_dequant_fp8(w_u8: np.ndarray, scale_u8: np.ndarray) -> np.ndarray:
    rows, cols = w_u8.shape
    assert scale_u8.shape == (-(-rows // 128), -(-cols // 128)), (w_u8.shape, scale_u8.shape)
    return np_e4m3(w_u8) * _tile(np_e8m0(scale_u8), rows, cols, 128, 128)


def np_dequant_fp4(packed_u8: np.ndarray, scale_u8: np.ndarray) -> np.ndarray:
    rows, cols = packed_u8.shape[0], 2 * packed_u8.shape[1]
    assert scale_u8.shape == (rows, -(-cols // 32)), (packed_u8.shape, scale_u8.shape)
    codes = np.empty((rows, cols), dtype=np.uint8)
    codes[:, 0::2], codes[:, 1::2] = packed_u8 & 0xF, packed_u8 >> 4   # low nibble = even column
    return np_e2m1(codes) * _tile(np_e8m0(scale_u8), rows, cols, 1, 32)


def _u8(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def dequantized_state_dict(ckpt_dir: str, include_mtp: bool = False) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as float32 (int64 kept), scales folded in, `model.` prefix dropped;
    `mtp.*` tensors only with include_mtp."""
    index = os.path.join(ckpt_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    raw = {}
    for fn in files:
        with safe_open(os.path.join(ckpt_dir, fn), framework="pt") as f:
            for k in f.keys():
                if include_mtp or not k.removeprefix("model.").startswith("mtp."):
                    raw[k.removeprefix("model.")] = f.get_tensor(k)
    out = {}
    for name, t in raw.items():
        if name.endswith(".scale"):
            continue
        partner = name.removesuffix(".weight") + ".scale"
        if partner in raw and t.dtype == torch.float8_e4m3fn:
            out[name] = torch.from_numpy(np_dequant_fp8(_u8(t), _u8(raw[partner])).astype(np.float32))
        elif partner in raw and t.dtype in (torch.int8, torch.uint8):
            out[name] = torch.from_numpy(np_dequant_fp4(_u8(t), _u8(raw[partner])).astype(np.float32))
        elif partner in raw:
            raise ValueError(f"{name}: has a .scale but dtype {t.dtype} is neither FP8 nor packed FP4")
        elif t.dtype == torch.int64:
            out[name] = t
        else:
            out[name] = t.float()
    return out


# ---- HF model ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=2)
def hf_model(ckpt_dir: str, dtype: torch.dtype = torch.float32):
    from transformers import DeepseekV4ForCausalLM

    with open(os.path.join(ckpt_dir, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)    # weights are de-quantized below
    state = dequantized_state_dict(ckpt_dir)
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f)
        save_file(state, os.path.join(tmp, "model.safetensors"))
        model, info = DeepseekV4ForCausalLM.from_pretrained(tmp, dtype=dtype, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    if problems:
        raise AssertionError(f"transformers did not load {ckpt_dir} cleanly: {problems}")
    # Every checkpoint element must land in exactly one HF parameter/buffer (renames and expert
    # merges preserve counts), and HF must hold nothing else that is persistent.
    n_ckpt = sum(t.numel() for t in state.values())
    n_hf = sum(t.numel() for t in model.state_dict().values())
    if n_ckpt != n_hf:
        raise AssertionError(f"HF model holds {n_hf} elements but the checkpoint has {n_ckpt}")
    return model.eval()


@torch.no_grad()
def hf_logits(ckpt_dir: str, token_ids, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits [L, V] (float32) of one full-sequence forward over `token_ids` (no cache)."""
    model = hf_model(os.path.abspath(ckpt_dir), dtype)
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(1, -1)
    return model(input_ids=ids, use_cache=False).logits[0].float()
