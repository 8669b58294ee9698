"""dspark.spec.policy: SPS table, Algorithm 1, async/ZOS, threshold, Appendix A, load sweep."""
import math

import numpy as np
import pytest
import torch

from dspark.spec.policy import (AsyncScheduledPolicy, HostHistory, ScheduledPolicy, SpsTable,
                                ThresholdPolicy, make_policy, modelled_throughput, survival)
from dspark.spec.verify import verify


pytestmark = pytest.mark.usefixtures("one_thread")


def logit(c):
    """Confidence logits giving per-position confidences c (1.0 -> +40, 0 -> -inf)."""
    c = torch.as_tensor(c, dtype=torch.float64)
    z = torch.where(c >= 1, torch.tensor(40.0, dtype=torch.float64), torch.log(c) - torch.log1p(-c))
    return z.float()


def alg1_literal(surv, sps, early_stop=True):
    """Spec §6.2 written out literally (per-item loop). early_stop=False is the retrospective
    (global argmax over the whole path) variant that Appendix A shows to be biased."""
    r_count, g = surv.shape
    cands = [(float(surv[r, j]), j, r) for r in range(r_count) for j in range(g) if surv[r, j] > 0]
    cands.sort(key=lambda c: (-c[0], c[1], c[2]))
    ell, best_ell = [0] * r_count, [0] * r_count
    b, tau = r_count, float(r_count)
    best = tau * sps.sps(b)
    for a, j, r in cands:
        assert j == ell[r], "non-prefix admission"
        ell[r] = j + 1
        b += 1
        tau += a
        theta = tau * sps.sps(b)
        if theta > best:
            best, best_ell = theta, list(ell)
        elif early_stop:
            break
    return best_ell


# ---- SpsTable ----------------------------------------------------------------------------------

def test_sps_table_monotone_ceiling_and_extrapolation():
    t = SpsTable.from_ms([[8, 12.0], [1, 10.0], [4, 9.0], [16, 20.0]])  # unsorted, noisy bucket 4
    assert t.to_list() == [[1, 10.0], [4, 10.0], [8, 12.0], [16, 20.0]]  # cumulative max of time
    assert [t.step_ms(b) for b in (1, 2, 4, 5, 8, 9, 16)] == [10, 10, 10, 12, 12, 20, 20]
    assert t.step_ms(20) == pytest.approx(24.0)  # slope of the last two buckets: 1 ms / token
    assert t.sps(5) == pytest.approx(1000 / 12)
    np.testing.assert_allclose(t.sps_range(3, 17), [t.sps(b) for b in range(3, 18)])
    np.testing.assert_allclose(t.sps_device(3, 17, "cpu").numpy(), t.sps_range(3, 17))
    np.testing.assert_allclose(t.sps_device(2000, 3000, "cpu").numpy(), t.sps_range(2000, 3000))
    s = SpsTable.from_sps([(1, 100.0), (4, 50.0)])
    assert s.step_ms(3) == pytest.approx(20.0) and s.step_ms(7) == pytest.approx(30.0)
    assert SpsTable.from_ms([[4, 8.0]]).step_ms(8) == pytest.approx(16.0)  # one point: ∝ B
    steps = t.step_ms(np.arange(1, 40))
    assert (np.diff(steps) >= 0).all()
    for bad in ([], [[0, 1.0]], [[2, 1.0], [2, 3.0]], [[2, -1.0]], [[2, float("nan")]], [[1.5, 2.0]]):
        with pytest.raises(ValueError, match="SpsTable"):
            SpsTable.from_ms(bad)


# ---- Algorithm 1 pinned by hand ------------------------------------------------------------------

CONF = [[0.9, 0.8, 0.5],   # survivals 0.9, 0.72, 0.36
        [0.6, 0.5, 0.9]]   # survivals 0.6, 0.30, 0.27
# Walk: (0,1) .9, (0,2) .72, (1,1) .6, (0,3) .36, (1,2) .30, (1,3) .27


