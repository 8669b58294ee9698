"""SPS by round shape (spec/sps_grid.py): the lookups, the width the scheduled policies pick with
it against the B-token table, and the profile that measures it."""
import json

import numpy as np
import pytest
import torch

from dspark import Engine
from dspark.spec.policy import AsyncScheduledPolicy, ScheduledPolicy, SpsTable
from dspark.spec.sps_grid import SpsGrid

G1 = 6                                   # q_max = γ + 1 of the shipped drafter


def _grid(fn, rs=(1, 2, 4, 8, 16, 32, 64)):
    return SpsGrid([[r, q, fn(r, q)] for r in rs for q in range(1, G1 + 1)])


def test_round_ms_is_the_next_request_bucket_up_and_extrapolates_past_the_last():
    grid = _grid(lambda r, q: 1.0 + r + 0.25 * q, rs=(1, 2, 4, 8))
    assert grid.round_ms(1, 1) == 2.25
    assert grid.round_ms(3, 2) == 1.0 + 4 + 0.5            # R = 3 runs in the 4-row bucket
    assert grid.round_ms(8, 6) == 1.0 + 8 + 1.5
    assert grid.round_ms(12, 6) == 1.0 + 12 + 1.5          # linear from buckets 4 and 8
    one = SpsGrid([[4, q, 2.0 * q] for q in range(1, 4)])
    assert one.round_ms(8, 3) == 12.0                      # one bucket: proportional to R
    with pytest.raises(ValueError, match="q=7 outside 1..6"):
        grid.round_ms(2, 7)


def test_the_grid_is_made_monotone_in_requests_and_width():
    pts = [[1, 1, 5.0], [1, 2, 4.0], [2, 1, 3.0], [2, 2, 6.0]]
    grid = SpsGrid(pts)
    assert grid.to_grid() == [[1, 1, 5.0], [1, 2, 5.0], [2, 1, 5.0], [2, 2, 6.0]]


def test_missing_or_repeated_shapes_are_errors():
    with pytest.raises(ValueError, match=r"missing \[\(2, 2\)\]"):
        SpsGrid([[1, 1, 1.0], [1, 2, 1.0], [2, 1, 1.0]])
    with pytest.raises(ValueError, match="given twice"):
        SpsGrid([[1, 1, 1.0], [1, 1, 2.0]])
    with pytest.raises(ValueError, match="none"):
        SpsGrid([])


def test_as_a_token_table_it_is_what_the_one_dimensional_profile_measures():
    """Ragged rounds look SPS up by B tokens: the grid's own table has the 1-D profile's points,
    one request at q < γ+1 tokens and R requests at the full γ+1."""
    fn = lambda r, q: 1.0 + 0.5 * r + 0.01 * r * q          # noqa: E731
    grid = _grid(fn)
    want = SpsTable.from_ms([[q, fn(1, q)] for q in range(1, G1)]
                            + [[r * G1, fn(r, G1)] for r in (1, 2, 4, 8, 16, 32, 64)])
    assert grid.buckets == want.buckets and grid.ms == pytest.approx(want.ms)
    assert grid.sps(100) == pytest.approx(want.sps(100))


def test_scheduled_policies_price_a_narrow_round_of_many_requests_by_its_shape():
    """A round's cost mostly per request (the draft pass, per-row work), little per verify token:
    narrowing the width saves little. The B-token table prices 64 requests x 3 tokens as 32 x 6
    (the rows the profile measured at B = 192) and the walk stops at w = 2; the grid sees the
    64-request round at every width and verifies them all (survival 1: no history yet)."""
    fn = lambda r, q: 1.0 + 0.5 * r + 0.01 * r * q          # noqa: E731
    grid = _grid(fn)
    table = SpsTable(grid.buckets, grid.ms)                  # the same points, by B alone
    ids, g = list(range(64)), G1 - 1
    widths = {}
    for name, sps in (("table", table), ("grid", grid)):
        pol = ScheduledPolicy(sps)
        pol.uniform = True
        widths[name] = pol.host_width(ids, [100] * 64, torch.zeros(64, g))
    assert widths == {"table": 2, "grid": g}
    # the same walk on the device path (this round's confidences): all drafts sure -> width γ
    pol = ScheduledPolicy(grid)
    pol.uniform = True
    assert pol(torch.full((64, g), 30.0)).tolist() == [g] * 64
    apol = AsyncScheduledPolicy(grid)
    apol.uniform = True
    assert apol.host_width(ids, [100] * 64, torch.zeros(64, g)) == g


