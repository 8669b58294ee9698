"""Sampling: per-request parameters, the single logits->probabilities transform, counter-based RNG.

Target and draft go through the same `probs_from_logits`, so the distribution a token was sampled
from is exactly the one verification later reads (spec §4: q must be exact). Randomness is a pure
function of (request seed, absolute position, purpose): no generator state, no host sync, the same
values on CPU and CUDA, and replays are deterministic (spec §5.3).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Sequence

import torch

from dspark import debug
from dspark.formats.sampling import _M32, Purpose, _mix32  # noqa: F401 (Purpose: public here)

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


# the server's range for temperature (OpenAI's); the Python API takes any finite value >= 0
SERVER_MAX_TEMPERATURE = 2.0


def _is_int(x) -> bool:            # numpy integers welcome, bools not
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, vLLM's names and meanings, checked when constructed (ValueError
    naming the field, the value and what is accepted). Token ids are checked against the
    vocabulary when the engine admits the request (`validate(vocab_size)`).

    Logits of the target AND of the drafter go through the same adjustments, in this order
    (dspark/logit_adjust.py): repetition_penalty (prompt and output tokens), frequency and
    presence penalties (output tokens), logit_bias, min_tokens (stop ids masked), min_p; then
    temperature, top_k, top_p (`probs_from_logits`). Speculative acceptance is exact for that law.
    temperature: any finite value >= 0 here (0 = greedy); the server accepts 0-2, as OpenAI.
    top_k: 0 or -1 = off. logprobs / prompt_logprobs: None = off, k >= 0 = the chosen token's
    log-probability plus the k most likely, from the target's raw distribution (log-softmax of
    its logits before any adjustment, vLLM's default)."""
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                         # 0 (or -1) = off
    min_p: float = 0.0
    max_tokens: int = 256
    min_tokens: int = 0
    stop: tuple[str, ...] = ()             # stop strings (the output ends before them)
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None  # None: the engine draws one at admission (keeps replays deterministic)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict | None = None         # {token id: added logit}

    def __post_init__(self):
        if isinstance(self.stop_token_ids, (list, set, frozenset, range)):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        if _is_int(self.top_k) and self.top_k == -1:      # vLLM's spelling of "off"
            object.__setattr__(self, "top_k", 0)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether this request changes logits before temperature (penalties, bias, min_tokens,
        min_p): the engine then runs the adjustment on target and draft rows."""
        return bool(self.logit_bias) or self.min_tokens > 0 or self.min_p > 0 or \
            self.presence_penalty != 0 or self.frequency_penalty != 0 or \
            self.repetition_penalty != 1

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raise ValueError naming the field, the bad value and the accepted range; return self.
        With vocab_size, token ids (stop_token_ids, logit_bias keys) are checked against it."""
        def bad(field, value, accepted):
            raise ValueError(f"SamplingParams.{field}={value!r} is invalid: expected {accepted}")

        def count(field, lo):
            v = getattr(self, field)
            if not _is_int(v) or v < lo:
                bad(field, v, f"an int >= {lo}")

        count("n", 1)
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            bad("temperature", t, "a finite number >= 0 (0 = greedy; the server takes 0-2)")
        p = self.top_p
        if not _is_real(p) or not (0 < p <= 1):  # nan fails the comparison too
            bad("top_p", p, "a number in (0, 1] (1 = off)")
        if not _is_int(self.top_k) or self.top_k < 0:
            bad("top_k", self.top_k, "an int >= 0 (0 or -1 = off)")
        if not _is_real(self.min_p) or not (0 <= self.min_p <= 1):
            bad("min_p", self.min_p, "a number in [0, 1] (0 = off)")
        count("max_tokens", 1)
        count("min_tokens", 0)
        if self.min_tokens > self.max_tokens:
            bad("min_tokens", self.min_tokens, f"at most max_tokens={self.max_tokens}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", self.stop, "a string or a list of non-empty strings")
        hi = vocab_size if vocab_size is not None else _INT64_MAX
        ids_range = f"ints in [0, {vocab_size})" if vocab_size is not None else "ints >= 0"
        if not isinstance(self.stop_token_ids, tuple):
            bad("stop_token_ids", self.stop_token_ids, "a tuple or list of token ids")
        for tok in self.stop_token_ids:
            if not _is_int(tok) or not (0 <= tok < hi):
                bad("stop_token_ids", self.stop_token_ids, ids_range)
        for flag in ("include_stop_str_in_output", "ignore_eos"):
            if not isinstance(getattr(self, flag), bool):
                bad(flag, getattr(self, flag), "a bool")
        if self.seed is not None and (not _is_int(self.seed) or not _INT64_MIN <= self.seed <= _INT64_MAX):
            bad("seed", self.seed, "None or an int in [-2**63, 2**63)")
        for field in ("logprobs", "prompt_logprobs"):
            v = getattr(self, field)
            if v is not None and (not _is_int(v) or not 0 <= v <= (vocab_size or _INT64_MAX)):
                bad(field, v, "None (off) or an int k >= 0 (the chosen token plus the k most "
                              "likely)" + (f", k <= {vocab_size}" if vocab_size else ""))
        for field in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, field)
            if not _is_real(v) or not -2 <= v <= 2:
                bad(field, v, "a number in [-2, 2] (0 = off)")
        r = self.repetition_penalty
        if not _is_real(r) or not (0 < r <= 1e4) or not math.isfinite(r):
            bad("repetition_penalty", r, "a finite number > 0 (1 = off; > 1 discourages repeats)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", self.logit_bias, "a dict {token id: bias}")
            for tok, b in self.logit_bias.items():
                if not _is_int(tok) or not 0 <= tok < hi:
                    bad("logit_bias", self.logit_bias, f"token id keys that are {ids_range}")
                if not _is_real(b) or not -100 <= b <= 100:
                    bad("logit_bias", self.logit_bias, "bias values in [-100, 100]")
        return self

    def all_stop_ids(self, eos_token_ids: Sequence[int] = ()) -> tuple[int, ...]:
        """Stop ids the engine must check: user stop ids plus EOS unless ignore_eos."""
        extra = () if self.ignore_eos else tuple(eos_token_ids)
        return tuple(dict.fromkeys(self.stop_token_ids + extra))

    def __hash__(self):      # logit_bias is a dict: hash its items
        return hash(tuple((f.name, tuple(sorted(v.items())) if isinstance(v, dict) else v)
                          for f in fields(self) for v in [getattr(self, f.name)]))


