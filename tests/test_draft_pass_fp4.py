"""The draft pass of a drafter with packed FP4 experts (QuantMoE stages): which batch buckets are
CUDA graphs (the rows their MoE sees against the grouped kernels' cap), the eager fallback of a
bucket past it, and the grouped-kernel pass against the per-request reference."""
import contextlib
import warnings
from types import SimpleNamespace

import pytest
import torch

from triton_env import triton_ok  # noqa: F401  (sets TRITON_INTERPRET on CPU)

from dspark import Engine, SamplingParams
from dspark.compile_stats import runner_stats
from dspark.draft_pass import MAX_GRAPH_CONTEXT_ROWS, DraftPass, _Captured, bucket_size
from dspark.kernels.fp4_moe import GROUPED_MAX_PAIRS
from dspark.models.qlinear import QuantMoE
from test_draft_pass import PARAMS, _taps, model_rope, reference_draft


@pytest.fixture(scope="module")
def fp4_engine(tiny_quant_ckpt):
    """The tiny FP8 / FP4 checkpoint with its weights kept quantized: every drafter stage a
    QuantMoE (γ = 5, top-2 of 8 experts)."""
    eng = Engine(tiny_quant_ckpt, device="cpu", dtype="fp32", weight_format="quantized",
                 kv_cache_dtype="fp8", max_num_seqs=8)
    assert all(type(st.ffn) is QuantMoE for st in eng.drafter.stages)
    return eng


@contextlib.contextmanager
def fp4_experts_on(drafter, backend: str, max_pairs=None):
    """The stages' routed experts on `backend` ("triton": the grouped kernels, interpreted on
    CPU, take every batch within the cap; "torch": the per-expert loop), with the grouped cap
    `max_pairs` per stage when given; restored afterwards."""
    saved = []
    for st in drafter.stages:
        saved.append((st.ffn.__dict__.get("grouped_max_pairs"),
                      [lin.backend for e in st.ffn.experts for lin in (e.w1, e.w2, e.w3)]))
        for e in st.ffn.experts:
            for lin in (e.w1, e.w2, e.w3):
                lin.backend = backend
        if max_pairs is not None:
            st.ffn.grouped_max_pairs = max_pairs
    try:
        yield
    finally:
        for st, (cap, backends) in zip(drafter.stages, saved):
            if cap is None:
                st.ffn.__dict__.pop("grouped_max_pairs", None)
            else:
                st.ffn.grouped_max_pairs = cap
            for lin, b in zip((lin for e in st.ffn.experts for lin in (e.w1, e.w2, e.w3)), backends):
                lin.backend = b


def _buckets(max_batch):
    return sorted({bucket_size(n) for n in range(1, max_batch + 1)})


def test_graph_buckets_by_moe_rows(fp4_engine, tiny_ckpt):
    d, dp = fp4_engine.drafter, fp4_engine.runner.draft_pass
    g, k = d.gamma, d.stages[0].ffn.gate.topk
    # on CUDA ("auto" backend: Triton) a bucket b is a graph iff b·γ rows x top-k pairs fit
    # the cap: 4096 / (5 x 2) -> buckets up to 256 of 512
    cuda = [b for b in _buckets(512) if d.moe_graph_blocker(b * g, "cuda") is None]
    assert cuda == [b for b in _buckets(512) if b * g * k <= GROUPED_MAX_PAIRS] == _buckets(256)
    assert "5120 (token, expert) pairs exceed" in d.moe_graph_blocker(512 * g, "cuda")
    # on CPU the "auto" backend is the per-expert loop (host sync): no draft graphs at all
    assert d.moe_graph_blocker(g, "cpu") is not None and not d.graphs_possible("cpu")
    assert dp.graph_buckets(8)["draft"] == []
    # the pass's own plan on its device once the grouped kernels serve it (Triton backend), with
    # one stage's cap lowered to 40 pairs: that stage decides, 40 / (5 x 2) -> buckets 1, 2, 4
    with fp4_experts_on(d, "triton"):
        d.stages[1].ffn.grouped_max_pairs = 40
        try:
            plan = dp.graph_buckets(32)
        finally:
            del d.stages[1].ffn.grouped_max_pairs
        assert dp.graph_buckets(32)["draft"] == _buckets(32)        # the class cap again
    assert plan["draft"] == [1, 2, 4] and sorted(plan["eager"]) == [8, 16, 32]
    assert plan["eager"][8] == ("batch bucket 8: stage 1 MoE: 40 rows x top-2 = 80 (token, "
                                "expert) pairs exceed the grouped FP4 kernels' cap 40 "
                                "(QuantMoE.grouped_max_pairs)")
    # the context write runs no MoE: every row bucket up to the largest
    assert plan["context"] == [8 << i for i in range(MAX_GRAPH_CONTEXT_ROWS.bit_length() - 3)]
    # the grouped kernels off for every QuantMoE: no draft bucket anywhere
    saved = QuantMoE.grouped_max_pairs
    QuantMoE.grouped_max_pairs = 0
    try:
        assert "per-expert loop" in d.moe_graph_blocker(g, "cuda")
        assert not d.graphs_possible("cuda")
    finally:
        QuantMoE.grouped_max_pairs = saved
    # small dense drafters (bf16 weights: plain MoE under DENSE_MOE_MAX_BYTES): any row count
    dense = Engine(tiny_ckpt, device="cpu", dtype="fp32").drafter
    assert all(dense.moe_graph_blocker(rows, "cuda") is None for rows in (1, 5, 10 ** 6))


