"""Verify-length policies (spec §6): how many of each request's γ drafts to verify next step.

All policies map confidence logits [R, γ] to lengths ℓ int64 [R] on the same device. Survival
a_{r,j} = Π_{i<=j} σ(l_{r,i} / T_i) is non-increasing in j, and every policy admits (r, j) only from
information about a_{r,<=j} (never a later position, which depends on the sampled x_{r,j}): that
is what keeps confidence scheduling lossless (spec §6.2, Appendix A).

Where the engine pads every verify block of a round to one width (CUDA-graph steps), the
scheduled policies choose that width on the host from earlier blocks' survivals (`host_width`,
`HostHistory`): the engine then queues the verify step while the draft pass still runs, as with
the fixed policy. The width is a function of blocks that lie wholly before every request's
anchor: of none of the draws the verified block is made of, so verification stays lossless.
"""
from __future__ import annotations

import collections
import math
from typing import Hashable, Sequence

import numpy as np
import torch


class SpsTable:
    """SPS(B): engine steps per second at B verify tokens (spec §6.4), stored as step time.

    Step time is made non-decreasing in B by a cumulative max (a bigger batch is never faster;
    measurement noise must not invent a cheaper bucket). Lookup is a ceiling: B is padded to the
    next measured bucket, with no interpolation inside a bucket. Past the largest bucket the step
    time is extrapolated linearly from the last two buckets (proportionally to B when only one
    point is known)."""

    def __init__(self, batch_sizes: Sequence[int], step_ms: Sequence[float]):
        if len(batch_sizes) == 0 or len(batch_sizes) != len(step_ms):
            raise ValueError(f"SpsTable needs >= 1 (B, ms) points with matching lengths, "
                             f"got {len(batch_sizes)} sizes and {len(step_ms)} times")
        pts = sorted(zip(batch_sizes, step_ms))
        bs = [int(b) for b, _ in pts]
        if any(b < 1 or b != bb for b, (bb, _) in zip(bs, pts)) or len(set(bs)) != len(bs):
            raise ValueError(f"SpsTable batch sizes must be distinct ints >= 1, got {sorted(batch_sizes)}")
        ms = [float(t) for _, t in pts]
        if not all(math.isfinite(t) and t > 0 for t in ms):
            raise ValueError(f"SpsTable step times must be finite and > 0 ms, got {ms}")
        self.buckets = bs
        self.ms = np.maximum.accumulate(np.asarray(ms, dtype=np.float64)).tolist()
        if len(bs) > 1:
            self._slope = (self.ms[-1] - self.ms[-2]) / (bs[-1] - bs[-2])
        else:
            self._slope = self.ms[0] / bs[0]
        self._dev_cache: dict = {}  # device -> float64 SPS(B) for B = 0..n-1
        self._width_cache: dict = {}  # (R, γ) -> SPS(R(1 + w)) for w = 0..γ
        self._widths_dev: dict = {}   # (R, γ, device) -> the same on the device

    @classmethod
    def from_sps(cls, points: Sequence[Sequence[float]]) -> "SpsTable":
        """From [(B, steps_per_second), ...]."""
        if any(not s > 0 for _, s in points):
            raise ValueError(f"steps per second must be > 0, got {[s for _, s in points]}")
        return cls([b for b, _ in points], [1000.0 / s for _, s in points])

    @classmethod
    def from_ms(cls, points: Sequence[Sequence[float]]) -> "SpsTable":
        """From [[B, step_ms], ...] (the user override format of spec §6.4)."""
        return cls([b for b, _ in points], [t for _, t in points])

    def step_ms(self, b):
        """Step time in ms at B verify tokens (int or int array)."""
        b_arr = np.asarray(b)
        idx = np.searchsorted(self.buckets, b_arr, side="left")  # first bucket >= B
        inside = np.asarray(self.ms + [0.0])[np.minimum(idx, len(self.buckets))]
        out = np.where(b_arr > self.buckets[-1],
                       self.ms[-1] + self._slope * (b_arr - self.buckets[-1]), inside)
        return float(out) if out.ndim == 0 else out

    def sps(self, b):
        """Steps per second at B verify tokens (int or int array)."""
        return 1000.0 / self.step_ms(b)

    def sps_range(self, lo: int, hi: int) -> np.ndarray:
        """SPS(B) for B = lo..hi inclusive, float64."""
        return self.sps(np.arange(lo, hi + 1))

    def sps_device(self, lo: int, hi: int, device) -> torch.Tensor:
        """SPS(B) for B = lo..hi as a float64 tensor on `device`. Served from a per-device cache
        (grown by doubling) so a step's lookup is a slice: no host->device copy, hence no sync."""
        cache = self._dev_cache
        key = str(torch.device(device))
        if key not in cache or cache[key].numel() <= hi:
            size = max(hi + 1, 2 * cache[key].numel() if key in cache else 1024)
            cache[key] = torch.as_tensor(self.sps(np.arange(size)), dtype=torch.float64, device=device)
        return cache[key][lo:hi + 1]

    def sps_widths(self, r_count: int, g: int) -> np.ndarray:
        """SPS at B = R(1 + w) for w = 0..γ (R requests that each verify w drafts), float64.
        Cached per (R, γ): a round's lookup on the host is one dict read."""
        key = (r_count, g)
        if key not in self._width_cache:
            self._width_cache[key] = self.sps(r_count * np.arange(1, g + 2))
        return self._width_cache[key]

    def sps_widths_device(self, r_count: int, g: int, device) -> torch.Tensor:
        """`sps_widths` as a float64 tensor on `device`, cached per (R, γ, device): after a
        request count's first round its lookup copies nothing to the device (no sync)."""
        key = (r_count, g, str(torch.device(device)))
        if key not in self._widths_dev:
            self._widths_dev[key] = torch.as_tensor(self.sps_widths(r_count, g),
                                                    dtype=torch.float64, device=device)
        return self._widths_dev[key]

    def to_list(self) -> list[list[float]]:
        """[[B, ms], ...] after the monotone fix, for logs."""
        return [[b, t] for b, t in zip(self.buckets, self.ms)]


