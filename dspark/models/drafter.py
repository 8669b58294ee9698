"""DeepSeek-V4 DSpark drafter built from the `mtp.*` tensors (dspark.md §3).

Context combiner: main_x = main_norm(main_proj(taps)) per committed target position, where taps
are the hc-mean residual streams after `dspark_target_layer_ids`. Each stage turns main_x into
its own window kv (wkv -> kv_norm -> RoPE), the only way context enters the drafter.
Draft block: [anchor, noise x (γ-1)] at positions P..P+γ-1 through the stages (SWA-only V4 blocks
whose attention is non-causal over ctx[max(0,P-128):P] ∪ the whole block), hc_head, norm, the
target's head -> base logits U; then the Markov head adds W2·W1[prev] left to right and the
confidence head scores each slot from [pre-norm hidden ; W1[prev]].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .deepseek_v4.attention import sparse_attention_with_sink
from .deepseek_v4.mhc import hc_head
from .deepseek_v4.model import Batch, Block
from .deepseek_v4.norm import RMSNorm


class DraftState:
    """Per-request draft context: per stage, window kv rows keyed by absolute position.

    Only committed (target-verified) rows are ever written, so rejection needs no rollback.
    Rows older than the window are never read; memory is bounded by keeping a ring of
    `capacity` >= window slots addressed by position % capacity.
    """

    def __init__(self, num_stages: int, window: int):
        self.window = window
        self.capacity = window
        self.kv = [None] * num_stages          # [capacity, head_dim] per stage
        self.length = 0                        # number of committed context positions

    def write(self, stage: int, positions: torch.Tensor, rows: torch.Tensor):
        if self.kv[stage] is None:
            self.kv[stage] = rows.new_zeros(self.capacity, rows.shape[-1])
        # only the newest `capacity` rows can be read again; writing more in one call would
        # collide in the ring (which of two writes to one slot wins is undefined)
        positions, rows = positions[-self.capacity:], rows[-self.capacity:]
        self.kv[stage][positions % self.capacity] = rows

    def window_rows(self, stage: int, P: int) -> torch.Tensor:
        """Context kv for positions max(0, P-W)..P-1 (order irrelevant: attention is non-causal)."""
        lo = max(0, P - self.window)
        if P == 0 or self.kv[stage] is None:
            return torch.zeros(0, 0)
        idx = torch.arange(lo, P, device=self.kv[stage].device) % self.capacity
        return self.kv[stage][idx]


class DSparkDrafter(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        D, n, S = cfg.hidden_size, cfg.hc_mult, cfg.num_dspark_stages
        self.gamma = cfg.dspark_block_size
        self.num_taps = len(cfg.dspark_target_layer_ids)
        # stage s runs as layer num_hidden_layers + s: ratio 0 (SWA), never hash-routed
        self.stages = nn.ModuleList(Block(cfg, cfg.num_hidden_layers + s, 0, False) for s in range(S))
        self.main_proj = nn.Linear(self.num_taps * D, D, bias=False)
        self.main_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * D))
        self.hc_head_base = nn.Parameter(torch.zeros(n))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        r = cfg.dspark_markov_rank
        self.markov_w1 = nn.Parameter(torch.zeros(cfg.vocab_size, r))   # lookup by token id
        self.markov_w2 = nn.Parameter(torch.zeros(cfg.vocab_size, r))   # projection r -> V
        self.confidence = nn.Linear(D + r, 1, bias=False)

    # checkpoint name <-> parameter name -------------------------------------------------
    _MODEL_LEVEL = {"main_proj.weight": "main_proj.weight", "main_norm.weight": "main_norm.weight",
                    "norm.weight": "norm.weight", "hc_head_fn": "hc_head_fn",
                    "hc_head_base": "hc_head_base", "hc_head_scale": "hc_head_scale",
                    "markov_head.markov_w1.weight": "markov_w1",
                    "markov_head.markov_w2.weight": "markov_w2",
                    "confidence_head.proj.weight": "confidence.weight"}

    @classmethod
    def param_name(cls, ckpt_name: str) -> str:
        """`mtp.{s}.<rest>` -> our parameter name (model-level heads ignore s)."""
        _, s, rest = ckpt_name.split(".", 2)
        if rest in cls._MODEL_LEVEL:
            return cls._MODEL_LEVEL[rest]
        return f"stages.{s}.{rest}"

    def ckpt_names(self) -> dict:
        """our parameter name -> checkpoint name."""
        last = self.cfg.num_dspark_stages - 1
        out = {}
        for name, _ in list(self.named_parameters()) + list(self.named_buffers()):
            if name.startswith("stages."):
                _, s, rest = name.split(".", 2)
                out[name] = f"mtp.{s}.{rest}"
            else:
                rest = {v: k for k, v in self._MODEL_LEVEL.items()}[name]
                s = 0 if rest.startswith("main_") else last
                out[name] = f"mtp.{s}.{rest}"
        return out

    # context --------------------------------------------------------------------------
    def commit_context(self, state: DraftState, taps: torch.Tensor, positions: torch.Tensor,
                       quant=None):
        """Write draft context rows for committed positions from target taps [n, taps*D]."""
        proj = self.main_proj     # nn.Linear, or a QuantLinear (raw fp8 `.weight`) in quantized mode
        main_x = self.main_norm(proj(taps.to(getattr(proj, "compute_dtype", proj.weight.dtype))))
        for s, stage in enumerate(self.stages):
            state.write(s, positions, stage.attn.project_kv(main_x, positions, quant))
        state.length = max(state.length, int(positions.max()) + 1)

    # block ------------------------------------------------------------------------------
    def block_hidden(self, embed: nn.Embedding, anchors: torch.Tensor, starts: list,
                     states: list, quant=None) -> torch.Tensor:
        """Pre-norm head hidden [R, γ, D] for blocks [anchor, noise...] at positions P_r + (0..γ-1)."""
        R, g = anchors.shape[0], self.gamma
        ids = torch.full((R, g), self.cfg.dspark_noise_token_id, dtype=torch.long,
                         device=anchors.device)
        ids[:, 0] = anchors
        batch = Batch.build([(st, P, ids[r].tolist()) for r, (st, P) in enumerate(zip(states, starts))],
                            anchors.device)
        X = embed(batch.token_ids)
        X = X.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        for s, stage in enumerate(self.stages):
            X = stage(X, batch, attn_fn=self._block_attention(s), quant=quant)
        h = hc_head(X, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.cfg.hc_eps,
                    self.cfg.rms_norm_eps)
        return h.view(R, g, -1)

    def _block_attention(self, s: int):
        def attend(attn, x, batch, layer_id, quant):
            pos = batch.positions
            _, q = attn.project_q(x, pos)
            kv = attn.project_kv(x, pos, quant)
            out = torch.empty(q.shape, dtype=torch.float32, device=x.device)
            for seg in batch.segments:
                sl = slice(seg.offset, seg.offset + seg.length)
                ctx = seg.state.window_rows(s, seg.start)
                keys = torch.cat([ctx.to(kv.dtype).view(-1, kv.shape[-1]), kv[sl]], 0)
                mask = torch.ones(seg.length, keys.shape[0], dtype=torch.bool, device=x.device)
                out[sl] = sparse_attention_with_sink(q[sl], keys, mask, attn.attn_sink,
                                                     attn.head_dim ** -0.5)
            return attn.output(out, pos, x.dtype)
        return attend

    def base_logits(self, head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(hidden).float(), head.weight.float())

    def markov_step(self, hidden_k: torch.Tensor, prev: torch.Tensor):
        """(Markov bias [R, V] fp32, confidence logit [R] fp32) for slot k given previous tokens."""
        e = self.markov_w1[prev].float()
        bias = e @ self.markov_w2.float().t()
        conf = F.linear(torch.cat([hidden_k.float(), e], -1), self.confidence.weight.float())[:, 0]
        return bias, conf
