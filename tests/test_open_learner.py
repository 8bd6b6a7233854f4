"""A learner never comes up open to the network by accident: no join token off loopback, or on a resume of
a run that had one, is refused in one line unless --insecure-no-token says it is meant."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from echo2cli.config import LearnerConfig, load_config
from echo2cli.errors import ConfigError
from echo2cli.learner.checkpoint import resume_check


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.5", "::", "learner.example.org"])
def test_a_learner_on_a_reachable_address_needs_a_token(host):
    with pytest.raises(ConfigError, match="without a join token"):
        load_config(LearnerConfig, None, {"host": host}, "learner")
    assert load_config(LearnerConfig, None, {"host": host, "token": "s"}, "learner").token == "s"
    assert load_config(LearnerConfig, None, {"host": host, "insecure_no_token": True}, "learner").token is None


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_a_learner_on_loopback_may_run_without_a_token(host):
    assert load_config(LearnerConfig, None, {"host": host}, "learner").token is None


def test_insecure_no_token_is_never_saved_with_the_run():
    cfg = LearnerConfig(host="0.0.0.0", insecure_no_token=True)
    assert "insecure_no_token" not in cfg.model_dump(mode="json")


def test_resuming_a_run_that_had_a_token_without_one_is_refused():
    saved = LearnerConfig().model_dump(mode="json")
    open_cfg = SimpleNamespace(**{**saved, "steps": 50, "token": None, "insecure_no_token": False})
    with pytest.raises(ConfigError, match="had a join token"):
        resume_check(saved, 10, open_cfg, had_token=True)
    resume_check(saved, 10, SimpleNamespace(**{**vars(open_cfg), "token": "s"}), had_token=True)
    resume_check(saved, 10, SimpleNamespace(**{**vars(open_cfg), "insecure_no_token": True}), had_token=True)
    resume_check(saved, 10, open_cfg, had_token=False)  # it never had one: it stays as it was


def test_the_cli_refuses_an_open_learner_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "echo2cli", "learner", "--host", "0.0.0.0", "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--insecure-no-token" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