def confidence(conf_logits: torch.Tensor, temperatures=None) -> torch.Tensor:
    """fp32 per-position confidence σ(l_k / T_k) [R, γ]; T = optional STS temperatures (length γ).
    NaN logits count as 0 confidence (never admitted)."""
    z = conf_logits.float()
    if temperatures is not None:
        t = torch.as_tensor(temperatures, dtype=torch.float32, device=z.device)
        if t.shape != z.shape[-1:]:
            raise ValueError(f"STS temperatures must have γ={z.shape[-1]} entries, got {tuple(t.shape)}")
        z = z / t
    return torch.nan_to_num(torch.sigmoid(z), nan=0.0)


def survival(conf_logits: torch.Tensor, temperatures=None) -> torch.Tensor:
    """fp32 cumulative survival a_j = Π_{i<=j} σ(l_i / T_i), [R, γ], non-increasing in j."""
    return confidence(conf_logits, temperatures).cumprod(dim=-1)


def expected_tokens(surv: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Expected emitted tokens per request, 1 + Σ_{j<=ℓ} a_j (float32 [R])."""
    keep = torch.arange(surv.shape[1], device=surv.device) < lengths.to(surv.device).unsqueeze(1)
    return 1.0 + (surv * keep).sum(dim=1)


def modelled_throughput(surv: torch.Tensor, lengths: torch.Tensor, sps: SpsTable) -> float:
    """Θ = τ · SPS(B), τ = Σ_r expected tokens, B = Σ_r (1 + ℓ_r) (spec §6.1). Host float."""
    tau = float(expected_tokens(surv, lengths).double().sum())
    return tau * sps.sps(int(lengths.sum()) + surv.shape[0])


def _ordered_candidates(surv: torch.Tensor):
    """All (r, j) sorted by survival desc, then position asc, then request asc. Flattening j-major
    makes the (j, r) tie order the input order, which a stable sort preserves."""
    r_count = surv.shape[0]
    flat = surv.t().reshape(-1)
    order = torch.sort(flat, descending=True, stable=True).indices
    return flat[order], order % r_count


def _lengths_from_admitted(rows: torch.Tensor, admitted: torch.Tensor, r_count: int) -> torch.Tensor:
    # Admitted slots of a request form a prefix (survival monotone + tie order), so ℓ_r = count.
    return torch.zeros(r_count, dtype=torch.long, device=rows.device).scatter_add_(0, rows, admitted.long())


class VerifyPolicy:
    """Base: __call__(conf_logits [R, γ], request_ids=None, temperatures=None) -> ℓ int64 [R].
    `temperatures` (per call) overrides the policy's STS temperatures; the policy's own are
    cached on the logits' device, so steady-state calls do no host->device copy."""
    name = "base"

    def __init__(self, temperatures=None):
        self.temperatures = temperatures
        self._temps_dev: dict = {}
        self._temps_host = None

    def __call__(self, conf_logits: torch.Tensor, request_ids: Sequence[Hashable] | None = None,
                 temperatures=None) -> torch.Tensor:
        if conf_logits.dim() != 2:
            raise ValueError(f"confidence logits must be [R, γ], got {tuple(conf_logits.shape)}")
        if temperatures is None and self.temperatures is not None:
            key = str(conf_logits.device)
            if key not in self._temps_dev:
                self._temps_dev[key] = torch.as_tensor(self.temperatures, dtype=torch.float32,
                                                       device=conf_logits.device)
            temperatures = self._temps_dev[key]
        conf = confidence(conf_logits, temperatures)
        return self.lengths(conf, conf.cumprod(dim=1), request_ids)

    def lengths(self, conf: torch.Tensor, surv: torch.Tensor, request_ids) -> torch.Tensor:
        """ℓ int64 [R] from per-position confidences and survivals (both fp32 [R, γ])."""
        raise NotImplementedError

    def host_lengths(self, num_requests: int, gamma: int) -> list | None:
        """ℓ per request when the policy decides it without the confidences (then the engine
        need not wait for the draft pass to read them); None when it needs them."""
        return None

    def host_width(self, request_ids: Sequence[Hashable], positions: Sequence[int],
                   conf_logits: torch.Tensor) -> int | None:
        """Where the runner pads a round to one width: that width, every request's ℓ, decided
        from what is on the host already (earlier rounds), so the engine need not wait for the
        draft pass. `positions`: each request's anchor position (the block drafts the γ after
        it); `conf_logits` [R, γ] (on the device, maybe not computed yet) are kept for later
        rounds without a wait. None: the policy needs this round's confidences read."""
        return None

    def host_survival(self, z: np.ndarray) -> np.ndarray:
        """survival() on the host, float64 [R, γ], of confidence logits read back [R, γ]."""
        z = z.astype(np.float64)
        if self.temperatures is not None:
            if self._temps_host is None:
                self._temps_host = np.asarray(self.temperatures, dtype=np.float64)
            z = z / self._temps_host
        conf = 0.5 + 0.5 * np.tanh(0.5 * z)     # σ(z) without exp's overflow warning at -inf
        conf[np.isnan(conf)] = 0.0               # as confidence(): NaN is never admitted
        return conf.cumprod(axis=1)


class FixedPolicy(VerifyPolicy):
    """Verify min(num_verify, γ) drafts for every request (default: the whole block)."""
    name = "fixed"

    def __init__(self, num_verify: int | None = None, temperatures=None):
        super().__init__(temperatures)
        if num_verify is not None and num_verify < 0:
            raise ValueError(f"num_verify must be >= 0, got {num_verify}")
        self.num_verify = num_verify

    def _length(self, gamma: int) -> int:
        return gamma if self.num_verify is None else min(self.num_verify, gamma)

    def lengths(self, conf, surv, request_ids=None):
        return torch.full((surv.shape[0],), self._length(surv.shape[1]), dtype=torch.long,
                          device=surv.device)

    def host_lengths(self, num_requests: int, gamma: int) -> list:
        return [self._length(gamma)] * num_requests


class ThresholdPolicy(VerifyPolicy):
    """mode="cumulative" (vLLM): ℓ = #{j : a_j >= θ}. mode="per_position" (DeepSpec eval):
    ℓ = index of the first position whose own confidence σ(l_k/T_k) < θ. θ = 0 = fixed."""
    name = "threshold"

    def __init__(self, threshold: float = 0.5, mode: str = "cumulative", temperatures=None):
        super().__init__(temperatures)
        if not 0 <= threshold <= 1:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        if mode not in ("cumulative", "per_position"):
            raise ValueError(f"threshold mode must be 'cumulative' or 'per_position', got {mode!r}")
        self.threshold, self.mode = threshold, mode

    def lengths(self, conf, surv, request_ids=None):
        if self.mode == "cumulative":
            return (surv >= self.threshold).long().sum(dim=1)
        return (conf >= self.threshold).long().cumprod(dim=1).sum(dim=1)


def _positive_prefix(surv: torch.Tensor) -> torch.Tensor:
    """int64 [R]: positions before each request's first zero survival (never admitted)."""
    return (surv > 0).long().cumprod(dim=1).sum(dim=1)


def _uniform_theta(tau_rows: torch.Tensor, r_count: int, sps: SpsTable) -> torch.Tensor:
    """Θ(w) for w = 0..γ when every request verifies w drafts: τ(w) = R + Σ_r Σ_{j<=w} a_{r,j}
    (from per-position sums `tau_rows` [γ]) times the SPS of a round of R requests at width w
    (`SpsTable.sps_widths`: at B = R·(1 + w) tokens; an SpsGrid prices the round's shape)."""
    g = tau_rows.shape[0]
    tau = r_count + torch.nn.functional.pad(tau_rows.double().cumsum(0), (1, 0))
    return tau * sps.sps_widths_device(r_count, g, tau_rows.device)


def _host_theta(tau_rows: np.ndarray, r_count: int, sps: SpsTable) -> np.ndarray:
    """_uniform_theta on the host (float64 numpy): Θ(w) for w = 0..γ."""
    tau = r_count + np.concatenate(([0.0], tau_rows.cumsum()))
    return tau * sps.sps_widths(r_count, tau_rows.shape[0])


class _Round:
    """One recorded round of HostHistory: request id -> row, the rows on the host, and each
    block's anchor position (None where not given)."""
    __slots__ = ("step", "index", "event", "rows", "positions", "convert", "_survival")

    def __init__(self, step, index, event, rows, positions, convert):
        self.step, self.index, self.event, self.rows = step, index, event, rows
        self.positions, self.convert, self._survival = positions, convert, None

    def survival(self) -> np.ndarray:
        """The rows as survivals [R, γ] (float64): waits for this round's copy (long done by
        then), converted once into a new array, so the buffer can be reused."""
        if self._survival is None:
            if self.event is not None:
                self.event.synchronize()
            self._survival = self.convert(self.rows)
        return self._survival


class HostHistory:
    """Per-request rows of recent rounds' [R, γ] tensors (confidence logits or survivals), on
    the host, for widths decided from earlier rounds only.

    `record` starts a round's copy without waiting for the device: into one of a ring of host
    buffers (pinned on CUDA), an event recorded after it. A round's rows are read a round later
    at the earliest (`stale`); in the engine the host has read a later round's acceptance by
    then, queued after this copy, so the event is long complete. The numpy views are made once
    per buffer: a read is no tensor call.

    Which row a request may use: one of a round `staleness` or more rounds back and, where the
    blocks' anchor positions are given, of a block that lies wholly before the request's anchor
    now (P_then + γ <= P_now). Drafts are drawn with uniforms keyed by (seed, position), and a
    block's confidences past its first rejection were computed from draws at positions the next
    blocks draw at again: a width read from them would depend on the drafts it then verifies,
    shifting the output law. A block wholly behind the anchor shares no draw with any block to
    come. The anchor moves >= 1 a round, so max(staleness, γ) + 1 rounds are kept."""

    def __init__(self, staleness: int):
        self.staleness = staleness
        self.step = 0                                          # rounds recorded so far
        self._rounds: collections.deque = collections.deque()
        self._buffers: list = []                               # (host tensor, its numpy view)

    def __len__(self) -> int:
        return len(self._rounds)

    def record(self, request_ids: Sequence[Hashable], values: torch.Tensor, convert,
               positions: Sequence[int] | None = None) -> None:
        """Keep `values` [R, γ] by request id, drafted at anchor `positions` (optional);
        convert(numpy rows) -> survivals, when first read. The buffer reused is that of the
        round dropped now, the oldest kept."""
        r_count, g = values.shape
        keep = max(self.staleness, g) + 1
        if self._rounds.maxlen != keep:                        # first round, or another γ
            self._rounds, self._buffers = collections.deque(maxlen=keep), [None] * keep
        turn = self.step % keep
        buf = self._buffers[turn]
        if buf is None or buf[0].shape[0] < r_count:
            rows = 1 << max(r_count - 1, 0).bit_length()       # powers of two: few regrowths
            host = torch.empty((rows, g), dtype=torch.float32, pin_memory=values.is_cuda)
            buf = self._buffers[turn] = (host, host.numpy())
        buf[0][:r_count].copy_(values, non_blocking=values.is_cuda)
        event = None
        if values.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(values.device.index))
        index = {rid: i for i, rid in enumerate(request_ids)}
        self._rounds.append(_Round(self.step, index, event, buf[1][:r_count], positions, convert))
        self.step += 1

    def stale(self, request_ids: Sequence[Hashable], g: int, positions: Sequence[int] | None = None,
              fill=None) -> np.ndarray:
        """Survivals [R, γ]: each request's row of the newest round it may use (class doc; the
        positions are the requests' anchors now). A request without one gets `fill`;
        fill=None: the mean of the rows found for the others, survival 1 where none is."""
        usable = [r for r in reversed(self._rounds)
                  if r.step <= self.step - self.staleness and r.rows.shape[1] == g
                  and (positions is None or r.positions is not None)]
        rows = []
        for k, rid in enumerate(request_ids):       # newest first; a few rounds, host ints
            row = None
            for rnd in usable:
                if rid in rnd.index:
                    i = rnd.index[rid]
                    if positions is None or rnd.positions[i] + g <= positions[k]:
                        row = rnd.survival()[i]
                        break
            rows.append(row)
        if fill is None:
            known = [r for r in rows if r is not None]
            fill = sum(known) / len(known) if known else np.ones(g)
        return np.array([fill if r is None else r for r in rows], dtype=np.float64)


