"""Which part of every checkpoint tensor rank r of N holds (design doc §9b, "Parallelism in REF").

    plan = ShardPlan(cfg, rank, world)
    plan.slices("layers.3.attn.wq_b.weight")   # (slice(rows), slice(cols)) | FULL | SKIP

* Attention heads are split evenly: rank r owns heads [r*H/N, (r+1)*H/N).
  - `attn.wq_b` and `attn_sink`: the rows of those heads (column-parallel).
  - `attn.wo_a` (grouped, G groups of H/G heads): with G % N == 0 the rank owns G/N whole groups
    (their rows); with N % G == 0 it owns a 1/(N/G) part of one group: that group's rows and the
    input columns of its heads. `attn.wo_b`: the input columns of the rank's groups
    (row-parallel; the partial outputs are summed by an all-reduce).
  - Indexer: `indexer.wq_b` rows and `indexer.weights_proj` rows of the rank's index heads.
* The single KV head (`wkv`, `kv_norm`), `wq_a`, `q_norm`, both compressors, norms, mHC, gates,
  embed and head are replicated.
* Routed experts: rank r owns experts e with e % N == r (expert parallel, interleaved so hot
  neighbouring ids spread over ranks); the others are not read at all.
* Shared expert: `w1`/`w3` rows and `w2` columns of an even split of its intermediate dim; when
  N does not divide it, rank 0 holds it whole and the other ranks skip it.

The same rules apply to the DSpark stages (`mtp.{s}.` prefix). Ranks combine partial results with
one all-reduce after the attention output projection and one after the MoE.

Quantized weights kept quantized (`weight_format="quantized"`): a rank holds the e4m3 codes of its
rows/columns of an FP8 weight and the 128x128 UE8M0 scale tiles under them, so each split must fall
on the scale blocks: a local range must start on a multiple of 128 or lie inside one 128-block
(then its one scale tile applies to all of it: e.g. 32 of 64 index heads' `weights_proj` rows).
FP4 experts are never split (a rank owns whole experts, kept packed); an FP4 column split must start
on a 32-column scale group. `check_quantized_split(cfg, world)` checks every tensor of every rank.
"""
from __future__ import annotations

import re

from dspark.config import ModelConfig

FULL = ()            # the whole tensor
SKIP = None          # not held by this rank

_BLOCK = re.compile(r"^(?:layers|mtp)\.\d+\.(.*)$")
_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")
_SHARED = re.compile(r"^ffn\.shared_experts\.(w[123])\.weight$")


def _even(n: int, rank: int, world: int) -> slice:
    per = n // world
    return slice(rank * per, (rank + 1) * per)


def check_world_size(cfg: ModelConfig, world: int) -> None:
    """Raise ValueError unless `world` ranks can split this model's heads and output groups."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size={world}: must be >= 1")
    H, G, HI = cfg.num_attention_heads, cfg.o_groups, cfg.index_n_heads
    problems = []
    if H % world:
        problems.append(f"num_attention_heads={H} is not divisible by {world}")
    if HI % world:
        problems.append(f"index_n_heads={HI} is not divisible by {world}")
    if G % world and world % G:
        problems.append(f"o_groups={G} and {world} do not divide one another")
    if problems:
        ok = [n for n in range(1, H + 1) if H % n == 0 and HI % n == 0 and (G % n == 0 or n % G == 0)]
        raise ValueError(f"tensor_parallel_size={world} cannot shard this model: "
                         f"{'; '.join(problems)}. Valid sizes: {ok}")


FP8_TILE, FP4_GROUP_COLS = 128, 32


def quantized_range_ok(start: int, stop: int, block: int) -> bool:
    """True when rows/cols [start, stop) of a block-scaled tensor, taken as a tensor of their own,
    see the same scale for every element: the range starts on a block boundary (local blocks are
    the global ones, shifted) or lies inside one block (one scale for all of it)."""
    return stop <= start or start % block == 0 or start // block == (stop - 1) // block


def quantized_split_problem(name: str, kind: str, shape: tuple, sl) -> str | None:
    """Why this rank's part `sl` of quantized tensor `name` cannot stay quantized (None: it can)."""
    if sl is SKIP or not sl:
        return None
    for d, (s, n) in enumerate(zip(sl, shape)):
        a, b, step = s.indices(n)
        if step != 1:
            return f"{name}: non-contiguous split"
        if (a, b) == (0, n):
            continue
        block = FP8_TILE if kind == "fp8" else (FP4_GROUP_COLS if d == 1 else 1)
        ok = quantized_range_ok(a, b, block) if kind == "fp8" else (a % block == 0)
        if not ok:
            what = ("128x128 FP8 scale blocks" if kind == "fp8"
                    else "32-column FP4 scale groups")
            return (f"{name} {tuple(shape)}: this rank's {('rows', 'columns')[d]} {a}:{b} do not "
                    f"fall on its {what}")
    return None


