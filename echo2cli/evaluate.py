"""`echo2 eval`: a model on a task's held-out split with vLLM — greedy accuracy and pass@k.

    model   'default', an HF directory, or a run (`--run DIR`: its newest checkpoint, its weights rounded to the
            run's wire dtype (bf16 or fp16) as the learner publishes them, and by default its task, task options
            and completion length; `--version N`: the version N it published instead)
    greedy  one completion per problem at temperature 0: mean reward, mean of each reward component,
            accuracy = the share solved
    pass@k  k completions per problem at temperature 1: the share of problems with at least one solved
            (k samples, so the estimate is the plain "any of k"), and the mean sampled reward

A completion *solves* a problem when its `correct` component is 1 (tasks that have one: arithmetic, math,
the example task) or, for tasks without it (poker), when its reward is 1 (the best action). Rewards come
from the task adapter through the same time-bounded scorer as in training. Problems are the first `limit`
distinct ids of the eval split for the seed.

A multi-turn task (poker_hands) plays each problem's episode turn by turn (`max_new_tokens` per turn) and
scores the transcript by the learner's replay; its components (poker_hands: `chips`, `won`, `illegal`) are
reported as `greedy_<name>`: greedy_chips is the base model's chips per hand.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from echo2cli.config import EvalConfig
from echo2cli.errors import ConfigError
from echo2cli.layout import VERSIONS_DIR, VersionKey, kept_versions, weights_path
from echo2cli.learner.checkpoint import find_checkpoint, read_state
from echo2cli.lora import is_adapter, write_merged
from echo2cli.models import copy_model_files, model_dir_with_weights, resolve_model
from echo2cli.tasks import Problem, Score, encode_chat, load_task
from echo2cli.tasks.episodes import LocalSteps, Turns, is_episodic, play
from echo2cli.tasks.scoring import Scorer

EPISODE_CONTEXT = 4096  # a multi-turn task's engine context: the prompt and every turn and observation after it


def eval_command(cfg: EvalConfig, engine: Any = None) -> tuple[dict[str, Any], Path | None]:
    """`echo2 eval`: resolve the model, task, options and completion length (from `--run` where given), evaluate,
    write the result where asked (with --run, by default `RUN/eval/TASK-step_N.json`, or `TASK-vN.json` for each
    version). Returns it and its path. `engine`: as `evaluate`'s."""
    task, model, max_new_tokens, options, checkpoint = cfg.task, cfg.model, cfg.max_new_tokens, {}, None
    wire = "bf16"  # a run's versions' dtype; runs from before --wire-dtype published in bf16
    versions = parse_versions(cfg.version)
    if versions and cfg.run is None:
        raise ConfigError("--version needs --run: the run directory whose published version to evaluate")
    if cfg.run is not None:
        checkpoint = find_checkpoint(cfg.run)
        saved = read_state(checkpoint)["config"]
        task = task or saved["task"]
        options = dict(saved.get("task_options") or {}) if task == saved["task"] else {}
        max_new_tokens = max_new_tokens or saved.get("max_new_tokens")
        wire = saved.get("wire_dtype", wire)
        model = model or str(checkpoint)
    task = task or "arithmetic"
    options.update(parse_options(cfg.option))
    if max_new_tokens is None:
        max_new_tokens = int(getattr(load_task(task, options), "max_new_tokens", 16))
    then = [version_weights(cfg.run, v).parent for v in versions[1:]] if cfg.run is not None else []
    with contextlib.ExitStack() as stack:
        if versions and cfg.run is not None and checkpoint is not None:
            model = str(stack.enter_context(published_version(cfg.run, versions[0], checkpoint)))
        elif checkpoint is not None and model == str(checkpoint) and is_adapter(checkpoint):
            model = str(stack.enter_context(lora_checkpoint(checkpoint)))
        elif checkpoint is not None and model == str(checkpoint) and engine_in_fp32():
            model = str(stack.enter_context(rounded_checkpoint(checkpoint, wire)))
        result = evaluate(
            model or "default",
            task,
            task_options=options,
            limit=cfg.limit,
            k=cfg.k,
            max_new_tokens=max_new_tokens,
            seed=cfg.seed,
            kv_cache_gib=cfg.kv_cache_gib,
            then=then,
            revision=cfg.revision,
            engine=engine,
        )
    if versions:
        result["version"] = versions[0]
        for version, later in zip(versions[1:], result.get("then", []), strict=True):
            later["version"] = version
    return result, _write_result(cfg, task, checkpoint, versions, result)