def test_algorithm1_smooth_curve_by_hand():
    sps = SpsTable.from_sps([(2, 100), (3, 100), (4, 100), (5, 80), (6, 70), (7, 60), (8, 50)])
    # Θ: k0 2*100=200, k1 2.9*100=290, k2 3.62*100=362, k3 4.22*80=337.6 < 362 -> stop
    assert ScheduledPolicy(sps)(logit(CONF)).tolist() == [2, 0]
    flat = SpsTable.from_sps([(8, 100)])  # flat: every positive candidate improves Θ
    assert ScheduledPolicy(flat)(logit(CONF)).tolist() == [3, 3]


def test_algorithm1_jagged_curve_stops_early_unlike_global_argmax():
    # measured ms with a noisy bucket (9.5 -> 10 after cummax); B=5..8 pad to bucket 8: 13.33 ms
    sps = SpsTable.from_ms([[2, 10.0], [4, 9.5], [8, 40 / 3]])
    # Θ: k0 200, k1 290, k2 362, k3 4.22*75=316.5 -> stop. Global max would be k6: 5.15*75=386.25
    surv = survival(logit(CONF))
    assert ScheduledPolicy(sps)(logit(CONF)).tolist() == [2, 0] == alg1_literal(surv, sps)
    assert alg1_literal(surv, sps, early_stop=False) == [3, 3]


def test_algorithm1_tie_break_smaller_position_then_request():
    # survivals r0: .8 .8 .8 (confidence 1 after the first), r1: .8 .4 .2, r2: .5 ...
    conf = logit([[0.8, 1.0, 1.0], [0.8, 0.5, 0.5], [0.5, 0.5, 0.5]])
    # order: (0,1) (1,1) (0,2) (0,3) ...; flat SPS for B <= 3 + 3 = 6, then a cliff
    sps = SpsTable.from_ms([[6, 10.0], [7, 100.0]])
    assert ScheduledPolicy(sps)(conf).tolist() == [2, 1, 0]
    sps4 = SpsTable.from_ms([[7, 10.0], [8, 100.0]])
    assert ScheduledPolicy(sps4)(conf).tolist() == [3, 1, 0]


def test_algorithm1_equals_literal_and_never_admits_non_prefix():
    gen = torch.Generator().manual_seed(7)
    for trial in range(150):
        r, g = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(1, 8, (1,), generator=gen))
        conf = torch.randn(r, g, generator=gen) * 2 + 1
        conf[torch.rand(r, g, generator=gen) < 0.1] = 40.0            # exact survival ties
        conf[torch.rand(r, g, generator=gen) < 0.05] = float("-inf")  # zero survival
        buckets = sorted(set(torch.randint(1, r * (g + 1) + 4, (4,), generator=gen).tolist()))
        ms = (torch.rand(len(buckets), generator=gen) * 20 + 5).tolist()  # jagged, non-monotone
        sps = SpsTable.from_ms(list(zip(buckets, ms)))
        got = ScheduledPolicy(sps)(conf).tolist()
        assert got == alg1_literal(survival(conf), sps), trial  # literal asserts prefix order


# ---- other policies ------------------------------------------------------------------------------

def test_threshold_and_fixed_policies():
    conf = logit([[0.9, 0.8, 0.95, 0.2], [0.3, 0.99, 0.99, 0.99]])
    # survivals r0: .9 .72 .684 .137; r1: .3 ...
    assert make_policy("threshold", threshold=0.7)(conf).tolist() == [2, 0]
    assert make_policy("threshold", threshold=0.7, mode="per_position")(conf).tolist() == [3, 0]
    assert make_policy("threshold", threshold=0.0)(conf).tolist() == [4, 4]
    assert make_policy("fixed")(conf).tolist() == [4, 4]
    assert make_policy("full", num_verify=2)(conf).tolist() == [2, 2]
    # STS temperatures change the survivals: T=4 on position 1 pulls 0.9 towards 0.5
    t = [4.0, 1.0, 1.0, 1.0]
    assert ThresholdPolicy(0.7, temperatures=t)(conf).tolist() == [0, 0]
    assert ThresholdPolicy(0.7)(conf, temperatures=t).tolist() == [0, 0]
    with pytest.raises(ValueError, match="γ=4"):
        ThresholdPolicy(0.7)(conf, temperatures=[1.0, 2.0])


