"""Attention backends: the registry, and the Triton backend against the reference backend.

Without CUDA the Triton kernels run under TRITON_INTERPRET=1 (set here before triton is first
imported, as tests/test_kernels.py does); if triton was imported earlier without it, or the
kernels are missing, the Triton tests skip with the reason. Interpreted kernels are slow, so the
shapes stay small: the cache is filled through the (fast) reference backend, then both backends
act on identical copies of that state.
"""
import copy
import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dspark.attention import available_backends, get_backend  # noqa: E402
from dspark.models.deepseek_v4.model import Batch  # noqa: E402
from paged_helpers import load_model, paged_runner, rel_err, row_rel_err  # noqa: E402


def _triton_reason():
    try:
        import triton
        get_backend("triton")
    except ImportError as e:
        return f"triton backend not importable: {e}"
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if not torch.cuda.is_available() and not (
            interp and type(triton.language.zeros).__name__ == "InterpretedFunction"):
        return "needs CUDA, or TRITON_INTERPRET=1 set before triton is first imported"
    return None


REASON = _triton_reason()
needs_triton = pytest.mark.skipif(REASON is not None, reason=str(REASON))


def test_registry_names_and_errors():
    assert available_backends() == ["flashmla", "reference", "triton"]
    with pytest.raises(ValueError, match="available: flashmla, reference, triton"):
        get_backend("flashinfer")


def test_reference_backend_does_not_import_triton():
    code = ("import sys, dspark.attention as A, dspark.runner; A.get_backend('reference'); "
            "assert 'triton' not in sys.modules, 'triton imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---- triton vs reference ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt)


SEQS = {0: [(7 * i + 3) % 1024 for i in range(24)], 1: [(11 * i + 5) % 1024 for i in range(12)]}


def filled(model, kv_dtype):
    """A paged runner whose cache holds request 0 at 20 positions (ring wrapped, CSA entries
    0..4, HCA entry 0) and request 1 at 6, written through the reference backend."""
    runner, cache = paged_runner(model, kv_dtype, lookahead=3)
    for r, n in ((0, 20), (1, 6)):
        cache.add_request(r)
        cache.reserve(r, 24)
    runner.target_forward([(0, 0, SEQS[0][:13]), (1, 0, SEQS[1][:6])])
    runner.target_forward([(0, 13, SEQS[0][13:20])])
    return runner, cache


NEXT = [(0, 20, SEQS[0][20:24]), (1, 6, SEQS[1][6:8])]   # a verify block and a 2-token chunk


@needs_triton
@pytest.mark.parametrize("kv_dtype", ["fp8", "fp32"])
def test_triton_model_logits_match_reference(model, kv_dtype):
    ref_runner, cache = filled(model, kv_dtype)
    tri_runner = copy.copy(ref_runner)
    tri_runner.backend = get_backend("triton")(copy.deepcopy(cache))
    want, _ = ref_runner.target_forward(NEXT)
    got, _ = tri_runner.target_forward(NEXT)
    # fp32: kernel vs torch summation order only. fp8: entries/keys emitted in this forward are
    # re-rounded to FP8/FP4 from inputs that differ in the last bits, so allow a little more.
    assert row_rel_err(got, want).max() <= (1e-4 if kv_dtype == "fp32" else 2e-3)


@needs_triton
@pytest.mark.parametrize("kv_dtype", ["fp8", "fp32"])
def test_triton_layer_ops_match_reference_on_identical_inputs(model, kv_dtype):
    _, cache = filled(model, kv_dtype)
    ref, tri = get_backend("reference")(cache), get_backend("triton")(cache)
    md = ref.plan(Batch.build(NEXT, "cpu"))
    T, H = md.positions.shape[0], model.cfg.num_attention_heads
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(T, 512, generator=g)
    # store: byte-identical pools (fp8: fused quantize-and-write vs layouts.py)
    for layer, pool, N, width in ((1, cache.swa[1], cache.capacity, 512),
                                  (1, cache.entries[1], 4, 512), (3, cache.index_keys[3], 4, 128)):
        ids = torch.tensor([5, 0, 17, 9])
        x = torch.randn(4, width, generator=g) * 4
        a, b = pool.clone(), pool.clone()
        ref.store(a, N, ids, x)
        tri.store(b, N, ids, x)
        assert torch.equal(a, b) and not torch.equal(a, pool), layer
    ref.write_window(md, 1, kv)          # stage this forward's window rows for both
    ref.write_window(md, 2, kv)
    # select: same chosen entries (compared by score, so that ties cannot matter)
    qi = torch.randn(T, 16, 128, generator=g)
    wi = torch.randn(T, 16, generator=g)
    s_ref, s_tri = ref.select(md, 1, qi, wi, 4), tri.select(md, 1, qi, wi, 4)
    assert ((s_ref >= 0).sum(1) == torch.clamp(md.ratios[4].n_visible, max=4)).all()
    assert torch.equal(torch.sort(s_ref, 1).values, torch.sort(s_tri, 1).values)
    # sparse attention over window ∪ entries: SWA layer 0, CSA layer 1 (selected), HCA layer 2
    q = torch.randn(T, H, 512, generator=g)
    sink = torch.randn(H, generator=g)
    for layer, sel in ((0, None), (1, s_ref), (2, None)):
        lists = ref.entry_lists(md, layer, sel)
        args = (md, q, cache.swa[layer], cache.capacity, md.window_ids, *lists, sink, 512 ** -0.5)
        assert rel_err(tri.sparse_mqa(*args), ref.sparse_mqa(*args)) <= 1e-5, layer