def _write_result(
    cfg: EvalConfig, task: str, checkpoint: Path | None, versions: list[int], result: dict[str, Any]
) -> Path | None:
    """`--out`, else with --run `RUN/eval/TASK-<checkpoint>.json` or one `TASK-vN.json` per version (the path of
    the first is returned)."""
    if cfg.out is not None:
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.write_text(json.dumps(result, indent=2))
        return cfg.out
    if cfg.run is None or checkpoint is None:
        return None
    (cfg.run / "eval").mkdir(parents=True, exist_ok=True)
    prefix = task.replace(":", ".")
    if not versions:
        out = cfg.run / "eval" / f"{prefix}-{checkpoint.name}.json"
        out.write_text(json.dumps(result, indent=2))
        return out
    each = [{k: v for k, v in result.items() if k != "then"}, *result.get("then", [])]
    for version, one in zip(versions, each, strict=True):
        (cfg.run / "eval" / f"{prefix}-{VersionKey(version).dir_name}.json").write_text(json.dumps(one, indent=2))
    return cfg.run / "eval" / f"{prefix}-{VersionKey(versions[0]).dir_name}.json"


def parse_versions(text: str | None) -> list[int]:
    """`--version 10,20,30` -> [10, 20, 30]; a one-line error for anything but comma-separated versions >= 0."""
    if text is None or not text.strip():
        return []
    try:
        versions = [int(v) for v in text.split(",")]
    except ValueError:
        versions = [-1]
    if any(v < 0 for v in versions):
        raise ConfigError(f"--version takes comma-separated version numbers (>= 0), got {text!r}")
    return versions