def filters_used(params: Sequence[SamplingParams]) -> tuple[bool, bool]:
    """(some request filters by top-k, some by top-p): when neither, probs_from_logits skips the
    O(V log V) sort. Decided from host-side params, never from device values."""
    return (any(s.top_k > 0 and not s.greedy for s in params),
            any(s.top_p < 1 and not s.greedy for s in params))


def stack_params(params: Sequence[SamplingParams], device=None):
    """Batch per-request params into (temperature f32[N], top_k i64[N] | None, top_p f32[N] | None).
    top_k / top_p come back as None when no request uses them (`filters_used`)."""
    temperature = torch.tensor([float(s.temperature) for s in params], dtype=torch.float32, device=device)
    use_top_k, use_top_p = filters_used(params)
    top_k = top_p = None
    if use_top_k:
        top_k = torch.tensor([s.top_k for s in params], dtype=torch.int64, device=device)
    if use_top_p:
        top_p = torch.tensor([float(s.top_p) for s in params], dtype=torch.float32, device=device)
    return temperature, top_k, top_p


def probs_from_logits(logits: torch.Tensor, temperature: torch.Tensor,
                      top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None) -> torch.Tensor:
    """float32 probs [N, V] from logits [N, V]; per-row temperature [N], top_k [N] (<= 0 = off),
    top_p [N] (>= 1 = off). Order: temperature, top-k, top-p (on the tempered, top-k-renormalised
    distribution), renormalise. temperature 0 -> one-hot of argmax (first index on ties).
    top_k / top_p may be None (off for every row). Rows must have at least one finite logit."""
    x = logits.float()
    n, v = x.shape
    t = temperature.to(device=x.device, dtype=torch.float32).reshape(n)
    greedy = t <= 0
    x = x / torch.where(greedy, torch.ones_like(t), t).unsqueeze(1)
    if top_k is not None or top_p is not None:
        # stable: equal logits rank by token id (lower first), a function of the logits alone
        # (kernels/sampling_filters.py keeps the same tokens)
        sorted_x, order = x.sort(dim=1, descending=True, stable=True)
        ranks = torch.arange(v, device=x.device).unsqueeze(0)
        if top_k is not None:
            k = top_k.to(device=x.device, dtype=torch.int64).reshape(n, 1)
            k = torch.where(k <= 0, torch.full_like(k, v), k.clamp(max=v))
            sorted_x = sorted_x.masked_fill(ranks >= k, float("-inf"))
        if top_p is not None:
            tp = top_p.to(device=x.device, dtype=torch.float32).reshape(n, 1)
            sp = torch.softmax(sorted_x, dim=1)
            # mass strictly before each token; keep while it is < top_p: the smallest prefix whose
            # mass reaches top_p. Rank 0 is always kept; top_p >= 1 keeps everything exactly
            # (rounding in the cumsum must not drop tail tokens).
            before = torch.nn.functional.pad(sp.cumsum(dim=1)[:, :-1], (1, 0))
            keep = (before < tp) | (tp >= 1) | (ranks == 0)
            sorted_x = sorted_x.masked_fill(~keep, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(1, order, sorted_x)
    # Greedy rows: overwrite in place instead of materialising a one-hot [N, V] and a where();
    # argmax of the untempered logits (x was divided by 1 on those rows, filtering kept rank 0).
    probs = torch.softmax(x, dim=1).masked_fill_(greedy.unsqueeze(1), 0.0)
    top = logits.argmax(dim=1, keepdim=True)
    return probs.scatter_(1, top, torch.where(greedy.unsqueeze(1), 1.0, probs.gather(1, top)))


def argmax_rows(x: torch.Tensor, two_pass: bool | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x.argmax(-1) (first index on ties, NaN counts as the maximum, as torch's), in two passes
    over chunks of the last dim on CUDA: torch's one-pass argmax over a 129k vocabulary row runs
    ~28 us on the H200 (few blocks per row), chunk maxima then the maximum of those ~4 us. The
    first maximal chunk holds the first maximal index, so ties and NaN resolve the same way.
    two_pass: None = on CUDA only (tests force it on CPU). On CUDA, rows of a 2-D tensor take
    the two Triton launches of kernels/argmax.py instead (same result), written straight into
    `out` when given (else `out` gets a copy)."""
    if x.is_cuda and two_pass is None:
        from dspark.kernels import argmax
        if argmax.supported(x):
            return argmax.row_argmax(x, out)
    got = _argmax_torch(x, two_pass)
    return got if out is None else out.copy_(got)


def _argmax_torch(x: torch.Tensor, two_pass: bool | None) -> torch.Tensor:
    V = x.shape[-1]
    chunk = next((c for c in (512, 256, 128) if V % c == 0 and V // c >= 8), 0)
    if not chunk or not (x.is_cuda if two_pass is None else two_pass):
        return x.argmax(-1)
    best, where = x.unflatten(-1, (V // chunk, chunk)).max(-1)           # [..., V / chunk]
    c = best.argmax(-1, keepdim=True)
    return (c * chunk + where.gather(-1, c)).squeeze(-1)


# "auto": the fused sampling kernels on CUDA; "reference": the torch ops here everywhere (the
# default with dspark.debug.REFERENCE_KERNELS); "triton": the kernels everywhere (tests: on CPU
# they need TRITON_INTERPRET=1 before triton is imported, and are slow).
FUSED_BACKEND = "reference" if debug.REFERENCE_KERNELS else "auto"


def fused_sampling_enabled(device) -> bool:
    """Whether sampled draft tokens / sampled verification use the fused Triton kernels
    (dspark/kernels/sampling.py, both validated against this module on an H200) instead of the
    torch ops here (FUSED_BACKEND). Read on every call (a draft pass captured as a CUDA graph
    keys its graphs by the answer). Requests with top-k / top-p take the torch path unless
    `fused_filters_enabled` too."""
    if FUSED_BACKEND not in ("auto", "reference", "triton"):
        raise ValueError(f"sampling FUSED_BACKEND {FUSED_BACKEND!r}: use auto, reference or "
                         "triton")
    return FUSED_BACKEND == "triton" or (FUSED_BACKEND == "auto"
                                         and torch.device(device).type == "cuda")


def fused_filters_enabled(device, rows: int = 1, vocab: int = 0) -> bool:
    """Whether `rows` rows of `vocab` logits with top-k / top-p take the fused kernels as well,
    first filtered by `kernels.sampling_filters.filter_logits` (one launch; the same kept tokens
    as probs_from_logits' top-k, top-p within rounding), when fused sampling is on, where it
    measured faster than the torch path's sort: one program per row streams its row a few
    times, so it wins on small vocabularies and on many rows, not on one long row. H200
    (benchmarks/bench_sampling_filters.py, top-k 50 + top-p 0.9; us torch / fused):
    V 512: 83 / 39 (1 row), 94 / 37 (48 rows); V 32768: 144 / 191 (1), 214 / 190 (6), 371 / 191
    (48); V 129280: 252 / 722 (1), 516 / 723 (6), 1168 / 803 (48). Rule: vocab <= 8192 or
    rows * 4096 >= vocab. Engine, the shipped pair (V 512), batch 1, T = 1, top-k 50, top-p
    0.9: 505 -> 988 tokens/s."""
    if not fused_sampling_enabled(device):
        return False
    return vocab <= 8192 or rows * 4096 >= vocab


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, purpose: int) -> torch.Tensor:
    """Deterministic U[0, 1) float32 keyed by (seed, position, purpose); broadcasts seeds against
    positions (int64 tensors, same device). Pure integer ops on device: no generator, no sync,
    bit-identical on CPU and CUDA. Resolution 2**-24, max value 1 - 2**-24 (< 1 strictly).
    Convention: `position` is the absolute position of the token the uniform decides."""
    seeds = torch.as_tensor(seeds, dtype=torch.int64)
    positions = torch.as_tensor(positions, dtype=torch.int64, device=seeds.device)
    seeds, positions = torch.broadcast_tensors(seeds, positions)
    # Start state depends on the purpose only (host constant); absorb the four 32-bit key words,
    # the position last so neighbouring positions differ right before the final mix.
    h = _mix32(_mix32((0x9E3779B9 * (int(purpose) + 1)) & _M32))
    for word in (seeds & _M32, (seeds >> 32) & _M32, (positions >> 32) & _M32, positions & _M32):
        h = _mix32(h ^ word)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample per row of probs [N, V] (non-negative, need not sum to 1) with u [N] in
    [0, 1). Returns int64 [N]. Never returns a zero-probability token, even when a parallel cumsum
    is not monotone or u * total rounds up to the total (it then takes the last positive token)."""
    probs = probs.float()
    n, v = probs.shape
    cdf = probs.cumsum(dim=1)
    target = u.to(device=probs.device, dtype=torch.float32).reshape(n, 1) * cdf[:, -1:]
    idx = torch.arange(v, device=probs.device).expand(n, v)
    positive = probs > 0
    first = torch.where((cdf > target) & positive, idx, v).amin(dim=1)
    last_positive = torch.where(positive, idx, -1).amax(dim=1)
    return torch.where(first < v, first, last_positive)


__all__ = ["Purpose", "SamplingParams", "filters_used", "fused_sampling_enabled", "stack_params", "probs_from_logits", "uniforms",
           "sample_from_probs"]
