"""Real processes for the integration tests: spawn `python -m echo2cli ...` (`echo2cli.launch`), wait for the
learner to listen, wait for the run to end (killing whatever is left)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from echo2cli.errors import Echo2Error
from echo2cli.launch import spawn as spawn  # re-exported for the tests
from echo2cli.launch import wait_for_learner


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    if sig == signal.SIGKILL:
        proc.wait()


def wait_listening(learner: subprocess.Popen, out: Path, timeout_s: float = 300) -> None:
    """Until the learner has written learner.json (it serves from then on)."""
    try:
        wait_for_learner(learner, out, out / "learner.log", timeout_s)
    except Echo2Error as exc:
        raise AssertionError(f"{exc}\n{log_tail(out / 'learner.log')}") from None


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
    assert learner.returncode == 0, log_tail(out / "learner.log")


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


def wait_for(
    predicate,
    timeout_s: float,
    what: str,
    poll_s: float = 0.5,
    *,
    running: tuple[subprocess.Popen, ...] = (),
    logs: tuple[Path, ...] = (),
) -> None:
    """Poll until `predicate()`. Fail past `timeout_s`, or at once when one of `running` has exited, with the last
    lines of each of `logs` (what the processes said is all a CI log keeps of a run that stalled)."""
    deadline = time.time() + timeout_s
    while not predicate():
        ended = [p.args for p in running if p.poll() is not None]
        if ended or time.time() >= deadline:
            why = f"{ended} exited" if ended else "timed out"
            tails = "".join(f"\n--- {log} (its end, see log_tail)\n{log_tail(log)}" for log in logs)
            raise AssertionError(f"{why} waiting for {what}{tails}")
        time.sleep(poll_s)


FATAL = "Fatal Python error"  # how faulthandler begins the stacks of a process killed by a fatal signal


def log_tail(log: Path, chars: int = 3000) -> str:
    """The end of a log, for an assertion message; if a process died of a fatal signal before that end (a rank of a
    sharded learner prints its threads' stacks then, `sharded.init_process_group`), those stacks first."""
    try:
        text = log.read_text(errors="replace")
    except OSError as exc:
        return f"(unreadable: {exc})"
    fatal = text.find(FATAL)
    stacks = text[fatal : fatal + 6000] + "\n[...]\n" if 0 <= fatal < len(text) - chars else ""
    return stacks + text[-chars:]