def test_make_policy_errors_list_valid_names():
    with pytest.raises(ValueError) as e:
        make_policy("greedy")
    assert all(n in str(e.value) for n in ("fixed", "threshold", "scheduled", "scheduled-async"))
    with pytest.raises(ValueError, match="threshold"):
        make_policy("threshold", threshold=1.5)
    with pytest.raises(ValueError, match="budget_frac"):
        make_policy("zos", sps=SpsTable.from_ms([[1, 1.0]]), budget_frac=0)
    with pytest.raises(ValueError, match="request id"):
        make_policy("scheduled-async", sps=SpsTable.from_ms([[1, 1.0]]))(logit([[0.5]]))


def test_async_capacity_uses_only_two_step_old_confidences():
    sps = SpsTable.from_ms([[3, 10.0], [4, 12.0], [6, 14.0], [9, 25.0]])
    pol = AsyncScheduledPolicy(sps)
    ids = ["a", "b", "c"]
    hi, lo = logit([[0.99] * 3] * 3), logit([[0.1] * 3] * 3)
    # no history: survival 1 everywhere -> Θ(k) ∝ (3 + k)/ms(3 + k): 3/10 4/12 5/14 6/14 7/25 .. 9/25
    # -> K = 3. With lo history: 3/10 beats 3.1/12 ... -> K = 0.
    pol(lo, ids)
    assert pol.last_capacity == 3
    pol(lo, ids)                     # call 1: history of call 0 is only one step old
    assert pol.last_capacity == 3
    ell = pol(hi, ids)               # call 2: K from call 0 (lo): every extra token loses
    assert pol.last_capacity == 0 and ell.tolist() == [0, 0, 0]
    pol(hi, ids)                     # call 3: K from call 1 (lo) again
    assert pol.last_capacity == 0
    ell = pol(lo, ids)               # call 4: K from call 2 (hi); admission by current (lo) survivals
    assert pol.last_capacity == 3 and ell.tolist() == [1, 1, 1]
    # a request without history counts survival 1; history is bounded
    pol(lo, ["a", "new", "c"])
    assert len(pol.history) == 4             # max(staleness, γ) + 1 calls


