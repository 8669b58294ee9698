"""dspark.kernels.gumbel.gumbel_argmax (the deterministic mode's sampler on CUDA) against the
per-row torch sampler `spec.gumbel.gumbel_token`: the same key hash, noise and tie rule, so the
same tokens; splits of V, strided and 16-bit rows, greedy rows, negative seeds and positions past
2**32. Without CUDA the kernel runs under TRITON_INTERPRET=1 with 64-wide blocks (rows span
several blocks and several splits)."""
from triton_env import DEV, triton_ok  # noqa: F401 (before triton)

import pytest  # noqa: E402
import torch  # noqa: E402

from dspark.kernels.gumbel import gumbel_argmax  # noqa: E402
from dspark.spec.gumbel import gumbel_draws, gumbel_noise, gumbel_token  # noqa: E402

pytestmark = [triton_ok, pytest.mark.usefixtures("one_thread")]


def _case(gen, n, v, dtype=torch.float32):
    x = (torch.randn(n, v, generator=gen) * 3).to(dtype)
    temps = torch.tensor([[0.0, 1.0, 0.7, 1.3, 2.0][i % 5] for i in range(n)])
    seeds = torch.randint(-2 ** 62, 2 ** 62, (n,), generator=gen)
    pos = torch.randint(0, 2 ** 40, (n,), generator=gen)
    return x, temps, seeds, pos


def _want(x, temps, seeds, pos):
    return [int(gumbel_token(x[i].to(DEV), float(temps[i]), 0, 1.0, int(seeds[i]), int(pos[i])))
            for i in range(x.shape[0])]


@pytest.mark.parametrize("n,v", [(1, 7), (5, 64), (3, 200), (6, 1000), (40, 129)])
def test_tokens_are_the_per_row_sampler_tokens(n, v):
    gen = torch.Generator().manual_seed(n * 1000 + v)
    x, temps, seeds, pos = _case(gen, n, v)
    got = gumbel_argmax(x.to(DEV), temps.to(DEV), seeds.to(DEV), pos.to(DEV))
    assert got.dtype == torch.int64 and got.tolist() == _want(x, temps, seeds, pos)


def test_strided_and_16_bit_rows():
    gen = torch.Generator().manual_seed(7)
    x, temps, seeds, pos = _case(gen, 6, 300, torch.bfloat16)
    wide = torch.zeros(6, 2, 300, dtype=torch.bfloat16)
    wide[:, 1] = x
    rows = wide[:, 1].to(DEV)                     # row stride 600
    assert not rows.is_contiguous()
    got = gumbel_argmax(rows, temps.to(DEV), seeds.to(DEV), pos.to(DEV))
    assert got.tolist() == _want(x.float(), temps, seeds, pos)


def test_a_row_does_not_depend_on_its_batch():
    """Each row alone gives the token it gets among 11 others (the splits of V change with N)."""
    gen = torch.Generator().manual_seed(11)
    x, temps, seeds, pos = _case(gen, 12, 700)
    d = lambda t: t.to(DEV)  # noqa: E731
    batch = gumbel_argmax(d(x), d(temps), d(seeds), d(pos)).tolist()
    alone = [int(gumbel_argmax(d(x[i:i + 1]), d(temps[i:i + 1]), d(seeds[i:i + 1]),
                               d(pos[i:i + 1]))[0]) for i in range(12)]
    assert batch == alone


def test_ties_go_to_the_lowest_index_and_greedy_is_the_argmax():
    x = torch.zeros(2, 150)
    x[0, [40, 90, 140]] = 5.0            # greedy: three equal maxima in different blocks
    x[1] = float("-inf")
    x[1, 100] = 1.0                      # sampled: one finite logit wins whatever the noise
    got = gumbel_argmax(x.to(DEV), torch.tensor([0.0, 1.0], device=DEV),
                        torch.tensor([3, 4], device=DEV), torch.tensor([5, 6], device=DEV))
    assert got.tolist() == [40, 100]


def test_the_draft_pass_sampler_draws_the_same_tokens():
    """gumbel_draws without filters (the kernel on CUDA, the torch ops on CPU)."""
    gen = torch.Generator().manual_seed(5)
    x, temps, seeds, pos = _case(gen, 8, 500)
    got = gumbel_draws(x.to(DEV), temps.to(DEV), None, None, seeds.to(DEV), pos.to(DEV))
    assert got.tolist() == _want(x, temps, seeds, pos)


def test_noise_is_the_torch_noise():
    """The kernel's scores at temperature 1 on a zero row are the noise itself: its argmax is
    gumbel_noise's."""
    for seed, p in [(0, 0), (-5, 2 ** 35), (2 ** 63 - 1, 17)]:
        want = int(gumbel_noise(seed, p, 333).argmax())
        got = gumbel_argmax(torch.zeros(1, 333, device=DEV), torch.ones(1, device=DEV),
                            torch.tensor([seed], device=DEV), torch.tensor([p], device=DEV))
        assert int(got[0]) == want
