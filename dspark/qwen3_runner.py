"""The Qwen3 target's runner and its construction: `build_engine_components` loads the target
(and a DeepSpec DSpark drafter), builds the paged GQA cache and attention backend and the
`Qwen3Runner` that the Engine drives."""
from __future__ import annotations

import torch

from .attention.gqa import PagedGQABackend
from .kvcache.paged_gqa import PagedGQACache
from .models.qwen3 import load_qwen3
from .runner import ModelRunner


def build_engine_components(target_path: str, draft_path: str | None, dtype, device,
                            speculative: str | None = None, num_speculative_tokens: int | None = None,
                            kv_layout: str = "paged", num_kv_blocks: int | None = None,
                            max_num_seqs: int = 64, kv_block_size: int = 256,
                            cuda_graphs: bool | None = None):
    """(cfg, model, drafter | None, runner) for `Engine` on a Qwen3 target (+ DSpark drafter).

    The runner is a `ModelRunner` whose draft state comes from the drafter (`new_state()`), not
    the DeepSeek-V4 window state; no fp8 storage simulation (that models the V4 checkpoint).
    kv_layout="paged": the target K/V live in a `PagedGQACache` (model dtype, `num_kv_blocks`
    pages of `kv_block_size` tokens; default: room for `max_num_seqs` sequences of
    min(max_position_embeddings, 2048) tokens) and `runner.backend.cache` is that cache;
    "dense": per-request position-indexed `KVState`s (the reference).
    cuda_graphs (default: on for a paged cache on CUDA): steps in which every request feeds the
    same number of tokens (decode, equal-length verify blocks) run through `Qwen3DecodeGraphs`
    (models/qwen3_graph.py), captured CUDA graphs; other steps stay eager. On CPU, True runs the
    same fixed-shape path without capture (what the tests check)."""
    if kv_layout not in ("paged", "dense"):
        raise ValueError(f"kv_layout={kv_layout!r}: use 'paged' (paged K/V pools, the serving "
                         f"layout) or 'dense' (the per-request reference state)")
    if speculative not in (None, "dspark", "none"):
        raise ValueError(f"speculative={speculative!r}: use 'dspark' or 'none'")
    if speculative == "dspark" and draft_path is None:
        raise ValueError(f"{target_path}: a Qwen3 target has no built-in drafter; pass "
                         f"draft=<DeepSpec DSpark checkpoint dir> (e.g. dspark_qwen3_4b_block7)")
    if draft_path is not None and speculative != "none":
        from .models.dspark_qwen3 import load_qwen3_pair
        model, drafter, cfg = load_qwen3_pair(target_path, draft_path, dtype, device)
        if num_speculative_tokens not in (None, drafter.gamma):
            raise ValueError(
                f"num_speculative_tokens={num_speculative_tokens} does not match the drafter's "
                f"block_size={drafter.gamma}: the block is bidirectional and trained at exactly "
                f"that width (other widths collapse acceptance). Leave it unset; use a verify_policy "
                f"to verify fewer tokens per round.")
    else:
        model, drafter = load_qwen3(target_path, dtype, device), None
        cfg = model.cfg
    device = torch.device(device)
    if cuda_graphs is None:
        cuda_graphs = device.type == "cuda" and kv_layout == "paged"
    if cuda_graphs and kv_layout != "paged":
        raise ValueError("cuda_graphs=True needs kv_layout='paged' (the graphs read the paged "
                         "K/V pools); use cuda_graphs=False with kv_layout='dense'")
    backend = None
    if kv_layout == "paged":
        if num_kv_blocks is None:
            per_seq = min(cfg.max_position_embeddings, 2048)
            num_kv_blocks = max(max_num_seqs * -(-per_seq // kv_block_size), 1)
        wdtype = model.embed.weight.dtype
        backend = PagedGQABackend(PagedGQACache(cfg, device=device, dtype=wdtype,
                                                num_blocks=num_kv_blocks, block_size=kv_block_size,
                                                max_num_seqs=max_num_seqs,
                                                scratch_rows=1 if cuda_graphs else 0))
    runner = Qwen3Runner(model, drafter, device, quant=None, backend=backend,
                         cuda_graphs=cuda_graphs, max_num_seqs=max_num_seqs)
    if cuda_graphs:
        from .models.qwen3_graph import Qwen3DecodeGraphs
        # plain decode (q = 1) and every verify-block length a DSpark round can produce
        q_lens = range(1, drafter.gamma + 2) if drafter is not None else (1,)
        runner.target_graphs = Qwen3DecodeGraphs(model, backend.cache, q_lens,
                                                 max_batch=max_num_seqs,
                                                 tap_layers=runner.tap_layers)
        runner.uniform_verify = True        # verify blocks padded to one width (Engine)
    return cfg, model, drafter, runner


class Qwen3Runner(ModelRunner):
    """ModelRunner for Qwen3 targets: uniform-length steps go through `target_graphs` (a
    `Qwen3DecodeGraphs`, when enabled), as the V4 target's do; the DeepSpec drafter's context
    lives in one `Qwen3DraftPool` and every round's draft pass is one batched `Qwen3DraftPass`
    (CUDA graphs per batch / context bucket when `cuda_graphs`), models/dspark_qwen3_pass.py."""

    def __init__(self, model, drafter=None, device="cpu", quant=None, backend=None,
                 cuda_graphs: bool = False, max_num_seqs: int = 8):
        super().__init__(model, drafter, device, quant, backend, max_num_seqs=max_num_seqs)
        if drafter is not None:
            from .models.dspark_qwen3_pass import Qwen3DraftPass
            # with graphs, room for every sequence up front (growing reallocates the pool and
            # recaptures); without, start small and double on demand
            slots = max_num_seqs if cuda_graphs else min(max_num_seqs, 8)
            self.draft_pool = drafter.new_pool(slots, self.device)
            self.draft_pass = Qwen3DraftPass(drafter, model.embed, model.head, self.draft_pool,
                                             cuda_graphs)

    def capture_graphs(self, q_lens, max_position: int, progress: bool = False) -> dict:
        """The target's (batch, q, page) buckets ahead of traffic; the drafter's graphs are
        captured on first use (their buckets include the context length, which grows)."""
        n = self.target_graphs.capture_all(q_lens, progress) if self.target_graphs is not None else 0
        return {"target": n, "draft": 0}

    def new_states(self):
        if self.drafter is None:
            return self.model.new_state(), None
        from .models.dspark_qwen3_pass import Qwen3DraftState
        return self.model.new_state(), Qwen3DraftState(self.draft_pool)

    def draft_blocks_for_profile(self, states, start: int):
        # SPS profiling warms only the target state; a block at `start` needs draft context for
        # 0..start-1 (the drafter refuses holes), so commit placeholder rows once: the timed block
        # then attends over `start` positions exactly as in serving
        for _, ds in states:
            if ds.length < start:
                w = self.drafter.fc.weight
                self.commit_context(ds, w.new_zeros(start - ds.length, w.shape[1]), ds.length)
        return super().draft_blocks_for_profile(states, start)
