"""`echo2 eval` with real vLLM: a run directory's checkpoint and a published version on the run's task, and
each built-in task on the default model. Problems are few (this is about the plumbing; docs/BENCHMARKS.md
has 200-problem figures).

Most of an eval's time is its engine's start: three processes, each importing torch and vLLM on one core. So the
evals run in two lanes at once, each lane's engines bound to a core of their own (`evals`), and the tests check
their results: the 7 evals took 288 s here against 358 s one after another (docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from echo2cli.evaluate import engine_in_fp32
from echo2cli.learner.checkpoint import STATE_FILE
from echo2cli.models import prepare_default_model

pytestmark = pytest.mark.integration

# math suggests 128 new tokens; 16 still reach the reward and cost an eighth of the generation
SHORT = ("--max-new-tokens", "16")


def run_eval(*args: str, env: dict[str, str] | None = None) -> dict:
    env = {**os.environ, **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "echo2cli", "eval", "--json", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # vLLM logs its shutdown on stdout after ours: take the result line
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith('{"model"')][-1])


def check(result: dict, problems: int) -> None:
    assert result["problems"] == problems
    for key in ("greedy_accuracy", "greedy_reward", "pass_at_k", "sampled_reward"):
        assert 0.0 <= result[key] <= 1.0, key
    assert result["pass_at_k"] >= result["greedy_accuracy"] - 0.5  # k samples rarely do much worse than greedy
    assert result["reward_errors"] == 0 and result["reward_timeouts"] == 0
    assert result["examples"] and all(e["prompt"] for e in result["examples"])


@pytest.fixture(scope="module")
def evals(tmp_path_factory):
    """Every eval of this module, started in two lanes of one core each; `evals[name]` is its future result."""
    run = tmp_path_factory.mktemp("eval") / "run"
    ckpt = run / "checkpoints" / "step_000003"
    shutil.copytree(prepare_default_model(), ckpt)
    config = {"task": "arithmetic", "task_options": {}, "max_new_tokens": 8}
    (ckpt / STATE_FILE).write_text(json.dumps({"step": 3, "config": config, "coordinator": {}}))
    # published versions: version 4 holds the checkpoint's weights; version 5's final norm is zeroed, so every
    # logit is 0 and greedy decoding repeats token 0
    from safetensors.torch import load_file, save_file

    weights = load_file(str(ckpt / "model.safetensors"))
    for version in (4, 5):
        (run / "versions" / f"v{version:06d}").mkdir(parents=True)
        if version == 5:
            weights["model.norm.weight"].zero_()
        save_file(weights, str(run / "versions" / f"v{version:06d}" / "model.safetensors"), metadata={"format": "pt"})
    # vLLM names its ZMQ sockets as files in the temp directory (a short path: a socket's name must fit in 107 bytes)
    tmpdirs = {task: tempfile.mkdtemp(prefix="e2-") for task in ("math", "poker")}
    tiny = Path(__file__).parent.parent / "data" / "gsm8k_tiny"
    verifiers = ["--option", "env=vf-tiny-sums", "--option", 'env_args={"num_tasks": 40}', "--max-new-tokens", "8"]
    jobs = {  # name: (lane, args, env)
        "checkpoint": (0, ["--run", str(run), "--limit", "12", "--k", "2"], {}),
        "versions": (0, ["--run", str(run), "--version", "4,5", "--limit", "12", "--k", "2"], {}),
        "math": (0, ["--task", "math", "--limit", "6", "--k", "2", *SHORT], {"TMPDIR": tmpdirs["math"]}),
        "parquet": (
            0,
            ["--task", "math", "--option", f"path={tiny}", "--option", "eval_split=test", "--k", "2", *SHORT],
            {},
        ),
        "poker": (1, ["--task", "poker", "--limit", "6", "--k", "2", *SHORT], {"TMPDIR": tmpdirs["poker"]}),
        "hands": (1, ["--task", "poker_hands", "--option", "unreadable=call", "--limit", "4", "--k", "2"], {}),
        "verifiers": (
            1,
            ["--task", "verifiers", *verifiers],
            {"PYTHONPATH": str(Path(__file__).parent.parent / "vf_envs")},
        ),
    }
    cores = sorted(os.sched_getaffinity(0))
    lanes = [ThreadPoolExecutor(max_workers=1) for _ in range(2)]  # one eval at a time in each lane, in order
    futures: dict[str, Future] = {}
    for name, (lane, args, env) in jobs.items():
        bind = {"VLLM_CPU_OMP_THREADS_BIND": str(cores[lane % len(cores)])}
        futures[name] = lanes[lane].submit(run_eval, *args, env={**env, **bind})
    yield {"run": run, "ckpt": ckpt, "tmpdirs": tmpdirs, **futures}
    for pool in lanes:
        pool.shutdown(wait=True)
    for tmp in tmpdirs.values():
        shutil.rmtree(tmp, ignore_errors=True)


def test_eval_of_a_run_uses_its_newest_checkpoint_and_task(evals):
    run, ckpt = evals["run"], evals["ckpt"]
    result = evals["checkpoint"].result()
    check(result, 12)
    # an engine computing in fp32 gets the checkpoint rounded to bf16 as published, from a directory of its own
    assert (f"{run}/eval-step_000003-" if engine_in_fp32() else str(ckpt)) in result["model"]
    assert result["task"] == "arithmetic" and result["max_new_tokens"] == 8
    written = json.loads((run / "eval" / "arithmetic-step_000003.json").read_text())
    assert written["greedy_accuracy"] == result["greedy_accuracy"]


def test_eval_of_published_versions_swaps_each_into_one_engine(evals):
    run, result = evals["run"], evals["checkpoint"].result()
    both = evals["versions"].result()
    check(both, 12)
    (later,) = both["then"]
    assert both["version"] == 4 and later["version"] == 5
    assert "eval-v4-" in both["model"] and both["max_new_tokens"] == 8
    # version 4 holds the checkpoint's weights: the same greedy answers; version 5's differ only if the engine
    # really swapped the weights
    assert [e["greedy"] for e in both["examples"]] == [e["greedy"] for e in result["examples"]]
    assert [e["greedy"] for e in later["examples"]] != [e["greedy"] for e in both["examples"]]
    assert later["greedy_accuracy"] == 0.0
    assert (run / "eval" / "arithmetic-v000004.json").exists()
    assert json.loads((run / "eval" / "arithmetic-v000005.json").read_text())["version"] == 5
    assert not list(run.glob("eval-*-*"))  # the model directories are removed afterwards


@pytest.mark.parametrize("task", ["math", "poker"])
def test_eval_of_each_builtin_task_on_the_default_model(evals, task):
    check(evals[task].result(), 6)
    # vLLM never removes its ZMQ socket files (hundreds were left in /tmp after a test run); the engine's process
    # must leave nothing in its temp directory but torch's compile cache, which every run shares
    assert not [name for name in os.listdir(evals["tmpdirs"][task]) if not name.startswith("torchinductor_")]


def test_eval_of_a_parquet_dataset_on_its_test_split(evals):
    result = evals["parquet"].result()
    check(result, 4)  # the test split's 4 problems, none of the 12 training ones
    assert {e["prompt"].split(".")[0] for e in result["examples"]} <= {
        "A farmer has 7 cows and buys 6 more",
        "A class of 18 splits into 3 equal teams",
        "Ben has 11 marbles and loses 5",
        "A car travels 30 km per hour for 2 hours",
    }


def test_eval_of_a_verifiers_environment(evals):
    result = evals["verifiers"].result()
    check(result, result["problems"])
    assert result["task"] == "verifiers" and "greedy_correct" in result and 4 <= result["problems"] <= 16


def test_eval_of_whole_poker_hands_plays_each_hand_turn_by_turn(evals):
    result = evals["hands"].result()
    check(result, 4)
    assert result["reward_errors"] == 0 and -200 <= result["greedy_chips"] <= 200
    assert result["greedy_turns"] > 1  # an unreadable answer calls: the hands go on past the first decision
    assert "<|im_start|>user" in result["examples"][0]["greedy"]  # the observations between the turns
