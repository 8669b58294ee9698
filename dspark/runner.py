"""Model runner: turns scheduled work into target / drafter forwards on one device.

The target forward takes a flattened ragged batch (prefill chunks, decode tokens and verify
blocks of many requests together) and returns logits for the rows the caller needs plus the
hc-mean taps the drafter's context is built from. The draft pass runs the parallel block for all
requests at once, then the Markov head left to right.
"""
from __future__ import annotations

import torch

from .models.deepseek_v4.model import Batch
from .models.drafter import DraftState
from .request import DraftBlock
from .sampling import Purpose, probs_from_logits, sample_from_probs, stack_params, uniforms


class QuantSim:
    """Reproduces the reference's storage rounding in the dense reference path: FP8 (UE8M0 64-tile)
    on the 448 NoPE dims of every cached 512-d kv, Hadamard + FP4 on indexer queries and keys.
    The paged fp8_ds_mla cache applies the same rounding by storing the real records."""

    def kv(self, x):
        from .kvcache.layouts import fp8_ds_mla_roundtrip
        return fp8_ds_mla_roundtrip(x)

    def indexer(self, x):
        from .kvcache.layouts import fp4_roundtrip, hadamard128
        return fp4_roundtrip(hadamard128(x.float()))


class ModelRunner:
    def __init__(self, model, drafter=None, device="cpu", quant: QuantSim | None = None,
                 backend=None):
        self.model, self.drafter, self.device, self.quant = model, drafter, torch.device(device), quant
        # paged attention (dspark.attention backend over a PagedKVCache) or None: dense states
        self.backend = backend
        self.tap_layers = tuple(model.cfg.dspark_target_layer_ids) if drafter is not None else ()

    @property
    def backend_name(self) -> str:
        return getattr(self.backend, "name", "paged") if self.backend is not None else "dense-reference"

    def new_states(self):
        ds = DraftState(self.model.cfg.num_dspark_stages, self.model.cfg.sliding_window) \
            if self.drafter is not None else None
        return self.model.new_state(), ds

    @torch.inference_mode()
    def target_forward(self, items, logit_rows=None):
        """items: list of (target_state, start, token list); with a paged backend the state is
        the request id registered in backend.cache. Returns (logits fp32 [N, V] for the flat
        rows in `logit_rows` (all rows when None), taps [T, taps*D] or None)."""
        batch = Batch.build(items, self.device)
        attn_fn = self.backend.forward_fn(batch) if self.backend is not None else None
        X, taps = self.model.forward_hidden(batch, attn_fn=attn_fn, quant=self.quant,
                                            tap_layers=self.tap_layers)
        if logit_rows is not None:
            X = X[torch.as_tensor(logit_rows, dtype=torch.long, device=self.device)]
        return self.model.logits(X), taps

    @torch.inference_mode()
    def commit_context(self, draft_state, taps, start: int):
        """Draft context rows for committed positions start..start+len(taps)-1."""
        pos = torch.arange(start, start + taps.shape[0], device=self.device)
        self.drafter.commit_context(draft_state, taps, pos, self.quant)

    @torch.inference_mode()
    def draft(self, reqs) -> list:
        """One DSpark block per request: parallel backbone, then Markov sampling left to right.
        Keeps the exact distributions each draft token was sampled from (q) and the confidences."""
        d, g = self.drafter, self.drafter.gamma
        anchors = torch.tensor([r.anchor for r in reqs], dtype=torch.long, device=self.device)
        starts = [r.num_committed for r in reqs]
        hidden = d.block_hidden(self.model.embed, anchors, starts, [r.draft_state for r in reqs],
                                self.quant)
        base = d.base_logits(self.model.head, hidden)                    # [R, γ, V]
        temp, top_k, top_p = stack_params([r.params for r in reqs], self.device)
        seeds = torch.tensor([r.seed for r in reqs], dtype=torch.long, device=self.device)
        P = torch.tensor(starts, dtype=torch.long, device=self.device)
        prev, toks, probs, confs = anchors, [], [], []
        for k in range(g):
            bias, conf = d.markov_step(hidden[:, k], prev)
            q = probs_from_logits(base[:, k] + bias, temp, top_k, top_p)
            prev = sample_from_probs(q, uniforms(seeds, P + k + 1, Purpose.DRAFT))
            toks.append(prev), probs.append(q), confs.append(conf)
        toks, probs, confs = torch.stack(toks, 1), torch.stack(probs, 1), torch.stack(confs, 1)
        # greedy requests keep no [γ, V] distribution: their q is the point mass on the token
        return [DraftBlock(toks[i], None if r.params.greedy else probs[i], confs[i])
                for i, r in enumerate(reqs)]

    def draft_blocks_for_profile(self, states, start: int):
        """Draft pass for len(states) synthetic requests anchored at `start` (SPS profiling)."""
        from types import SimpleNamespace
        from .sampling import SamplingParams
        reqs = [SimpleNamespace(anchor=1, num_committed=start, draft_state=ds,
                                params=SamplingParams(temperature=1.0), seed=i)
                for i, (_, ds) in enumerate(states)]
        return self.draft(reqs)
