"""A vLLM general plugin (entry point `vllm.general_plugins`): vLLM loads it in every process it starts.

On CPU, vLLM starts its model-runner process with `spawn` and talks to it through a shared-memory queue whose
reader busy-waits (`sched_yield` in a loop) for a second after every message before it sleeps on a socket.
A worker's engine gets one message per generation step and one per weight swap, so after each swap, and after
each lease, that process burns up to a second of a core doing nothing, on a box where the learner and the other
workers want the same cores. An engine started by echo2 (`worker/engine.py`) sets ECHO2_VLLM_BUSY_LOOP_S in its
environment and this plugin makes it the queue's busy-wait time; anywhere else the plugin does nothing.
Measured in docs/BENCHMARKS.md ("Idle engines").
"""

from __future__ import annotations

import os

BUSY_LOOP_ENV = "ECHO2_VLLM_BUSY_LOOP_S"


def register() -> None:
    value = os.environ.get(BUSY_LOOP_ENV)
    if value is None:
        return
    try:
        from vllm.distributed.device_communicators import shm_broadcast

        init = shm_broadcast.SpinCondition.__init__
        defaults = init.__defaults__
    except (ImportError, AttributeError):  # another vLLM version: leave it as it is
        return
    if defaults is not None and len(defaults) == 1:
        init.__defaults__ = (float(value),)
