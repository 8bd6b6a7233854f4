"""The join token never sits in a command line: `main` moves `--token` into ECHO2_TOKEN before any command runs, so
no torchrun rank's argv (`ps`), W&B run metadata (sys.argv) or child process holds it; every command that takes
--token still gets it, and a flag still wins over the environment. The loggers' config never holds it either."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from echo2cli import cli, loggers
from echo2cli.config import LearnerConfig
from echo2cli.protocol import Status

SECRET = "s3cret-join-token"


@pytest.fixture
def env(monkeypatch):
    """No ECHO2_TOKEN to begin with, and whatever `main` puts there is gone after the test."""
    monkeypatch.setenv("ECHO2_TOKEN", "")
    monkeypatch.delenv("ECHO2_TOKEN")
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-m", "echo2cli"])
    return monkeypatch


def test_token_flags_move_from_argv_to_the_environment():
    environ = {"ECHO2_TOKEN": "from-env"}
    argv = ["echo2", "worker", "--token", "a", "--name", "w", "--token=b", "--token-file", "f", "--", "--token", "c"]
    assert cli.token_to_env(argv, environ) == [
        "echo2",
        "worker",
        "--name",
        "w",
        "--token-file",
        "f",
        "--",
        "--token",
        "c",
    ]
    assert environ == {"ECHO2_TOKEN": "b"}  # the last flag, as click takes it, over the environment
    environ = {}
    assert cli.token_to_env(["echo2", "status", "URL", "--token"], environ) == ["echo2", "status", "URL", "--token"]
    assert environ == {}  # no value: click says so


def run_main(monkeypatch, argv: list[str]) -> int | str | None:
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    return exit_.value.code


def fake_learner_run(monkeypatch, seen: dict) -> None:
    """`echo2 learner --nproc-per-node 2` runs itself again under torchrun, as its child: record the argv it would
    start (and the signal handlers it would install, which must not stay in pytest's process)."""

    class Torchrun:
        def __init__(self, argv: list[str], **kwargs) -> None:
            seen["argv"], self.pid = argv, -1

        def wait(self) -> int:
            return 0

    monkeypatch.setattr(subprocess, "Popen", Torchrun)
    monkeypatch.setattr(signal, "signal", lambda signum, handler: seen.setdefault("signals", []).append(signum))


def fake_worker_run(monkeypatch, seen: dict) -> None:
    def create_worker(cfg, console):
        seen["token"] = cfg.token
        return SimpleNamespace(run=dict)

    monkeypatch.setattr("echo2cli.worker.loop.create_worker", create_worker)
    monkeypatch.setattr("echo2cli.worker.loop.install_sigterm_as_interrupt", lambda: None)


def fake_status_run(monkeypatch, seen: dict) -> None:
    class Learner:
        def __init__(self, url: str, token: str | None, **kwargs) -> None:
            seen["token"] = token

        def status(self) -> Status:
            return Status(run_id="r", step=0, target_steps=1, version=0, finished=True, workers=[])

    monkeypatch.setattr("echo2cli.worker.client.LearnerClient", Learner)


COMMANDS = {
    "learner": (["learner", "--nproc-per-node", "2", "--quiet"], fake_learner_run),
    "worker": (["worker", "--join", "http://127.0.0.1:9", "--quiet"], fake_worker_run),
    "status": (["status", "http://127.0.0.1:9", "--json"], fake_status_run),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("given", ["--token VALUE", "--token=VALUE", "ECHO2_TOKEN"])
def test_every_command_gets_the_token_and_no_argv_holds_it(env, tmp_path, command, given):
    args, fake = COMMANDS[command]
    if command == "learner":
        args = [*args, "--out", str(tmp_path)]
    if given == "ECHO2_TOKEN":
        env.setenv("ECHO2_TOKEN", SECRET)
        token_args = []
    else:
        env.setenv("ECHO2_TOKEN", "an older token: the flag wins")
        token_args = ["--token", SECRET] if given == "--token VALUE" else [f"--token={SECRET}"]
        env.setattr(sys, "orig_argv", [*sys.orig_argv, *token_args])
    seen: dict = {}
    fake(env, seen)
    assert run_main(env, ["echo2", args[0], *token_args, *args[1:]]) == 0
    assert SECRET not in " ".join(sys.argv) and SECRET not in " ".join(sys.orig_argv)
    assert os.environ["ECHO2_TOKEN"] == SECRET
    if command == "learner":  # each rank reads the token from the environment it inherits
        assert seen["argv"][-len(args) - 2 :] == ["-m", "echo2cli", *args] and SECRET not in " ".join(seen["argv"])
        assert cli.load_config(LearnerConfig, None, {}, "learner").token == SECRET
        assert sorted(seen["signals"]) == sorted([signal.SIGTERM, signal.SIGINT])  # forwarded to rank 0
    else:
        assert seen["token"] == SECRET


def test_the_torchrun_ranks_command_line_is_the_one_given():
    argv = cli.torchrun_argv(4, ["learner", "--steps", "3"])
    assert argv[-5:] == ["-m", "echo2cli", "learner", "--steps", "3"] and "--nproc-per-node=4" in argv


def test_the_loggers_and_the_saved_config_never_hold_the_token(monkeypatch, tmp_path):
    seen: list[dict] = []

    class Backend:
        def __init__(self, out, config) -> None:
            seen.append(config)

    for name in ("tensorboard", "wandb", "trackio"):
        monkeypatch.setitem(loggers.OPENERS, name, Backend)
    cfg = LearnerConfig(token=SECRET, out_dir=tmp_path)
    loggers.Reporters(["jsonl", "tensorboard", "wandb", "trackio"], tmp_path, cfg.model_dump(mode="json"))  # as loop.py
    assert len(seen) == 3 and all(SECRET not in json.dumps(config) for config in seen)
    assert SECRET not in cfg.model_dump_json() and SECRET not in repr(cfg)  # config.json, checkpoints, logs
