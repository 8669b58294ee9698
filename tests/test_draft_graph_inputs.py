"""The draft pass's graph path (DraftPass with cuda_graphs) on CPU: a stand-in graph whose replay
reruns the captured function on the same input buffers and writes the same output buffers. Its
host side is the CUDA one: inputs uploaded only when their rows change (anchors and starts
written on the device by a pass drafting ahead), context rows gathered into the graph's input
with rejected drafts sent to the scratch slot. Oracle: the same engine with graphs off (eager
passes): the same tokens and per-round acceptance, which equal drafts imply."""
import torch

import dspark.draft_pass as draft_pass_mod
from dspark import Engine, SamplingParams


class _RerunGraph:
    """replay() = the captured fn again, its outputs copied into the first call's tensors."""

    def __init__(self, fn):
        self.fn, self.outputs = fn, fn()

    def replay(self):
        new = self.fn()
        for keep, now in zip(self.outputs or (), new or ()):    # (a context write: None)
            if keep is not None:
                keep.copy_(now)


def _capture(fn, pool):
    g = _RerunGraph(fn)
    return g, g.outputs


def _logged(fn, blocks):
    def drafted(*a, **k):
        out = fn(*a, **k)
        blocks.append([(b.tokens.tolist(), b.conf_logits.tolist()) for b in out])
        return out
    return drafted


def _generate(path, prompts, params, graphs: bool, monkeypatch):
    with monkeypatch.context() as m:
        # fp32 records: a bucket-padded GEMM's last-bit difference then stays one (fp8 records
        # may round it across an e4m3 step: 0.3% in a confidence on a 16-core host)
        eng = Engine(path, device="cpu", max_num_seqs=3, kv_cache_dtype="fp32")
        if graphs:
            m.setattr(draft_pass_mod, "capture", _capture)
            m.setattr(draft_pass_mod, "warm_up", lambda *a, **k: None)
            m.setattr(torch.cuda, "graph_pool_handle", lambda: None)
            dp = eng.runner.draft_pass
            dp.cuda_graphs = dp.graphs_wanted = True
        blocks = []                   # every drafted block's tokens and confidences
        for name in ("draft", "draft_ahead"):
            m.setattr(eng.runner, name, _logged(getattr(eng.runner, name), blocks))
        outs = eng.generate(prompts, params)
        if graphs:
            kinds = {key[0] for key in eng.runner.draft_pass._graphs}
            assert kinds == {"draft", "context"}, kinds
    return [(o.token_ids, o.metrics.rounds, o.metrics.accepted) for o in outs], blocks


def test_graph_path_drafts_the_eager_blocks(tiny_ckpt, monkeypatch):
    prompts = [[5, 9, 2], [17, 3, 3, 8, 1, 40], [7]]
    params = [SamplingParams(temperature=0, max_tokens=24),
              SamplingParams(temperature=1.0, seed=3, max_tokens=30),
              SamplingParams(temperature=0.7, seed=5, max_tokens=17)]
    want, want_blocks = _generate(tiny_ckpt, prompts, params, False, monkeypatch)
    got, got_blocks = _generate(tiny_ckpt, prompts, params, True, monkeypatch)
    assert got == want
    assert len(got_blocks) == len(want_blocks)
    for g, w in zip(got_blocks, want_blocks):
        assert [t for t, _ in g] == [t for t, _ in w]
        for (_, cg), (_, cw) in zip(g, w):
            torch.testing.assert_close(cg, cw, rtol=1e-3, atol=1e-3)   # (bucket padding)