class EagerReplay:
    """Stand-in for torch.cuda.CUDAGraph on a CPU-only machine: "replay" runs the captured
    function again on the same static input buffers and writes into the same output tensors,
    so everything around a graph (bucket choice, padding, buffer refills, output copies,
    counting) runs as on CUDA."""

    def __init__(self, fn, buffers):
        self.fn, self.buffers, self.replays = fn, buffers, 0
        self.outputs = fn(*buffers)

    def replay(self):
        self.replays += 1
        new = self.fn(*self.buffers)
        for out, value in zip(self.outputs or (), new or ()):
            if out is not None:
                out.copy_(value)


class ReplayedDraftPass(DraftPass):
    """DraftPass standing in for one on CUDA: graphs on, `EagerReplay` as the graph, buckets
    decided for a CUDA device (the "auto" experts' grouped kernels; the eager compute here stays
    the CPU's per-expert loop, which the grouped kernels match: see the test below)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cuda_graphs = self.graphs_wanted = True

    def draft_blocker(self, size, device=None):
        return super().draft_blocker(size, device or torch.device("cuda"))

    def _capture(self, buffers, fn):
        graph = EagerReplay(fn, buffers)
        return _Captured(graph, buffers, graph.outputs)


def _requests(eng, positions, params, seed0=0):
    reqs = []
    for i, P in enumerate(positions):
        _, ds = eng.runner.new_states()
        eng.runner.commit_context(ds, _taps(eng, P, seed=seed0 + i), 0)
        reqs.append(SimpleNamespace(anchor=(5 * i + 1) % eng.cfg.vocab_size, num_committed=P,
                                    draft_state=ds, seed=100 + i, params=params[i % len(params)]))
    eng.runner.flush_context()
    return reqs


def test_bucket_past_the_cap_runs_eagerly_others_keep_replaying(fp4_engine):
    eng = fp4_engine
    runner, d = eng.runner, eng.drafter
    with fp4_experts_on(d, "auto", max_pairs=40):             # buckets 1, 2, 4 graphs; 8 eager
        dp = ReplayedDraftPass(d, eng.model.embed, eng.model.head, runner.draft_pool)
        eager = DraftPass(d, eng.model.embed, eng.model.head, runner.draft_pool)
        saved, runner.draft_pass = runner.draft_pass, dp      # eng.compile_stats() counts dp
        try:
            with torch.inference_mode():
                n = dp.capture_all(8, 64, d.main_proj.in_features, (torch.float32,), runner.quant)
            # greedy and sampled per graphed bucket + one per context row bucket; 8 not tried
            n_context = len(dp.graph_buckets(8)["context"])
            assert n == 3 * 2 + n_context
            assert {key[1] for key in dp._graphs if key[0] == "draft"} == {1, 2, 4}
            warm = eng.compile_stats()
            assert warm["graph_captures"] == n and warm["eager_fallbacks"] == {}
            reqs = _requests(eng, [3, 17, 40, 9, 0, 25], PARAMS[:2])     # greedy, sampled

            def draft_replays():
                return sum(g.graph.replays for key, g in dp._graphs.items() if key[0] == "draft")
            with torch.inference_mode():
                # bucket 4 (replay), 8 (eager, warned once) twice, 4 again (still a replay)
                for R, warns in ((3, 0), (6, 1), (6, 0), (3, 0)):
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        replays = draft_replays()
                        toks, q, conf = dp(reqs[:R], runner.quant)
                    assert draft_replays() == replays + (R == 3), R
                    ref_toks, ref_q, ref_conf = eager(reqs[:R], runner.quant)
                    assert torch.equal(toks, ref_toks), R
                    torch.testing.assert_close(conf, ref_conf, rtol=1e-4, atol=1e-4)
                    torch.testing.assert_close(q, ref_q, rtol=1e-4, atol=1e-5)
                    said = [str(w.message) for w in caught if "runs eagerly" in str(w.message)]
                    assert len(said) == warns and all("batch bucket 8" in m for m in said), said
            assert dp.cuda_graphs, "an eager bucket must not turn the graphs off"
            stats = eng.compile_stats()
            reason = ("draft: batch bucket 8: stage 0 MoE: 40 rows x top-2 = 80 (token, expert) "
                      "pairs exceed the grouped FP4 kernels' cap 40 (QuantMoE.grouped_max_pairs)")
            assert stats["eager_fallbacks"] == {reason: 2}
            assert stats["graph_captures"] == n                 # nothing captured in traffic
        finally:
            runner.draft_pass = saved


@triton_ok
def test_grouped_fp4_draft_pass_equals_reference(fp4_engine):
    """The pass with the stages' experts on the grouped kernels (the path its graphs replay) and
    on the per-expert loop, against one request at a time through `Block.forward` (its own
    QuantMoE on the per-expert loop): same tokens, confidences and q to fp32 rounding (the
    grouped kernels sum the k slots in slot order, the loop in expert order)."""
    eng = fp4_engine
    d, dp = eng.drafter, eng.runner.draft_pass
    positions = [0, 9, 30, 5]
    params = PARAMS
    reqs = _requests(eng, positions, params, seed0=7)
    taps = [_taps(eng, P, seed=7 + i) for i, P in enumerate(positions)]
    with torch.inference_mode():
        with fp4_experts_on(d, "triton"):
            assert dp.draft_blocker(bucket_size(len(reqs))) is None     # the grouped path runs
            grouped = dp(reqs, eng.runner.quant)
        loop = dp(reqs, eng.runner.quant)
        with model_rope(d):
            refs = [reference_draft(eng, t, r.anchor, r.params, r.seed) for r, t in zip(reqs, taps)]
    for toks, q, conf in (grouped, loop):
        for i, (r, (ref_toks, ref_q, ref_conf)) in enumerate(zip(reqs, refs)):
            assert torch.equal(toks[i], ref_toks), (r.num_committed, r.params)
            torch.testing.assert_close(conf[i], ref_conf, rtol=1e-4, atol=1e-4)
            if not r.params.greedy:
                torch.testing.assert_close(q[i], ref_q, rtol=1e-4, atol=1e-5)


# ---- CUDA graphs -------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fp4_draft_graphs_replay_equals_eager_and_capture_in_warmup(tiny_quant_ckpt):
    """A tiny FP4-expert drafter on CUDA: warm-up captures the draft pass of every batch bucket
    and the context writes, traffic captures nothing, and a replay gives the eager pass's tokens
    (confidences and q to GEMM rounding); a bucket past a lowered cap runs eagerly, counted, while
    the other buckets keep replaying."""
    eng = Engine(tiny_quant_ckpt, device="cuda", dtype="bf16", weight_format="quantized",
                 cuda_graphs=True, max_num_seqs=8)
    runner, d = eng.runner, eng.drafter
    dp = runner.draft_pass

    def draft_stats():              # the draft pass's own counts (the target's are not checked)
        return runner_stats(SimpleNamespace(draft_pass=dp))
    assert all(type(st.ffn) is QuantMoE for st in d.stages)
    assert dp.cuda_graphs, "an FP4 drafter within the grouped cap should run as CUDA graphs"
    eng.warmup(prompt_lengths=[16], batch_sizes=[1, 3])
    assert {key[1] for key in dp._graphs if key[0] == "draft"} == {1, 2, 4, 8}
    assert any(key[0] == "context" for key in dp._graphs)
    warm = draft_stats()
    prompts = [list(range(3, 40)), list(range(100, 110)), [5]]
    eng.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    eng.generate(prompts, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=3))
    after = draft_stats()
    assert after["graph_captures"] == warm["graph_captures"] > 0, "traffic captured a graph"
    assert after["eager_fallbacks"] == {}, after

    eager = DraftPass(d, eng.model.embed, eng.model.head, runner.draft_pool, cuda_graphs=False)
    reqs = []
    for i, P in enumerate([200, 5, 127, 128, 0, 129, 40, 7]):
        _, ds = runner.new_states()
        runner.commit_context(ds, _taps(eng, P, seed=i).to("cuda", eng.dtype), 0)
        reqs.append(SimpleNamespace(anchor=(7 * i + 3) % eng.cfg.vocab_size, num_committed=P,
                                    draft_state=ds, seed=11 + i, params=PARAMS[i % 2]))
    # the queued context rows (bf16 taps of lengths traffic never had) are written now: a
    # context-write graph of their row bucket may be captured here, before the draft passes
    runner.flush_context()
    captures = draft_stats()["graph_captures"]
    for R in (1, 4, 8):            # full buckets: the graph runs the eager kernels on its shapes
        graph_blocks = runner.draft(reqs[:R])
        with torch.inference_mode():
            toks, q, conf = eager(reqs[:R], runner.quant)
        for i, b in enumerate(graph_blocks):
            assert torch.equal(b.tokens, toks[i]), (R, i)
            torch.testing.assert_close(b.conf_logits, conf[i], rtol=2e-2, atol=2e-2)
            if b.probs is not None:
                torch.testing.assert_close(b.probs, q[i], rtol=2e-2, atol=2e-3)
    assert draft_stats()["graph_captures"] == captures

    # lower stage 0's cap to 4 buckets' worth of rows: bucket 8 eager, bucket 4 still replays
    d.stages[0].ffn.grouped_max_pairs = 4 * d.gamma * d.stages[0].ffn.gate.topk
    try:
        with pytest.warns(UserWarning, match="batch bucket 8"):
            runner.draft(reqs[:8])
        runner.draft(reqs[:4])
    finally:
        del d.stages[0].ffn.grouped_max_pairs
    stats = draft_stats()
    assert list(stats["eager_fallbacks"].values()) == [1], stats
    assert "batch bucket 8" in next(iter(stats["eager_fallbacks"]))
    assert stats["graph_captures"] == captures and dp.cuda_graphs
