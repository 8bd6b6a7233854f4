"""The learning rate schedule: a pure function of the step."""

import math

import pytest

from echo2cli.config import LearnerConfig, load_config
from echo2cli.errors import ConfigError
from echo2cli.learner.schedule import LrSchedule


def test_constant_is_the_rate_at_every_step_and_warmup_climbs_to_it():
    assert [LrSchedule(1e-5, 10).at(t) for t in (0, 5, 9)] == [1e-5] * 3
    warm = LrSchedule(1.0, 10, warmup_steps=4)
    assert [warm.at(t) for t in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]  # no step of zero at the start


@pytest.mark.parametrize("name", ["linear", "cosine"])
@pytest.mark.parametrize(("warmup", "floor"), [(0, 0.0), (3, 0.1)])
def test_decay_starts_at_the_peak_after_warmup_falls_and_never_reaches_the_floor(name, warmup, floor):
    sched = LrSchedule(2.0, 30, name, warmup, floor)
    rates = [sched.at(t) for t in range(30)]
    assert rates[warmup] == 2.0
    assert all(a > b for a, b in zip(rates[warmup:], rates[warmup + 1 :], strict=False))
    assert 2.0 * floor < rates[-1] < 2.0 * (floor + 0.1)  # the last step still moves the weights
    assert rates[warmup - 1 if warmup else 0] <= 2.0


def test_cosine_halfway_is_midway_between_peak_and_floor_and_linear_is_a_straight_line():
    assert math.isclose(LrSchedule(1.0, 20, "cosine", 0, 0.2).at(10), 0.6)
    assert math.isclose(LrSchedule(1.0, 20, "linear", 0, 0.0).at(5), 0.75)


def test_a_resumed_run_continues_the_same_curve():
    """No scheduler state: the rate of step t is the same whether the run got there in one go or after a resume."""
    a, b = LrSchedule(1.0, 40, "cosine", 5, 0.1), LrSchedule(1.0, 40, "cosine", 5, 0.1)
    assert [a.at(t) for t in range(40)][17:] == [b.at(t) for t in range(17, 40)]


def test_a_warmup_as_long_as_the_run_is_a_one_line_error():
    with pytest.raises(ConfigError, match="--lr-warmup-steps 20 must be less than --steps 20"):
        load_config(LearnerConfig, None, {"steps": 20, "lr_warmup_steps": 20}, "learner")
    cfg = load_config(LearnerConfig, None, {"steps": 20, "lr_schedule": "cosine", "lr_warmup_steps": 2}, "learner")
    assert (cfg.lr_schedule, cfg.lr_warmup_steps, cfg.lr_min_ratio) == ("cosine", 2, 0.0)
