"""Multi-turn environments: an episode the worker plays with vLLM turn by turn, and the learner replays.

An episodic task is a task (`tasks/__init__.py`) with two more members:

    max_turns: int                         # the policy's turns in one episode, at most
    episode(spec: str) -> Episode          # a fresh episode; deterministic given `spec` alone

and an Episode is

    reset() -> str                         # the first observation: the user's first message
    step(action: str) -> Step              # Step(observation, reward, done): the environment's answer

Each Problem of an episodic task carries its episode's spec in `meta["episode"]` (short text, e.g. a seed), and
its messages are the system prompt and `reset()`. The learner leases the spec with the prompt; the worker
builds the same episode and plays it (`play`): generate a turn from prompt + transcript so far, decode it as the
action, step the environment, append the observation as the chat template's next user turn (`Turns`), repeat
until `done`, `max_turns`, or the engine's context. The worker returns the whole transcript: every token after
the prompt, the behaviour log-prob of each (0 for environment tokens) and a policy mask (1 = the policy
sampled this token).

The learner owns rewards: it replays the episode itself (`score_transcript`) from its own copy of the spec,
decoding each policy span with its own tokenizer and stepping a fresh episode. Every environment span must be
exactly the tokens the environment's observation makes at that point; a transcript with any other environment
token is forged and rejected whole (`FORGED` component), as are malformed masks and spans after the end.
Training uses policy tokens only. The episode's reward is the sum of its steps' rewards, which must stay in
[0, 1] like any task's reward; components are the last step's `info` plus `turns`, `done` and `truncated`.

A truncated episode (the transcript ends before the environment says done: the engine's context, the learner's
transcript cap or max_turns ran out) is scored as the environment says with `truncate() -> Step`, the step it
takes when a player runs out of time; an environment without one scores the rewards of the steps it took.
poker_hands folds the hand there: the chips committed so far are lost, not the whole stack.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from echo2cli.tasks import Score

FORGED = "forged"  # the component that marks a transcript whose environment tokens are not the environment's


@dataclass(frozen=True)
class Step:
    observation: str
    reward: float
    done: bool
    info: Mapping[str, float] = field(default_factory=dict)  # numbers reported as reward components


class Episode(Protocol):
    def reset(self) -> str: ...

    def step(self, action: str) -> Step: ...  # optional too: truncate() -> Step (see the module docstring)


def is_episodic(task: Any) -> bool:
    return callable(getattr(task, "episode", None)) and int(getattr(task, "max_turns", 0)) > 0


class Turns:
    """The chat template's boundary between turns, as tokens: what follows a policy turn so that the model sees
    the observation as the next user message and starts its next answer. Derived once from the tokenizer's own
    template by rendering a conversation with marker texts, so it holds for any chat model."""

    def __init__(self, tokenizer: Any) -> None:
        marks = ("@@ECHO2-A@@", "@@ECHO2-B@@", "@@ECHO2-C@@")
        text = tokenizer.apply_chat_template(
            [
                {"role": "user", "content": marks[0]},
                {"role": "assistant", "content": marks[1]},
                {"role": "user", "content": marks[2]},
            ],
            add_generation_prompt=True,
            tokenize=False,
        )
        between = text.split(marks[1], 1)[1]
        self.before, self.after = between.split(marks[2], 1)  # "<|im_end|>\n<|im_start|>user\n", "<|im_end|>..."
        self.tokenizer = tokenizer
        self.eos_ids = set(_eos_ids(tokenizer))
        self.eos_text = tokenizer.decode(sorted(self.eos_ids)[:1]) if self.eos_ids else ""

    def env_tokens(self, observation: str, policy_ids: Sequence[int]) -> list[int]:
        """The tokens after a policy turn `policy_ids` that hand the model `observation`. A turn that ended with
        the end-of-turn token already closed itself: the template's copy of it is left out."""
        before = self.before
        if policy_ids and policy_ids[-1] in self.eos_ids and before.startswith(self.eos_text):
            before = before[len(self.eos_text) :]
        return list(self.tokenizer.encode(before + observation + self.after, add_special_tokens=False))

    def action(self, policy_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(policy_ids), skip_special_tokens=True))


def _eos_ids(tokenizer: Any) -> list[int]:
    eos = tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


