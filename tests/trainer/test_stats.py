"""The update's small parts: running statistics, the skip-on-non-finite policy, the phase timer."""

from __future__ import annotations

import math

import pytest
import torch

from pyppo.trainer.guards import NonFiniteUpdateError, SkipPolicy
from pyppo.trainer.step_stats import PHASES, PhaseTimer, RunningStats


def test_running_stats_divide_once_by_the_total_weight():
    s = RunningStats()
    s.add({"clipfrac": 0.5, "approx_kl": 1.0}, weight=1)  # 1 token
    s.add({"clipfrac": 0.0, "approx_kl": 4.0}, weight=3)  # 3 tokens
    s.add_max("ratio_max", 1.5)
    s.add_max("ratio_max", 1.2)
    assert s.means() == {"clipfrac": 0.125, "approx_kl": 3.25, "ratio_max": 1.5}  # not the mean of means
    assert s.total("approx_kl") == 13.0 and math.isnan(s.total("missing"))


def test_running_stats_merge_and_empty():
    a, b = RunningStats(), RunningStats()
    a.add({"x": 2.0}, weight=2)
    b.add({"x": 5.0}, weight=1)
    b.add_max("m", 3.0)
    a.merge(b)
    assert a.means() == {"x": 3.0, "m": 3.0}
    empty = RunningStats()
    empty.add({"y": 1.0}, weight=0)
    assert math.isnan(empty.means()["y"])


def test_skip_policy_counts_and_stops():
    p = SkipPolicy(max_consecutive=2)
    assert p.allows({"policy_loss": 0.3, "value_grad_norm": 1.0}, "step 1")
    with pytest.warns(
        RuntimeWarning, match=r"step 1, minibatch 2: non-finite policy_loss=nan; update skipped \(1 in a row"
    ):
        assert not p.allows({"policy_loss": math.nan, "value_loss": 0.1}, "step 1, minibatch 2")
    assert (p.consecutive, p.total) == (1, 1)
    assert p.allows({"policy_loss": 0.1}, "step 2")  # a good update resets the run, not the total
    assert (p.consecutive, p.total) == (0, 1)
    with pytest.warns(RuntimeWarning):
        p.allows({"value_grad_norm": math.inf}, "step 3")
    with (
        pytest.warns(RuntimeWarning),
        pytest.raises(NonFiniteUpdateError, match=r"training stopped at step 4: 2 updates in a row.*-inf"),
    ):
        p.allows({"policy_grad_norm": -math.inf}, "step 4")


def test_skip_policy_state_round_trip():
    p = SkipPolicy(3)
    with pytest.warns(RuntimeWarning):
        p.allows({"x": math.nan}, "here")
    q = SkipPolicy(3)
    q.load_state_dict(p.state_dict())
    assert (q.consecutive, q.total) == (1, 1)


def test_phase_timer_accumulates_and_marks_the_profiler():
    t = PhaseTimer()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with t.phase("score"):
                sum(range(10000))
    m = t.metrics()
    assert set(m) == {f"time_{p}" for p in PHASES} | {"step_seconds"}
    assert 0 < m["time_score"] <= m["step_seconds"] and m["time_update"] == 0.0
    assert sum(e.name == "pyppo/score" for e in prof.events()) == 2
