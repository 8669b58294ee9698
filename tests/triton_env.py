"""Triton test environment shared by the kernel tests: import this before anything imports triton.

Without CUDA the kernels run under TRITON_INTERPRET=1 on small shapes. Triton reads that variable
when it is imported (its own tl.* helpers are @jit functions too), so it is set here first; if
triton was imported earlier in this process without it, Triton tests skip with that reason (set
TRITON_INTERPRET=1 in the environment or in tests/conftest.py then). GPU-sized comparisons are
marked ``gpu`` and skip without CUDA.
"""
import os
import sys

import torch

HAS_CUDA = torch.cuda.is_available()
TRITON_PREIMPORTED = "triton" in sys.modules
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# triton's own @jit helpers (tl.zeros, tl.sum, ...) are interpretable only if TRITON_INTERPRET was
# set when triton was imported
_interp_usable = INTERPRET and type(triton.language.zeros).__name__ == "InterpretedFunction"
SKIP_REASON = ("needs CUDA, or TRITON_INTERPRET=1 set before triton is first imported "
               f"(triton already imported: {TRITON_PREIMPORTED})")
DEV = "cuda" if HAS_CUDA else "cpu"
triton_ok = pytest.mark.skipif(not (HAS_CUDA or _interp_usable), reason=SKIP_REASON)
# CPU-side launch censuses run CUDA's kernel choices through the interpreter on CPU tensors
interpreter_ok = pytest.mark.skipif(not _interp_usable, reason="runs the kernels on CPU under "
                                    "TRITON_INTERPRET=1 (set before triton is first imported)")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
