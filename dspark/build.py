"""What an Engine runs, built from its EngineConfig: model, drafter, KV cache, attention backend
and runner, for a DeepSeek-V4 checkpoint (its mtp.* DSpark stages as the drafter) or a Qwen3
target (+ a separate DeepSpec drafter checkpoint).

    parts = build_parts(path, config, device, dtype, model_type)
    parts.runner.target_forward(...)

`Engine` owns scheduling and requests; it does not thread settings into these pieces itself.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .config import ModelConfig
from .engine_config import EngineConfig
from .models.deepseek_v4.model import DeepseekV4Model
from .models.drafter import DSparkDrafter
from .models.loader import load_checkpoint
from .runner import DETERMINISTIC_PIECE, ModelRunner, QuantSim


@dataclass
class EngineParts:
    cfg: object                   # ModelConfig (DeepSeek-V4) or Qwen3Config
    model: torch.nn.Module
    drafter: torch.nn.Module | None
    runner: object                # ModelRunner, Qwen3Runner or DistributedRunner
    speculative: str              # "dspark" | "none"
    weight_format: str = "bf16"   # how the weights are held: "bf16" | "quantized"


def build_parts(path: str, c: EngineConfig, device: torch.device, dtype,
                model_type: str | None) -> EngineParts:
    if model_type == "qwen3":
        return _qwen3(path, c, device, dtype)
    return _deepseek_v4(path, c, device, dtype)


def _qwen3(path, c: EngineConfig, device, dtype) -> EngineParts:
    from .qwen3_runner import build_engine_components
    cfg, model, drafter, runner = build_engine_components(
        path, c.draft, dtype, device, c.speculative, c.num_speculative_tokens,
        kv_layout=c.kv_layout, num_kv_blocks=c.num_kv_blocks, max_num_seqs=c.max_num_seqs,
        cuda_graphs=c.cuda_graphs)
    return EngineParts(cfg, model, drafter, runner, "dspark" if drafter is not None else "none")


def _deepseek_v4(path, c: EngineConfig, device, dtype) -> EngineParts:
    tp = c.tensor_parallel_size > 1
    if c.cuda_graphs and tp and c.tensor_parallel_drafter == "sharded":
        raise ValueError("cuda_graphs=True with tensor_parallel_drafter='sharded': the sharded "
                         "draft pass runs eagerly on every rank; use tensor_parallel_drafter="
                         "'replicated' (rank 0 drafts alone, as CUDA graphs) or leave cuda_graphs "
                         "unset")
    cfg = ModelConfig.from_path(path)
    speculative = _speculative(path, cfg, c)
    if c.weight_format == "auto":
        c = dataclasses.replace(c, weight_format=auto_weight_format(
            cfg, device, c.tensor_parallel_size,
            speculative == "dspark" and c.tensor_parallel_drafter == "sharded"))
    tp_runner = None
    if tp:       # every rank reads only its slices
        from .distributed.engine import DistributedRunner
        tp_runner = DistributedRunner.launch(
            path, cfg, c.tensor_parallel_size, device, dtype, drafter=speculative == "dspark",
            progress=c.progress, weight_format=c.weight_format,
            drafter_mode=c.tensor_parallel_drafter, cuda_graphs=c.cuda_graphs,
            max_num_seqs=c.max_num_seqs)
        model, drafter = tp_runner.model, tp_runner.drafter
    else:
        model, drafter = _load_v4_models(path, cfg, c, device, dtype, speculative == "dspark")
    quant = QuantSim() if c.kv_cache_dtype in ("fp8", "auto") else None
    # the V4 target's decode / verify steps as CUDA graphs (fixed-shape plan on the Triton
    # kernels): on by default (None) on CUDA with the Triton backend, where the step allows it
    # (experts not routed on the host); True also under "flashmla" (graph steps then run the
    # Triton attention kernel); False forces the eager target. Under tensor parallelism every
    # rank runs that fixed-shape step with the collectives inside (True on CPU: eagerly)
    # (deterministic mode: with them every forward is uniform graph steps of batch-invariant
    # kernels; without them, e.g. on CPU, one-token eager forwards)
    target_graphs = c.target_cuda_graphs
    if target_graphs is None:
        from .attention import resolve_backend
        target_graphs = (device.type == "cuda" and c.kv_layout == "paged" and resolve_backend(
            c.attention_backend, device, c.kv_cache_dtype) == "triton")
    tp_steps = tp and bool(target_graphs) and c.kv_layout == "paged"
    backend = _paged_backend(cfg, drafter, c, device, target_graphs, tp_steps) \
        if c.kv_layout == "paged" else None
    if tp_runner is not None:
        runner = tp_runner.configure(quant, backend, target_graphs=tp_steps)
    else:
        # the draft pass as CUDA graphs (dspark/draft_pass.py); default on CUDA where the target
        # runs graphs too (deterministic mode without them drafts one request per pass)
        graphs = device.type == "cuda" and (bool(target_graphs) or not c.deterministic) \
            if c.cuda_graphs is None else c.cuda_graphs
        runner = ModelRunner(model, drafter, device, quant, backend=backend, cuda_graphs=graphs,
                             max_num_seqs=c.max_num_seqs, target_graphs=bool(target_graphs),
                             deterministic=c.deterministic)
    return EngineParts(cfg, model, drafter, runner, speculative, c.weight_format)


def auto_weight_format(cfg: ModelConfig, device, tensor_parallel_size: int = 1,
                       sharded_drafter: bool = False) -> str:
    """weight_format="auto": "quantized" for an FP8 / FP4 checkpoint on CUDA (the quantized
    kernels run there, at a quarter of the expert memory) and under tensor parallelism (every
    rank keeps its codes, where each rank's split falls on the scale blocks:
    distributed.sharding.resolve_weight_format), else "bf16" (de-quantized at load: the CPU
    path)."""
    if tensor_parallel_size > 1:
        from .distributed.sharding import resolve_weight_format
        include = None if sharded_drafter else (lambda n: not n.startswith("mtp."))
        return resolve_weight_format(cfg, tensor_parallel_size, "auto", include)
    quantized = cfg.weight_dtype == "fp8" or cfg.expert_format in ("fp8", "fp4")
    return "quantized" if quantized and torch.device(device).type == "cuda" else "bf16"


def _speculative(path, cfg: ModelConfig, c: EngineConfig) -> str:
    """"dspark" when the checkpoint has DSpark stages (unless speculative="none")."""
    speculative = c.speculative
    if speculative is None:
        speculative = "dspark" if cfg.has_dspark else "none"
    if speculative == "dspark" and not cfg.has_dspark:
        raise ValueError(f"{path}: speculative='dspark' needs a DSpark checkpoint (mtp.* draft "
                         f"stages and dspark_block_size in config.json); this one has none. "
                         f"Use speculative='none' or a *-DSpark checkpoint.")
    n = c.num_speculative_tokens
    if speculative == "dspark" and n not in (None, cfg.dspark_block_size):
        raise ValueError(
            f"num_speculative_tokens={n} does not match the checkpoint's "
            f"dspark_block_size={cfg.dspark_block_size}: the drafter's block is bidirectional and "
            f"trained at exactly that width, so other widths change every draft position (and "
            f"collapse acceptance). Leave it unset; to verify fewer tokens per round use a "
            f"verify_policy such as 'threshold' or 'scheduled'.")
    return speculative


def _load_v4_models(path, cfg: ModelConfig, c: EngineConfig, device, dtype, with_drafter: bool):
    """(model, drafter | None) on one device. weight_format "bf16": fp8 / fp4 checkpoint weights
    de-quantized at load to `dtype` (the debug reference); "quantized": kept as FP8 / packed FP4
    + e8m0 scales (dspark.models.qlinear)."""
    from .models.qlinear import format_memory_report, memory_report
    if c.weight_format == "quantized":
        from .models.qlinear import build_quantized_models
        model, drafter = build_quantized_models(path, cfg, dtype, device, with_drafter, c.progress)
    else:
        weights = load_checkpoint(path, cfg, dtype=dtype, device=device, progress=c.progress)
        with torch.device("meta"):
            model = DeepseekV4Model(cfg)
            drafter = DSparkDrafter(cfg) if with_drafter else None
        model.load_state_dict({k: v for k, v in weights.items() if not k.startswith("mtp.")},
                              strict=True, assign=True)
        if drafter is not None:
            drafter.load_state_dict({DSparkDrafter.param_name(k): v for k, v in weights.items()
                                     if k.startswith("mtp.")}, strict=True, assign=True)
        del weights
        model.eval()
        if drafter is not None:
            drafter.eval()
    if c.progress:
        print(format_memory_report(memory_report(model, drafter)))
    return model, drafter


def _paged_backend(cfg: ModelConfig, drafter, c: EngineConfig, device, target_graphs: bool,
                   tp_steps: bool = False):
    """The paged fp8_ds_mla KV cache and the attention backend over it."""
    from .attention import get_backend, resolve_backend
    from .kvcache.paged import PagedKVCache
    name = resolve_backend(c.attention_backend, device, c.kv_cache_dtype)
    # V4 target CUDA graphs (ModelRunner) and the tensor-parallel fixed-shape steps park padding
    # rows in one scratch request: one more sequence slot and one more block than the scheduler
    # hands out
    extra = int(tp_steps or (bool(target_graphs) and device.type == "cuda"
                             and name in ("triton", "flashmla")))
    lookahead = drafter.gamma + 1 if drafter is not None else 0
    if c.deterministic and target_graphs and device.type == "cuda":
        lookahead = max(lookahead, DETERMINISTIC_PIECE - 1)   # prompts as uniform steps
    num_blocks, max_len = c.num_kv_blocks, c.max_model_len
    if num_blocks is None and c.kv_cache_memory is None:
        # room for every sequence at a moderate length (or one at the full model length)
        per_seq = min(max_len or cfg.max_position_embeddings, 2048)
        num_blocks = max(c.max_num_seqs * -(-per_seq // 256),
                         -(-min(max_len or 0, cfg.max_position_embeddings) // 256), 1)
    if num_blocks is not None:
        num_blocks += extra
    cache = PagedKVCache(cfg, device=device, kv_cache_dtype=c.kv_cache_dtype,
                         num_blocks=num_blocks, memory_bytes=c.kv_cache_memory,
                         max_num_seqs=c.max_num_seqs + extra, lookahead=lookahead,
                         max_batch_tokens=c.max_num_batched_tokens + c.max_num_seqs * (lookahead + 1))
    return get_backend(name)(cache)


__all__ = ["EngineParts", "build_parts"]
