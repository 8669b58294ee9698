"""The checkpoint directory: where the shipped model lives, what config.json says the model is,
a clear error for a path that is not a checkpoint directory, and the optional files beside the
weights (tokenizer, the confidence head's calibration)."""
from __future__ import annotations

import json
import os


def default_model_path() -> str:
    return os.path.join(os.path.dirname(__file__), "assets", "default")


def read_model_type(path: str) -> str | None:
    """config.json's model_type, or None when unreadable (the DeepSeek-V4 loader then reports)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def check_model_dir(path: str) -> None:
    """A clear error for a path that is not a local checkpoint directory (e.g. a hub id)."""
    if os.path.isdir(path):
        return
    parts = str(path).split("/")
    if not os.path.exists(path) and len(parts) == 2 and all(parts) and not path.startswith("."):
        raise ValueError(
            f"{path!r} is not a local directory. It looks like a Hugging Face Hub id, and dspark "
            f"loads checkpoints from disk only: download it first, e.g. `huggingface-cli download "
            f"{path} --local-dir ./{parts[1]}`, then pass that directory (Engine('./{parts[1]}'))")
    what = "does not exist" if not os.path.exists(path) else "is a file, not a directory"
    raise ValueError(f"{path!r} {what}: pass the checkpoint directory (config.json, "
                     f"*.safetensors, tokenizer.json)")


def load_sts(path: str):
    """The confidence head's calibration table (spec/calibrate.py) saved beside the weights, or
    None."""
    from .spec.calibrate import STS_FILENAME, load_sts as load
    fn = os.path.join(path, STS_FILENAME)
    return load(fn) if os.path.exists(fn) else None


def load_tokenizer(path: str):
    """tokenizer.json + tokenizer_config.json (special tokens, chat template), or None."""
    from .tokenizer import Tokenizer
    return Tokenizer.from_dir(path)


def weight_format_for(path: str, choice: str = "auto") -> str:
    """The benchmarks' weight format for checkpoint `path`: `choice` unless "auto", then
    "quantized" for a checkpoint with a quantization_config (FP8 / FP4 kept as stored), else
    "bf16"."""
    if choice != "auto":
        return choice
    try:
        with open(os.path.join(path, "config.json")) as f:
            return "quantized" if json.load(f).get("quantization_config") else "bf16"
    except (OSError, ValueError):
        return "bf16"
