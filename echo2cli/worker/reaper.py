"""A watchdog that takes a worker's engine processes down with it.

On a GPU host vLLM runs its engine in child processes (EngineCore, and its own workers, which follow EngineCore
through a death pipe); a CPU worker runs its engine in its own process (`engine.py`, `in_process`) and needs no
watchdog unless VLLM_ENABLE_V1_MULTIPROCESSING=1 asks for vLLM's processes there too. Nothing makes EngineCore
follow *its* parent: after `kill -9` of an `echo2 worker`, or an OOM kill, EngineCore is re-parented to init and
keeps running, with its CPU share and memory (docs/BENCHMARKS.md, "A killed worker's engine"); on a GPU host it
would keep the GPU's memory, and a restarted worker could not start its engine.

So before it starts an engine, a worker starts this watchdog (`python -m echo2cli.worker.reaper PID`) in a
session of its own, where Ctrl-C to the worker's terminal does not reach it. Every 0.5 s it notes the
worker's descendants with their start times (Linux /proc); once the worker is gone (the watchdog has been
re-parented), it SIGKILLs every noted process that is still the same process, and exits. Where /proc is
missing it is not started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.5


def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks since boot), from /proc/<pid>/stat."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
        table[int(entry.name)] = (int(fields[1]), int(fields[19]))
    return table


def descendants(root: int, table: dict[int, tuple[int, int]]) -> dict[int, int]:
    """Every process below `root`: pid -> start time."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, stack = {}, list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found[pid] = table[pid][1]
        stack.extend(children.get(pid, []))
    return found


def watch(parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    me = os.getpid()
    noted: dict[int, int] = {}
    while os.getppid() == parent:
        table = process_table()
        noted = {
            pid: start
            for pid, start in {**noted, **descendants(parent, table)}.items()
            if pid != me and table.get(pid, (0, -1))[1] == start
        }
        time.sleep(POLL_S)
    table = process_table()
    for pid, start in noted.items():
        if table.get(pid, (0, -1))[1] == start:  # still the process we saw, not a new one with its pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def start_reaper() -> subprocess.Popen | None:
    """Watch this process; None where there is no /proc to watch with."""
    if not Path("/proc/self/stat").exists():
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "echo2cli.worker.reaper", str(os.getpid())],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


if __name__ == "__main__":
    watch(int(sys.argv[1]))
