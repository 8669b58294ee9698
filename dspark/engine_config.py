"""EngineConfig: every setting of an `Engine`, in one frozen dataclass.

    from dspark import Engine, EngineConfig
    eng = Engine(path, config=EngineConfig(max_num_seqs=8, kv_cache_dtype="bf16"))
    eng = Engine(path, max_num_seqs=8, kv_cache_dtype="bf16")        # the same (keyword sugar)

The verify policy's own options (`threshold=0.3`, `num_verify=2`, ...) may be given as keywords
too; they land in `policy_options`. Checks happen in three places, each as early as it can:
  - here, at construction: types, ranges and choices of every field, unknown keys (the error
    lists the valid ones), policy options the chosen verify_policy does not take;
  - `check_environment`: what this process can run (CUDA for device="cuda", a Triton driver for
    attention_backend="triton");
  - `check_applies`: settings that do nothing for the checkpoint's model type (Qwen3 vs
    DeepSeek-V4), its drafter (none with speculative="none") or the KV layout are errors, not
    silently ignored.

deterministic=True (DeepSeek-V4, one device): a request's logits, cache records and tokens are a
function of its prompt, its SamplingParams and its seed alone: the same alone or in any batch,
with any chunking, with speculation on or off, under any verify policy, after preemption. On
CUDA every forward is a series of uniform graph steps (each request's tokens in pieces of up to
8, one piece per step) whose kernels make the same choices for every token count
(dspark/kernels/invariant.py); without the target's graphs (CPU, or target_cuda_graphs=False)
the runner computes every forward one token at a time and the drafter one request at a time.
Sampling is Gumbel-max keyed by (seed, position) (dspark/spec/gumbel.py); the overlapped plain
decode launches those same steps ahead of their read back.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16}
KV_CACHE_DTYPES = ("fp8", "auto", "bf16", "fp32")
ATTENTION_BACKENDS = ("auto", "reference", "triton", "flashmla")


class EngineConfigError(ValueError):
    """An Engine setting is unknown, out of range, or does not apply to this checkpoint/device."""


@dataclass(frozen=True)
class EngineConfig:
    device: str | None = None                  # "cpu", "cuda", "cuda:1"; default: cuda if available
    dtype: Any = None                          # "bf16" | "fp32" | torch dtype; default bf16 on CUDA
    speculative: str | None = None             # "dspark" | "none"; default: dspark if it has a drafter
    num_speculative_tokens: int | None = None  # must equal the drafter's block size when given
    verify_policy: str = "fixed"               # fixed | threshold | scheduled | scheduled-async
    policy_options: dict = field(default_factory=dict)   # keyword arguments of that policy
    sps_table: Any = None                      # scheduled policies' SPS: [[B, ms]] or [[R, q, ms]]
    draft: str | None = None                   # Qwen3 targets: the DeepSpec drafter's directory
    kv_cache_dtype: str = "fp8"                # DeepSeek-V4: fp8 (fp8_ds_mla records) | bf16 | fp32
    kv_layout: str = "paged"                   # "paged" (serving) | "dense" (per-request reference)
    attention_backend: str = "auto"            # DeepSeek-V4 paged: auto | reference | triton | flashmla
    num_kv_blocks: int | None = None           # paged cache pages (256 tokens each)
    kv_cache_memory: int | None = None         # DeepSeek-V4 paged cache size in bytes
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None           # default: the model's positions (or what the cache holds)
    allow_long_max_model_len: bool = False     # max_model_len past max_position_embeddings (warns)
    seed: int = 0
    progress: bool = False
    cpu_threads: int | None = None
    tensor_parallel_size: int = 1              # DeepSeek-V4: one process per device
    tensor_parallel_drafter: str = "replicated"  # "replicated" (rank 0 drafts alone) | "sharded"
    weight_format: str = "auto"                # DeepSeek-V4: "auto" | "bf16" (de-quantize) | "quantized"
    cuda_graphs: bool | None = None            # the draft pass (and Qwen3 steps) as CUDA graphs
    target_cuda_graphs: bool | None = None     # DeepSeek-V4: the target's steps as CUDA graphs
    overlap_decode: bool | None = None         # DeepSeek-V4 single device: overlapped plain decode
    deterministic: bool = False                # a request's tokens independent of batch / speculation

    def __post_init__(self):
        self._check_fields()

    # ---- construction from keywords --------------------------------------------------------
    @classmethod
    def from_kwargs(cls, config: "EngineConfig | None" = None, **kw) -> "EngineConfig":
        """`config` (or the defaults) with `kw` replacing fields; a keyword that is an option of
        a verify policy goes into policy_options. Unknown keywords fail with the valid ones."""
        if config is not None and not isinstance(config, EngineConfig):
            raise EngineConfigError(f"config={config!r}: pass an EngineConfig (or keywords)")
        base = config or cls()
        fields = {f.name for f in dataclasses.fields(cls)}
        options = {k: kw.pop(k) for k in list(kw) if k not in fields and k in policy_option_names()}
        _check_names(kw)
        if options:
            kw["policy_options"] = {**base.policy_options, **kw.get("policy_options", {}), **options}
        return dataclasses.replace(base, **kw) if kw else base

    def replace(self, **kw) -> "EngineConfig":
        return EngineConfig.from_kwargs(self, **kw)

    @property
    def torch_dtype(self):
        return DTYPES[self.dtype] if isinstance(self.dtype, str) else self.dtype

    # ---- checks --------------------------------------------------------------------------
    def _check_fields(self):
        def bad(name, want):
            raise EngineConfigError(f"{name}={getattr(self, name)!r} is not supported: {want}")

        def integer(name, lo, optional=True):
            v = getattr(self, name)
            if v is None and optional:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                bad(name, f"an integer >= {lo}" + (" or None" if optional else ""))

        def choice(name, options):
            if getattr(self, name) not in options:
                bad(name, "one of " + ", ".join(repr(o) for o in options))

        def flag(name, optional=True):
            v = getattr(self, name)
            if not (isinstance(v, bool) or (optional and v is None)):
                bad(name, "True or False" + (" or None (the default for the device)" if optional else ""))

        if self.device is not None:
            try:
                dev = torch.device(self.device)
            except (RuntimeError, TypeError):
                dev = None
            if dev is None or dev.type not in ("cpu", "cuda"):
                bad("device", "'cpu', 'cuda' or 'cuda:<index>' (or None: CUDA when available)")
        if isinstance(self.dtype, str) or self.dtype is None:
            choice("dtype", (None, *DTYPES))
        elif self.dtype not in (torch.float32, torch.bfloat16):
            bad("dtype", "torch.float32, torch.bfloat16 or one of " + ", ".join(DTYPES))
        choice("speculative", (None, "dspark", "none"))
        integer("num_speculative_tokens", 1)
        from .spec.policy import ALIASES, POLICIES
        choice("verify_policy", (*POLICIES, *ALIASES))
        if not isinstance(self.policy_options, dict):
            bad("policy_options", "a dict of the verify policy's keyword arguments")
        takes = policy_option_names(self.verify_policy)
        wrong = sorted(set(self.policy_options) - set(takes))
        if wrong:
            raise EngineConfigError(
                f"{', '.join(wrong)}: not an option of verify_policy={self.verify_policy!r} (it "
                f"takes {', '.join(takes) or 'no options'}); set verify_policy to the policy they "
                f"belong to: "
                + "; ".join(f"{p}: {', '.join(policy_option_names(p))}" for p in POLICIES
                            if p != ALIASES.get(self.verify_policy, self.verify_policy)))
        if self.draft is not None and not isinstance(self.draft, (str, os.PathLike)):
            bad("draft", "the drafter checkpoint's directory")
        choice("kv_cache_dtype", KV_CACHE_DTYPES)
        choice("kv_layout", ("paged", "dense"))
        choice("attention_backend", ATTENTION_BACKENDS)
        integer("num_kv_blocks", 1)
        integer("kv_cache_memory", 1)
        integer("max_num_seqs", 1, optional=False)
        integer("max_num_batched_tokens", 1, optional=False)
        integer("max_model_len", 2)
        flag("allow_long_max_model_len", optional=False)
        integer("seed", 0, optional=False)
        flag("progress", optional=False)
        integer("cpu_threads", 1)
        integer("tensor_parallel_size", 1, optional=False)
        choice("weight_format", ("auto", "bf16", "quantized"))
        choice("tensor_parallel_drafter", ("replicated", "sharded"))
        for name in ("cuda_graphs", "target_cuda_graphs", "overlap_decode"):
            flag(name)
        flag("deterministic", optional=False)
        if self.deterministic:
            self._check_deterministic()
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise EngineConfigError("num_kv_blocks and kv_cache_memory both size the KV cache: "
                                    "give one of them")

    def _check_deterministic(self):
        """deterministic=True runs on one device, with the Gumbel-max sampler."""
        if self.tensor_parallel_size != 1:
            raise EngineConfigError(
                f"tensor_parallel_size={self.tensor_parallel_size} with deterministic=True: "
                f"deterministic mode runs on one device (the all-reduce of the tensor-parallel "
                f"forward is not batch-invariant); use tensor_parallel_size=1 or "
                f"deterministic=False")

    def check_environment(self, device: torch.device) -> None:
        """What this process can run: CUDA for a CUDA device, a Triton driver for the Triton
        attention backend (CUDA, or TRITON_INTERPRET=1 set before triton is imported)."""
        if device.type == "cuda":
            if not torch.cuda.is_available():
                why = ("this torch is a CPU build" if torch.version.cuda is None
                       else "no CUDA device is visible")
                raise EngineConfigError(f"device={self.device!r} needs CUDA, but {why}; use "
                                        f"device='cpu' (or leave device unset)")
            if device.index is not None and device.index >= torch.cuda.device_count():
                raise EngineConfigError(f"device={self.device!r}: only {torch.cuda.device_count()} "
                                        f"CUDA device(s) visible (cuda:0..)")
        if device.type != "cuda" and self.attention_backend in ("triton", "flashmla"):
            interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
            if self.attention_backend == "flashmla" or not interpreted:
                raise EngineConfigError(
                    f"attention_backend={self.attention_backend!r} needs a CUDA device (this engine "
                    f"runs on {device.type}); on CPU use attention_backend='auto' or 'reference'"
                    + ("" if self.attention_backend == "flashmla" else
                       " (the Triton kernels run on CPU only under TRITON_INTERPRET=1, the "
                       "test mode, set before triton is imported)"))

    def _changed(self, name: str) -> bool:
        return getattr(self, name) != getattr(_DEFAULTS, name)

    def check_model_type(self, model_type: str) -> None:
        """Settings that do nothing for this checkpoint's model type or the KV layout are errors
        (each names what it applies to) rather than silently ignored."""
        changed = self._changed
        if model_type == "qwen3" and self.deterministic:
            raise EngineConfigError(
                "deterministic=True is implemented for DeepSeek-V4 checkpoints (their runner has "
                "the token-serial forward); this checkpoint is Qwen3: set deterministic=False")
        if model_type == "qwen3":
            only_v4 = [n for n in _ONLY_V4 if changed(n)]
            if only_v4:
                raise EngineConfigError(
                    f"{', '.join(f'{n}={getattr(self, n)!r}' for n in only_v4)}: DeepSeek-V4 "
                    f"setting(s) that a Qwen3 checkpoint does not use ("
                    + "; ".join(_ONLY_V4[n] for n in only_v4) + "); leave them unset")
        elif self.draft is not None:
            raise EngineConfigError(
                f"draft={self.draft!r}: a separate drafter applies to Qwen3 targets only; a "
                f"DeepSeek-V4 checkpoint carries its DSpark stages (mtp.*); leave draft unset")
        if self.kv_layout == "dense":
            unused = [n for n in ("num_kv_blocks", "kv_cache_memory", "attention_backend")
                      if changed(n)]
            if unused:
                raise EngineConfigError(f"{', '.join(unused)}: paged-cache settings, but "
                                        f"kv_layout='dense' has no paged cache; leave them unset")

    def check_drafter(self, has_drafter: bool) -> None:
        """Without a drafter the verify settings would do nothing: an error naming them."""
        if has_drafter:
            return
        unused = [n for n in ("num_speculative_tokens", "verify_policy", "sps_table")
                  if self._changed(n)] + sorted(self.policy_options)
        if unused:
            raise EngineConfigError(
                f"{', '.join(unused)}: verify settings apply to speculative decoding, but this "
                f"engine decodes without a drafter (speculative='none' or a checkpoint without "
                f"one); leave them unset or use a DSpark checkpoint")

    def check_max_model_len(self, max_position_embeddings: int, cache) -> tuple[int, str]:
        """(max_model_len, what limits it). An explicit max_model_len past the model's positions
        fails unless allow_long_max_model_len (then it warns); one past what the whole KV cache
        holds fails with the pages it has and needs. Unset: the model's positions, or the cache's
        capacity when that is smaller."""
        n = self.max_model_len
        limit = (f"set by max_model_len={n}; raise it for longer requests" if n is not None
                 else "the model's max_position_embeddings")
        if n is not None and n > max_position_embeddings:
            if not self.allow_long_max_model_len:
                raise EngineConfigError(
                    f"max_model_len={n} is past the model's max_position_embeddings="
                    f"{max_position_embeddings} (positions it was not trained on); lower it, or "
                    f"pass allow_long_max_model_len=True to run past them anyway")
            warnings.warn(f"max_model_len={n} is past the model's max_position_embeddings="
                          f"{max_position_embeddings}: outputs past that position are untested",
                          stacklevel=3)
        if n is None:
            n = max_position_embeddings
        if cache is not None:
            pages, size = cache.num_blocks, cache.block_size
            need = -(-n // size)
            sizing = ("num_kv_blocks" if self.num_kv_blocks is not None else
                      "kv_cache_memory" if self.kv_cache_memory is not None else "num_kv_blocks")
            if self.max_model_len is not None and need > pages:
                raise EngineConfigError(
                    f"the KV cache has {pages} page(s) of {size} tokens ({sizing}="
                    f"{getattr(self, sizing)}) but one request of max_model_len={n} tokens needs "
                    f"{need}: raise {sizing} (to >= {need} pages) or lower max_model_len to "
                    f"<= {pages * size}")
            if pages * size < n:
                n, limit = pages * size, (f"what the KV cache holds: {pages} page(s) of {size} "
                                          f"tokens; raise {sizing} for longer requests")
        return n, limit


def _check_names(kw: dict) -> None:
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(kw) - fields)
    if unknown:
        options = [k for k in unknown if k in policy_option_names()]
        raise EngineConfigError(
            f"unknown Engine setting(s) {', '.join(unknown)}; valid settings: "
            f"{', '.join(sorted(fields))}; verify-policy options (Engine keywords, or "
            f"EngineConfig(policy_options={{...}})): {', '.join(policy_option_names())}"
            + (f"; {', '.join(options)}: pass in policy_options" if options else ""))


_dataclass_init = EngineConfig.__init__


@functools.wraps(_dataclass_init)
def _init(self, *args, **kw):
    _check_names(kw)                     # EngineConfig(tpyo=1): the valid names, not a TypeError
    _dataclass_init(self, *args, **kw)


EngineConfig.__init__ = _init


def policy_option_names(policy: str | None = None) -> tuple[str, ...]:
    """Keyword arguments of one verify policy's constructor (all policies when None), except the
    SPS table, which comes from `sps_table`."""
    from .spec.policy import ALIASES, POLICIES
    classes = POLICIES.values() if policy is None else [POLICIES[ALIASES.get(policy, policy)]]
    names = {p for c in classes for p in inspect.signature(c.__init__).parameters}
    return tuple(sorted(names - {"self", "sps"}))


_DEFAULTS = EngineConfig()
# settings of the DeepSeek-V4 path only, and why a Qwen3 target has no use for them
_ONLY_V4 = {
    "kv_cache_dtype": "its K/V cache is in the model dtype",
    "attention_backend": "it has one paged GQA attention path",
    "kv_cache_memory": "its cache is sized by num_kv_blocks",
    "target_cuda_graphs": "its steps run as graphs under cuda_graphs",
    "weight_format": "its weights load as stored",
    "tensor_parallel_size": "tensor parallelism is implemented for DeepSeek-V4 only",
    "tensor_parallel_drafter": "tensor parallelism is implemented for DeepSeek-V4 only",
    "overlap_decode": "the overlapped decode runs on the DeepSeek-V4 runner only",
}

__all__ = ["EngineConfig", "EngineConfigError", "DTYPES", "policy_option_names"]
