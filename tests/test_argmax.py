"""kernels/argmax.py (the decode graph's row argmax on CUDA) == torch's argmax(-1): first index
on ties (within and across chunks), NaN the maximum (first one wins), -0.0 equal to +0.0,
all -inf rows, the last column, 16-bit inputs; under the interpreter on CPU."""
from triton_env import DEV, triton_ok  # noqa: F401 (before triton)

import pytest  # noqa: E402
import torch  # noqa: E402

from dspark.kernels.argmax import row_argmax  # noqa: E402


def _cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (8, 9000), generator=g).float()     # many ties per row
    x[0, 5000] = x[0, 8500] = 10.0                                # tie across chunks
    x[1, 4100] = x[1, 4095] = 11.0                                # ... either side of a border
    x[2, 7] = x[2, 6000] = float("nan")
    x[2, 1] = float("inf")
    x[3] = -0.0
    x[3, 6000:] = 0.0                                             # +0.0 after -0.0: first wins
    x[4] = float("-inf")
    x[5, 8999] = 99.0                                             # last column
    x[6] = -torch.rand(9000, generator=g)                         # all negative
    x[6, 4321] = -1e-30
    return x


@triton_ok
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_equals_torch(dtype):
    x = _cases().to(dtype)
    want = x.argmax(-1)
    got = row_argmax(x.to(DEV)).cpu()
    assert got.dtype == torch.long and torch.equal(got, want), (got, want)
    assert want[0] == 5000 and want[1] == 4095 and want[2] == 7 and want[3] == 0


@triton_ok
def test_row_argmax_small_vocab_and_out_buffer():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 1001, generator=g)                         # one chunk, partial
    out = torch.full((5,), -7, dtype=torch.long, device=DEV)
    row_argmax(x.to(DEV), out=out[:3])
    assert torch.equal(out[:3].cpu(), x.argmax(-1)) and (out[3:] == -7).all()
