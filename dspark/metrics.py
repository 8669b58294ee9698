"""Speculative-decoding metrics (spec §7), per request and aggregated.

Denominators (stated because every engine defines them differently):
  proposed = drafts produced (γ per drafting round), verified = drafts sent to the target (ℓ; the
  denominator of the acceptance rate under confidence scheduling), accepted = drafts kept.
  Mean accepted length τ = emitted tokens / rounds, bonus included (paper, DeepSpec accept_len);
  a round cut by a stop token counts only what it emitted.
Every field is additive, so merging is a field-wise sum.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Iterable


def _ratio(num, den):
    return num / den if den else 0.0


def _add_lists(x, y):
    n = max(len(x), len(y))
    return [(x[i] if i < len(x) else 0) + (y[i] if i < len(y) else 0) for i in range(n)]


def _count(hist: list, lo: int, hi: int) -> None:
    """hist[k] += 1 for lo <= k < hi, the list grown with zeros as needed."""
    if len(hist) < hi:
        hist.extend([0] * (hi - len(hist)))
    for k in range(lo, hi):
        hist[k] += 1


@dataclass
class SpecMetrics:
    rounds: int = 0
    proposed: int = 0          # draft tokens produced
    verified: int = 0          # draft tokens verified by the target
    accepted: int = 0          # draft tokens accepted (and emitted)
    emitted: int = 0           # tokens emitted by speculative rounds (accepted + bonus/corrected)
    tau_hist: list = field(default_factory=list)      # tau_hist[t] = rounds that emitted t tokens
    pos_verified: list = field(default_factory=list)  # [k]: rounds that verified 0-based position k
    pos_reached: list = field(default_factory=list)   # [k]: ... verified k with all of 0..k-1 accepted
    pos_accepted: list = field(default_factory=list)  # [k]: rounds that accepted position k
    requests: int = 0
    ttft_sum: float = 0.0      # seconds, summed over requests that reported a first token
    ttft_count: int = 0
    decode_time: float = 0.0   # seconds from first to last token, summed
    decode_tokens: int = 0     # tokens after the first, summed

    def record_round(self, verified: int, accepted: int, emitted: int, proposed: int) -> None:
        """One speculative round of one request. emitted = accepted + 1 normally; fewer when a
        stop token / max_tokens cut the round (then accepted counts only the emitted drafts)."""
        if not 0 <= accepted <= verified <= proposed:
            raise ValueError(f"need 0 <= accepted ({accepted}) <= verified ({verified}) "
                             f"<= proposed ({proposed})")
        if not accepted <= emitted <= accepted + 1:
            raise ValueError(f"emitted ({emitted}) must be accepted ({accepted}) or accepted + 1")
        self.rounds += 1
        self.proposed += proposed
        self.verified += verified
        self.accepted += accepted
        self.emitted += emitted
        # counted in place: this runs per request and round (rebuilding the lists cost ~15 us)
        _count(self.tau_hist, emitted, emitted + 1)
        _count(self.pos_verified, 0, verified)
        _count(self.pos_reached, 0, min(accepted + 1, verified))
        _count(self.pos_accepted, 0, accepted)

    def record_timing(self, ttft: float | None = None, decode_time: float = 0.0,
                      decode_tokens: int = 0) -> None:
        """Per-request timing at finish: time to first token, and first->last token span."""
        self.requests += 1
        if ttft is not None:
            self.ttft_sum += ttft
            self.ttft_count += 1
        self.decode_time += decode_time
        self.decode_tokens += decode_tokens

    # ---- derived -----------------------------------------------------------------------------
    @property
    def mean_accepted_length(self) -> float:
        """τ: emitted tokens per round, bonus included."""
        return _ratio(self.emitted, self.rounds)

    @property
    def acceptance_rate(self) -> float:
        """accepted / verified drafts."""
        return _ratio(self.accepted, self.verified)

    @property
    def verify_rate(self) -> float:
        """Emitted tokens per verified slot, the anchor slot included (DeepSpec verify_rate)."""
        return _ratio(self.emitted, self.verified + self.rounds)

    @property
    def per_position_rate(self) -> list:
        """vLLM per-position acceptance: fraction of rounds that accepted position k."""
        return [_ratio(a, self.rounds) for a in self.pos_accepted]

    @property
    def accept_rate_at(self) -> list:
        """DeepSpec accept_rate@k: rounds accepting k / rounds verifying k."""
        return [_ratio(a, v) for a, v in zip(self.pos_accepted, self.pos_verified)]

    @property
    def conditional_acceptance(self) -> list:
        """Paper Fig. 2: P(position k accepted | 1..k-1 accepted and k verified)."""
        return [_ratio(a, r) for a, r in zip(self.pos_accepted, self.pos_reached)]

    @property
    def ttft(self) -> float:
        return _ratio(self.ttft_sum, self.ttft_count)

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first (token-weighted when aggregated)."""
        return _ratio(self.decode_time, self.decode_tokens)

    def check(self) -> None:
        """Raise ValueError if an invariant is broken (accepted <= verified <= proposed, ...)."""
        if not 0 <= self.accepted <= self.verified <= self.proposed:
            raise ValueError(f"invariant broken: accepted {self.accepted} <= verified "
                             f"{self.verified} <= proposed {self.proposed}")
        if sum(self.pos_accepted) != self.accepted or sum(self.pos_verified) != self.verified:
            raise ValueError("per-position counts do not sum to the totals")
        if not all(a <= r <= v for a, r, v in zip(self.pos_accepted, self.pos_reached, self.pos_verified)):
            raise ValueError("per-position counts must satisfy accepted <= reached <= verified")
        tau_total = sum(t * c for t, c in enumerate(self.tau_hist))
        if sum(self.tau_hist) != self.rounds or tau_total != self.emitted:
            raise ValueError("accepted-length histogram does not match rounds / emitted")

    def merge(self, other: "SpecMetrics") -> "SpecMetrics":
        """Field-wise sum (new object)."""
        out = SpecMetrics()
        for f in fields(self):
            x, y = getattr(self, f.name), getattr(other, f.name)
            setattr(out, f.name, _add_lists(x, y) if isinstance(x, list) else x + y)
        return out

    def summary(self) -> dict:
        """Flat dict for logs: totals plus derived values."""
        return {"rounds": self.rounds, "proposed": self.proposed, "verified": self.verified,
                "accepted": self.accepted, "emitted": self.emitted,
                "mean_accepted_length": self.mean_accepted_length,
                "acceptance_rate": self.acceptance_rate, "verify_rate": self.verify_rate,
                "per_position_rate": self.per_position_rate,
                "conditional_acceptance": self.conditional_acceptance,
                "ttft": self.ttft, "tpot": self.tpot}


def aggregate(items: Iterable[SpecMetrics]) -> SpecMetrics:
    out = SpecMetrics()
    for m in items:
        out = out.merge(m)
    return out


def record_batch(metrics: list, proposed: int, verified, accepted, emitted) -> None:
    """Record one round for each request of a batch. verified / accepted / emitted: int tensors
    or sequences [R] aligned with `metrics` (one host transfer for the whole batch)."""
    cols = [x.tolist() if hasattr(x, "tolist") else list(x) for x in (verified, accepted, emitted)]
    for m, v, a, e in zip(metrics, *cols):
        m.record_round(int(v), int(a), int(e), proposed)


__all__ = ["SpecMetrics", "aggregate", "record_batch"]
