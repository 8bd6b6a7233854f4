"""A learner and `echo2 eval` started from a Hugging Face Hub id with HF_HUB_OFFLINE=1, the weights in shards: the
default model saved as ~100 MB shards and their index into a Hub cache of the test's own (`hub_cache.py`). The
learner trains a step with one worker, which has an empty Hub cache of its own (the learner serves it everything);
its version 0 is the default model's weights bit for bit; it resumes from its checkpoint by the same id; `echo2
eval` samples from the sharded snapshot. ~3 minutes on 2 cores (two vLLM engine starts)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from hub_cache import add_to_hub_cache, offline_env
from procs import finish, kill_group, log_tail, spawn, wait_listening
from safetensors.torch import load_file

from echo2cli.broadcast.image import WIRE_DTYPES
from echo2cli.demo import free_port
from echo2cli.layout import LEARNER_FILE, VersionKey
from echo2cli.models import prepare_default_model
from echo2cli.protocol import MODEL_FILES

pytestmark = pytest.mark.integration

REPO = "echo2-test/SmolLM2-135M-sharded"


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    default = prepare_default_model()
    staging = tmp_path_factory.mktemp("sharded")
    AutoModelForCausalLM.from_pretrained(default, dtype=torch.bfloat16).save_pretrained(staging, max_shard_size="100MB")
    files = {f.name: f for f in staging.iterdir()}
    assert "model.safetensors.index.json" in files and len([n for n in files if n.endswith(".safetensors")]) >= 2
    files |= {name: default / name for name in MODEL_FILES if (default / name).exists() and name not in files}
    home = tmp_path_factory.mktemp("hf")
    add_to_hub_cache(home, REPO, files)
    return home


def hub_only(hf_home) -> dict[str, str]:
    return {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}


def test_a_learner_trains_and_resumes_from_a_sharded_hub_model_offline(hf_home, tmp_path):
    out, port = tmp_path / "run", free_port()
    args = ["--out", str(out), "--port", str(port), "--bt-listen", "127.0.0.1:0", "--checkpoint-every", "0", "--quiet"]
    run = ["--model", REPO, "--steps", "1", "--prompts-per-step", "2", "-G", "4", "--max-new-tokens", "8", *args]
    learner = spawn(["learner", *run], tmp_path / "learner.log", env=hub_only(hf_home))
    wait_listening(learner, out)
    worker = spawn(
        ["worker", "--join", f"http://127.0.0.1:{port}", "--work-dir", str(tmp_path / "w0"),
         "--bt-listen", "127.0.0.1:0", "--kv-cache-gib", "0.5"],
        tmp_path / "worker.log",
        env=hub_only(tmp_path / "empty-hf"),
    )  # fmt: skip
    finish(learner, [worker], out)
    config = json.loads((out / "config.json").read_text())
    assert config["model"] == REPO
    published = load_file(str(VersionKey(0).path(out / "versions")))
    original = load_file(str(prepare_default_model() / "model.safetensors"))
    assert published.keys() == original.keys()
    wire = WIRE_DTYPES[config["wire_dtype"]]  # the run's --wire-dtype
    for name, tensor in original.items():
        assert torch.equal(published[name], tensor.to(wire)), name

    (out / LEARNER_FILE).unlink()  # the first learner's: wait for the resumed one's
    resume = ["learner", "--resume", str(out), "--steps", "2", *args]
    resumed = spawn(resume, tmp_path / "resumed.log", env=hub_only(hf_home))
    try:
        wait_listening(resumed, out)  # the model resolved from the cache by the saved id, the checkpoint loaded
        resumed.send_signal(signal.SIGTERM)
        assert resumed.wait(timeout=120) == 0, log_tail(tmp_path / "resumed.log")
    finally:
        if resumed.poll() is None:
            kill_group(resumed)
    summary = json.loads((tmp_path / "resumed.log").read_text().strip().splitlines()[-1])
    assert summary["start_step"] == 1 and summary["stopped_at"] is not None  # it may train groups the first left


def test_eval_of_a_sharded_hub_model_offline(hf_home):
    proc = subprocess.run(
        [sys.executable, "-m", "echo2cli", "eval", "--model", REPO, "--limit", "4", "--k", "0", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        env=offline_env(hf_home),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith('{"model"')][-1])
    assert result["model"].startswith(os.fspath(hf_home)) and result["problems"] == 4
