"""Load a DeepSeek-V4 safetensors checkpoint into de-quantized logical tensors.

    tensors = load_checkpoint("/ckpt", cfg)      # {official name: tensor}, no `.scale` entries

The checkpoint is validated against `tensor_inventory(cfg)` from the file headers alone before any
data is read: every missing, unexpected, wrongly shaped or wrongly typed tensor is reported in one
`CheckpointError`. Names and shapes are strict. Dtypes are strict for FP8 codes (e4m3), packed FP4
bytes (int8 / uint8) and their UE8M0 scales; unquantized float tensors may be stored as bf16, fp32
or fp16 and are cast to the dtype they are held in (`held_dtype`), with one log line per
(stored -> held) dtype pair saying how many tensors were cast. Data is then read one shard at a
time (safe_open memory-maps the file), and each quantized weight is de-quantized as soon as it and
its `.scale` have both been read.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from dspark.config import SUPPORTED_MODEL_TYPES, ConfigError, ModelConfig
from dspark.models.deepseek_v4.weights import (FLOAT_KINDS, scale_name, stored_inventory,
                                               stored_tensors, tensor_inventory)
from dspark.formats.quant import dequant_fp4_experts, dequant_fp8_blocks

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_REGENERATE = ("re-download the checkpoint, or regenerate it with "
               "`python -m dspark.tools.make_checkpoint --out DIR ...`")


class CheckpointError(ValueError):
    """The checkpoint on disk does not match what its config says it should contain."""


def _listing(names, limit: int = 10) -> str:
    names = list(names)
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in total)" if len(names) > limit else "")


def _check_model_type(path: str) -> dict | None:
    fn = os.path.join(path, "config.json")
    if not os.path.exists(fn):
        return None
    try:
        with open(fn) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{fn}: cannot read config.json ({e}); {_REGENERATE}") from None
    mt = raw.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES or "text_config" in raw:
        raise CheckpointError(
            f"{fn}: model_type {mt!r} is not a DeepSeek-V4 checkpoint; load_checkpoint reads "
            f"model_type {', '.join(map(repr, SUPPORTED_MODEL_TYPES))} only (DeepSeek-V4.1 and Qwen3 "
            f"checkpoints need their own loader). Fix: point it at a DeepSeek-V4 checkpoint directory.")
    return raw


def _shard_map(path: str) -> dict[str, str]:
    """{stored tensor name as in the files: shard file name}, from the index or the single file."""
    index_fn = os.path.join(path, INDEX_FILE)
    if os.path.exists(index_fn):
        try:
            with open(index_fn) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_fn}: not a valid safetensors index ({type(e).__name__}: {e}); "
                                  f"{_REGENERATE}") from None
        missing = sorted({s for s in weight_map.values() if not os.path.exists(os.path.join(path, s))})
        if missing:
            raise CheckpointError(f"{path}: {len(missing)} shard file(s) listed in {INDEX_FILE} are "
                                  f"missing: {_listing(missing)}. Fix: {_REGENERATE}")
        return dict(weight_map)
    if os.path.exists(os.path.join(path, SINGLE_FILE)):
        with _open(path, SINGLE_FILE) as f:
            return {name: SINGLE_FILE for name in f.keys()}
    raise CheckpointError(f"{path}: no {INDEX_FILE} or {SINGLE_FILE} found; pass a checkpoint directory "
                          f"(e.g. one written by `python -m dspark.tools.make_checkpoint`)")


def _open(path: str, shard: str):
    try:
        return safe_open(os.path.join(path, shard), framework="pt")
    except Exception as e:  # safetensors raises its own error types for truncated / corrupt files
        raise CheckpointError(f"{os.path.join(path, shard)}: unreadable safetensors file "
                              f"({type(e).__name__}: {e}); the file is truncated or corrupt. "
                              f"Fix: {_REGENERATE}") from None


# safetensors header dtype tags -> torch dtypes
_SAFE_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32,
                "I64": torch.int64, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu}


def _canonical(name: str) -> str:
    # Some V4-family exports prefix every tensor with `model.` (spec §5.1); the names are otherwise REF.
    return name[len("model."):] if name.startswith("model.") else name


def _headers(path: str, shard_map: dict[str, str]) -> dict[str, tuple[str, str, tuple, torch.dtype]]:
    """{canonical name: (shard, name in file, shape, dtype)} read from the shard headers only."""
    by_shard: dict[str, list[str]] = {}
    for name, shard in shard_map.items():
        by_shard.setdefault(shard, []).append(name)
    found, absent, dup = {}, [], []
    for shard, names in by_shard.items():
        with _open(path, shard) as f:
            keys = set(f.keys())
            for name in names:
                if name not in keys:
                    absent.append(f"{name} (in {shard})")
                    continue
                sl = f.get_slice(name)
                canon = _canonical(name)
                if canon in found:
                    dup.append(f"{name} / {found[canon][1]}")
                dtype = _SAFE_DTYPES.get(sl.get_dtype(), sl.get_dtype())  # unknown: keep the tag
                found[canon] = (shard, name, tuple(sl.get_shape()), dtype)
    if absent:
        raise CheckpointError(f"{path}: {len(absent)} tensor(s) listed in {INDEX_FILE} are not in their "
                              f"shard file: {_listing(absent)}. Fix: {_REGENERATE}")
    if dup:
        raise CheckpointError(f"{path}: tensors stored twice (with and without a `model.` prefix): "
                              f"{_listing(dup)}. Fix: keep one copy of each tensor")
    return found


# what each storage kind must look like on disk, and what to do about a mismatch
_DTYPE_HINTS = {
    "fp8": "FP8 weights are float8_e4m3fn codes next to a UE8M0 `.scale` per 128x128 tile; a "
           "checkpoint with de-quantized (bf16) dense weights needs a config.json without "
           "quantization_config",
    "fp4": "FP4 expert weights are packed e2m1 pairs stored as int8 or uint8 next to a UE8M0 "
           "`.scale` per 32 columns; a checkpoint with fp8 or bf16 experts needs that expert_dtype "
           "in config.json",
    "scale": "scales are UE8M0 exponents stored as float8_e8m0fnu (or their raw uint8 bytes); "
             "float scales are another format: convert them to e8m0 when exporting",
    "bf16": "unquantized tensors may be stored as bfloat16, float32 or float16 (cast on load), "
            "not as integers, fp8 or float64: re-export them in one of those",
    "int64": "the hash-routing table gate.tid2eid is stored as int64 or int32",
}
_DTYPE_HINTS["fp32"] = _DTYPE_HINTS["bf16"]


def held_dtype(kind: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a loaded tensor of storage `kind` is held in ("bf16" kinds in the engine dtype,
    "fp32" kinds in float32, hash tables in int64); quantized kinds de-quantize to `dtype`."""
    return {"fp32": torch.float32, "int64": torch.int64}.get(kind, dtype)