def test_async_admits_top_k_by_current_survival_in_prefix_order():
    sps = SpsTable.from_ms([[2, 10.0], [5, 10.0], [6, 1000.0]])  # flat up to 3 drafts, then cliff
    pol = AsyncScheduledPolicy(sps)
    ell = pol(logit(CONF), [0, 1])
    # K = 3 (no history); top-3 current: (0,1) .9, (0,2) .72, (1,1) .6
    assert pol.last_capacity == 3 and ell.tolist() == [2, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_policies_on_cuda_match_cpu():
    sps = realistic_sps()
    conf = torch.randn(300, 5, generator=torch.Generator().manual_seed(4)) * 1.5 + 2.0
    for name, kw in (("fixed", {}), ("threshold", {"threshold": 0.6}), ("scheduled", {"sps": sps}),
                     ("scheduled-async", {"sps": sps})):
        cpu_pol, gpu_pol = make_policy(name, **kw), make_policy(name, **kw)
        for step in range(4):  # async: exercises the non-blocking host copy + event path
            c = conf.roll(step, 0)
            ids = list(range(300))
            got = gpu_pol(c.cuda(), ids)
            assert got.is_cuda and torch.equal(cpu_pol(c, ids), got.cpu()), (name, step)


# ---- Appendix A counterexample -------------------------------------------------------------------

def appendix_a_first_token_freq(len_a, len_b, trials=200_000):
    """R=1, γ=2, vocab {A=0, B=1}; target (0.7, 0.3), draft (0.5, 0.5); ℓ chosen per x₁ by the
    policy. Returns the empirical P(first emitted token = A) using the real verifier."""
    gen = torch.Generator().manual_seed(11)
    p_t, p_d = torch.tensor([0.7, 0.3]), torch.tensor([0.5, 0.5])
    x = (torch.rand(trials, 2, generator=gen) < 0.5).long()          # x ~ p_d, A=0 / B=1
    ell = torch.where(x[:, 0] == 0, len_a, len_b)
    q = p_d.expand(trials, 2, 2)
    p = p_t.expand(trials, 3, 2)
    res = verify(x, q, p, ell, torch.arange(trials), torch.zeros(trials, dtype=torch.long))
    first = torch.where(res.accepted > 0, x[:, 0], res.next_token)
    return (first == 0).double().mean().item()


def test_appendix_a_counterexample():
    sps = SpsTable.from_sps([(1, 1.0), (2, 0.5), (3, 0.45)])
    conf_a = logit([[0.8, 0.9]])   # x₁ = A -> c₂ = 0.9
    conf_b = logit([[0.8, 0.0]])   # x₁ = B -> c₂ = 0
    retro = [alg1_literal(survival(c), sps, early_stop=False)[0] for c in (conf_a, conf_b)]
    assert retro == [2, 0]
    assert appendix_a_first_token_freq(*retro) == pytest.approx(0.85, abs=0.006)  # biased
    policies = {"fixed": lambda: make_policy("fixed"),
                "threshold": lambda: make_policy("threshold", threshold=0.5),
                "threshold-pp": lambda: make_policy("threshold", threshold=0.5, mode="per_position"),
                "scheduled": lambda: make_policy("scheduled", sps=sps),
                "scheduled-async": lambda: make_policy("scheduled-async", sps=sps)}
    for name, mk in policies.items():
        lens = [int(mk()(c, ["req"])[0]) for c in (conf_a, conf_b)]
        assert appendix_a_first_token_freq(*lens) == pytest.approx(0.7, abs=0.006), (name, lens)


# ---- synthetic load sweep (Fig. 8 shape) ---------------------------------------------------------

def realistic_sps():
    b = np.arange(1, 8193)
    return SpsTable.from_ms(list(zip(b.tolist(), (10.0 + 0.01 * np.maximum(0, b - 128)).tolist())))


def test_load_sweep_budget_falls_with_concurrency_and_beats_fixed():
    sps, gen, g = realistic_sps(), torch.Generator().manual_seed(3), 5
    sched, fixed = make_policy("scheduled", sps=sps), make_policy("fixed")
    means = []
    for r in (1, 8, 32, 128, 256, 512, 1024):
        budget = []
        for rnd in range(4):
            conf = torch.randn(r, g, generator=gen) * 1.5 + 2.0
            surv = survival(conf)
            ell = sched(conf)
            budget.append(ell.float().mean().item())
            th_s, th_f = modelled_throughput(surv, ell, sps), modelled_throughput(surv, fixed(conf), sps)
            th_0 = modelled_throughput(surv, torch.zeros(r, dtype=torch.long), sps)
            assert th_s >= th_f * (1 - 1e-9) and th_s >= th_0 * (1 - 1e-9), (r, rnd)
            # ZOS with stale == current confidences: global argmax, never below Algorithm 1
            zos = make_policy("scheduled-async", sps=sps)
            ids = list(range(r))
            for _ in range(3):
                ell_z = zos(conf, ids)
            assert modelled_throughput(surv, ell_z, sps) >= th_s * (1 - 1e-9)
        means.append(float(np.mean(budget)))
    assert means[0] == pytest.approx(g, abs=0.3)              # idle: verify (almost) everything
    assert all(b <= a + 0.05 for a, b in zip(means, means[1:])), means
    assert means[-1] < 0.6 * means[0], means
    assert math.isfinite(sum(means))


def test_fixed_lengths_are_known_on_the_host():
    """The engine skips the confidence read (a wait for the draft pass) when the policy can say
    ℓ on the host: only the fixed policy can, and it says what its device answer says."""
    from dspark.spec.policy import FixedPolicy
    conf = torch.randn(3, 5)
    for n in (None, 2, 9):
        f = FixedPolicy(n)
        assert f.host_lengths(3, 5) == f(conf).tolist()
    tab = SpsTable.from_ms([[1, 10.0], [64, 12.0]])
    for p in (ThresholdPolicy(0.5), ScheduledPolicy(tab), AsyncScheduledPolicy(tab)):
        assert p.host_lengths(3, 5) is None
        # one width from earlier rounds only where rounds are padded (uniform), else none
        assert p.host_width(["a", "b", "c"], [7, 8, 9], conf) is None


def _width_literal(surv, sps, early_stop=True):
    """One width w for every request, Θ(w) = (R + Σ_r Σ_{j<=w} a_{r,j}) · SPS(R(1+w)) written
    out: grown while it strictly improves (early_stop) or its first global maximum."""
    r_count, g = surv.shape
    theta = [(r_count + float(surv[:, :w].sum())) * sps.sps(r_count * (1 + w)) for w in range(g + 1)]
    if not early_stop:
        return int(np.argmax(theta))
    w = 0
    while w < g and theta[w + 1] > theta[w]:
        w += 1
    return w


@pytest.mark.parametrize("seed", range(6))
def test_uniform_width_policies_equal_the_literal_walk(seed):
    """Where rounds are padded to one width the scheduled policies choose that width: the
    early-stopping walk over w (scheduled) and the argmax over w of the stale survivals
    (scheduled-async); every request gets w, cut at its first zero confidence."""
    rng = np.random.default_rng(seed)
    sps = SpsTable.from_ms([[b, 10.0 + float(rng.uniform(0, 3e-3)) * b * b] for b in range(1, 97)])
    r_count, g = int(rng.integers(1, 9)), 5
    conf = rng.uniform(0.05, 1.0, (r_count, g))
    conf[rng.uniform(size=(r_count, g)) < 0.1] = 0.0            # a few zero confidences
    z = logit(conf)
    surv = torch.as_tensor(conf).cumprod(1)
    cut = (surv > 0).long().cumprod(1).sum(1)
    pol = ScheduledPolicy(sps)
    pol.uniform = True
    w = _width_literal(surv, sps)
    assert pol(z).tolist() == cut.clamp(max=w).tolist()
    ids = list(range(r_count))
    apol = AsyncScheduledPolicy(sps)
    apol.uniform = True
    first = apol(z, ids)                        # no history: survival 1 at every position
    assert first.tolist() == cut.clamp(max=_width_literal(torch.ones(r_count, g), sps, False)).tolist()
    apol(logit(np.full((r_count, g), 0.5)), ids)
    again = apol(z, ids)                        # the width of the call two steps back
    assert again.tolist() == cut.clamp(max=_width_literal(surv, sps, False)).tolist()


# ---- widths from earlier rounds, on the host ---------------------------------------------------

def test_host_history_takes_blocks_wholly_behind_the_anchor():
    """HostHistory(1): a request's row is that of the newest earlier round whose block (drafted
    at anchor P, positions P+1..P+γ) lies wholly before its anchor now; a request with none counts
    the mean of the rows found for the others, survival 1 where none is. Without positions: the
    newest earlier round holding it. Rounds of changing sizes regrow and reuse the buffers."""
    h = HostHistory(1)
    rounds = [{"a": 10, "b": 20}, {"a": 12, "b": 21, "c": 30}, {"a": 15, "c": 31},
              {"a": 16, "b": 24, "c": 35, "d": 40}, {"a": 20, "b": 26}, {"a": 25, "b": 30}]
    want = [{}, {},                                     # no block behind any anchor yet: 1
            {"a": 10, "c": 10, "new": 10},              # a's block of round 1 (12 + 3 <= 15)
            {"a": 10, "b": 11, "c": 22, "d": 43 / 3, "new": 43 / 3},
            {"a": 30, "b": 11, "new": 41 / 2},          # a: round 3 (16 + 3 <= 20)
            {"a": 40, "b": 41, "new": 40.5}]
    for k, at in enumerate(rounds):
        ids = list(at) + ["new"]
        got = h.stale(ids, 3, list(at.values()) + [0])
        assert got.shape == (len(ids), 3) and np.array_equal(got, got[:, :1].repeat(3, 1)), k
        assert got[:, 0].tolist() == pytest.approx([want[k].get(r, 1.0) for r in ids]), k
        vals = torch.tensor([[10.0 * k + ord(r) - ord("a")] * 3 for r in at])
        h.record(list(at), vals, lambda rows: rows.astype(np.float64), list(at.values()))
        assert len(h) == min(k + 1, 4)                  # max(staleness, γ) + 1 rounds
    assert h.stale(["a", "b", "c"], 3)[:, 0].tolist() == [50, 51, 32]   # positions not given
    assert np.array_equal(h.stale(["zz"], 3, [99], fill=np.zeros(3)), np.zeros((1, 3)))
    assert np.array_equal(h.stale(["a"], 4, [99]), np.ones((1, 4)))    # other γ: no row of it


def test_host_survival_matches_the_device_survival():
    z = torch.tensor([[2.0, -1.0, 40.0, float("nan")], [float("-inf"), 3.0, -300.0, 0.5]])
    t = [1.3, 0.7, 2.0, 1.0]
    pol = ThresholdPolicy(0.5, temperatures=t)
    np.testing.assert_allclose(pol.host_survival(z.numpy()), survival(z, t).double().numpy(),
                               rtol=1e-6, atol=1e-12)


def _usable_rows(history, ids, positions, staleness, g):
    """HostHistory's rule written out: per request the newest round >= staleness calls back
    holding a block of it drafted at P with P + γ <= its position now, else the mean of the
    rows found for the others, else survival 1."""
    rows = []
    for rid, pos in zip(ids, positions):
        found = [surv[i] for surv, rids, at in reversed(history[:len(history) - staleness + 1])
                 for i, r in enumerate(rids) if r == rid and at[i] + g <= pos]
        rows.append(found[0] if found else None)
    known = [r for r in rows if r is not None]
    fill = torch.stack(known).mean(0) if known else torch.ones(g, dtype=torch.float64)
    return torch.stack([fill if r is None else r for r in rows])


@pytest.mark.parametrize("seed", range(4))
def test_host_width_walks_the_stale_survivals(seed):
    """The engine's path in uniform mode: `host_width` is the width walk (scheduled) / argmax
    (scheduled-async) over the survivals of blocks wholly behind each anchor, one / `staleness`
    calls back or more (HostHistory). Every width is a function of earlier calls only: the
    confidences passed now change no width of this call."""
    rng = np.random.default_rng(seed)
    slope = float(rng.uniform(0.02, 0.3))
    sps = SpsTable.from_ms([[b, 1.0 + slope * b] for b in range(1, 97)])
    g, t = 5, [1.2, 1.1, 1.5, 2.0, 1.0]
    pol, apol = ScheduledPolicy(sps, temperatures=t), AsyncScheduledPolicy(sps, temperatures=t)
    pol.uniform = apol.uniform = True
    ids_of = [[0, 1, 2], [0, 1, 2, 3], [1, 2, 3], [1, 2, 3, 4, 5], [2, 5, 6], [2, 5, 6, 7],
              [2, 5, 6, 7], [5, 6, 7]]
    levels = [3.0, -1.0, 3.0, 0.0, 4.0, 1.0, 3.0, -1.0]
    anchor, history, widths = {}, [], set()
    for k, (ids, level) in enumerate(zip(ids_of, levels)):
        for r in ids:                                   # every round moves an anchor 1..γ+1
            anchor[r] = anchor.get(r, 0) + int(rng.integers(1, g + 2))
        at = [anchor[r] for r in ids]
        z = torch.as_tensor(rng.normal(level, 1.5, (len(ids), g)), dtype=torch.float32)
        w = pol.host_width(ids, at, z)
        assert w == _width_literal(_usable_rows(history, ids, at, 1, g), sps), k
        wa = _width_literal(_usable_rows(history, ids, at, 2, g), sps, early_stop=False)
        assert apol.host_width(ids, at, z) == wa and apol.last_capacity == wa * len(ids), k
        history.append((survival(z, t).double(), ids, at))
        widths.add(w)
    assert len(widths) > 1, "the width never changed: the test lost its purpose"
    with pytest.raises(ValueError, match="one request id and position per row"):
        pol.host_width([0], [3], torch.zeros(2, g))
