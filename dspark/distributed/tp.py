"""Tensor-parallel attention + expert-parallel MoE on top of the reference modules.

`shard_modules(model_or_drafter, plan, tp)` turns every decoder `Block` of a meta-device-built
DeepseekV4Model / DSparkDrafter into the structure of rank `plan.rank`'s part without changing
the model code: the modules' classes are swapped for the thin subclasses below, which reuse every
parent method and only add the collectives, and the per-rank sizes (heads, output groups, expert
set) are set on the instances. `build_rank_model` does that and then fills in the weights from
`load_checkpoint_shard` (only this rank's slices are read).

* TPAttention: H/N query heads (wq_b rows, attn_sink), the rank's wo_a groups (or its part of one
  group), wo_b columns; `output` = the parent's grouped projection on local heads + all-reduce.
  KV head, compressors and everything else run replicated, so every rank keeps the same cache.
* TPIndexer: H_I/N index heads. Either "scores" mode (the design's REF scheme): each rank scores
  its heads, the [L, n_entries] scores are all-reduced, then every rank takes the same top-k;
  or "gather" mode: the rank's index queries and head weights are all-gathered and every rank
  scores all heads (used with paged attention backends, whose `select(q, w)` is one fused step).
  "scores" needs `Attention.forward` to call the indexer through the instance
  (`self.indexer.select(...)`); `indexer_mode="auto"` picks it when that is so.
* EPMoE (ep_moe.py): replicated gate; only the rank's routed experts (e % N == r) and its slice
  of the shared expert run, by fixed-shape paths at decode / verify sizes; the fp32 partial
  outputs are all-reduced.

The fixed-shape decode / verify step (models/deepseek_v4/static_forward.py) runs on these modules
unchanged: every collective has a fixed shape (the indexer in "gather" mode, which every paged
backend uses), so on CUDA it is captured inside the step's graph.

weight_format="quantized": after the structure is sharded, every nn.Linear whose checkpoint tensor
is FP8 / FP4 and that the rank holds becomes a `QuantLinear` of the rank's local shape
(dspark/models/qlinear.py), loaded with the rank's codes and scale tiles (keep_quantized loads).
TPAttention's output then takes QuantLinear.grouped over the local groups; EPMoE runs the owned
FP4 experts from their packed weights (`fp4_moe_grouped` over the rank's stack, or per expert).
"""
from __future__ import annotations

import inspect
import math

import torch
from torch import nn

from dspark.models.deepseek_v4.attention import Attention
from dspark.models.deepseek_v4.indexer import Indexer
from dspark.models.deepseek_v4.model import Block, DeepseekV4Model

from .comm import TPGroup
from .ep_moe import EPMoE
from .sharding import ShardPlan, check_world_size

INDEXER_MODES = ("auto", "scores", "gather")


class TPAttention(Attention):
    """Attention over this rank's heads; the output projection is summed over ranks."""

    def output(self, o, positions, dtype, *args, **kwargs):
        # extra arguments (e.g. a host-side position bound) pass through to the parent
        out = super().output(o, positions, dtype, *args, **kwargs)   # local wo_a groups, wo_b cols
        if self._tp.world == 1:
            return out
        return self._tp.all_reduce(out.float()).to(dtype)


