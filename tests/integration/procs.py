"""Real processes for the integration tests: spawn `python -m echo2cli ...`, wait for the learner to
listen, wait for the run to end (killing whatever is left)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def spawn(args: list[str], log: Path, env: dict | None = None, prefix: list[str] | None = None) -> subprocess.Popen:
    """`prefix`: e.g. `ip netns exec NS`. Each process leads its own group, so `kill_group` takes its vLLM
    engine processes too, as when a machine is preempted."""
    return subprocess.Popen([*(prefix or []), sys.executable, "-m", "echo2cli", *args], stdout=open(log, "a"),
                            stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True)


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    if sig == signal.SIGKILL:
        proc.wait()


def wait_listening(learner: subprocess.Popen, out: Path, timeout_s: float = 300) -> None:
    """Until the learner has written learner.json (it serves from then on)."""
    deadline = time.time() + timeout_s
    while not (out / "learner.json").exists():
        assert learner.poll() is None, (out / "learner.log").read_text()[-3000:]
        assert time.time() < deadline, "learner did not start"
        time.sleep(0.5)


def finish(learner: subprocess.Popen, workers: list[subprocess.Popen], out: Path) -> None:
    """Wait for the learner's last step and the workers' exit; the learner must have succeeded."""
    try:
        learner.wait(timeout=900)
        for w in workers:
            w.wait(timeout=120)
    finally:
        for p in [learner, *workers]:
            if p.poll() is None:
                kill_group(p)
    assert learner.returncode == 0, (out / "learner.log").read_text()[-3000:]


def stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process still running (its whole group), then SIGKILL what has not exited in 30 s."""
    for p in procs:
        if p.poll() is None:
            kill_group(p, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_group(p)


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.5) -> None:
    deadline = time.time() + timeout_s
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)