def cast_float(t: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """t as `dtype`; a CheckpointError naming the tensor when finite values overflow the narrower
    dtype (an fp32 tensor loaded as fp16, say) instead of silently holding inf."""
    if t.dtype == dtype:
        return t
    out = t.to(dtype)
    if (t.is_floating_point() and dtype.is_floating_point
            and torch.finfo(dtype).max < torch.finfo(t.dtype).max):
        over = torch.isinf(out) & torch.isfinite(t)
        if bool(over.any()):
            raise CheckpointError(
                f"{name}: stored as {t.dtype} with values up to {t[over].abs().max().item():.4g}, "
                f"beyond {dtype}'s range (max {torch.finfo(dtype).max:.4g}). Fix: load with a "
                f"wider dtype (bf16 or fp32)")
    return out


def log_casts(path: str, stored: dict, held: dict) -> None:
    """One INFO line per (stored dtype -> held dtype) pair: how many tensors, and one example."""
    pairs: dict = {}
    for name, s in stored.items():
        if s != held[name]:
            pairs.setdefault((s, held[name]), []).append(name)
    for (s, h), names in pairs.items():
        log.info("%s: cast %d tensor(s) stored as %s to %s (e.g. %s)", path, len(names),
                 str(s).removeprefix("torch."), str(h).removeprefix("torch."), names[0])


def log_float_casts(path: str, cfg: ModelConfig, found: dict, dtype: torch.dtype) -> None:
    """`log_casts` for the unquantized float tensors of a validated V4 checkpoint."""
    floats = {n: spec.kind for n, spec in tensor_inventory(cfg).items() if spec.kind in FLOAT_KINDS}
    log_casts(path, {n: found[n][3] for n in floats},
              {n: held_dtype(k, dtype) for n, k in floats.items()})


def _shape_hint(cfg: ModelConfig, pairs) -> str:
    """Which config.json field the wrong shapes point at: the integer fields whose value is the
    expected size of a dimension that the tensors hold at another size most often (in two
    tensors or more: one tensor of the wrong shape is the tensor's fault, not the config's)."""
    counts = collections.Counter((e, f) for want, got in pairs if len(want) == len(got)
                                 for e, f in zip(want, got) if e != f)
    for (e, f), n in counts.most_common(3):
        if n < 2:
            break
        names = [fl.name for fl in dataclasses.fields(cfg) if fl.type == "int"
                 and getattr(cfg, fl.name) == e and fl.name not in ("bos_token_id", "eos_token_id")]
        if names:
            return (f" (config.json's {' / '.join(f'{n} = {e}' for n in names)}, but the tensors "
                    f"have {f} there)")
    return ""


def _validate(path: str, cfg: ModelConfig, found: dict) -> None:
    expected = stored_inventory(cfg)
    ignored = [n for n in found if n not in expected and n.startswith("mtp.") and not cfg.has_dspark]
    if ignored:
        # Classic one-layer MTP heads ship in the official V4 checkpoints; we do not run them.
        log.info("ignoring %d classic MTP tensor(s) (mtp.*): config has no dspark_* keys", len(ignored))
    missing = [n for n in expected if n not in found]
    unexpected = [n for n in found if n not in expected and n not in ignored]
    bad_shape = [f"{n}: {list(found[n][2])} (expected {list(st.shape)})"
                 for n, st in expected.items() if n in found and found[n][2] != tuple(st.shape)]
    kinds = {st.name: spec.kind for name, spec in tensor_inventory(cfg).items()
             for st in stored_tensors(name, spec)}
    wrong = [n for n, st in expected.items() if n in found and found[n][3] not in st.dtypes]
    bad_dtype = [f"{n}: {found[n][3]} (expected {' or '.join(map(str, expected[n].dtypes))})"
                 for n in wrong]
    is_scale = {n for n in wrong if kinds[n] in ("fp8", "fp4") and n.endswith(".scale")}
    hints = list(dict.fromkeys(_DTYPE_HINTS["scale" if n in is_scale else kinds[n]] for n in wrong))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {_listing(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {_listing(unexpected)}")
    if bad_shape:
        hint = _shape_hint(cfg, [(tuple(st.shape), found[n][2]) for n, st in expected.items()
                                 if n in found and found[n][2] != tuple(st.shape)])
        problems.append(f"{len(bad_shape)} tensor(s) with the wrong shape{hint}: {_listing(bad_shape)}")
    if bad_dtype:
        problems.append(f"{len(bad_dtype)} tensor(s) with the wrong dtype: {_listing(bad_dtype)}")
        problems += hints
    if problems:
        fmt = (f"weights {cfg.weight_dtype}, experts {cfg.expert_format}, "
               f"{cfg.num_hidden_layers} layers, {cfg.num_dspark_stages} DSpark stages")
        raise CheckpointError(
            f"{path}: checkpoint does not match its config ({fmt}):\n  " + "\n  ".join(problems) +
            f"\nFix: use the config.json that belongs to these weights (num_hidden_layers, "
            f"compress_ratios, quantization_config / expert_dtype and dspark_* keys decide the "
            f"expected tensors), or {_REGENERATE}")


def _dequant(kind: str, w: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    return dequant_fp8_blocks(w, scale, dtype) if kind == "fp8" else dequant_fp4_experts(w, scale, dtype)


def load_checkpoint(path: str, cfg: ModelConfig | None = None, dtype: torch.dtype = torch.float32,
                    device="cpu", progress: bool = True,
                    keep_quantized: bool = False) -> dict[str, torch.Tensor]:
    """Read, validate and de-quantize the checkpoint in directory `path`.

    Returns {official name: tensor} for every entry of `tensor_inventory(cfg)`: fp8 / fp4 / bf16
    weights as `dtype`, fp32 parameters as float32, the hash table as int64, all on `device`
    (`held_dtype`; unquantized tensors stored in another float dtype are cast and logged).
    `cfg` defaults to the directory's config.json. Raises CheckpointError on any mismatch.
    keep_quantized=True (opt-in): fp8 / fp4 weights are returned as stored (e4m3 codes / packed
    int8) with their `.scale` entries (e8m0) added under the official scale names.
    """
    if not os.path.isdir(path):
        raise CheckpointError(f"{path!r} is not a directory; pass the checkpoint directory that holds "
                              f"config.json and the *.safetensors files")
    raw = _check_model_type(path)
    if cfg is None:
        if raw is None:
            raise CheckpointError(f"{path}: no config.json; pass cfg= or add the checkpoint's config.json")
        try:
            cfg = ModelConfig.from_dict(raw)
        except ConfigError as e:
            raise CheckpointError(f"{path}/config.json: {e}") from None
    inventory = tensor_inventory(cfg)
    found = _headers(path, _shard_map(path))
    _validate(path, cfg, found)
    log_float_casts(path, cfg, found, dtype)

    # stored name -> logical name, and the stored names grouped by shard (one shard open at a time)
    owner = {st.name: name for name, spec in inventory.items() for st in stored_tensors(name, spec)}
    by_shard: dict[str, list[str]] = {}
    for canon, (shard, _, _, _) in found.items():
        if canon in owner:
            by_shard.setdefault(shard, []).append(canon)

    out, pending = {}, {}
    bar = tqdm(total=len(owner), desc=f"loading {os.path.basename(os.path.normpath(path))}",
               unit="tensor", disable=not progress)
    for shard in sorted(by_shard):
        bar.set_postfix_str(shard)
        with _open(path, shard) as f:
            for canon in by_shard[shard]:
                try:
                    t = f.get_tensor(found[canon][1]).to(device)
                except Exception as e:
                    raise CheckpointError(f"{os.path.join(path, shard)}: cannot read {canon} "
                                          f"({type(e).__name__}: {e}); Fix: {_REGENERATE}") from None
                name = owner[canon]
                kind = inventory[name].kind
                if kind in ("fp8", "fp4"):
                    # a weight and its scale may sit in different shards: hold the first until
                    # its partner has been read
                    pending[canon] = t
                    w, s = pending.get(name), pending.get(scale_name(name))
                    if w is not None and s is not None:
                        if keep_quantized:
                            out[name], out[scale_name(name)] = w, s
                        else:
                            out[name] = _dequant(kind, w, s, dtype)
                        del pending[name], pending[scale_name(name)]
                else:
                    out[name] = cast_float(t, held_dtype(kind, dtype), name)
                bar.update(1)
    bar.close()
    if keep_quantized:
        return {n: out[n] for name, spec in inventory.items() for n in
                ((name, scale_name(name)) if spec.kind in ("fp8", "fp4") else (name,))}
    return {name: out[name] for name in inventory}
