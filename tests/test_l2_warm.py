"""kernels/l2_warm.py (opt-in DSPARK_L2_WARM=1): the warm kernel reads every word it is given
(the per-program XORs fold to the XOR of the whole range), stops at the byte limit, and the
decode-step hook does nothing unless enabled on CUDA. Its effect (L2 hits of the GEMV after it)
is a GPU timing question: `bench_decode_v4.py` with DSPARK_L2_WARM=1 against 0.
"""
from triton_env import DEV, needs_cuda, triton_ok  # noqa: F401 (before triton)

import functools  # noqa: E402
import operator  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from dspark.kernels import l2_warm  # noqa: E402


def _xor_all(words: torch.Tensor) -> int:
    return functools.reduce(operator.xor, words.tolist(), 0)


@triton_ok
def test_warm_reads_every_word_up_to_the_limit():
    gen = torch.Generator().manual_seed(0)
    t = torch.randint(-2 ** 31, 2 ** 31 - 1, (3 * l2_warm.BLOCK + 17,), generator=gen,
                      dtype=torch.int32).to(DEV)
    sink = l2_warm.warm(t.view(torch.uint8).view(torch.bfloat16))   # any 16-bit / byte dtype
    assert _xor_all(sink.cpu()) == _xor_all(t.cpu())
    sink = l2_warm.warm(t, limit=4 * 100 + 3)                       # whole words under the limit
    assert _xor_all(sink.cpu()) == _xor_all(t[:100].cpu())


def test_hook_off_unless_enabled_on_cuda(monkeypatch):
    lin = torch.nn.Linear(8, 8)
    assert l2_warm.warm_ahead((lin,), torch.device("cpu")) is None
    monkeypatch.setenv("DSPARK_L2_WARM", "0")
    assert l2_warm.warm_ahead((lin,), torch.device("cuda")) is None
    monkeypatch.setenv("DSPARK_L2_WARM", "1")
    monkeypatch.setenv("DSPARK_L2_WARM_MB", "0.5")
    assert l2_warm.max_bytes() == 1 << 19


@pytest.mark.gpu
@needs_cuda
def test_engine_greedy_identical_with_warm_gpu(monkeypatch):
    """The shipped pair through the Engine with target graphs: DSPARK_L2_WARM=1 == off (the
    warm lane reads and writes nothing the step uses)."""
    from dspark import Engine, SamplingParams
    prompts = ["def fibonacci(n):\n", "class Stack:\n    def "]
    outs = {}
    for on in ("0", "1"):
        monkeypatch.setenv("DSPARK_L2_WARM", on)
        eng = Engine(device=DEV, dtype="bf16", target_cuda_graphs=True, max_num_seqs=2)
        res = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
        outs[on] = [o.token_ids for o in res]
    assert outs["1"] == outs["0"]