def _identity_survival(rows: np.ndarray) -> np.ndarray:
    return rows.astype(np.float64)


class _ScheduledBase(VerifyPolicy):
    """What the SPS-scheduled policies share: the table, `uniform` (set by the engine where the
    runner pads every verify block of a round to the widest, as the CUDA-graph steps do) and, in
    uniform mode, the round's width chosen on the host from earlier blocks' survivals
    (`host_width`): each request's newest block that lies wholly before its anchor
    (HostHistory says why), a round (scheduled-async: `staleness` rounds) or more back.

    There a request without such a block (new) counts the mean survival of those that have one:
    the drafter's acceptance now is the best guess for it (survival 1 would widen the whole round
    for it, 0 narrow it); where none has (an idle engine's first rounds) survival 1, the width the
    SPS alone picks (as `fixed`). Every request then verifies the width (less what max_tokens /
    the model length leave): a cut by the block's own survivals would need them read from the
    device, and verifying more drafts is lossless."""
    uniform = False
    staleness = 1
    last_capacity = 0            # drafts admitted by the last call (w·R in uniform mode)

    def __init__(self, sps: SpsTable, temperatures=None):
        super().__init__(temperatures)
        self.sps = sps
        self.history = HostHistory(self.staleness)

    def _best_width(self, theta: np.ndarray) -> int:
        """The width chosen from Θ(w), w = 0..γ."""
        raise NotImplementedError

    def stale_width(self, request_ids: Sequence[Hashable], g: int, positions=None) -> int:
        """The round's width from the stale survivals in `history` (HostHistory.stale)."""
        tau_rows = np.add.reduce(self.history.stale(request_ids, g, positions), axis=0)
        return self._best_width(_host_theta(tau_rows, len(request_ids), self.sps))

    def host_width(self, request_ids, positions, conf_logits):
        if not self.uniform:
            return None
        if not len(request_ids) == len(positions) == conf_logits.shape[0]:
            raise ValueError("host_width needs one request id and position per row of the "
                             "confidence logits")
        w = self.stale_width(request_ids, conf_logits.shape[1], positions)
        self.last_capacity = w * len(request_ids)
        self.history.record(request_ids, conf_logits, self.host_survival, positions)
        return w


