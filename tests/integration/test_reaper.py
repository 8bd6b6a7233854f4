"""A worker killed with SIGKILL takes its vLLM engine processes with it, and a worker restarted on the same
work directory comes up and generates. The engine runs in processes of its own here as on a GPU host (on CPU a
worker's engine runs in its own process unless VLLM_ENABLE_V1_MULTIPROCESSING=1). Real learner, real workers,
real vLLM; ~2-3 minutes on 2 cores."""

from __future__ import annotations

import os
import signal
import subprocess

import httpx
import pytest
from procs import spawn, stop_all, wait_for, wait_listening

from echo2cli.demo import free_port
from echo2cli.worker.reaper import descendants, process_table

pytestmark = pytest.mark.integration

TOKEN = "reaper-token"


def test_a_killed_worker_leaves_no_engine_behind_and_a_restarted_one_generates(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)

    def generating() -> set[str]:
        """Ids of the workers whose rollouts were admitted."""
        try:
            workers = http.get("/v1/status").json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return set()
        return {w["worker_id"] for w in workers if w["rollouts"] > 0}

    def worker() -> subprocess.Popen:
        return spawn(
            [
                "worker",
                "--join",
                url,
                "--token",
                TOKEN,
                "--name",
                "w",
                "--work-dir",
                str(tmp_path / "w"),
                "--bt-listen",
                "127.0.0.1:0",
                "--prompts-per-lease",
                "1",
                "--kv-cache-gib",
                "0.5",
            ],
            tmp_path / "w.log",
            env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},  # on CPU the engine runs in the worker's process otherwise
        )

    learner = spawn(
        [
            "learner",
            "--out",
            str(tmp_path / "run"),
            "--port",
            str(port),
            "--steps",
            "100000",
            "--prompts-per-step",
            "1",
            "-G",
            "2",
            "--max-new-tokens",
            "8",
            "--bt-listen",
            "127.0.0.1:0",
            "--token",
            TOKEN,
            "--activation",
            "all",
            "--checkpoint-every",
            "0",
            "--quiet",
            "--lease-timeout-s",
            "20",
        ],
        tmp_path / "learner.log",
    )
    procs = [learner]
    try:
        wait_listening(learner, tmp_path / "run")
        procs.append(first := worker())
        wait_for(lambda: bool(generating()), 300, "the worker to generate")
        before = generating()
        engine = descendants(first.pid, process_table())
        assert len(engine) >= 1, "no engine process under the worker"
        os.kill(first.pid, signal.SIGKILL)  # the worker alone, as the OOM killer would
        first.wait()

        def alive() -> list[int]:
            table = process_table()
            return [pid for pid, start in engine.items() if table.get(pid, (0, -1))[1] == start]

        wait_for(lambda: not alive(), 30, "the killed worker's engine processes to exit")
        procs.append(worker())
        wait_for(lambda: bool(generating() - before), 300, "the restarted worker to generate")
    finally:
        stop_all(procs)