def check_quantized_split(cfg: ModelConfig, world: int, include=None) -> None:
    """Raise ValueError unless every rank's part of every FP8 / FP4 tensor can be held quantized
    (see module docstring); `include(name)` limits the tensors checked."""
    from dspark.models.deepseek_v4.weights import tensor_inventory
    check_world_size(cfg, world)
    if world == 1:
        return
    inv = {n: s for n, s in tensor_inventory(cfg).items() if s.kind in ("fp8", "fp4")
           and (include is None or include(n))}
    for rank in range(world):
        plan = ShardPlan(cfg, rank, world)
        for name, spec in inv.items():
            why = quantized_split_problem(name, spec.kind, spec.shape, plan.slices(name))
            if why:
                raise ValueError(
                    f"weight_format='quantized' with tensor_parallel_size={world}: rank {rank}'s "
                    f"part of {why} (a split must start on a multiple of the block or lie inside "
                    f"one block, so the rank's scales are a slice of the checkpoint's). Use "
                    f"weight_format='bf16' (de-quantize at load) or another tensor_parallel_size")


def resolve_weight_format(cfg, world: int, weight_format: str, include=None) -> str:
    """weight_format="auto" under tensor parallelism: "quantized" for an FP8 / FP4 checkpoint
    whose every rank's split falls on the scale blocks (each rank runs the quantized kernels on
    its codes), else "bf16"."""
    if weight_format not in ("auto", "bf16", "quantized"):
        raise ValueError(f"weight_format={weight_format!r}: use 'auto', 'bf16' or 'quantized'")
    if weight_format != "auto":
        return weight_format
    if not (cfg.weight_dtype == "fp8" or cfg.expert_format in ("fp8", "fp4")):
        return "bf16"
    try:
        check_quantized_split(cfg, world, include)
    except ValueError:
        return "bf16"
    return "quantized"


class ShardPlan:
    def __init__(self, cfg: ModelConfig, rank: int, world: int):
        check_world_size(cfg, world)
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside [0, {world})")
        self.cfg, self.rank, self.world = cfg, rank, world
        H, hd, G, R = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
        self.local_heads = H // world
        self.heads = _even(H, rank, world)
        self.index_heads = _even(cfg.index_n_heads, rank, world)
        self.local_index_heads = cfg.index_n_heads // world
        if G % world == 0:                         # whole groups per rank
            gpr = G // world
            self.local_groups = gpr
            self.wo_a_rows = slice(rank * gpr * R, (rank + 1) * gpr * R)
            self.wo_a_cols = slice(None)
        else:                                      # world % G == 0: part of one group per rank
            m = world // G
            g, p = divmod(rank, m)
            w = H * hd // world
            self.local_groups = 1
            self.wo_a_rows = slice(g * R, (g + 1) * R)
            self.wo_a_cols = slice(p * w, (p + 1) * w)
        self.wo_b_cols = self.wo_a_rows
        self.local_experts = [e for e in range(cfg.n_routed_experts) if e % world == rank]
        inter = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_split = inter % world == 0
        self.holds_shared = self.shared_split or rank == 0
        self.shared_rows = _even(inter, rank, world) if self.shared_split else slice(None)

    def owns_expert(self, e: int) -> bool:
        return e % self.world == self.rank

    def slices(self, name: str):
        """FULL, SKIP, or one python slice per dimension for checkpoint tensor `name`."""
        m = _BLOCK.match(name)
        if m is None or self.world == 1:
            return FULL
        rest, hd, dI = m.group(1), self.cfg.head_dim, self.cfg.index_head_dim
        if rest == "attn.wq_b.weight":
            return (slice(self.heads.start * hd, self.heads.stop * hd), slice(None))
        if rest == "attn.attn_sink":
            return (self.heads,)
        if rest == "attn.wo_a.weight":
            return (self.wo_a_rows, self.wo_a_cols)
        if rest == "attn.wo_b.weight":
            return (slice(None), self.wo_b_cols)
        if rest == "attn.indexer.wq_b.weight":
            return (slice(self.index_heads.start * dI, self.index_heads.stop * dI), slice(None))
        if rest == "attn.indexer.weights_proj.weight":
            return (self.index_heads, slice(None))
        e = _EXPERT.match(rest)
        if e is not None:
            return FULL if self.owns_expert(int(e.group(1))) else SKIP
        s = _SHARED.match(rest)
        if s is not None:
            if not self.holds_shared:
                return SKIP
            if not self.shared_split:
                return FULL
            if s.group(1) == "w2":                 # row-parallel: its input columns
                return (slice(None), self.shared_rows)
            return (self.shared_rows, slice(None))
        return FULL

    def local_shape(self, name: str, shape: tuple) -> tuple | None:
        """Shape of this rank's part of a tensor of logical `shape` (None when skipped)."""
        sl = self.slices(name)
        if sl is SKIP:
            return None
        out = list(shape)
        for d, s in enumerate(sl):
            out[d] = len(range(*s.indices(shape[d])))
        return tuple(out)


def take(t, sl):
    """Apply a plan entry to a full tensor (FULL returns t itself)."""
    if sl is SKIP:
        raise ValueError("tensor is not held by this rank")
    return t[sl] if sl else t
