"""Finding a learner once it serves (`launch.wait_for_learner`), with real processes standing in for it."""

import json
import os
import subprocess
import sys
import time

import pytest

from echo2cli.errors import Echo2Error
from echo2cli.launch import wait_for_learner

# a "learner" that starts, then announces itself as a real one does (written, then renamed)
ANNOUNCE = """
import sys, time
from pathlib import Path
from echo2cli.launch import announce_learner
time.sleep(float(sys.argv[2]))
announce_learner(Path(sys.argv[1]), {"url": "http://127.0.0.1:2", "pid": 0})
"""


def stale_learner_file(out):
    (out / "learner.json").write_text(json.dumps({"url": "http://127.0.0.1:1", "pid": 0}))
    an_hour_ago = time.time() - 3600
    os.utime(out / "learner.json", (an_hour_ago, an_hour_ago))


def test_a_file_left_by_a_killed_learner_is_not_taken_for_the_new_one(tmp_path):
    stale_learner_file(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", ANNOUNCE, str(tmp_path), "0.5"])
    try:
        assert wait_for_learner(proc, tmp_path, tmp_path / "learner.log", timeout_s=60)["url"] == "http://127.0.0.1:2"
    finally:
        proc.wait(timeout=60)


def test_a_learner_that_exits_is_an_error_even_beside_an_old_file(tmp_path):
    stale_learner_file(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(Echo2Error, match="learner exited with code 3"):
        wait_for_learner(proc, tmp_path, tmp_path / "learner.log", timeout_s=60)
