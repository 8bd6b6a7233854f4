"""`echo2 eval`: greedy accuracy and sampled reward of a model on a task's held-out split, with vLLM.

Used to check that a task leaves headroom for the default model and to compare a checkpoint with the
model it started from. Rewards come from the task adapter exactly as in training.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from echo2cli.models import resolve_model
from echo2cli.tasks import load_task


def evaluate(
    model: str, task_name: str, n_prompts: int, samples: int, max_new_tokens: int, seed: int
) -> dict:
    from transformers import AutoTokenizer

    from echo2cli.worker.engine import Engine

    model_dir: Path = resolve_model(model)
    task = load_task(task_name)
    seen: dict[str, object] = {}
    for problem in itertools.islice(task.prompts(seed, "eval"), 50 * n_prompts):
        seen.setdefault(problem.prompt, problem)
        if len(seen) == n_prompts:
            break
    problems = list(seen.values())
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        list(tok.apply_chat_template([{"role": "user", "content": p.prompt}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False))
        for p in problems
    ]
    engine = Engine(model_dir, seed=seed)

    def mean_reward(n: int, temperature: float) -> float:
        groups = engine.generate(prompts, n=n, temperature=temperature, max_new_tokens=max_new_tokens)
        rewards = [task.reward(p, tok.decode(c.token_ids, skip_special_tokens=True))
                   for p, group in zip(problems, groups, strict=True) for c in group]
        return sum(rewards) / len(rewards)

    return {
        "model": str(model_dir), "task": task.name, "prompts": len(problems),
        "greedy_accuracy": mean_reward(1, 0.0),
        "sampled_reward": mean_reward(samples, 1.0),
        "samples_per_prompt": samples,
    }