def test_a_grid_makes_the_scheduler_verify_nothing_when_drafts_cannot_pay():
    """Each verify token costs more than a whole decode round returns: width 0 at every load."""
    grid = _grid(lambda r, q: 1.0 + 10.0 * r * q * q)
    for r_count in (1, 5, 64):
        pol = ScheduledPolicy(grid)
        pol.uniform = True
        assert pol.host_width(list(range(r_count)), [50] * r_count,
                              torch.zeros(r_count, G1 - 1)) == 0


def test_the_graph_path_profiles_the_grid_and_caches_it(small_vocab_ckpt, tmp_path, monkeypatch):
    """Where the runner pads rounds to one width (the CUDA-graph path) the SPS profile measures
    every request bucket at every width through the runner (verify step + draft pass), saves it
    and reads it back; a damaged file is measured again."""
    from dspark.spec.profile import load_or_profile, plan_profile, sps_table
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    eng = Engine(small_vocab_ckpt, device="cpu", dtype="fp32", kv_cache_dtype="fp32",
                 max_num_seqs=3)
    g1 = eng.cfg.dspark_block_size + 1
    plan = plan_profile(eng, 3 * g1, grid=True)
    assert sorted((r, q) for _, r, q in plan.steps) == \
        [(r, q) for r in (1, 2, 3) for q in range(1, g1 + 1)]
    assert all(b == r * q for b, r, q in plan.steps)
    eng.runner.uniform_verify = True
    grid = sps_table(eng, None, 3, progress=False)
    assert isinstance(grid, SpsGrid) and grid.request_buckets == [1, 2, 3] and grid.q_max == g1
    assert np.all(np.diff(grid.grid_ms, axis=0) >= 0) and np.all(np.diff(grid.grid_ms, axis=1) >= 0)
    files = list((tmp_path / "dspark" / "sps").iterdir())
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    data["grid"] = [[r, q, 1.0 + r + q] for r, q, _ in data["grid"]]
    files[0].write_text(json.dumps(data))
    again = load_or_profile(eng, 3 * g1, progress=False, grid=True)
    assert isinstance(again, SpsGrid) and again.round_ms(2, 3) == 6.0      # read, not measured
    files[0].write_text(json.dumps(data)[:30])
    with pytest.warns(UserWarning, match="unreadable SPS profile"):
        measured = load_or_profile(eng, 3 * g1, progress=False, grid=True)
    assert isinstance(measured, SpsGrid) and measured.round_ms(2, 3) != 6.0
    # the 1-D profile of the eager path is another plan: its own file
    eng.runner.uniform_verify = False
    assert not isinstance(sps_table(eng, None, 3, progress=False), SpsGrid)
    assert len(list((tmp_path / "dspark" / "sps").iterdir())) == 2


def test_extrapolated_rounds_stay_monotone_in_width():
    """Past the largest bucket each width extrapolates with its own slope; a wider round must
    still not come out cheaper (here width 1's slope is steep, width 2's flat)."""
    grid = SpsGrid([[1, 1, 1.0], [1, 2, 10.0], [2, 1, 9.0], [2, 2, 10.0]])
    assert grid.round_ms(10, 1) == 73.0
    assert grid.round_ms(10, 2) == 73.0
    assert list(grid.sps_widths(10, 1)) == [1000.0 / 73.0] * 2


def test_bad_round_times_are_errors_at_any_bucket():
    for bad in (0.0, -5.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite and > 0"):
            SpsGrid([[2, 1, bad], [2, 2, 1.0]])


def test_a_grid_given_as_sps_table_is_used_as_given(small_vocab_ckpt):
    """sps_table=[[R, q, ms], ...] (what the bench's JSON saves) builds the grid, no profile;
    rows of another width are an error naming both forms."""
    from dspark.spec.profile import sps_table
    eng = Engine(small_vocab_ckpt, device="cpu", dtype="fp32", kv_cache_dtype="fp32",
                 max_num_seqs=2)
    rows = [[r, q, 1.0 + r + q] for r in (1, 2) for q in range(1, G1 + 1)]
    grid = sps_table(eng, rows, 2, progress=False)
    assert isinstance(grid, SpsGrid) and grid.round_ms(2, 3) == 6.0
    with pytest.raises(ValueError, match=r"\[\[B, ms\], ...\] .* \[\[R, q, ms\], ...\]"):
        sps_table(eng, [[1, 1.0], [2, 3, 4.0]], 2, progress=False)
    spec = Engine(small_vocab_ckpt, device="cpu", dtype="fp32", kv_cache_dtype="fp32",
                  max_num_seqs=2, verify_policy="scheduled", sps_table=rows)
    assert isinstance(spec.policy.sps, SpsGrid)
