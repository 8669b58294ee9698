"""The one-launch MoE gate of few tokens (dspark/kernels/gate_route.py: GEMV of the 16-bit gate
weight + routing, last-arriving program routes) against the torch reference of `moe.Gate`
(linear_fp32, sqrt(softplus), top-k of scores + bias or the hash table, normalise, scale); CPU
runs the kernel in the Triton interpreter (programs one after the other: the last-arrival
pattern holds there too)."""
import triton_env  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch

from dspark.models.deepseek_v4 import norm as N
from dspark.models.deepseek_v4.moe import Gate
from triton_env import DEV, triton_ok


def make_gate(D, E, k, hashed, dtype=torch.bfloat16, seed=0, vocab=100):
    """A gate with realistic magnitudes: logits ~ N(0, 1.5²) for x ~ N(0, 1) (the normed
    hidden state), a small bias, a hash table of distinct experts per token."""
    torch.manual_seed(seed)
    g = Gate(D, E, k, 2.5, hash_vocab=vocab if hashed else 0)
    with torch.no_grad():
        g.weight.copy_(torch.randn(E, D) * (1.5 / D ** 0.5))
        if hashed:
            g.tid2eid.copy_(torch.stack([torch.randperm(E)[:k] for _ in range(vocab)]))
        else:
            g.bias.copy_(torch.randn(E) * 0.1)
    g.weight.data = g.weight.data.to(dtype)
    return g.to(DEV)


def tokens(T, D, dtype=torch.bfloat16, vocab=100):
    x = torch.randn(T, D).to(dtype).to(DEV)
    return x, torch.randint(0, vocab, (T,), device=DEV)


def gate_both_ways(g, x, tok):
    old = N.NORM_BACKEND
    try:
        with torch.no_grad():
            N.NORM_BACKEND = "reference"
            want = g(x, tok)
            N.NORM_BACKEND = "triton"
            got = g(x, tok)
    finally:
        N.NORM_BACKEND = old
    return got, want


def assert_routing(got, want):
    (gi, gw), (wi, ww) = got, want
    assert gi.dtype == torch.long and gw.dtype == torch.float32 and gi.shape == wi.shape
    assert torch.equal(gi, wi)
    torch.testing.assert_close(gw, ww, rtol=1e-5, atol=1e-6)


def counter():
    from dspark.kernels import gate_route as G
    return G._DEVICE_BUFFERS[torch.empty(0, device=DEV).device, 0]        # the main lane


@triton_ok
@pytest.mark.parametrize("hashed", [False, True])
@pytest.mark.parametrize("T", [1, 3, 16])
@pytest.mark.parametrize("E,k", [(16, 2), (256, 6)])
def test_gate_route_equals_reference(hashed, T, E, k):
    g = make_gate(256, E, k, hashed, seed=T + E + hashed)
    x, tok = tokens(T, 256)
    assert_routing(*gate_both_ways(g, x, tok))


@triton_ok
@pytest.mark.parametrize("hashed", [False, True])
def test_gate_route_full_size(hashed):
    """The V4 gate shape: D = 4096, E = 256, k = 6, one token."""
    g = make_gate(4096, 256, 6, hashed, seed=11)
    x, tok = tokens(1, 4096)
    assert_routing(*gate_both_ways(g, x, tok))


@triton_ok
@pytest.mark.parametrize("block", [(64, 1), (16, 2, 4, False), (16, 2, 4, True), (32, 8, 4, False),
                                   (32, 8, 4, True)])
@pytest.mark.parametrize("D", [384, 200])
def test_gate_route_blocks_and_logits(block, D):
    """Expert blocks past E (masked), one split (logits stored directly) or several (summed by
    the last program, or per expert block by that block's last split: BY_BLOCK), D not a
    multiple of the 128-column tile; the logits it returns."""
    from dspark.kernels.gate_route import gate_route
    g = make_gate(D, 48, 6, False, seed=D)
    x, _ = tokens(5, D)
    with torch.no_grad():
        want = g.weight.float()
        want_logits = x.float() @ want.t()
        idx, w, logits = gate_route(x, g.weight, 6, 2.5, bias=g.bias.float(), block=block)
        ref_i, ref_w = gate_both_ways(g, x, torch.zeros(5, dtype=torch.long, device=DEV))[1]
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert_routing((idx, w), (ref_i, ref_w))
    assert not counter().any()


@triton_ok
@pytest.mark.parametrize("hashed", [False, True])
def test_counter_rearmed(hashed):
    """The arrival counter is back at zero after each launch, and a second launch (new inputs,
    same buffers) routes correctly."""
    g = make_gate(256, 64, 6, hashed, seed=3)
    for T in (3, 3, 1):
        x, tok = tokens(T, 256)
        assert_routing(*gate_both_ways(g, x, tok))
        assert not counter().any()


@triton_ok
def test_gate_forward_picks_the_fused_kernel(monkeypatch):
    """Fused backend + 16-bit weight + x of the weight's dtype + few tokens: gate_route; more
    tokens or an fp32 weight: the GEMM and decode_fused.route; reference backend: torch."""
    from dspark.kernels import decode_fused, gate_route
    calls = []
    for mod, name in ((gate_route, "gate_route"), (decode_fused, "route")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name,
                            lambda *a, _real=real, _name=name, **kw: calls.append(_name)
                            or _real(*a, **kw))

    def path(g, T, dtype=torch.bfloat16, backend="triton"):
        calls.clear()
        x, tok = tokens(T, 256, dtype)
        old = N.NORM_BACKEND
        try:
            N.NORM_BACKEND = backend
            with torch.no_grad():
                g(x, tok)
        finally:
            N.NORM_BACKEND = old
        return calls[:]

    g = make_gate(256, 16, 2, False)
    assert path(g, 2) == ["gate_route"]
    assert path(g, gate_route.MAX_T) == ["gate_route"]
    assert path(g, gate_route.MAX_T + 1) == ["route"]
    assert path(g, 2, torch.float32) == ["route"]               # x not in the weight's dtype
    assert path(g, 2, backend="reference") == []
    g32 = make_gate(256, 16, 2, True, dtype=torch.float32)
    assert path(g32, 2, torch.float32) == ["route"]             # fp32 weight
    with torch.enable_grad():                                   # autograd: the torch path
        calls.clear()
        old = N.NORM_BACKEND
        try:
            N.NORM_BACKEND = "triton"
            g(*tokens(2, 256))
        finally:
            N.NORM_BACKEND = old
        assert calls == []


@triton_ok
def test_gate_route_fp16():
    g = make_gate(256, 32, 4, False, dtype=torch.float16, seed=4)
    x, tok = tokens(4, 256, torch.float16)
    assert_routing(*gate_both_ways(g, x, tok))
