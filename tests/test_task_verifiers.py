"""The verifiers adapter: a v1 taskset (tests/vf_envs/vf_tiny_sums) as an echo2 task, scored by its own reward
functions offline; a multi-turn environment and a missing one are one-line config errors."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from echo2cli.errors import ConfigError
from echo2cli.tasks import load_task

ENVS = Path(__file__).parent / "vf_envs"


@pytest.fixture
def sums(monkeypatch):
    monkeypatch.syspath_prepend(str(ENVS))
    return load_task("verifiers", {"env": "vf-tiny-sums", "env_args": {"num_tasks": 30}})


def test_tasks_become_problems_with_the_environments_prompt_and_a_held_out_split(sums):
    assert len(sums.train) + len(sums.eval) == 30 and sums.eval
    assert not {p.id for p in sums.train} & {p.id for p in sums.eval}
    problem = sums.train[0]
    assert [m["role"] for m in problem.messages] == ["system", "user", "assistant", "user"]
    assert problem.messages[0]["content"] == "Answer with just the number."
    assert list(sums.prompts(0, "eval")) == sums.eval


def test_the_environments_reward_functions_score_the_completion(sums):
    for problem in sums.train[:5]:
        a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)\?", problem.prompt)[0])
        right = sums.score(problem, f"The sum is {a + b}")
        assert right.reward == 1.0 and right.components == {"correct": 1.0}
        assert sums.score(problem, f"{a + b + 1}").reward == 0.0


def test_a_multi_turn_environment_is_refused(tmp_path, monkeypatch):
    (tmp_path / "vf_talker.py").write_text(
        textwrap.dedent(
            """
            import verifiers.v1 as vf
            from vf_tiny_sums import SumTaskset

            class TalkConfig(vf.EnvConfig):
                player: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"}, max_turns=4)

            class TalkEnv(vf.Env[TalkConfig]):
                async def run(self, task, agents):
                    pass

            __all__ = ["SumTaskset", "TalkEnv"]
            """
        )
    )
    monkeypatch.syspath_prepend(str(ENVS))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="runs its own conversation loop"):
        load_task("verifiers", {"env": "vf-talker"})


def test_a_missing_environment_is_a_one_line_error():
    with pytest.raises(ConfigError, match="cannot load verifiers environment 'no-such-env'") as info:
        load_task("verifiers", {"env": "no-such-env"})
    assert "\n" not in str(info.value)
