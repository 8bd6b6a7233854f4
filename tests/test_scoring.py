"""Rewards never crash or stall the learner: errors and timeouts become reward 0, counted; the example
user task loads by import path and scores as documented."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tasks_for_tests import MisbehavingTask

from echo2cli.errors import ConfigError
from echo2cli.tasks import load_task
from echo2cli.tasks.scoring import ERROR, TIMEOUT, Scorer, safe_score

PROBLEM = next(MisbehavingTask().prompts(0))


@pytest.mark.parametrize("completion", ["raise", "nan", "big"])
def test_a_score_that_raises_or_leaves_0_1_is_an_error_with_reward_0(completion):
    assert safe_score(MisbehavingTask(), PROBLEM, completion) == ERROR


def test_a_hanging_score_times_out_alone_and_the_scorer_goes_on():
    scorer = Scorer("tasks_for_tests:MisbehavingTask", timeout_s=1.0)
    try:
        scores = scorer(PROBLEM, ["fine", "hang", "raise", "fine"])
        assert [s.reward for s in scores] == [1.0, 0.0, 0.0, 1.0]
        assert scores[1] == TIMEOUT and scores[2] == ERROR
        assert (scorer.timeouts, scorer.errors) == (1, 1)
        assert [s.reward for s in scorer(PROBLEM, ["fine"])] == [1.0]  # a fresh process after the kill
    finally:
        scorer.close()


def test_the_example_user_task_loads_by_import_path_with_options(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "examples"))
    task = load_task("my_task:ReverseWordTask", {"max_len": 5})
    train = [p for _, p in zip(range(50), task.prompts(0, "train"), strict=False)]
    held_out = list(task.prompts(0, "eval"))
    assert held_out and not {p.id for p in train} & {p.id for p in held_out}
    problem = train[0]
    assert task.score(problem, problem.answer).reward == 1.0
    assert task.score(problem, f"It is {problem.answer}").components == {"correct": 1.0, "format": 0.0}
    assert task.score(problem, problem.answer[::-1]).reward == pytest.approx(0.1)
    with pytest.raises(ConfigError, match="does not take these options"):
        load_task("my_task:ReverseWordTask", {"colour": "red"})
    with pytest.raises(ConfigError, match="no word"):
        load_task("my_task:ReverseWordTask", {"min_len": 20})
    sys.modules.pop("my_task", None)


def test_the_scoring_processs_own_start_does_not_count_against_a_completions_deadline():
    scorer = Scorer("tasks_for_tests:SlowStartTask", timeout_s=0.5)  # starting takes 2 s, scoring a few ms
    try:
        assert [s.components for s in scorer(PROBLEM, ["fine", "fine"])] == [{"format": 1.0}] * 2
        assert scorer.timeouts == 0
    finally:
        scorer.close()
