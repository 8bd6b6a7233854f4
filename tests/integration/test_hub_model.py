"""`echo2 eval` of a model given by its Hugging Face Hub id with HF_HUB_OFFLINE=1, the weights in shards: the default
model saved as ~100 MB shards and their index into a Hub cache of the test's own (`integration_fixtures.hf_home`).
The learner's side of the same (training from the id, a worker with an empty cache, resuming by the id) is checked
in the end-to-end run (`test_e2e.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hub_cache import HUB_REPO, offline_env

pytestmark = pytest.mark.integration


def test_eval_of_a_sharded_hub_model_offline(hf_home):
    proc = subprocess.run(
        [sys.executable, "-m", "echo2cli", "eval", "--model", HUB_REPO, "--limit", "4", "--k", "0", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        env=offline_env(hf_home),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith('{"model"')][-1])
    assert result["model"].startswith(os.fspath(hf_home)) and result["problems"] == 4
