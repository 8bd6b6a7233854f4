"""CPU lists and pinning the learner's training loop (`--train-cpus`)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from echo2cli.config import LearnerConfig
from echo2cli.errors import ConfigError
from echo2cli.hardware import compute_dtype, cpu_has_bf16, parse_cpus, pin_thread, usable_cpus


@pytest.mark.parametrize(
    ("spec", "cpus"), [("0", {0}), ("0,2", {0, 2}), ("0-3", {0, 1, 2, 3}), ("0-1,4", {0, 1, 4}), (" 1 , 3", {1, 3})]
)
def test_cpu_lists_read_as_taskset_writes_them(spec, cpus):
    assert parse_cpus(spec) == cpus


@pytest.mark.parametrize("spec", ["", "a", "0-", "-1", "3-1", "0,,1", "1.5"])
def test_a_bad_cpu_list_is_refused(spec):
    with pytest.raises(ValueError):
        parse_cpus(spec)


def test_the_learner_config_refuses_a_bad_cpu_list_in_one_line():
    with pytest.raises(ConfigError, match="not a CPU list"):
        from echo2cli.config import load_config

        load_config(LearnerConfig, None, {"train_cpus": "zero"}, "learner")


def test_a_cpu_this_process_may_not_use_is_refused():
    beyond = max(os.sched_getaffinity(0)) + 1000
    with pytest.raises(ValueError, match=f"CPUs \\[{beyond}\\] are not available"):
        usable_cpus(str(beyond))
    assert usable_cpus(str(min(os.sched_getaffinity(0)))) == {min(os.sched_getaffinity(0))}


def test_pinning_moves_only_the_calling_thread():
    before = os.sched_getaffinity(0)
    one = {min(before)}
    seen: dict[str, set[int]] = {}

    def train() -> None:
        pin_thread(one)
        seen["pinned"] = os.sched_getaffinity(0)
        child = threading.Thread(target=lambda: seen.update(child=os.sched_getaffinity(0)))
        child.start()
        child.join()

    thread = threading.Thread(target=train)
    thread.start()
    thread.join()
    assert seen == {"pinned": one, "child": one}  # threads it starts inherit its CPUs
    assert os.sched_getaffinity(0) == before  # the rest of the process keeps its own


def test_the_cli_refuses_an_unavailable_training_cpu_in_one_line(tmp_path):
    beyond = max(os.sched_getaffinity(0)) + 1000
    proc = subprocess.run(
        [sys.executable, "-m", "echo2cli", "learner", "--train-cpus", str(beyond), "--out", str(tmp_path), "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and f"--train-cpus {beyond}" in proc.stderr and "not available" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_echo2_cpu_bf16_0_makes_a_cpu_compute_in_fp32(monkeypatch):
    """A box whose CPU has bf16 runs as one without it: learner and engines in fp32 (so --wire-dtype fp16 runs)."""
    monkeypatch.setenv("ECHO2_CPU_BF16", "0")
    assert not cpu_has_bf16() and compute_dtype(cuda=False) == "float32" and compute_dtype(cuda=True) == "bfloat16"
