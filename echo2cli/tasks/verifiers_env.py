"""Environments of the `verifiers` ecosystem (PyPI `verifiers` >= 0.4, its `verifiers.v1` API) as an echo2 task.

    [learner]
    task = "verifiers"
    [learner.task_options]
    env = "my-env"                 # the environment's taskset id: an installed module (my_env) or owner/name
    env_args = { num_tasks = 500 } # its taskset's config fields

The environment is loaded the way verifiers loads it (`vf.load_environment(vf.resolve_env_config(...))`), its
taskset iterated once: each task becomes a Problem whose messages are the task's system prompt and prompt
(what verifiers' own chat harness sends), with the task's key as its id. The eval split is the tasks whose key
hashes to bucket 0 of `eval_every` (a taskset has no split of its own); the train split is endless, each epoch a
shuffle seeded by (seed, epoch).

Scoring is the environment's own: the completion becomes the trace's one assistant turn and the task's
`@vf.reward` functions score it (`Task.score`, offline: no client, no runtime), the weighted sum being the
reward and each reward function a component. The reward must lie in [0, 1] like any task's (an out-of-range
sum scores 0 and counts as a reward error). Only single-turn environments are played here: one whose `Env`
runs its own conversation loop (`Env.run`) is refused at load with a one-line error.

verifiers is an optional extra: `pip install 'echo2cli[verifiers]'` (the test setup installs it).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from echo2cli.tasks import Problem, Score, Split, fixed_split


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ValueError(
            f"the verifiers task needs the verifiers package: pip install 'echo2cli[verifiers]' ({exc})"
        ) from None
    return vf


def chat_messages(task: Any) -> tuple[dict[str, str], ...]:
    """The task's system prompt and prompt as chat messages (a string prompt is one user message)."""
    from verifiers.v1.dialects.chat import message_to_wire

    data = task.data
    out = [{"role": "system", "content": str(data.system_prompt)}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        out.append({"role": "user", "content": data.prompt})
    else:
        for message in data.prompt or []:
            wire = message_to_wire(message)
            out.append({"role": str(wire["role"]), "content": str(wire.get("content") or "")})
    if not out or out[-1]["role"] != "user":
        raise ValueError(f"task {task.key}: its prompt must end with a user message")
    return tuple(out)


class VerifiersTask:
    """Options: `env` (the taskset id), `env_args` (its config fields), `eval_every` (default 5)."""

    name = "verifiers"
    max_new_tokens = 256

    def __init__(self, env: str, env_args: Mapping[str, Any] | None = None, eval_every: int = 5) -> None:
        if isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 2:
            raise ValueError(f"eval_every must be an integer >= 2, not {eval_every!r}")
        vf = _vf()
        try:
            self.env = vf.load_environment(vf.resolve_env_config({"taskset": {"id": env, **dict(env_args or {})}}))
        except Exception as exc:  # verifiers raises many types for a missing or broken environment
            raise ValueError(f"cannot load verifiers environment {env!r}: {type(exc).__name__}: {exc}") from None
        if type(self.env).run is not vf.SingleAgentEnv.run:
            raise ValueError(
                f"verifiers environment {env!r} runs its own conversation loop ({type(self.env).__name__}.run): "
                "only single-turn environments are supported"
            )
        self.tasks: dict[str, Any] = {}
        self.train: list[Problem] = []
        self.eval: list[Problem] = []
        for task in self.env.taskset:
            key = str(task.key)
            self.tasks[key] = task
            problem = Problem(f"vf-{key[:24]}", chat_messages(task), "", {"key": key})
            held_out = int(hashlib.sha256(key.encode()).hexdigest(), 16) % eval_every == 0
            (self.eval if held_out else self.train).append(problem)
        if not self.train:
            raise ValueError(f"verifiers environment {env!r} has no training tasks ({len(self.eval)} held out)")

    def prompts(self, seed: int, split: Split = "train") -> Iterator[Problem]:
        return fixed_split(self.train, self.eval, seed, split)

    def score(self, problem: Problem, completion: str) -> Score:
        task = self.tasks[problem.meta["key"]]
        trace = asyncio.run(self._scored(task, list(problem.messages), completion))
        components = {str(name): float(r.score) for name, r in trace.rewards.items()}
        return Score(float(trace.reward), components)

    async def _scored(self, task: Any, prompt: list[dict[str, str]], completion: str) -> Any:
        """The trace of one assistant turn, scored by the task's reward functions."""
        vf = _vf()
        from verifiers.v1 import graph
        from verifiers.v1.state import state_cls

        trace = vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            agent=vf.AgentInfo(config=vf.AgentConfig(model="echo2", harness={"id": "null"}), name="echo2"),
            state=state_cls(type(task))(),
        )
        kinds = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}
        messages = [kinds[m["role"]](content=m["content"]) for m in prompt]
        response = vf.Response(
            id=uuid.uuid4().hex,
            created=int(time.time()),
            model="echo2",
            message=vf.AssistantMessage(content=completion),
            finish_reason="stop",
        )
        graph.prepare_turn(trace, messages).commit(response)
        await task.score(trace)
        return trace
