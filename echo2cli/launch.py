"""Starting echo2 processes from Python, and finding a learner once it serves.

`echo2 demo`, the integration tests and the scripts all start learners and workers as real processes
(`python -m echo2cli ...`), each leading its own process group so that stopping it stops its vLLM engine
processes too. A learner writes `<out>/learner.json` (url, run id, pid) once its API serves; whoever
started it waits for that file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from echo2cli.errors import Echo2Error
from echo2cli.layout import LEARNER_FILE


def flags(**options: object) -> list[str]:
    """`--name value` pairs for an argv, names with dashes (None: left out; True: the switch alone)."""
    out: list[str] = []
    for name, value in options.items():
        if value is None or value is False:
            continue
        out.append("--" + name.replace("_", "-"))
        if value is not True:
            out.append(str(value))
    return out


def stop(procs: list[subprocess.Popen], timeout_s: float = 30) -> None:
    """Terminate what still runs, then kill what has not exited within `timeout_s`."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()


def spawn(
    args: list[str], log: Path, env: dict[str, str] | None = None, prefix: list[str] | None = None
) -> subprocess.Popen:
    """`echo2 <args>` as a process writing to `log` (appended). `prefix`: e.g. `ip netns exec NS`."""
    with open(log, "a") as out:  # the child keeps its own handle
        return subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", "echo2cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )


def announce_learner(out: Path, info: dict[str, Any]) -> None:
    """Written then renamed: a reader never sees half the file."""
    tmp = out / (LEARNER_FILE + ".tmp")
    tmp.write_text(json.dumps(info))
    tmp.rename(out / LEARNER_FILE)


def rank0_pid(out: Path, since: float) -> int | None:
    """The pid in `out`'s learner.json if a learner wrote it at or after `since` (not a previous run's file)."""
    try:
        if (out / LEARNER_FILE).stat().st_mtime < since:
            return None
        pid = json.loads((out / LEARNER_FILE).read_text()).get("pid")
    except (OSError, ValueError, AttributeError):
        return None
    return pid if isinstance(pid, int) and pid > 0 else None


def wait_for_learner(
    proc: subprocess.Popen, out: Path, log: Path, timeout_s: float = 600, started: float | None = None
) -> dict[str, Any]:
    """The learner's `learner.json` once it serves; an Echo2Error naming the log if it exits or takes too long.

    Only a file written at or after `started` (default: now; a learner needs seconds to start before it writes
    it) counts: a learner killed earlier in the same `out` leaves its file behind, naming a dead port."""
    started = time.time() if started is None else started
    path = out / LEARNER_FILE
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if path.stat().st_mtime >= started:
                return dict(json.loads(path.read_text()))
        except (FileNotFoundError, ValueError):
            pass  # not written yet, or (a writer without announce_learner) half written
        if proc.poll() is not None:
            raise Echo2Error(f"learner exited with code {proc.returncode}: see {log}")
        time.sleep(0.2)
    raise Echo2Error(f"learner did not start within {timeout_s:.0f} s: see {log}")
