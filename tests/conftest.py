"""Shared fixtures: small random checkpoints in the official layout, made once per test run."""
import os
import sys

import pytest

# Triton kernels run in the interpreter on CPU-only machines; this must be set before triton is
# first imported anywhere.
try:
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # the reference path runs many small ops; intra-op threads cost more than they gain there
    torch.set_num_threads(1)
except ImportError:
    pass

sys.path.insert(0, os.path.dirname(__file__))   # test utilities such as hf_oracle

# interpreted Triton (CPU): skip the interpreter's repeated no-op re-patching of triton.language
# inside a kernel run (~25-30% of interpreted kernel time; results unchanged, see the module doc;
# DSPARK_FAST_INTERP=0 turns it off). A no-op where Triton is compiled (CUDA).
import interp_fastpath  # noqa: E402
interp_fastpath.install()

from dspark.tools.make_checkpoint import make_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """Small element-wise tensors: the intra-op thread pool only adds wake-up latency. (Restores
    the count afterwards: an Engine earlier in the test run may have changed it.)"""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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


@pytest.fixture(scope="session")
def small_vocab_ckpt(tmp_path_factory):
    """Tiny architecture with an 8-token vocabulary: random drafts are right often enough to
    exercise partial acceptance, and output distributions can be enumerated exactly."""
    out = str(tmp_path_factory.mktemp("vocab8"))
    make_checkpoint(out, preset="tiny", seed=2, dspark=True, vocab=8, progress=False)
    return out


def pytest_runtest_logreport(report):
    """DSPARK_INSTAFAIL=1: print a failing test's traceback the moment it fails (time-boxed GPU
    runs may be cut off before pytest's end-of-run summary)."""
    if report.failed and os.environ.get("DSPARK_INSTAFAIL") == "1":
        print(f"\n=== FAILED {report.nodeid} ({report.when}) ===\n{report.longreprtext[-3000:]}\n",
              flush=True)
