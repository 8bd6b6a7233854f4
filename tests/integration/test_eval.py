"""`echo2 eval` with real vLLM: a run directory's checkpoint and a published version on the run's task, and
each built-in task on the default model. Problems are few (this is about the plumbing; docs/BENCHMARKS.md
has 200-problem figures)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from echo2cli.evaluate import engine_in_fp32
from echo2cli.learner.checkpoint import STATE_FILE
from echo2cli.models import prepare_default_model

pytestmark = pytest.mark.integration


def run_eval(*args: str, env: dict[str, str] | None = None) -> dict:
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


def test_eval_of_a_run_uses_its_newest_checkpoint_and_task(tmp_path):
    ckpt = tmp_path / "run" / "checkpoints" / "step_000003"
    shutil.copytree(prepare_default_model(), ckpt)
    config = {"task": "arithmetic", "task_options": {}, "max_new_tokens": 8}
    (ckpt / STATE_FILE).write_text(json.dumps({"step": 3, "config": config, "coordinator": {}}))
    result = run_eval("--run", str(tmp_path / "run"), "--limit", "12", "--k", "2")
    check(result, 12)
    # an engine computing in fp32 gets the checkpoint rounded to bf16 as published, from a directory of its own
    assert (f"{tmp_path / 'run'}/eval-step_000003-" if engine_in_fp32() else str(ckpt)) in result["model"]
    assert result["task"] == "arithmetic" and result["max_new_tokens"] == 8
    assert not list((tmp_path / "run").glob("eval-step_*"))  # removed afterwards
    written = json.loads((tmp_path / "run" / "eval" / "arithmetic-step_000003.json").read_text())
    assert written["greedy_accuracy"] == result["greedy_accuracy"]

    # a published version: the same weights as the checkpoint here, so the same greedy answers
    vdir = tmp_path / "run" / "versions" / "v000004"
    vdir.mkdir(parents=True)
    shutil.copy2(ckpt / "model.safetensors", vdir / "model.safetensors")
    by_version = run_eval("--run", str(tmp_path / "run"), "--version", "4", "--limit", "12", "--k", "2")
    check(by_version, 12)
    assert "eval-v4-" in by_version["model"] and by_version["max_new_tokens"] == 8
    assert [e["greedy"] for e in by_version["examples"]] == [e["greedy"] for e in result["examples"]]
    assert (tmp_path / "run" / "eval" / "arithmetic-v000004.json").exists()
    assert not list((tmp_path / "run").glob("eval-v4-*"))  # the model directory is removed afterwards

    # several versions in one engine: version 5's final norm is zeroed, so every logit is 0 and greedy decoding
    # repeats token 0; its answers differ from version 4's only if the engine really swapped the weights
    from safetensors.torch import load_file, save_file

    weights = load_file(str(vdir / "model.safetensors"))
    weights["model.norm.weight"].zero_()
    (tmp_path / "run" / "versions" / "v000005").mkdir()
    save_file(weights, str(tmp_path / "run" / "versions" / "v000005" / "model.safetensors"), metadata={"format": "pt"})
    both = run_eval("--run", str(tmp_path / "run"), "--version", "4,5", "--limit", "12", "--k", "0")
    (later,) = both["then"]
    assert both["version"] == 4 and later["version"] == 5
    assert [e["greedy"] for e in both["examples"]] == [e["greedy"] for e in by_version["examples"]]
    assert [e["greedy"] for e in later["examples"]] != [e["greedy"] for e in both["examples"]]
    assert later["greedy_accuracy"] == 0.0
    assert json.loads((tmp_path / "run" / "eval" / "arithmetic-v000005.json").read_text())["version"] == 5


@pytest.mark.parametrize("task", ["math", "poker"])
def test_eval_of_each_builtin_task_on_the_default_model(task):
    # vLLM names its ZMQ sockets as files in the temp directory and never removes them (hundreds were left in
    # /tmp after a test run); the engine's process must leave nothing there but torch's compile cache, which
    # every run shares. (A short path: a socket's name must fit in 107 bytes.)
    with tempfile.TemporaryDirectory(prefix="e2-") as tmp:
        check(run_eval("--task", task, "--limit", "6", "--k", "2", env={**os.environ, "TMPDIR": tmp}), 6)
        assert not [name for name in os.listdir(tmp) if not name.startswith("torchinductor_")]


def test_eval_of_a_parquet_dataset_on_its_test_split():
    tiny = Path(__file__).parent.parent / "data" / "gsm8k_tiny"
    result = run_eval("--task", "math", "--option", f"path={tiny}", "--option", "eval_split=test", "--k", "2")
    check(result, 4)  # the test split's 4 problems, none of the 12 training ones
    assert {e["prompt"].split(".")[0] for e in result["examples"]} <= {
        "A farmer has 7 cows and buys 6 more",
        "A class of 18 splits into 3 equal teams",
        "Ben has 11 marbles and loses 5",
        "A car travels 30 km per hour for 2 hours",
    }


def test_eval_of_a_verifiers_environment():
    envs = str(Path(__file__).parent.parent / "vf_envs")
    options = ["--option", "env=vf-tiny-sums", "--option", 'env_args={"num_tasks": 40}']
    result = run_eval(
        "--task", "verifiers", *options, "--k", "2", "--max-new-tokens", "8", env={**os.environ, "PYTHONPATH": envs}
    )
    check(result, result["problems"])
    assert result["task"] == "verifiers" and "greedy_correct" in result and 4 <= result["problems"] <= 16


def test_eval_of_whole_poker_hands_plays_each_hand_turn_by_turn():
    result = run_eval("--task", "poker_hands", "--option", "unreadable=call", "--limit", "4", "--k", "2")
    check(result, 4)
    assert result["reward_errors"] == 0 and -200 <= result["greedy_chips"] <= 200
    assert result["greedy_turns"] > 1  # an unreadable answer calls: the hands go on past the first decision
    assert "<|im_start|>user" in result["examples"][0]["greedy"]  # the observations between the turns
