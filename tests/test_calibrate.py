"""dspark.spec.calibrate: ECE, Sequential Temperature Scaling, JSON artefact, reliability PNG."""
import json

import numpy as np
import pytest
import torch

from dspark.spec.calibrate import (STS_FILENAME, TEMPERATURE_GRID, StsCalibration, cumulative_confidence,
                                   ece, fit_sts, load_sts, plot_reliability, prefix_accept_labels,
                                   save_sts)


def _sigmoid(z):
    return 1 / (1 + np.exp(-z))


def synthetic_rounds(scales, n=20_000, seed=0):
    """Rounds with true per-position acceptance σ(z_k); the head emits logits scale_k * z_k
    (scale > 1 overconfident, < 1 underconfident). Returns (logits, labels, valid)."""
    rng = np.random.default_rng(seed)
    g = len(scales)
    z = rng.normal(1.0, 1.5, size=(n, g))
    accept = rng.random((n, g)) < _sigmoid(z)
    accepted = np.cumprod(accept, axis=1).sum(axis=1)
    labels, valid = prefix_accept_labels(accepted, np.full(n, g), g)
    return z * np.asarray(scales), labels, valid


def test_grid_and_ece_by_hand():
    assert len(TEMPERATURE_GRID) == 49 and TEMPERATURE_GRID[0] == pytest.approx(0.125)
    assert TEMPERATURE_GRID[-1] == pytest.approx(8.0) and TEMPERATURE_GRID[24] == pytest.approx(1.0)
    # bins of width 0.05: 0.1 -> bin 2 (|0.1 - 0.5| * 2/4), 0.9 -> bin 18 (|0.9 - 1| * 2/4)
    assert ece([0.1, 0.1, 0.9, 0.9], [0, 1, 1, 1]) == pytest.approx(0.25)
    assert ece([1.0, 1.0], [1, 1]) == 0.0                      # pred = 1 lands in the last bin
    assert ece([0.04, 0.06], [0, 0]) == pytest.approx(0.05)    # two bins: 0.5*0.04 + 0.5*0.06
    assert ece(torch.tensor([0.3, 0.9]), torch.tensor([0, 1]), mask=[True, False]) == pytest.approx(0.3)
    assert ece([], []) == 0.0


def test_prefix_labels():
    y, valid = prefix_accept_labels([0, 2, 3], [3, 2, 3], 3)
    assert y.tolist() == [[0, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert valid.tolist() == [[True] * 3, [True, True, False], [True] * 3]


def test_sts_reduces_ece_on_miscalibrated_data():
    scales = [3.0, 0.5, 2.0, 1.0, 3.0]
    logits, labels, valid = synthetic_rounds(scales)
    cal = fit_sts(logits, labels, valid, dataset="synthetic")
    assert cal.num_rounds == 20_000 and cal.dataset == "synthetic" and len(cal.temperatures) == 5
    # position 1 is fitted alone: the temperature recovers the logit scale (one grid step ≈ 9%)
    assert cal.temperatures[0] == pytest.approx(3.0, rel=0.1)
    assert cal.temperatures[1] == pytest.approx(0.5, rel=0.2)
    for k in range(3):  # strongly miscalibrated positions improve a lot
        assert cal.ece_before[k] > 0.03 and cal.ece_after[k] < 0.4 * cal.ece_before[k], (k, cal)
    for k in range(5):
        assert cal.ece_after[k] < cal.ece_before[k]
        assert cal.ece_after[k] < 0.015
    # reported ece_after is the ECE of the fitted cumulative product
    after = cumulative_confidence(logits, cal.temperatures)
    for k in range(5):
        assert ece(after[:, k], labels[:, k]) == pytest.approx(cal.ece_after[k])


def test_sts_keeps_calibrated_head_near_identity():
    logits, labels, valid = synthetic_rounds([1.0] * 3, seed=1)
    cal = fit_sts(logits, labels, valid)
    assert all(0.8 <= t <= 1.25 for t in cal.temperatures), cal.temperatures
    assert all(e < 0.02 for e in cal.ece_before)  # sampling-noise floor of 20 bins at n = 20k


def test_sts_ignores_invalid_positions():
    logits, labels, valid = synthetic_rounds([3.0, 3.0], n=5000, seed=2)
    valid[:, 1] = False
    labels[:, 1] = 1 - labels[:, 1]  # garbage where invalid: must not matter
    cal = fit_sts(torch.tensor(logits), labels, valid)
    assert cal.temperatures[1] == 1.0 and cal.ece_after[1] == 0.0
    assert cal.temperatures[0] == pytest.approx(3.0, rel=0.1)


def test_json_round_trip_and_validation(tmp_path):
    cal = StsCalibration([2.0, 0.5], [0.05, 0.04], [0.01, 0.02], 123, "alpaca")
    path = save_sts(str(tmp_path), cal)  # a directory -> dspark_sts.json inside
    assert path.endswith(STS_FILENAME)
    raw = json.loads(open(path).read())
    assert raw == {"temperatures": [2.0, 0.5], "ece_before": [0.05, 0.04], "ece_after": [0.01, 0.02],
                   "num_rounds": 123, "dataset": "alpaca"}
    assert load_sts(path) == cal and StsCalibration.load(str(tmp_path)) == cal
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"temperatures": [1.0, -2.0]}))
    with pytest.raises(ValueError, match="temperatures"):
        load_sts(str(bad))
    bad.write_text(json.dumps({"temps": [1.0]}))
    with pytest.raises(ValueError, match="not an STS file"):
        load_sts(str(bad))


def test_plot_reliability_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    logits, labels, valid = synthetic_rounds([3.0, 2.0], n=3000, seed=3)
    cal = fit_sts(logits, labels, valid)
    before = (cumulative_confidence(logits)[valid], labels[valid])
    after = (cumulative_confidence(logits, cal.temperatures)[valid], labels[valid])
    out = plot_reliability(before, after, str(tmp_path / "rel.png"))
    data = open(out, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
