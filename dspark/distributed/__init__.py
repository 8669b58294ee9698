"""Several devices: tensor-parallel attention + expert-parallel MoE (design doc §9b).

    from dspark import Engine
    eng = Engine("/ckpt/DeepSeek-V4-Flash", tensor_parallel_size=8)    # one process per GPU
    eng = Engine(path, tensor_parallel_size=2, tensor_parallel_drafter="sharded")
    ...
    eng.close()                                                         # stops the workers

Every rank runs the single-device fast path on its shard: the fixed-shape decode / verify step
(CUDA graphs on GPU, the collectives captured inside), FP8 / FP4 weights kept quantized
(weight_format="auto" under tensor parallelism), the routed experts expert-parallel with a dense
all-reduce of partials. The drafter is replicated on rank 0 (it drafts alone) or sharded.

Modules: `sharding` (which slice of each tensor a rank holds), `loader` (rank-sharded safetensors
reads with on-slice de-quantization, or the rank's FP8 codes + scale tiles kept quantized), `tp`
(sharded Attention / Indexer and the rank model builder), `ep_moe` (the expert-parallel MoE),
`engine` (DistributedRunner: rank 0 drives, workers execute), `comm` (process groups; NCCL on GPU
with NVLS off, gloo on CPU), `comm_profile` (a step's collectives and their cost).
"""
from .comm import TPGroup, free_port, init_distributed, destroy_distributed
from .sharding import FULL, SKIP, ShardPlan, check_world_size

__all__ = ["TPGroup", "free_port", "init_distributed", "destroy_distributed", "FULL", "SKIP",
           "ShardPlan", "check_world_size", "DistributedRunner", "load_checkpoint_shard",
           "build_rank_model", "shard_modules"]


def __getattr__(name):          # heavier pieces on first use
    if name == "DistributedRunner":
        from .engine import DistributedRunner
        return DistributedRunner
    if name == "load_checkpoint_shard":
        from .loader import load_checkpoint_shard
        return load_checkpoint_shard
    if name in ("build_rank_model", "shard_modules"):
        from . import tp
        return getattr(tp, name)
    raise AttributeError(name)
