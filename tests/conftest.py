"""Shared fixtures: small random checkpoints in the official layout, made once per session."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))   # test utilities such as hf_oracle

from dspark.tools.make_checkpoint import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Spec §9 tiny config (every layer type within ~70 tokens), bf16 storage, DSpark stages."""
    out = str(tmp_path_factory.mktemp("tiny"))
    make_checkpoint(out, preset="tiny", seed=0, dspark=True, progress=False)
    return out


@pytest.fixture(scope="session")
def tiny_quant_ckpt(tmp_path_factory):
    """Same architecture stored as FP8 block-scaled weights + FP4 experts; swiglu clamp 0.5."""
    out = str(tmp_path_factory.mktemp("tiny_fp8"))
    make_checkpoint(out, preset="tiny", seed=1, dtype="fp8", fp4_experts=True, dspark=True,
                    overrides={"swiglu_limit": 0.5}, progress=False)
    return out
