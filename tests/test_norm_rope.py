"""Fused RMSNorm + RoPE kernel (dspark/kernels/norm_rope.py) against the model's torch composition
(dspark/models/deepseek_v4/fused.norm_rope with the reference backend), for every way the decode
path uses it; CPU runs the kernel in the Triton interpreter."""
import triton_env  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch

from dspark.models.deepseek_v4 import norm as N
from dspark.models.deepseek_v4.fused import norm_rope
from dspark.models.deepseek_v4.norm import RMSNorm
from dspark.models.deepseek_v4.rope import Rope
from triton_env import DEV, triton_ok

YARN = dict(factor=16.0, original_seq_len=65536, beta_fast=32.0, beta_slow=1.0)


def backend(name):
    class Ctx:
        def __enter__(self):
            self.old, N.NORM_BACKEND = N.NORM_BACKEND, name

        def __exit__(self, *exc):
            N.NORM_BACKEND = self.old
    return Ctx()


def both(fn):
    with backend("reference"):
        want = fn()
    with backend("triton"):
        got = fn()
    return got, want


def assert_rounding_close(got, want):
    """Same dtype and shape; values equal up to one rounding step of the output dtype, and equal
    on most elements (only the sum-of-squares order and the rsqrt differ)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.double(), want.double()
    ulp = 2.0 ** -7 if want.dtype == torch.bfloat16 else 1e-5
    assert ((g - w).abs() <= ulp * w.abs() + 1e-6).all(), (g - w).abs().max()
    assert (g != w).double().mean() <= (0.02 if want.dtype == torch.bfloat16 else 1.0)


def make_norm(D, dtype, seed=0):
    torch.manual_seed(seed)
    norm = RMSNorm(D, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D) * 0.5 + 1)
    return norm.to(dtype).to(DEV)


@triton_ok
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_module(dtype):
    norm = make_norm(320, dtype)
    x = (torch.randn(5, 320) * 3).to(dtype).to(DEV)
    with torch.no_grad():
        got, want = both(lambda: norm(x))
    assert_rounding_close(got, want)


@triton_ok
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inverse", [False, True])
def test_norm_rope_every_decode_use(dtype, inverse):
    rope = Rope(64, 160000.0, YARN)
    T, H, D = 3, 4, 512
    pos = torch.tensor([5, 130, 4097], device=DEV)
    norm = make_norm(D, dtype, seed=1)
    q = (torch.randn(T, H, D) * 2).to(dtype).to(DEV)
    kv = (torch.randn(T, D) * 2).to(dtype).to(DEV)
    o32 = torch.randn(T, H, D, device=DEV)                 # fp32 attention output
    qi = torch.randn(T, 16, 128).to(dtype).to(DEV)
    memo = {}
    cases = {
        "q head norm + rope": lambda: norm_rope(q, rope, pos, "unweighted", 1e-6, inverse,
                                                bound=5000, memo=memo),
        "kv norm + rope": lambda: norm_rope(kv, rope, pos, norm, inverse=inverse, bound=5000),
        "entry cast + norm + rope": lambda: norm_rope(o32[:, 0], rope, pos, norm,
                                                      inverse=inverse, dtype=dtype),
        "output cast + rope": lambda: norm_rope(o32, rope, pos, inverse=inverse, dtype=dtype),
        "indexer rope -> fp32": lambda: norm_rope(qi, rope, pos, inverse=inverse,
                                                  out_dtype=torch.float32),
        "norm only": lambda: norm_rope(q, None, pos, "unweighted", 1e-6),
    }
    with torch.no_grad():
        for name, fn in cases.items():
            got, want = both(fn)
            assert_rounding_close(got, want)


@triton_ok
@pytest.mark.parametrize("inverse", [False, True])
def test_draft_rope_through_the_fused_kernel(inverse, monkeypatch):
    """The drafter's DraftRope (its own tables, a host-side bound inside `bounded`) takes the
    fused kernel like the layers' Rope: the same values as its torch composition, with the
    bound from the `bounded` block (the kernel gathers the rows) and without one (rows gathered
    first)."""
    from dspark.models.drafter import DraftRope
    rope = DraftRope(Rope(64, 160000.0, YARN))
    T, H, D = 5, 4, 512
    pos = torch.tensor([0, 7, 127, 128, 300], device=DEV)
    norm = make_norm(D, torch.bfloat16, seed=2)
    q = (torch.randn(T, H, D) * 2).bfloat16().to(DEV)
    kv = (torch.randn(T, D) * 2).bfloat16().to(DEV)
    o32 = torch.randn(T, H, D, device=DEV)
    cases = {
        "q head norm + rope": lambda: norm_rope(q, rope, pos, "unweighted", 1e-6, inverse),
        "kv norm + rope": lambda: norm_rope(kv, rope, pos, norm, inverse=inverse),
        "output cast + rope": lambda: norm_rope(o32, rope, pos, inverse=inverse,
                                                dtype=torch.bfloat16),
    }
    from dspark.kernels import norm_rope as kernel
    launches, launch = [], kernel.norm_rope

    def counted(*args, **kwargs):
        launches.append(kwargs.get("positions") is not None)
        return launch(*args, **kwargs)
    monkeypatch.setattr(kernel, "norm_rope", counted)
    with torch.no_grad():
        for name, fn in cases.items():
            got, want = both(fn)
            assert launches == [False], (name, launches)  # the kernel ran, rows gathered first
            assert_rounding_close(got, want)
            launches.clear()
            with rope.bounded(512, DEV):
                got_b, want_b = both(fn)
            assert launches == [True], (name, launches)   # the kernel gathers the rows
            launches.clear()
            assert_rounding_close(got_b, want_b)
            assert torch.equal(got_b, got), name         # the same rows either way
    # the drafter's tables against the layers' own Rope (tables built independently)
    plain = Rope(64, 160000.0, YARN)
    with torch.no_grad(), backend("reference"):
        assert_rounding_close(norm_rope(kv, rope, pos, norm, inverse=inverse),
                              norm_rope(kv, plain, pos, norm, inverse=inverse))


@triton_ok
def test_strided_rows_and_grad_fallback():
    rope = Rope(64, 10000.0)
    big = torch.randn(4, 2 * 256).bfloat16().to(DEV)
    x = big[:, :256]                                       # row stride 512, last dim contiguous
    pos = torch.arange(4, device=DEV)
    norm = make_norm(256, torch.bfloat16)
    with torch.no_grad():
        got, want = both(lambda: norm_rope(x, rope, pos, norm))
    assert_rounding_close(got, want)
    # with autograd wanted the torch path runs (no backward in the kernel)
    with backend("triton"):
        y = norm_rope(x.float().requires_grad_(), rope, pos, norm.float())
    assert y.requires_grad


@pytest.fixture(scope="module")
def tiny3_ckpt(tmp_path_factory):
    """The tiny config cut to its first 3 layers, compress ratios (0, 4, 16): one layer of each
    type (SWA, CSA + indexer, HCA), hash and routed MoE. Layers 4-6 of the full tiny model
    repeat these types, so they would only run the same norm / RoPE call sites again; in the
    interpreter every (token, head) row is one program, so the cost is ~ layers x tokens."""
    from dspark.tools.make_checkpoint import make_checkpoint
    out = str(tmp_path_factory.mktemp("tiny3"))
    make_checkpoint(out, preset="tiny", layers=3, seed=0, progress=False)
    return out


@triton_ok
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_model_forward_with_fused_norms(tiny3_ckpt, dtype):
    """The tiny model's dense forward (every layer type) with the fused kernel for every norm /
    RoPE == the torch composition. (Without the fp8 / fp4 quantisation simulation: on these
    random weights a last-bit difference that flips one fp8 rounding moves the logits by ~10%.)
    The first 3 layers run every call site of the kernel that all 6 do (RMSNorm, q head norm +
    RoPE, kv norm + RoPE, entry + indexer key norm + RoPE, indexer query RoPE, inverse output
    RoPE). 40 tokens: 10 ratio-4 entries, so the top-k selection (index_topk 4) bites for most
    queries; an indexer query RoPE one position off shows only through that selection, and with
    ~20 tokens it went unnoticed."""
    from paged_helpers import dense_runner, load_model
    model = load_model(tiny3_ckpt, dtype, device=DEV)    # (CUDA: the compiled kernel needs
    assert set(model.cfg.compress_ratios) == {0, 4, 16}
    toks = [(11 * i + 5) % model.cfg.vocab_size for i in range(40)]   # device tensors)

    def run():
        r = dense_runner(model, quant=False, device=DEV)
        return r.target_forward([(r.new_states()[0], 0, toks)])[0]
    got, want = both(run)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= (2e-2 if dtype == "bf16" else 1e-5), err


@triton_ok
@pytest.mark.parametrize("inverse", [False, True])
def test_kernel_gathers_table_rows_like_rows(inverse):
    """With a host bound the kernel reads cis[positions[t]] from the whole table itself (no
    gather launch): bit-identical to passing the gathered rows."""
    from dspark.kernels import norm_rope as K
    rope = Rope(64, 160000.0, YARN)
    pos = torch.tensor([7, 0, 4099, 31], device=DEV)
    x = (torch.randn(4, 8, 192) * 2).bfloat16().to(DEV)
    with torch.no_grad():
        rows = K.norm_rope(x, None, 1e-6, rope.rows(pos, x.device, inverse, 5000), 64)
        table = K.norm_rope(x, None, 1e-6, rope.table(5000, x.device, inverse), 64,
                            positions=pos)
    assert torch.equal(rows, table)
    other = K.norm_rope(x, None, 1e-6, rope.table(5000, x.device, inverse), 64,
                        positions=pos + 1)
    assert not torch.equal(rows, other)


@triton_ok
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_per_head_weights(dtype):
    """weight [H, D]: head h normalised with its own row (the drafter's context write: every
    stage's kv_norm + RoPE in one launch), as the torch composition of H separate norms, on
    strided rows of one GEMM output."""
    from dspark.kernels import norm_rope as kernel
    H, D = 3, 96
    norms = [make_norm(D, dtype, seed=h) for h in range(H)]
    rope = Rope(32, 10000.0)
    torch.manual_seed(4)
    y = (torch.randn(7, H * D + 5) * 3).to(dtype).to(DEV)[:, :H * D].view(7, H, D)
    pos = torch.tensor([0, 3, 9, 130, 17, 5, 2], device=DEV)
    w = torch.stack([n.weight.detach() for n in norms])
    with torch.no_grad():
        got = kernel.norm_rope(y, w, 1e-6, rope.table(200, DEV), 32, dtype, positions=pos)
        with backend("reference"):
            want = torch.stack([norm_rope(y[:, h], rope, pos, norms[h]) for h in range(H)], 1)
    assert_rounding_close(got, want)
