"""A worker's side of a multi-turn task (`tasks/episodes.py`): build each leased prompt's episode from its spec
and play it with the engine, turn by turn.

The environment's code runs on the worker, so only a task the worker trusts is built: a built-in one named by
the learner (`poker_hands`), or the one this worker names itself with `--env-task` (a learner cannot make a
worker import a module of its choosing). A prompt whose spec the task refuses is handed back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from echo2cli.errors import ConfigError
from echo2cli.protocol import JoinResponse, Lease
from echo2cli.tasks import builtin_tasks, load_task
from echo2cli.tasks.episodes import Transcript, Turns, is_episodic, play


class EpisodePlayer:
    def __init__(self, info: JoinResponse, env_task: str | None, tokenizer_dir: Path) -> None:
        from transformers import AutoTokenizer

        spec = env_task or info.task
        if env_task is None and info.task not in builtin_tasks():
            raise ConfigError(
                f"the learner's task {info.task!r} is multi-turn and not built in: its environment runs here, so "
                f"pass --env-task {info.task} if you trust that module"
            )
        self.task: Any = load_task(spec)
        if not is_episodic(self.task):
            raise ConfigError(f"task {spec!r} is not a multi-turn environment (no episode/max_turns)")
        self.turns = Turns(AutoTokenizer.from_pretrained(tokenizer_dir))
        self.info = info

    def play(self, engine: Any, lease: Lease, context_len: int) -> list[list[Transcript]]:
        """G transcripts per leased prompt; none for a prompt whose episode spec this task refuses."""
        info, G = self.info, self.info.group_size
        episodes, prompts, owner = [], [], []
        for k, item in enumerate(lease.prompts):
            try:
                made = [self.task.episode(item.episode or "") for _ in range(G)]
            except (ValueError, TypeError):
                continue
            episodes += made
            prompts += [item.prompt_token_ids] * G
            owner += [k] * G

        def generate(batch: list[list[int]], temperature: float, max_new_tokens: int) -> list[Any]:
            groups = engine.generate(batch, n=1, temperature=temperature, max_new_tokens=max_new_tokens)
            return [g[0] if g else None for g in groups]

        played = play(
            generate,
            self.turns,
            prompts,
            episodes,
            temperature=info.temperature,
            max_new_tokens=info.max_new_tokens,
            max_turns=min(info.max_turns, int(self.task.max_turns)),
            context_len=context_len,
            transcript_tokens=info.transcript_tokens,
        )
        out: list[list[Transcript]] = [[] for _ in lease.prompts]
        for k, transcript in zip(owner, played, strict=True):
            if transcript.token_ids:
                out[k].append(transcript)
        return [group if len(group) == G else [] for group in out]
