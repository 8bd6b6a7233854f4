"""A worker's side of a multi-turn task (`tasks/episodes.py`): play each leased prompt's episodes with the engine,
turn by turn.

Where the environment runs:
- A task whose environment hides state (`JoinResponse.hidden_state`: a card deal) is stepped by the learner
  (`LearnerSteps`, learner/episode_host.py): the worker sends each turn's tokens and gets the next observation's,
  and never holds the deal. It needs no environment code of its own.
- Any other is built here from the spec each leased prompt carries. Its code runs on the worker, so only a task
  the worker trusts is built: a built-in one named by the learner, or the one this worker names itself with
  `--env-task` (a learner cannot make a worker import a module of its choosing). A prompt whose spec the task
  refuses is handed back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from echo2cli.errors import ConfigError, LeaseLost, ProtocolError
from echo2cli.protocol import EpisodeAction, JoinResponse, Lease, StepRequest
from echo2cli.tasks import builtin_tasks, load_task
from echo2cli.tasks.episodes import LocalSteps, Steps, Transcript, Turns, is_episodic, play


class LearnerSteps:
    """Episodes the learner steps: one `/v1/episodes/step` call per turn for every live episode of a lease. What the
    learner answers is bounded like anything it sends: token ids inside the vocabulary, one answer per action."""

    def __init__(self, client: Any, worker_id: str, lease: Lease, group_size: int, vocab_size: int) -> None:
        self.client, self.worker_id, self.lease_id, self.vocab_size = client, worker_id, lease.lease_id, vocab_size
        self.keys = [(item.prompt_id, j) for item in lease.prompts for j in range(group_size)]  # episode index -> key

    def __call__(self, turn: int, actions: list[tuple[int, list[int]]]) -> list[tuple[bool, list[int]]]:
        request = StepRequest(
            worker_id=self.worker_id,
            lease_id=self.lease_id,
            actions=[
                EpisodeAction(prompt_id=self.keys[i][0], sample_idx=self.keys[i][1], turn=turn, token_ids=ids)
                for i, ids in actions
            ],
        )
        try:
            reply = self.client.step_episodes(request)
        except LeaseLost:
            raise
        except ProtocolError as exc:  # the learner refused the turn: this lease's work cannot be finished
            raise LeaseLost(f"lease {self.lease_id}: {exc}") from exc
        if len(reply.steps) != len(actions):
            raise ProtocolError(f"the learner answered {len(reply.steps)} steps to {len(actions)} actions")
        if any(t >= self.vocab_size for s in reply.steps for t in s.env_token_ids):
            raise ProtocolError("the learner's observation holds token ids outside the model's vocabulary")
        return [(s.done, list(s.env_token_ids)) for s in reply.steps]


class EpisodePlayer:
    def __init__(self, info: JoinResponse, env_task: str | None, tokenizer_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.info = info
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.turns, self.vocab_size = Turns(tokenizer), len(tokenizer)
        self.task: Any = None
        self.max_turns = info.max_turns
        if info.hidden_state:
            return  # the learner steps every episode: no environment here
        spec = env_task or info.task
        if env_task is None and info.task not in builtin_tasks():
            raise ConfigError(
                f"the learner's task {info.task!r} is multi-turn and not built in: its environment runs here, so "
                f"pass --env-task {info.task} if you trust that module"
            )
        self.task = load_task(spec)
        if not is_episodic(self.task):
            raise ConfigError(f"task {spec!r} is not a multi-turn environment (no episode/max_turns)")
        self.max_turns = min(info.max_turns, int(self.task.max_turns))

    def play(
        self, engine: Any, lease: Lease, context_len: int, client: Any = None, worker_id: str = ""
    ) -> list[list[Transcript]]:
        """G transcripts per leased prompt; none for a prompt whose episode spec this task refuses. `client` and
        `worker_id`: for the episodes the learner steps. LeaseLost if the learner refuses a turn."""
        info, G = self.info, self.info.group_size
        prompts: list[list[int]] = []
        owner: list[int] = []
        steps: Steps
        if info.hidden_state:
            steps = LearnerSteps(client, worker_id, lease, G, self.vocab_size)
            for k, item in enumerate(lease.prompts):
                prompts += [item.prompt_token_ids] * G
                owner += [k] * G
        else:
            episodes = []
            for k, item in enumerate(lease.prompts):
                try:
                    made = [self.task.episode(item.episode or "") for _ in range(G)]
                except (ValueError, TypeError):
                    continue
                episodes += made
                prompts += [item.prompt_token_ids] * G
                owner += [k] * G
            steps = LocalSteps(self.turns, episodes)

        def generate(batch: list[list[int]], temperature: float, max_new_tokens: int) -> list[Any]:
            groups = engine.generate(batch, n=1, temperature=temperature, max_new_tokens=max_new_tokens)
            return [g[0] if g else None for g in groups]

        played = play(
            generate,
            steps,
            prompts,
            temperature=info.temperature,
            max_new_tokens=info.max_new_tokens,
            max_turns=self.max_turns,
            context_len=context_len,
            transcript_tokens=info.transcript_tokens,
        )
        out: list[list[Transcript]] = [[] for _ in lease.prompts]
        for k, transcript in zip(owner, played, strict=True):
            if transcript.token_ids:
                out[k].append(transcript)
        return [group if len(group) == G else [] for group in out]
