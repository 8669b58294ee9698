"""dspark/compile_stats.py: Engine.compile_stats() counts Triton compiles, CUDA-graph captures and
eager fallbacks (by reason) of graph-capable steps; the Triton hook is Triton's own."""
import triton_env  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)
import torch

from dspark import Engine, SamplingParams
from dspark.compile_stats import delta, install_triton_hook, total, triton_compiles
from dspark.models.deepseek_v4.graph import V4DecodeGraphs, reserve_scratch
from triton_env import gpu, needs_cuda


def test_target_graph_fallbacks_are_counted_by_reason(tiny_ckpt):
    """Steps the V4 target graphs cannot take return None (the caller runs them eagerly) and
    are counted under why: a prompt chunk, ragged verify lengths, a batch past the largest
    bucket, a duplicated request, a set disabled by a failed capture."""
    eng = Engine(tiny_ckpt, device="cpu", dtype="fp32", max_num_seqs=4, num_kv_blocks=8)
    assert eng.compile_stats()["eager_fallbacks"] == {}
    r = eng.runner
    reserve_scratch(eng.cache)
    g = V4DecodeGraphs(r.model, eng.cache, "triton", q_lens=range(1, r.drafter.gamma + 2),
                       max_batch=2, tap_layers=r.tap_layers, capture=False)
    r.target_graphs = g
    for rid in ("a", "b", "c"):
        eng.cache.add_request(rid)
        eng.cache.reserve(rid, 40)
    steps = {"prefill / mixed step": [("a", 0, list(range(20)))],
             "ragged lengths": [("a", 0, [1, 2]), ("b", 0, [1, 2, 3])],
             "batch too large": [("a", 0, [1]), ("b", 0, [1]), ("c", 0, [1])],
             "duplicate request": [("a", 0, [1]), ("a", 0, [2])]}
    for reason, items in steps.items():
        assert g.run(items) is None, reason
    g.disabled = True
    assert g.run([("a", 0, [1])]) is None
    stats = eng.compile_stats()
    want = {f"target: {k}": 1 for k in list(steps) + ["capture failed"]}
    assert stats["eager_fallbacks"] == want
    assert stats["graph_captures"] == 0
    assert total(delta(stats, {"triton_compiles": stats["triton_compiles"], "graph_captures": 0,
                               "eager_fallbacks": {}})) == 5
    # another engine keeps its own counts
    assert Engine(tiny_ckpt, device="cpu", dtype="fp32").compile_stats()["eager_fallbacks"] == {}


def test_triton_hook_is_installed_in_tritons_slot():
    """The counter sits in the hook Triton calls after every JIT compile (Triton >= 3.4:
    knobs.runtime.jit_post_compile_hook) and counts one per call."""
    import triton
    assert install_triton_hook() and install_triton_hook()        # idempotent
    hook = triton.knobs.runtime.jit_post_compile_hook
    assert callable(hook)
    before = triton_compiles()
    hook(key=None, repr="k", fn=None, compile={}, is_manual_warmup=False, already_compiled=False)
    assert triton_compiles() == before + 1
    assert triton.knobs.runtime.jit_post_compile_hook is hook     # installed once


@gpu
@needs_cuda
def test_real_compiles_and_captures_are_counted():
    """A fresh Triton specialisation counts one compile; the engine's first rounds on CUDA
    capture graphs (target and draft)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _add_one(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

    install_triton_hook()
    x = torch.zeros(8, device="cuda")
    before = triton_compiles()
    _add_one[(1,)](x, 8, BLOCK=8)
    _add_one[(1,)](x, 8, BLOCK=8)                  # cached: no second compile
    torch.cuda.synchronize()
    assert triton_compiles() == before + 1 and x.tolist() == [2.0] * 8
    eng = Engine(device="cuda", max_num_seqs=2)
    eng.generate(["def f(n):\n"], SamplingParams(temperature=0, max_tokens=16))
    assert eng.compile_stats()["graph_captures"] > 0
