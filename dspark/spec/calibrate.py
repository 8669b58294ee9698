"""Sequential Temperature Scaling (STS) of the confidence head (spec §6.6) and its artefacts.

The scheduler consumes the *cumulative* product a_k = Π_{i<=k} σ(l_i/T_i), so STS calibrates that
product against the prefix-accept label y_k = 1[positions 1..k all accepted], fitting T_1..T_γ
left to right (T_k chosen with T_<k frozen). Works on numpy; accepts torch tensors too.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

import numpy as np

TEMPERATURE_GRID = np.geomspace(0.125, 8.0, 49)  # ratio 2**(1/8); index 24 is exactly 1.0
NUM_BINS = 20
STS_FILENAME = "dspark_sts.json"


def _np(x, dtype=np.float64):
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype)


def _sigmoid(z):
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # overflow-free logistic


def _bin_sums(pred, label, num_bins):
    """Per-bin (count, Σpred, Σlabel) over the last axis; pred [..., n] in [0, 1], label [n]."""
    pred = np.atleast_2d(pred)
    rows, n = pred.shape
    bins = np.clip((pred * num_bins).astype(np.int64), 0, num_bins - 1)  # pred = 1 -> last bin
    flat = (bins + num_bins * np.arange(rows)[:, None]).ravel()
    size = rows * num_bins
    count = np.bincount(flat, minlength=size).reshape(rows, num_bins)
    s_pred = np.bincount(flat, weights=pred.ravel(), minlength=size).reshape(rows, num_bins)
    s_lab = np.bincount(flat, weights=np.broadcast_to(label, pred.shape).ravel(),
                        minlength=size).reshape(rows, num_bins)
    return count, s_pred, s_lab


def ece(pred, label, num_bins: int = NUM_BINS, mask=None) -> float:
    """Expected calibration error: Σ_bins (n_b/n)|mean pred_b − mean label_b| with equal-width bins
    on [0, 1]. `mask` selects the entries that count. 0.0 for no entries."""
    pred, label = _np(pred).ravel(), _np(label).ravel()
    if mask is not None:
        m = _np(mask, bool).ravel()
        pred, label = pred[m], label[m]
    if pred.size == 0:
        return 0.0
    _, s_pred, s_lab = _bin_sums(pred, label, num_bins)
    return float(np.abs(s_pred - s_lab).sum() / pred.size)


def prefix_accept_labels(accepted, verified, gamma: int):
    """Labels y [N, γ] (y_k = 1 iff k <= accepted, k 1-based) and validity [N, γ] (k <= verified:
    a prefix label exists only for verified positions, as in DeepSpec)."""
    k = np.arange(1, gamma + 1)
    acc, ver = _np(accepted, np.int64)[:, None], _np(verified, np.int64)[:, None]
    return (k <= acc).astype(np.float64), k <= ver


def cumulative_confidence(conf_logits, temperatures=None):
    """Π_{i<=k} σ(l_i / T_i), [N, γ] float64."""
    z = _np(conf_logits)
    t = np.ones(z.shape[1]) if temperatures is None else _np(temperatures)
    return np.cumprod(_sigmoid(z / t), axis=1)


@dataclass
class StsCalibration:
    temperatures: list = field(default_factory=list)
    ece_before: list = field(default_factory=list)  # per position, T = 1 everywhere
    ece_after: list = field(default_factory=list)   # per position, fitted T
    num_rounds: int = 0
    dataset: str = ""

    def save(self, path: str) -> str:
        """Write JSON to `path` (or to `path`/dspark_sts.json when path is a directory)."""
        if os.path.isdir(path):
            path = os.path.join(path, STS_FILENAME)
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=2)
        return path

    @classmethod
    def load(cls, path: str) -> "StsCalibration":
        if os.path.isdir(path):
            path = os.path.join(path, STS_FILENAME)
        with open(path) as f:
            raw = json.load(f)
        unknown = set(raw) - {f for f in cls.__dataclass_fields__}
        if unknown or "temperatures" not in raw:
            raise ValueError(f"{path}: not an STS file (unknown keys {sorted(unknown)}, "
                             f"expected {sorted(cls.__dataclass_fields__)})")
        temps = raw["temperatures"]
        if not temps or not all(isinstance(t, (int, float)) and math.isfinite(t) and t > 0 for t in temps):
            raise ValueError(f"{path}: temperatures must be a non-empty list of finite numbers > 0, "
                             f"got {temps}")
        return cls(**raw)


def save_sts(path: str, calibration: StsCalibration) -> str:
    return calibration.save(path)


def load_sts(path: str) -> StsCalibration:
    return StsCalibration.load(path)


def fit_sts(conf_logits, labels, valid=None, grid=TEMPERATURE_GRID, num_bins: int = NUM_BINS,
            dataset: str = "") -> StsCalibration:
    """Fit T_1..T_γ left to right, each by grid search minimising the ECE of the cumulative
    product against the prefix labels at that position, with earlier temperatures frozen.
    conf_logits, labels [N, γ]; valid [N, γ] bool (default all). Ties pick the smallest T; a
    position with no valid rows keeps T = 1."""
    z, y = _np(conf_logits), _np(labels)
    n, g = z.shape
    valid = np.ones((n, g), bool) if valid is None else _np(valid, bool)
    grid = _np(grid)
    before = cumulative_confidence(z)
    prefix = np.ones(n)
    temps, ece_b, ece_a = [], [], []
    for k in range(g):
        m = valid[:, k]
        ece_b.append(ece(before[:, k], y[:, k], num_bins, m))
        if not m.any():
            temps.append(1.0)
            ece_a.append(0.0)
            prefix = prefix * _sigmoid(z[:, k])
            continue
        preds = prefix[m][None, :] * _sigmoid(z[m, k][None, :] / grid[:, None])  # [G, n_valid]
        _, s_pred, s_lab = _bin_sums(preds, y[m, k], num_bins)
        errs = np.abs(s_pred - s_lab).sum(axis=1) / m.sum()
        best = int(np.argmin(errs))
        temps.append(float(grid[best]))
        ece_a.append(float(errs[best]))
        prefix = prefix * _sigmoid(z[:, k] / grid[best])
    return StsCalibration(temps, ece_b, ece_a, int(n), dataset)


def reliability_bins(pred, label, num_bins: int = NUM_BINS):
    """(mean pred, mean label, count) per non-empty bin, for reliability diagrams."""
    pred, label = _np(pred).ravel(), _np(label).ravel()
    count, s_pred, s_lab = _bin_sums(pred, label, num_bins)
    count, s_pred, s_lab = count[0], s_pred[0], s_lab[0]
    nz = count > 0
    return s_pred[nz] / count[nz], s_lab[nz] / count[nz], count[nz]


def plot_reliability(before, after, path: str, num_bins: int = NUM_BINS, title: str | None = None) -> str:
    """Reliability diagram PNG. before / after: (pred, label) array pairs (flattened over the
    valid entries). matplotlib is imported here so the engine does not depend on it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: no global backend / figure state touched

    fig = Figure(figsize=(5, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", label="perfect")
    for (pred, label), name, mark in ((before, "before", "o"), (after, "after STS", "s")):
        mp, ml, _ = reliability_bins(pred, label, num_bins)
        ax.plot(mp, ml, marker=mark, label=f"{name} (ECE {100 * ece(pred, label, num_bins):.2f}%)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("predicted prefix-accept probability")
    ax.set_ylabel("observed prefix-accept rate")
    ax.set_title(title or "DSpark confidence reliability")
    ax.legend(loc="upper left")
    fig.savefig(path, format="png", dpi=100)
    return path


__all__ = ["TEMPERATURE_GRID", "STS_FILENAME", "ece", "prefix_accept_labels", "cumulative_confidence",
           "StsCalibration", "save_sts", "load_sts", "fit_sts", "reliability_bins", "plot_reliability"]