def parse_options(items: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` task options; VALUE as JSON if it parses, else text."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--option {item!r}: expected KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def version_weights(run: Path, version: int) -> Path:
    """The weights file of a run's published version; a one-line error where it is gone."""
    versions = run / VERSIONS_DIR
    weights = weights_path(versions, version)
    if not weights.is_file():
        raise ConfigError(
            f"version {version} is not in {versions} (kept: {kept_versions(versions) or 'none'}; the learner keeps "
            f"the newest S+1, and every N-th with --keep-versions-every N): evaluate a checkpoint with --run alone"
        )
    return weights


@contextlib.contextmanager
def published_version(run: Path, version: int, checkpoint: Path) -> Iterator[Path]:
    """A model directory for a run's published version: the checkpoint's config and tokenizer files and
    the version's weights (hard-linked), removed afterwards."""
    weights = version_weights(run, version)
    mdir = Path(tempfile.mkdtemp(prefix=f"eval-v{version}-", dir=run))
    try:
        yield model_dir_with_weights(mdir, checkpoint, weights)
    finally:
        shutil.rmtree(mdir, ignore_errors=True)


def engine_in_fp32() -> bool:
    """Whether this host's engine computes in fp32 (a CPU without bf16), and so would run a checkpoint's fp32
    weights as they are. One computing in bf16 rounds them itself, as the learner does when it publishes."""
    import torch

    from echo2cli.hardware import compute_dtype

    return compute_dtype(torch.cuda.is_available()) == "float32"


@contextlib.contextmanager
def rounded_checkpoint(checkpoint: Path, wire: str = "bf16") -> Iterator[Path]:
    """A model directory for a checkpoint's weights rounded to `wire` ('bf16' or 'fp16'), as the learner
    publishes them: the policy its steps trained (`learner/rounding.py`). The fp32 weights themselves are another
    policy, up to several nats apart on a token (docs/BENCHMARKS.md). Removed afterwards."""
    from safetensors.torch import load_file, save_file

    from echo2cli.broadcast.image import WIRE_DTYPES

    if wire not in WIRE_DTYPES:
        raise ConfigError(
            f"{checkpoint}: wire dtype {wire[:40]!r} is neither bf16 nor fp16: not a checkpoint of this echo2"
        )
    mdir = Path(tempfile.mkdtemp(prefix=f"eval-{checkpoint.name}-", dir=checkpoint.parent.parent))
    try:
        copy_model_files(checkpoint, mdir)
        for index in checkpoint.glob("*.safetensors.index.json"):  # a checkpoint saved in shards
            shutil.copy2(index, mdir / index.name)
        for shard in checkpoint.glob("*.safetensors"):
            tensors = {k: v.to(WIRE_DTYPES[wire]) for k, v in load_file(shard).items()}
            save_file(tensors, str(mdir / shard.name), metadata={"format": "pt"})
        yield mdir
    finally:
        shutil.rmtree(mdir, ignore_errors=True)


@contextlib.contextmanager
def lora_checkpoint(checkpoint: Path) -> Iterator[Path]:
    """A model directory for a LoRA run's checkpoint (adapters only): its adapters merged into the run's base,
    version 0 of `RUN/versions`, kept for the whole run; removed afterwards."""
    run = checkpoint.parent.parent
    base = VersionKey(0).path(run / VERSIONS_DIR)
    if not base.is_file():
        raise ConfigError(f"{checkpoint} holds LoRA adapters, and their base {base} is gone: rerun the learner")
    mdir = Path(tempfile.mkdtemp(prefix=f"eval-{checkpoint.name}-", dir=run))
    try:
        copy_model_files(checkpoint, mdir)
        write_merged(mdir, checkpoint, base)
        yield mdir
    finally:
        shutil.rmtree(mdir, ignore_errors=True)


def solved(score: Score) -> bool:
    return score.components.get("correct", score.reward) >= 1.0 - 1e-9


def eval_problems(task: Any, limit: int, seed: int) -> list[Problem]:
    """The first `limit` distinct problems of the eval split (an endless stream may repeat some)."""
    seen: dict[str, Problem] = {}
    for problem in itertools.islice(task.prompts(seed, "eval"), 50 * limit):
        seen.setdefault(problem.id, problem)
        if len(seen) == limit:
            break
    return list(seen.values())


def summarize(greedy: list[list[Score]], sampled: list[list[Score]]) -> dict[str, Any]:
    flat = [g[0] for g in greedy]
    names = sorted({k for s in flat for k in s.components})
    return {
        "greedy_accuracy": sum(solved(s) for s in flat) / len(flat),
        "greedy_reward": sum(s.reward for s in flat) / len(flat),
        **{f"greedy_{k}": sum(s.components.get(k, 0.0) for s in flat) / len(flat) for k in names},
        "pass_at_k": sum(any(solved(s) for s in group) for group in sampled) / len(sampled),
        "sampled_reward": sum(s.reward for group in sampled for s in group) / sum(len(g) for g in sampled),
    }


def by_level(
    problems: Sequence[Problem], greedy: Sequence[Sequence[Score]], weights: Mapping[str, float] | None
) -> dict[str, Any]:
    """Greedy accuracy per `meta["level"]` where the task names levels, and with the task's `level_weights` (its
    training mix) their weighted mean over the levels evaluated: `greedy_accuracy_train_mix`, the accuracy on unseen
    problems drawn as training draws them, where the split's own mix differs from it."""
    levels: dict[str, list[bool]] = {}
    for problem, group in zip(problems, greedy, strict=True):
        if (level := problem.meta.get("level")) is not None:
            levels.setdefault(str(level), []).append(solved(group[0]))
    if not levels:
        return {}
    acc = {name: sum(hits) / len(hits) for name, hits in levels.items()}
    out: dict[str, Any] = {
        "by_level": {name: {"problems": len(levels[name]), "greedy_accuracy": acc[name]} for name in sorted(acc)}
    }
    if weighted := {name: float(w) for name, w in (weights or {}).items() if name in acc and w > 0}:
        out["greedy_accuracy_train_mix"] = sum(w * acc[name] for name, w in weighted.items()) / sum(weighted.values())
    return out


def _generate_and_score(
    engine: Any,
    tok: Any,
    scorer: Scorer,
    task: Any,
    problems: list[Problem],
    prompts: list[list[int]],
    k: int,
    max_new_tokens: int,
) -> tuple[list[list[str]], list[list[Score]]]:
    """Texts and scores of each problem's greedy completion, then (k > 0) of its k samples at temperature 1.
    One batch: a prompt's two requests share its prefill through vLLM's prefix cache."""
    requests = [(p, 1, 0.0) for p in prompts] + ([(p, k, 1.0) for p in prompts] if k > 0 else [])
    groups = engine.generate(
        [r[0] for r in requests],
        n=[r[1] for r in requests],
        temperature=[r[2] for r in requests],
        max_new_tokens=max_new_tokens,
    )
    texts = [[tok.decode(c.token_ids, skip_special_tokens=True) for c in group] for group in groups]
    scores = [scorer(p, t) for p, t in zip(problems * (2 if k > 0 else 1), texts, strict=True)]
    return texts, scores


def _play_and_score(
    engine: Any,
    tok: Any,
    scorer: Scorer,
    task: Any,
    problems: list[Problem],
    prompts: list[list[int]],
    k: int,
    max_new_tokens: int,
) -> tuple[list[list[str]], list[list[Score]]]:
    """`_generate_and_score` for a multi-turn task: each problem's episode played greedily, then k times at
    temperature 1, every transcript scored by the learner's replay (`episodes.score_transcript`)."""
    turns = Turns(tok)

    def generate(batch: list[list[int]], temperature: float, new_tokens: int) -> list[Any]:
        groups = engine.generate(batch, n=1, temperature=temperature, max_new_tokens=new_tokens)
        return [g[0] if g else None for g in groups]

    texts: list[list[str]] = []
    scores: list[list[Score]] = []
    for copies, temperature in ((1, 0.0), (k, 1.0)) if k > 0 else ((1, 0.0),):
        episodes = [task.episode(p.meta["episode"]) for p in problems for _ in range(copies)]
        played = play(
            generate,
            LocalSteps(turns, episodes),
            [ids for ids in prompts for _ in range(copies)],
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            max_turns=int(task.max_turns),
            context_len=engine.max_model_len,
            transcript_tokens=engine.max_model_len,
        )
        for i, problem in enumerate(problems):
            mine = played[i * copies : (i + 1) * copies]
            texts.append([tok.decode(t.token_ids, skip_special_tokens=False) for t in mine])
            scores.append(scorer(problem, [(t.token_ids, t.policy_mask) for t in mine]))
    return texts, scores


def evaluate(
    model: str,
    task_name: str,
    *,
    task_options: Mapping[str, Any] | None = None,
    limit: int = 200,
    k: int = 4,
    max_new_tokens: int = 16,
    seed: int = 0,
    reward_timeout_s: float = 5.0,
    kv_cache_gib: float = 4.0,
    then: Sequence[Path] = (),
    revision: str | None = None,
    engine: Any = None,
) -> dict[str, Any]:
    """`model` on the task's first `limit` held-out problems. `then`: more weights of the same model (directories
    holding a model.safetensors: a run's versions) swapped into the same engine after it and evaluated on the same
    problems, one engine start for all; their results are listed under "then". `revision`: of a Hub id.

    `engine`: a running engine of the same architecture (an `Engine` with a context long enough for the task) to
    evaluate on instead of starting one: `model`'s weights are swapped into it first, and it is left running with
    the last weights evaluated. Several evaluations then share one engine start (the test suite does)."""
    from transformers import AutoTokenizer

    model_dir: Path = resolve_model(model, revision)
    task = load_task(task_name, task_options)
    problems = eval_problems(task, limit, seed)
    if not problems:
        raise ValueError(f"task {task_name!r} has no eval problems")
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [encode_chat(tok, p.messages) for p in problems]
    t0 = time.perf_counter()
    episodic = is_episodic(task)
    own = engine is None
    engine = _engine_for(model_dir, EPISODE_CONTEXT if episodic else 1024, seed, kv_cache_gib, engine)
    t_engine = time.perf_counter() - t0
    scorer = Scorer(task_name, task_options, timeout_s=reward_timeout_s, tokenizer_dir=str(model_dir))
    results, run = [], _play_and_score if episodic else _generate_and_score
    try:
        for weights in [None, *then]:
            if weights is not None:
                engine.reload(weights)
            t1 = time.perf_counter()
            texts, scores = run(engine, tok, scorer, task, problems, prompts, k, max_new_tokens)
            results.append(_result(problems, texts, scores, k, time.perf_counter() - t1))
            results[-1] |= by_level(problems, scores[: len(problems)], getattr(task, "level_weights", None))
    finally:
        scorer.close()
        if own:
            engine.close()
    head = {"model": str(model_dir), "task": task.name, "problems": len(problems), "k": k}
    head |= {"max_new_tokens": max_new_tokens, "seed": seed}
    tail = {"reward_errors": scorer.errors, "reward_timeouts": scorer.timeouts, "t_engine_s": t_engine}
    return {**head, **results[0], **tail, **({"then": results[1:]} if then else {})}


def _engine_for(model_dir: Path, context: int, seed: int, kv_cache_gib: float, given: Any) -> Any:
    """An engine holding `model_dir`'s weights: `given` with them swapped in (it must hold `context` tokens), or a
    new one with room for every problem's k samples at once, on every CPU (nothing else runs on its machine)."""
    from echo2cli.worker.engine import Engine

    if given is None:
        return Engine(model_dir, seed=seed, kv_cache_gib=kv_cache_gib, all_cpus=True, max_model_len=context)
    if given.max_model_len < context:
        raise ValueError(f"the engine given holds {given.max_model_len} tokens; this task needs {context}")
    given.reload(model_dir)
    return given


def _result(
    problems: list[Problem], texts: list[list[str]], scores: list[list[Score]], k: int, t_eval: float
) -> dict[str, Any]:
    """One evaluation's measures, its time, the ids of the problems its greedy completions solved (to weigh or
    pair them afterwards) and its first examples."""
    greedy, greedy_texts = scores[: len(problems)], texts[: len(problems)]
    sampled = scores[len(problems) :] if k > 0 else greedy
    return {
        **summarize(greedy, sampled),
        "t_eval_s": t_eval,
        "greedy_solved": [p.id for p, g in zip(problems, greedy, strict=True) if solved(g[0])],
        "examples": [
            {"id": p.id, "prompt": p.prompt, "answer": p.answer, "greedy": t[0], "reward": g[0].reward}
            for p, t, g in itertools.islice(zip(problems, greedy_texts, greedy, strict=True), 5)
        ],
    }
