"""Only a run that reached its last step tells workers "finished".

A learner stopped by SIGTERM/Ctrl-C (`request_stop`), or one that fails (a full disk at its checkpoint), must
leave its workers retrying so they join the resumed learner: a worker that hears "finished" leaves and exits.
These run the real learner (HTTP server, libtorrent seed; the default model cut to two layers, `plumbing_model.py`)
without workers.
"""

from __future__ import annotations

import pytest

from echo2cli.config import LearnerConfig
from echo2cli.errors import DiskFullError

pytestmark = pytest.mark.integration


def make_learner(out, model):
    from echo2cli.learner.loop import Learner

    cfg = LearnerConfig(
        model=str(model),
        out_dir=out,
        port=0,
        bt_listen="127.0.0.1:0",
        steps=3,
        checkpoint_every=0,
        activation="all",
        linger_s=0,
    )
    return Learner(cfg)


def test_a_stop_request_checkpoints_without_telling_workers_finished(tmp_path, plumbing_model):
    learner = make_learner(tmp_path, plumbing_model)
    learner.request_stop()
    summary = learner.run()
    assert summary["stopped_at"] == 0
    assert not learner.coord.finished


def test_a_learner_that_fails_does_not_tell_workers_finished(tmp_path, monkeypatch, plumbing_model):
    learner = make_learner(tmp_path, plumbing_model)

    def full(step):
        raise DiskFullError("disk full writing checkpoint")

    monkeypatch.setattr(learner, "checkpoint", full)
    learner.request_stop()
    with pytest.raises(DiskFullError):
        learner.run()
    assert not learner.coord.finished


def test_sigterm_to_a_sharded_learner_reaches_rank_0_which_checkpoints_and_every_rank_exits_0(tmp_path, plumbing_model):
    """`echo2 learner --nproc-per-node 2` runs torchrun as its child and gives the first SIGTERM to rank 0 alone,
    the way a one-process learner takes it. Handed to torchrun's agent, the signal would end the job with code 1
    and SIGKILL every rank 30 s later, whatever rank 0 was still writing."""
    import signal

    from procs import spawn, wait_for

    from echo2cli.layout import checkpoint_dir
    from echo2cli.learner.checkpoint import STATE_FILE

    (tmp_path / "learner.json").write_text('{"pid": 1}')  # a previous run's file: never signalled
    args = ["learner", "--nproc-per-node", "2", "--out", str(tmp_path), "--port", "0", "--bt-listen", "127.0.0.1:0"]
    args += ["--model", str(plumbing_model)]
    learner = spawn([*args, "--steps", "3", "--token", "t0k3n", "--quiet"], tmp_path / "learner.log")
    try:
        wait_for(lambda: '"pid": 1}' not in (tmp_path / "learner.json").read_text(), 300, "rank 0's learner.json")
        learner.send_signal(signal.SIGTERM)
        rc = learner.wait(timeout=240)
    finally:
        learner.kill()
    log = (tmp_path / "learner.log").read_text()
    assert rc == 0, log[-3000:]
    assert (checkpoint_dir(tmp_path, 0) / STATE_FILE).exists() and "SignalException" not in log