class ScheduledPolicy(_ScheduledBase):
    """Algorithm 1 (spec §6.2): walk candidates by survival desc (ties: smaller j, then r), admit
    while Θ = τ·SPS(B) strictly improves, stop at the first non-improvement. The break is what
    keeps it lossless. Vectorised: along the walk Θ_best is always the previous Θ, so the admitted
    set is the strictly increasing run of Θ_0, Θ_1, ... from the start.

    uniform=True: a shorter ℓ for one request saves nothing in a padded round, and
    B = Σ(1 + ℓ) would price a round at less than it costs (on the H200 the walk stopped at the
    first jump of the bucketed SPS, ℓ ≈ 0.5 at 64 requests, 0.54x of fixed). The walk is then
    over one width for all: w grows from 0 while Θ(w) = (R + Σ_r Σ_{j<=w} a_{r,j}) · SPS(R(1+w))
    strictly improves, with the same break (w depends on positions <= w + 1 only: a stopping
    time of every block, so still lossless). Called with the confidences that is this round's
    walk; the engine asks `host_width` instead, the same walk on earlier blocks' survivals
    (_ScheduledBase), so that it need not wait for this round's draft pass."""
    name = "scheduled"

    def _best_width(self, theta):
        w, g = 0, theta.shape[0] - 1
        while w < g and theta[w + 1] > theta[w]:      # grow while Θ strictly improves
            w += 1
        return w

    def lengths(self, conf, surv, request_ids=None):
        r_count, g = surv.shape
        if self.uniform:
            theta = _uniform_theta(surv.sum(dim=0), r_count, self.sps)
            width = (theta[1:] > theta[:-1]).long().cumprod(0).sum()
            return torch.minimum(_positive_prefix(surv), width)
        a, rows = _ordered_candidates(surv)
        sps = self.sps.sps_device(r_count, r_count + r_count * g, surv.device)
        tau = r_count + torch.nn.functional.pad(a.double().cumsum(0), (1, 0))
        theta = tau * sps                                           # Θ_k after k admissions
        step_ok = (theta[1:] > theta[:-1]) & (a > 0)
        return _lengths_from_admitted(rows, step_ok.long().cumprod(0), r_count)


