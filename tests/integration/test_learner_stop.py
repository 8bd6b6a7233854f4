"""Only a run that reached its last step tells workers "finished".

A learner stopped by SIGTERM/Ctrl-C (`request_stop`), or one that fails (a full disk at its checkpoint), must
leave its workers retrying so they join the resumed learner: a worker that hears "finished" leaves and exits.
These run the real learner (default model, HTTP server, libtorrent seed) without workers; ~30 s.
"""

from __future__ import annotations

import pytest

from echo2cli.config import LearnerConfig
from echo2cli.errors import DiskFullError

pytestmark = pytest.mark.integration


def make_learner(out):
    from echo2cli.learner.loop import Learner

    cfg = LearnerConfig(
        out_dir=out, port=0, bt_listen="127.0.0.1:0", steps=3, checkpoint_every=0, activation="all", linger_s=0
    )
    return Learner(cfg)


def test_a_stop_request_checkpoints_without_telling_workers_finished(tmp_path):
    learner = make_learner(tmp_path)
    learner.request_stop()
    summary = learner.run()
    assert summary["stopped_at"] == 0
    assert not learner.coord.finished


def test_a_learner_that_fails_does_not_tell_workers_finished(tmp_path, monkeypatch):
    learner = make_learner(tmp_path)

    def full(step):
        raise DiskFullError("disk full writing checkpoint")

    monkeypatch.setattr(learner, "checkpoint", full)
    learner.request_stop()
    with pytest.raises(DiskFullError):
        learner.run()
    assert not learner.coord.finished
