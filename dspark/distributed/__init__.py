"""Several devices: tensor-parallel attention + expert-parallel MoE (design doc §9b).

    from dspark import Engine
    eng = Engine("/ckpt/DeepSeek-V4-Flash", tensor_parallel_size=8)    # one process per GPU
    eng = Engine(path, tensor_parallel_size=2, weight_format="quantized")  # FP8 / FP4 kept as stored
    ...
    eng.close()                                                         # stops the workers

Modules: `sharding` (which slice of each tensor a rank holds), `loader` (rank-sharded safetensors
reads with on-slice de-quantization, or the rank's FP8 codes + scale tiles kept quantized), `tp`
(sharded Attention / Indexer / MoE and the rank model builder), `engine` (DistributedRunner: rank 0
drives, workers execute), `comm` (process groups; NCCL on GPU with NVLS off, gloo on CPU).
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