class AsyncScheduledPolicy(_ScheduledBase):
    """ZOS variant (spec §6.5). Capacity K (total drafts to verify) comes from survivals recorded
    `staleness` (2) calls ago only, through a global argmax of Θ(k) over k (no early stop, jagged
    SPS is fine); requests without such history count survival 1 at every position. Then the top-K
    slots by *current* survival (survival desc, position asc) are admitted on device.

    History is kept per call, keyed by request id (HostHistory); a call records the survivals it
    was given. On CUDA the host copy is started without blocking and waited for (event) only
    when it is read, `staleness` steps later. Called with the confidences (no anchor positions)
    a request's row is that of `staleness` calls back, whatever positions its block drafted.

    uniform=True (as ScheduledPolicy): one width per round, the argmax over w of Θ(w) on the stale
    survivals, a new request counting the others' mean (_ScheduledBase); `host_width` (the
    engine's path) records this round's confidence logits and also takes only blocks wholly
    before each request's anchor."""
    name = "scheduled-async"

    def __init__(self, sps: SpsTable, budget_frac: float = 1.0, staleness: int = 2, temperatures=None):
        if not 0 < budget_frac <= 1:
            raise ValueError(f"budget_frac must be in (0, 1], got {budget_frac}")
        if staleness < 1:
            raise ValueError(f"staleness must be >= 1, got {staleness}")
        self.budget_frac, self.staleness = budget_frac, staleness
        super().__init__(sps, temperatures)

    def __call__(self, conf_logits, request_ids=None, temperatures=None):
        if request_ids is None or len(request_ids) != conf_logits.shape[0]:
            raise ValueError("scheduled-async needs one request id per row of the confidence logits")
        return super().__call__(conf_logits, request_ids, temperatures)

    def _best_width(self, theta):
        return int(np.argmax(theta))  # first maximum: the smallest w among equals

    def capacity(self, request_ids: Sequence[Hashable], g: int) -> int:
        r_count = len(request_ids)
        stale = self.history.stale(request_ids, g, fill=np.ones(g)).reshape(-1)
        stale = -np.sort(-stale)[: math.ceil(self.budget_frac * stale.size)]
        tau = r_count + np.concatenate([[0.0], np.cumsum(stale)])
        theta = tau * self.sps.sps_range(r_count, r_count + stale.size)
        return int(np.argmax(theta))  # first maximum: the smallest K among equals

    def lengths(self, conf, surv, request_ids):
        r_count, g = surv.shape
        if self.uniform:
            w = self.stale_width(request_ids, g)
            self.last_capacity = w * r_count
            self.history.record(request_ids, surv, _identity_survival)
            return _positive_prefix(surv).clamp(max=w)
        k = self.capacity(request_ids, g)
        self.last_capacity = k
        a, rows = _ordered_candidates(surv)
        admitted = (torch.arange(a.numel(), device=surv.device) < k) & (a > 0)
        self.history.record(request_ids, surv, _identity_survival)
        return _lengths_from_admitted(rows, admitted, r_count)


POLICIES = {"fixed": FixedPolicy, "threshold": ThresholdPolicy, "scheduled": ScheduledPolicy,
            "scheduled-async": AsyncScheduledPolicy}
ALIASES = {"full": "fixed", "alg1": "scheduled", "zos": "scheduled-async"}  # spec §6.7 knob names


def make_policy(name: str, **kw) -> VerifyPolicy:
    key = ALIASES.get(name, name)
    if key not in POLICIES:
        raise ValueError(f"unknown verify policy {name!r}; valid: {sorted(POLICIES)} "
                         f"(aliases {ALIASES})")
    return POLICIES[key](**kw)


__all__ = ["SpsTable", "confidence", "survival", "expected_tokens", "modelled_throughput", "VerifyPolicy",
           "HostHistory", "FixedPolicy", "ThresholdPolicy", "ScheduledPolicy", "AsyncScheduledPolicy",
           "make_policy", "POLICIES"]
