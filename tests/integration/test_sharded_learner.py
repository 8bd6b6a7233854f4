"""A learner sharded over 2 ranks (`echo2 learner --nproc-per-node 2`: torchrun, FSDP2, gloo on CPU) with one
real worker: versions go out through the swarm, the learner is killed with SIGKILL after its step-2 checkpoint,
and `--resume` on 2 ranks continues from that checkpoint with the same worker. ~5 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from procs import kill_group, log_tail, spawn, stop_all, wait_for, wait_listening

from echo2cli.demo import free_port
from echo2cli.layout import checkpoint_dir
from echo2cli.learner.checkpoint import STATE_FILE
from echo2cli.metrics import read_metrics

pytestmark = pytest.mark.integration

STEPS = 4


def ranks_alive(out) -> list[int]:
    """Learner ranks still running: processes whose command line is `echo2cli learner ... --out OUT` and that
    torchrun started (LOCAL_RANK set): torchrun's own process and the `echo2 learner` that runs it left out."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        text = b" ".join(args).decode(errors="replace")
        if "echo2cli learner" in text and str(out) in text and "torch.distributed.run" not in text:
            try:
                if b"LOCAL_RANK=" in (cmdline.parent / "environ").read_bytes():
                    pids.append(int(cmdline.parent.name))
            except OSError:
                continue
    return pids


@pytest.fixture(scope="module")
def run(tmp_path_factory, plumbing_model):
    out = tmp_path_factory.mktemp("sharded")
    port = free_port()
    args = ["learner", "--nproc-per-node", "2", "--out", str(out), "--port", str(port), "--bt-listen", "127.0.0.1:0"]
    args += ["--model", str(plumbing_model)]  # nothing here depends on what the model says
    args += ["--steps", str(STEPS), "--prompts-per-step", "2", "-G", "4", "--max-new-tokens", "8", "-S", "1"]
    args += ["--checkpoint-every", "2", "--token", "t0k3n", "--max-tokens-per-micro-batch", "256", "--quiet"]
    learner = spawn(args, out / "learner.log")
    worker = None
    report: dict = {}
    try:
        wait_listening(learner, out)
        worker = spawn(
            ["worker", "--join", f"http://127.0.0.1:{port}", "--token", "t0k3n", "--name", "w0"]
            + ["--work-dir", str(out / "w0"), "--bt-listen", "127.0.0.1:0", "--kv-cache-gib", "0.5"],
            out / "worker.log",
        )
        wait_for(
            lambda: (checkpoint_dir(out, 2) / STATE_FILE).exists(),
            600,
            "the step-2 checkpoint",
            running=(learner, worker),
            logs=(out / "learner.log", out / "worker.log"),
        )
        report["ranks_before_kill"] = len(ranks_alive(out))
        kill_group(learner)  # `echo2 learner`, with SIGKILL: neither torchrun nor its ranks may outlive it
        wait_for(lambda: not ranks_alive(out), 30, "the learner's ranks to exit with torchrun")
        report["steps_before_kill"] = len(read_metrics(out / "metrics.jsonl"))
        (out / "learner.json").unlink()
        learner = spawn(args + ["--resume", str(checkpoint_dir(out, 2))], out / "learner.log")
        wait_listening(learner, out)
        learner.wait(timeout=900)
        worker.wait(timeout=120)
        report["learner_rc"] = learner.returncode
    finally:
        stop_all([p for p in (learner, worker) if p is not None])
        time.sleep(0.5)
        for pid in ranks_alive(out):
            os.kill(pid, signal.SIGKILL)
    assert report.get("learner_rc") == 0, log_tail(out / "learner.log")
    return out, report


def test_two_ranks_train_every_step_and_resume_after_a_kill_from_the_checkpoint(run):
    out, report = run
    assert report["ranks_before_kill"] == 2
    assert report["steps_before_kill"] >= 2
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS))  # steps after the checkpoint are trained again, once
    assert [r["version"] for r in rows] == list(range(1, STEPS + 1))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["start_step"] == 2  # the resumed run began at the checkpoint it was given
    final = Path(summary["checkpoint"])
    assert final == checkpoint_dir(out, STEPS) and (final / "dcp").is_dir()  # each rank's shards
    assert (final / "model.safetensors").exists()  # and rank 0's whole-model export, for eval


def test_the_worker_loaded_at_least_three_versions_from_the_swarm_with_verified_hashes(run):
    out, _ = run
    loads = {e["version"]: e for e in read_metrics(out / "w0" / "events.jsonl") if e["event"] == "loaded"}
    assert len(loads) >= 3
    for e in loads.values():
        assert e["digest_verified"] and len(e["digest"]) == 64
    for r in read_metrics(out / "metrics.jsonl"):
        for _, version in r["rollout/worker_versions"]:
            assert version in loads, f"trained on v{version}, which the worker never loaded"
