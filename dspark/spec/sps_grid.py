"""SPS by round shape: the step time of R requests that each verify q tokens, T(R, q).

Where the runner pads every verify block of a round to one width (CUDA-graph steps), a round of
R requests at width w costs a target step of R x (w + 1) tokens (the graph bucket of R rows)
plus the draft pass for R requests. SPS(B) alone prices it by its token count B = R(1 + w), as
the profile measured B with B / (γ + 1) requests: a round of many requests at a narrow width was
priced as half as many requests at the full width, with half the per-request work of the draft
pass and the round's rows. The scheduled policies then picked narrow widths at high load that
served slower than `fixed`. The grid measures every (R bucket, q) the policies can choose and
prices a round by its own shape (`sps_widths`).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .policy import SpsTable


class SpsGrid(SpsTable):
    """T(R, q) in ms for R in the measured request buckets and q = 1..q_max, from
    [[R, q, ms], ...] with every (R, q) of those present.

    Made non-decreasing in R and in q (a cumulative max along both: noise must not invent a
    cheaper shape). A round of R requests is priced at the next measured R bucket up (the target
    graphs' batch buckets pad the same way); past the largest, linearly from the last two
    buckets at each q (proportionally to R when one bucket was measured).

    As an SpsTable (the ragged rounds' lookup by B tokens) it holds the points of the 1-D
    profile's kind: one request feeding q < q_max tokens at B = q, R requests feeding q_max at
    B = R·q_max."""

    def __init__(self, points: Sequence[Sequence[float]]):
        pts = [(int(r), int(q), float(ms)) for r, q, ms in points]
        if not pts:
            raise ValueError("SpsGrid needs [[R, q, ms], ...] points, got none")
        if any(r < 1 or q < 1 for r, q, _ in pts):
            raise ValueError(f"SpsGrid R and q must be >= 1, got {[(r, q) for r, q, _ in pts]}")
        rs = sorted({r for r, _, _ in pts})
        q_max = max(q for _, q, _ in pts)
        at = {(r, q): ms for r, q, ms in pts}
        missing = [(r, q) for r in rs for q in range(1, q_max + 1) if (r, q) not in at]
        if missing or len(at) != len(pts):
            raise ValueError(f"SpsGrid needs exactly one time for every (R, q), R in {rs}, "
                             f"q in 1..{q_max}; missing {missing[:8]}"
                             + ("" if len(at) == len(pts) else ", and some (R, q) given twice"))
        grid = np.array([[at[(r, q)] for q in range(1, q_max + 1)] for r in rs], dtype=np.float64)
        if not np.all(np.isfinite(grid) & (grid > 0)):
            raise ValueError(f"SpsGrid round times must be finite and > 0 ms, got {grid.tolist()}")
        grid = np.maximum.accumulate(np.maximum.accumulate(grid, axis=1), axis=0)
        self.request_buckets, self.q_max, self.grid_ms = rs, q_max, grid
        first = [(q, grid[0, q - 1]) for q in range(1, q_max)] if rs[0] == 1 else []
        super().__init__([b for b, _ in first] + [r * q_max for r in rs],
                         [t for _, t in first] + grid[:, -1].tolist())

    def round_ms(self, r_count: int, q: int) -> float:
        """T(R, q) in ms: R requests feeding q tokens each (1 <= q <= q_max)."""
        if not 1 <= q <= self.q_max or r_count < 1:
            raise ValueError(f"SpsGrid.round_ms: q={q} outside 1..{self.q_max} or R={r_count} < 1")
        return float(self._row(r_count)[q - 1])

    def _row(self, r_count: int) -> np.ndarray:
        """T(R, q) for q = 1..q_max: the next bucket up's row, or past the largest bucket each q
        extrapolated, then made non-decreasing in q again (slopes that differ by q must not
        make a wider round cheaper)."""
        rs, g = self.request_buckets, self.grid_ms
        i = int(np.searchsorted(rs, r_count, side="left"))      # first bucket >= R
        if i < len(rs):
            return g[i]
        if len(rs) == 1:
            row = g[-1] * (r_count / rs[-1])
        else:
            row = g[-1] + (g[-1] - g[-2]) / (rs[-1] - rs[-2]) * (r_count - rs[-1])
        return np.maximum.accumulate(row)

    def sps_widths(self, r_count: int, g: int) -> np.ndarray:
        """SPS of a round of R requests at width w, w = 0..γ: 1000 / T(R, w + 1). Widths past
        the grid's q_max fall back to the B-token table."""
        if g + 1 > self.q_max:
            return super().sps_widths(r_count, g)
        key = (r_count, g)
        if key not in self._width_cache:
            self._width_cache[key] = 1000.0 / self._row(r_count)[:g + 1]
        return self._width_cache[key]

    def to_grid(self) -> list[list[float]]:
        """[[R, q, ms], ...] after the monotone fix, for logs and the on-disk cache."""
        return [[r, q, float(self.grid_ms[i, q - 1])] for i, r in enumerate(self.request_buckets)
                for q in range(1, self.q_max + 1)]
