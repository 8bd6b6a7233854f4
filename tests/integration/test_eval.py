"""`echo2 eval` with real vLLM: a run directory's checkpoint and its published versions on the run's task, each
built-in task on the default model, and a model given by its Hugging Face Hub id offline, its weights in shards.
Problems are few (this is about the plumbing; docs/results.md has the 200-problem figures).

Most of an eval's time is its engine's start, so one evaluation runs as the command a user types, with an engine
of its own (`echo2 eval --model ORG/NAME` with HF_HUB_OFFLINE=1: the default model saved as ~100 MB shards and their
index into a Hub cache of the suite's own, `integration_fixtures.hf_home`), in a thread beside the others; every
other one runs in this process on the session's shared engine (`integration_fixtures.engine`,
`eval_command(..., engine=)`), which swaps each model's weights in first. The learner's side of the Hub id
(training from it, a worker with an empty cache, resuming by it) is checked in the end-to-end run (`test_e2e.py`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hub_cache import HUB_REPO, hub_only

from echo2cli.config import EvalConfig
from echo2cli.evaluate import engine_in_fp32, eval_command
from echo2cli.learner.checkpoint import STATE_FILE
from echo2cli.models import prepare_default_model
from echo2cli.tasks import load_task

pytestmark = pytest.mark.integration

# math suggests 128 new tokens; 16 still reach the reward and cost an eighth of the generation
SHORT = 16
TESTS = Path(__file__).parent.parent


def run_eval_command(*args: str, env: dict[str, str]) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "echo2cli", "eval", "--json", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # vLLM logs its shutdown on stdout after ours: take the result line
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith('{"model"')][-1])


def check(result: dict, problems: int) -> None:
    """What every evaluation's result must satisfy, whatever the model answered."""
    n, k = result["problems"], result["k"]
    assert n == problems
    for key in ("greedy_accuracy", "greedy_reward", "pass_at_k", "sampled_reward"):
        assert 0.0 <= result[key] <= 1.0, key
    # the accuracy is the share of the problems listed as solved, and pass@k a share of whole problems
    assert result["greedy_accuracy"] == pytest.approx(len(result["greedy_solved"]) / n)
    assert len(set(result["greedy_solved"])) == len(result["greedy_solved"])
    assert result["pass_at_k"] * n == pytest.approx(round(result["pass_at_k"] * n))
    if k == 0:  # greedy only: "any of k" is then the greedy completion itself
        assert result["pass_at_k"] == result["greedy_accuracy"]
    assert result["reward_errors"] == 0 and result["reward_timeouts"] == 0
    examples = result["examples"]
    assert len(examples) == min(5, n) and all(e["prompt"] for e in examples)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory: a checkpoint at step 3 (the default weights), version 4 (the same weights) and version 5
    (its final norm zeroed, so every logit is 0 and greedy decoding repeats token 0)."""
    from safetensors.torch import load_file, save_file

    run = tmp_path_factory.mktemp("eval") / "run"
    ckpt = run / "checkpoints" / "step_000003"
    shutil.copytree(prepare_default_model(), ckpt)
    config = {"task": "arithmetic", "task_options": {}, "max_new_tokens": 8}
    (ckpt / STATE_FILE).write_text(json.dumps({"step": 3, "config": config, "coordinator": {}}))
    weights = load_file(str(ckpt / "model.safetensors"))
    for version in (4, 5):
        (run / "versions" / f"v{version:06d}").mkdir(parents=True)
        if version == 5:
            weights["model.norm.weight"].zero_()
        save_file(weights, str(run / "versions" / f"v{version:06d}" / "model.safetensors"), metadata={"format": "pt"})
    return run, ckpt


@pytest.fixture(scope="module")
def command(hf_home):
    """`echo2 eval --model ORG/NAME` offline as a process of its own, started at once in a thread; its result."""
    # vLLM names its ZMQ sockets as files in the temp directory (a short path: a socket's name must fit in 107 bytes)
    tmp = tempfile.mkdtemp(prefix="e2-")
    args = ["--model", HUB_REPO, "--limit", "4", "--k", "0"]
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(run_eval_command, *args, env={"TMPDIR": tmp, **hub_only(hf_home)})
        yield future, tmp
    shutil.rmtree(tmp, ignore_errors=True)


def evaluate_here(engine, **fields) -> dict:
    result, _ = eval_command(EvalConfig(**fields), engine=engine)
    return result


def test_eval_of_a_run_uses_its_newest_checkpoint_and_task(run, command, engine, tmp_path):
    run, ckpt = run
    result = evaluate_here(engine, run=run, limit=12, k=2)
    check(result, 12)
    # an engine computing in fp32 gets the checkpoint rounded to bf16 as published, from a directory of its own
    assert (f"{run}/eval-step_000003-" if engine_in_fp32() else str(ckpt)) in result["model"]
    assert result["task"] == "arithmetic" and result["max_new_tokens"] == 8
    written = json.loads((run / "eval" / "arithmetic-step_000003.json").read_text())
    assert written["greedy_accuracy"] == result["greedy_accuracy"]
    # version 4 holds the checkpoint's weights: in the same engine, the same greedy answers
    version = evaluate_here(engine, run=run, version="4", limit=12, k=0, out=tmp_path / "v4.json")
    assert [e["greedy"] for e in version["examples"]] == [e["greedy"] for e in result["examples"]]


def test_eval_of_published_versions_swaps_each_into_one_engine(run, command, engine):
    run, _ = run
    both = evaluate_here(engine, run=run, version="4,5", limit=12, k=2)
    check(both, 12)
    (later,) = both["then"]
    assert both["version"] == 4 and later["version"] == 5
    assert "eval-v4-" in both["model"] and both["max_new_tokens"] == 8
    # version 5's greedy answers differ from version 4's only if the engine really swapped the weights
    assert [e["greedy"] for e in later["examples"]] != [e["greedy"] for e in both["examples"]]
    assert later["greedy_accuracy"] == 0.0
    assert (run / "eval" / "arithmetic-v000004.json").exists()
    assert json.loads((run / "eval" / "arithmetic-v000005.json").read_text())["version"] == 5
    assert not list(run.glob("eval-*-*"))  # the model directories are removed afterwards


def test_eval_command_of_a_sharded_hub_model_offline(command, hf_home):
    future, tmp = command
    result = future.result()
    check(result, 4)
    assert result["model"].startswith(os.fspath(hf_home)) and result["task"] == "arithmetic"
    # vLLM never removes its ZMQ socket files (hundreds were left in /tmp after a test run); the engine's process
    # must leave nothing in its temp directory but torch's compile cache, which every run shares
    assert not [name for name in os.listdir(tmp) if not name.startswith("torchinductor_")]


@pytest.mark.parametrize("task", ["math", "poker"])
def test_eval_of_each_builtin_task_on_the_default_model(engine, task):
    check(evaluate_here(engine, task=task, limit=6, k=2, max_new_tokens=SHORT), 6)


def test_eval_of_a_parquet_dataset_on_its_test_split(engine):
    tiny = TESTS / "data" / "gsm8k_tiny"
    result = evaluate_here(engine, task="math", option=[f"path={tiny}", "eval_split=test"], k=2, max_new_tokens=SHORT)
    check(result, 4)  # the test split's 4 problems, none of the 12 training ones
    assert {e["prompt"].split(".")[0] for e in result["examples"]} == {
        "A farmer has 7 cows and buys 6 more",
        "A class of 18 splits into 3 equal teams",
        "Ben has 11 marbles and loses 5",
        "A car travels 30 km per hour for 2 hours",
    }


def test_eval_of_a_verifiers_environment(engine, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS / "vf_envs"))
    options = ["env=vf-tiny-sums", 'env_args={"num_tasks": 40}']
    held_out = len(load_task("verifiers", {"env": "vf-tiny-sums", "env_args": {"num_tasks": 40}}).eval)
    result = evaluate_here(engine, task="verifiers", option=options, max_new_tokens=8, k=2)
    assert 4 <= held_out <= 16  # bucket 0 of 5 of 40 task keys
    check(result, held_out)
    assert result["task"] == "verifiers" and "greedy_correct" in result


def test_eval_of_whole_poker_hands_plays_each_hand_turn_by_turn(engine):
    result = evaluate_here(engine, task="poker_hands", option=["unreadable=call"], limit=4, k=2)
    check(result, 4)
    assert -200 <= result["greedy_chips"] <= 200
    assert result["greedy_turns"] > 1  # an unreadable answer calls: the hands go on past the first decision
    assert "<|im_start|>user" in result["examples"][0]["greedy"]  # the observations between the turns