class TPIndexer(Indexer):
    """Lightning indexer over this rank's index heads (see module docstring for the two modes)."""

    # (Indexer.queries calls these two; the fixed-shape step calls them apart)
    def index_queries(self, cq, positions, rope, quant, *args, **kwargs):
        q = super().index_queries(cq, positions, rope, quant, *args, **kwargs)
        return self._tp.all_gather(q, dim=1) if self._mode == "gather" else q

    def head_weights(self, x):
        # the parent scales the head weights by (d * local heads)^-1/2; the model's scale uses
        # all heads
        w = super().head_weights(x)
        if self._w_fix != 1.0:
            w = w * self._w_fix
        return self._tp.all_gather(w, dim=1) if self._mode == "gather" else w

    def select(self, q, w, keys, positions, ratio: int, topk: int) -> torch.Tensor:
        """Indexer.select with the head sum split over ranks ("scores" mode): partial scores of
        the local heads, all-reduced before masking and top-k, so every rank keeps the same
        entries."""
        if self._mode == "gather":                # q, w already hold every head
            return Indexer.select(q, w, keys, positions, ratio, topk)
        n = keys.shape[0]
        visible = torch.arange(n, device=q.device)[None, :] < ((positions + 1) // ratio)[:, None]
        if n == 0:
            return visible
        scores = (torch.einsum("lhd,jd->lhj", q, keys.float()).relu() * w[:, :, None]).sum(1)
        scores = self._tp.all_reduce(scores.contiguous())
        scores = scores.masked_fill(~visible, float("-inf"))
        top = scores.topk(min(topk, n), dim=-1).indices
        chosen = torch.zeros_like(visible).scatter_(1, top, True)
        return chosen & visible


def instance_select_hook_present() -> bool:
    """True when the dense `Attention.forward` calls `self.indexer.select` (so TPIndexer.select,
    the all-reduce of scores, is reached)."""
    try:
        return "self.indexer.select(" in inspect.getsource(Attention.forward)
    except (OSError, TypeError):
        return False


def resolve_indexer_mode(mode: str, paged: bool = False) -> str:
    if mode not in INDEXER_MODES:
        raise ValueError(f"indexer_mode={mode!r}: use one of {INDEXER_MODES}")
    if mode == "auto":
        return "scores" if (not paged and instance_select_hook_present()) else "gather"
    if mode == "scores" and not instance_select_hook_present():
        raise ValueError("indexer_mode='scores' needs Attention.forward to call "
                         "self.indexer.select(...); use 'gather' or 'auto'")
    return mode


def set_indexer_mode(root: nn.Module, mode: str, paged: bool = False) -> str:
    """Switch every TPIndexer under `root` to `mode` (resolved like `shard_modules` does)."""
    mode = resolve_indexer_mode(mode, paged)
    for m in root.modules():
        if isinstance(m, TPIndexer):
            m._mode = mode
    return mode


def _shard_block(block: Block, plan: ShardPlan, tp: TPGroup, mode: str) -> None:
    cfg = plan.cfg
    attn = block.attn
    attn.__class__ = TPAttention
    attn._tp = tp
    attn.n_heads = plan.local_heads
    # `output` reads o_groups from the module's cfg: local groups (a part of one group counts 1)
    attn.cfg = cfg.replace(num_attention_heads=plan.local_heads, o_groups=plan.local_groups)
    if hasattr(attn, "indexer"):
        ix = attn.indexer
        ix.__class__ = TPIndexer
        ix._tp, ix._mode = tp, mode
        ix.n_heads = plan.local_index_heads
        ix._w_fix = math.sqrt(plan.local_index_heads / cfg.index_n_heads)
    ffn = block.ffn
    ffn.__class__ = EPMoE
    ffn._tp = tp
    ffn._n_experts = cfg.n_routed_experts
    ffn._rank, ffn._world = plan.rank, plan.world
    if isinstance(ffn.experts, nn.ModuleList):
        ffn.experts = nn.ModuleDict({str(e): ffn.experts[e] for e in plan.local_experts})
    if not plan.holds_shared:
        ffn.shared_experts = None


def shard_modules(root: nn.Module, plan: ShardPlan, tp: TPGroup, indexer_mode: str = "auto",
                  paged: bool = False) -> nn.Module:
    """Make every Block under `root` rank plan.rank's part (structure only; in place)."""
    mode = resolve_indexer_mode(indexer_mode, paged)
    for m in list(root.modules()):
        if isinstance(m, Block) and not isinstance(m.attn, TPAttention):
            _shard_block(m, plan, tp, mode)
    return root


def _assign(root: nn.Module, name: str, t: torch.Tensor) -> None:
    path, _, leaf = name.rpartition(".")
    mod = root.get_submodule(path) if path else root
    if leaf in mod._parameters:
        mod._parameters[leaf] = nn.Parameter(t, requires_grad=False)
    elif leaf in mod._buffers:
        mod._buffers[leaf] = t
    else:
        raise KeyError(f"{name}: no such parameter or buffer")


def assign_weights(root: nn.Module, weights: dict, what: str) -> None:
    """Put `weights` {param name: tensor} into a meta-built, sharded module; every parameter and
    buffer must be covered exactly."""
    have = {n for n, _ in list(root.named_parameters()) + list(root.named_buffers())}
    missing, unexpected = sorted(have - set(weights)), sorted(set(weights) - have)
    if missing or unexpected:
        raise KeyError(f"{what}: sharded weights do not match the module: missing {missing[:8]}, "
                       f"unexpected {unexpected[:8]}")
    for n, t in weights.items():
        _assign(root, n, t)


WEIGHT_FORMATS = ("bf16", "quantized")


def quantize_sharded(model, drafter, plan: ShardPlan, dtype, include=None) -> int:
    """Replace, in meta-built sharded modules, every nn.Linear whose checkpoint weight is FP8 / FP4
    and held by this rank with a QuantLinear of the rank's local shape. Returns how many."""
    from dspark.models.deepseek_v4.weights import tensor_inventory
    from dspark.models.qlinear import QUANT_KINDS, QuantLinear, drafter_param_name
    n = 0
    for name, spec in tensor_inventory(plan.cfg).items():
        if spec.kind not in QUANT_KINDS or (include is not None and not include(name)):
            continue
        shape = plan.local_shape(name, spec.shape)
        if shape is None:
            continue
        root, pname = (drafter, drafter_param_name(name)) if name.startswith("mtp.") else (model, name)
        if root is None:
            continue
        path = pname[:-len(".weight")]
        parent_path, _, leaf = path.rpartition(".")
        parent = root.get_submodule(parent_path) if parent_path else root
        lin = getattr(parent, leaf)
        if isinstance(lin, QuantLinear):              # shared by several stages
            continue
        if not isinstance(lin, nn.Linear):
            raise TypeError(f"{name}: expected an nn.Linear to quantize, found {type(lin).__name__}")
        setattr(parent, leaf, QuantLinear(shape[1], shape[0], spec.kind, dtype))
        n += 1
    return n


def build_rank_model(path: str, cfg, tp: TPGroup, dtype=torch.float32, device="cpu",
                     with_drafter: bool = False, indexer_mode: str = "auto", paged: bool = False,
                     progress: bool = False, weight_format: str = "bf16"):
    """(model, drafter | None) holding rank tp.rank's shard of the checkpoint at `path`, read with
    `load_checkpoint_shard` (only the rank's slices). The modules talk over `tp`.
    weight_format="quantized" keeps the rank's FP8 / FP4 slices quantized (QuantLinear)."""
    from dspark.models.drafter import DSparkDrafter
    from dspark.models.qlinear import drafter_param_name

    from .loader import load_checkpoint_shard
    from .sharding import check_quantized_split
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format={weight_format!r}: use one of {WEIGHT_FORMATS}")
    quantized = weight_format == "quantized"
    check_world_size(cfg, tp.world)
    include = None if with_drafter else lambda n: not n.startswith("mtp.")
    if quantized:
        check_quantized_split(cfg, tp.world, include)
    plan = ShardPlan(cfg, tp.rank, tp.world)
    with torch.device("meta"):
        model = DeepseekV4Model(cfg)
        drafter = DSparkDrafter(cfg) if with_drafter else None
    shard_modules(model, plan, tp, indexer_mode, paged)
    if drafter is not None:
        shard_modules(drafter, plan, tp, indexer_mode, paged)
    if quantized:
        quantize_sharded(model, drafter, plan, dtype, include)
    weights = load_checkpoint_shard(path, cfg, tp.rank, tp.world, dtype=dtype, device=device,
                                    progress=progress, include=include, keep_quantized=quantized)
    assign_weights(model, {k: v for k, v in weights.items() if not k.startswith("mtp.")}, "model")
    if drafter is not None:
        assign_weights(drafter, {drafter_param_name(k): v for k, v in weights.items()
                                 if k.startswith("mtp.")}, "drafter")
    del weights
    if quantized:
        from dspark.models.qlinear import fuse_same_input_linears
        for root in (model, drafter):
            if root is not None:
                fuse_same_input_linears(root)      # the replicated wq_a + wkv, shared w1 + w3
    if torch.device(device).type == "cuda":
        # the stacks the fixed-shape expert paths read, built now (not under graph capture)
        for root in (model, drafter):
            for m in (root.modules() if root is not None else ()):
                if isinstance(m, EPMoE) and m._local():
                    if _holds_fp4(m):
                        m.fp4_stack()
                    else:
                        m._plain_stack()
    return model.eval(), (drafter.eval() if drafter is not None else None)


def _holds_fp4(moe) -> bool:
    from dspark.models.qlinear import QuantLinear
    w1 = moe._local()[0].w1
    return isinstance(w1, QuantLinear) and w1.kind == "fp4"


def build_full_drafter(path: str, cfg, dtype=torch.float32, device="cpu",
                       weight_format: str = "bf16", progress: bool = False):
    """The whole DSpark drafter (every stage unsharded, no collectives) from the checkpoint's
    mtp.* tensors only, as the single-device engine builds it: the drafter a tensor-parallel
    rank 0 runs alone (drafter="replicated")."""
    from dspark.models.drafter import DSparkDrafter
    from dspark.models.deepseek_v4.weights import tensor_inventory
    from dspark.models.qlinear import (QUANT_KINDS, QuantMoE, drafter_param_name,
                                       fuse_same_input_linears, quantize_modules)

    from .loader import load_checkpoint_shard
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format={weight_format!r}: use one of {WEIGHT_FORMATS}")
    quantized = weight_format == "quantized"
    with torch.device("meta"):
        drafter = DSparkDrafter(cfg)
    if quantized:
        quantize_modules(drafter, {drafter_param_name(n)[:-len(".weight")]: s.kind
                                   for n, s in tensor_inventory(cfg).items()
                                   if s.kind in QUANT_KINDS and n.startswith("mtp.")}, dtype)
    weights = load_checkpoint_shard(path, cfg, 0, 1, dtype=dtype, device=device,
                                    progress=progress, include=lambda n: n.startswith("mtp."),
                                    keep_quantized=quantized)
    drafter.load_state_dict({drafter_param_name(k): v for k, v in weights.items()},
                            strict=True, assign=True)
    del weights
    if quantized:
        fuse_same_input_linears(drafter)
        if torch.device(device).type == "cuda" and QuantMoE.grouped_max_pairs:
            for m in drafter.modules():        # ready before any graph capture
                if isinstance(m, QuantMoE):
                    m.stack_experts()
    return drafter.eval()


def fixed_shape_steps(runner, tp: TPGroup, q_lens, max_batch: int, capture: bool):
    """This rank's V4DecodeGraphs over its runner's cache, or None where a captured step could
    not hold an expert path (capture=True with experts that route on the host: eager steps).
    Rank 0 leads (fills the inputs and computes the plan); the others follow: they receive both
    by a broadcast inside the step."""
    from dspark.models.deepseek_v4.graph import V4DecodeGraphs
    if capture and not all(m.fixed_shape_capable() for m in runner.model.modules()
                           if isinstance(m, EPMoE)):
        return None
    backend = runner.backend
    kernels = "triton" if getattr(backend, "name", "") in ("triton", "flashmla") else backend
    share = (lambda t: tp.broadcast(t, src=0)) if tp.world > 1 else None
    return V4DecodeGraphs(runner.model, backend.cache, kernels, q_lens=q_lens,
                          max_batch=max_batch, tap_layers=runner.tap_layers, capture=capture,
                          share_inputs=share, follower=tp.rank > 0)