@dataclass
class Transcript:
    """Everything after the prompt: tokens, behaviour log-probs, policy mask; and the worker's view of the end."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_mask: list[int] = field(default_factory=list)
    done: bool = False
    finish_reason: str = ""

    def add(self, ids: Sequence[int], logprobs: Sequence[float] | None, policy: bool) -> None:
        self.token_ids += ids
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.policy_mask += [int(policy)] * len(ids)


Generate = Callable[[list[list[int]], float, int], list[Any]]  # (prompts, temperature, max_new_tokens) -> Completion
# (turn, [(episode index, the turn's policy tokens)]) -> [(done, the tokens that hand the model the next observation)]
Steps = Callable[[int, list[tuple[int, list[int]]]], list[tuple[bool, list[int]]]]


class LocalSteps:
    """Episodes stepped here: a worker's own copies of an environment without hidden state, or `echo2 eval`'s.
    (An environment with hidden state is stepped by the learner: worker/multiturn.LearnerSteps.)"""

    def __init__(self, turns: Turns, episodes: Sequence[Episode]) -> None:
        self.turns, self.episodes = turns, list(episodes)
        for episode in self.episodes:
            episode.reset()  # its first observation is the prompt

    def __call__(self, turn: int, actions: list[tuple[int, list[int]]]) -> list[tuple[bool, list[int]]]:
        out = []
        for i, ids in actions:
            step = self.episodes[i].step(self.turns.action(ids))
            out.append((step.done, [] if step.done else self.turns.env_tokens(step.observation, ids)))
        return out


def play(
    generate: Generate,
    steps: Steps,
    prompts: Sequence[list[int]],
    *,
    temperature: float,
    max_new_tokens: int,
    max_turns: int,
    context_len: int,
    transcript_tokens: int,
) -> list[Transcript]:
    """Play every episode to its end, all live ones batched into one engine call and one `steps` call per turn. A
    transcript stops early where the next turn could pass the engine's context or `transcript_tokens` (the
    learner's cap)."""
    out = [Transcript() for _ in prompts]
    live = list(range(len(prompts)))
    for turn in range(max_turns):
        if not live:
            break
        completions = generate([prompts[i] + out[i].token_ids for i in live], temperature, max_new_tokens)
        acting = []
        for i, c in zip(live, completions, strict=True):
            if c is None:  # the engine cannot take this context: the transcript ends here
                out[i].finish_reason = "context"
                continue
            out[i].add(c.token_ids, c.logprobs, policy=True)
            acting.append((i, list(c.token_ids)))
        still = []
        for (i, _), (done, env) in zip(acting, steps(turn, acting) if acting else [], strict=True):
            t = out[i]
            if done:
                t.done, t.finish_reason = True, "done"
                continue
            after = len(t.token_ids) + len(env) + max_new_tokens
            room = len(prompts[i]) + after <= context_len and after <= transcript_tokens
            if turn + 1 == max_turns or not room:
                t.finish_reason = "max_turns" if turn + 1 == max_turns else "context"
                continue
            t.add(env, None, policy=False)
            still.append(i)
        live = still
    return out


def spans(mask: Sequence[int]) -> list[tuple[int, int, bool]]:
    """(start, end, is_policy) of each run of equal mask values."""
    runs: list[tuple[int, int, bool]] = []
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((start, i, bool(mask[start])))
            start = i
    return runs


def mask_problem(mask: Sequence[int], n_tokens: int, max_turns: int, max_new_tokens: int) -> str:
    """Why a transcript's policy mask is malformed, or ''. Checked at admission, before any replay."""
    if len(mask) != n_tokens:
        return "policy_mask and completion_token_ids differ in length"
    if any(m not in (0, 1) for m in mask):
        return "policy_mask holds values other than 0 and 1"
    runs = spans(mask)
    if not runs or not runs[0][2] or not runs[-1][2]:
        return "a transcript starts and ends with policy tokens"
    policy = [e - s for s, e, p in runs if p]
    if len(policy) > max_turns:
        return f"{len(policy)} policy turns, more than the task's {max_turns}"
    if max(policy) > max_new_tokens:
        return f"a policy turn of {max(policy)} tokens, more than max_new_tokens {max_new_tokens}"
    return ""


def score_transcript(task: Any, turns: Turns, spec: str, token_ids: Sequence[int], mask: Sequence[int]) -> Score:
    """Replay the episode from `spec` against the transcript's policy turns: the reward, or FORGED."""
    problem = mask_problem(mask, len(token_ids), int(task.max_turns), len(token_ids))
    if problem:
        return Score(0.0, {FORGED: 1.0})
    episode = task.episode(spec)
    episode.reset()
    runs = spans(mask)
    total, info, turn_count, done = 0.0, {}, 0, False
    for k, (start, end, is_policy) in enumerate(runs):
        if not is_policy:
            continue
        if done:  # policy tokens after the episode ended
            return Score(0.0, {FORGED: 1.0})
        policy_ids = list(token_ids[start:end])
        step = episode.step(turns.action(policy_ids))
        total, info, turn_count, done = total + step.reward, dict(step.info), turn_count + 1, step.done
        if k + 1 < len(runs):
            env_start, env_end, _ = runs[k + 1]
            if done or list(token_ids[env_start:env_end]) != turns.env_tokens(step.observation, policy_ids):
                return Score(0.0, {FORGED: 1.0})
    truncated = not done and callable(getattr(episode, "truncate", None))
    if truncated:
        step = episode.truncate()
        total, info = total + step.reward, dict(step.info)
    components = {str(k): float(v) for k, v in info.items()}
    return Score(total, {**components, "turns": turn_count, "done": float(done), "truncated": float(not done)})
