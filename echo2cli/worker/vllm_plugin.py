"""A vLLM general plugin (entry point `vllm.general_plugins`): vLLM loads it in every process it starts.

On CPU, vLLM starts its model-runner process with `spawn` and talks to it through a shared-memory queue whose
reader busy-waits (`sched_yield` in a loop) for a second after every message before it sleeps on a socket.
A worker's engine gets one message per generation step and one per weight swap, so after each swap, and after
each lease, that process burns up to a second of a core doing nothing, on a box where the learner and the other
workers want the same cores. An engine started by echo2 (`worker/engine.py`) sets ECHO2_VLLM_BUSY_LOOP_S in its
environment and this plugin makes it the queue's busy-wait time; anywhere else the plugin does nothing.
Measured in docs/BENCHMARKS.md ("Idle engines").

vLLM 0.32's executors also meet through a torch FileStore named `vllm_dist_<uuid>` in the temp directory, which
a process killed at shutdown (vLLM force-kills an engine that takes more than a second to stop) never removes:
one file per engine start piled up in /tmp. An engine started by echo2 sets ECHO2_VLLM_STORE_DIR, its own
directory that it removes at exit (`engine.socket_dir`), and this plugin puts the FileStore there.
"""

from __future__ import annotations

import os
import uuid

BUSY_LOOP_ENV = "ECHO2_VLLM_BUSY_LOOP_S"
STORE_DIR_ENV = "ECHO2_VLLM_STORE_DIR"


def register() -> None:
    _file_store_in(os.environ.get(STORE_DIR_ENV))
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


def _file_store_in(directory: str | None) -> None:
    if not directory:
        return
    try:
        from vllm.v1.executor import multiproc_executor, uniproc_executor
    except ImportError:  # another vLLM version: leave it as it is
        return

    def file_store_init_method() -> str:
        return f"file://{directory}/vllm_dist_{uuid.uuid4().hex}"

    for module in (multiproc_executor, uniproc_executor):
        if hasattr(module, "get_file_store_init_method"):
            module.get_file_store_init_method = file_store_init_method
