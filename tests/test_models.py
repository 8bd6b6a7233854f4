"""`--model` as a Hugging Face Hub id (ORG/NAME) or a local directory, and `plan-memory` from a config alone, against a
Hub cache built on disk (`hub_cache.py`) with HF_HUB_OFFLINE=1: no network. The learner and `echo2 eval` started
from a Hub id (sharded weights) are in tests/integration/test_e2e.py and test_eval.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hub_cache import add_to_hub_cache, offline_env

from echo2cli.errors import ModelError
from echo2cli.models import is_hub_id, resolve_model, resolve_model_config

QWEN3_8B_CONFIG = Path(__file__).parent / "data" / "hub" / "qwen3-8b-config.json"  # Qwen/Qwen3-8B's config.json


def echo2(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "echo2cli", *args], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """This process reads only a Hub cache of its own (huggingface_hub read the environment when imported)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hf"


def test_plan_memory_of_a_hub_id_needs_only_its_config_offline(tmp_path):
    add_to_hub_cache(tmp_path / "hf", "Qwen/Qwen3-8B", {"config.json": QWEN3_8B_CONFIG})
    run = echo2(
        "plan-memory", "--model", "Qwen/Qwen3-8B", "--ranks", "8", "--activation-checkpointing", "--json",
        env=offline_env(tmp_path / "hf"),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["params"] == pytest.approx(8.19e9, rel=1e-2) and report["learner"]["ranks"] == 8
    by_file = echo2(
        "plan-memory", "--config-json", str(QWEN3_8B_CONFIG), "--ranks", "8", "--activation-checkpointing", "--json",
        env=offline_env(tmp_path / "empty"),
    )  # fmt: skip
    assert by_file.returncode == 0, by_file.stderr
    assert json.loads(by_file.stdout) == report
    at_defaults = echo2("plan-memory", "--model", "Qwen/Qwen3-8B", "--ranks", "8", env=offline_env(tmp_path / "hf"))
    assert at_defaults.returncode == 2 and at_defaults.stderr.count("\n") == 1  # 8,192 tokens need checkpointing
    assert "needs 107.7 GiB per rank of 8" in at_defaults.stderr
    assert "try --max-tokens-per-micro-batch" in at_defaults.stderr


def test_a_hub_id_missing_from_the_cache_offline_is_one_line_that_says_what_to_do(tmp_path):
    run = echo2("plan-memory", "--model", "Qwen/Qwen3-8B", env=offline_env(tmp_path / "hf"))
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "HF_HUB_OFFLINE is set" in run.stderr and "hf download" in run.stderr


def test_a_directory_with_only_a_config_is_enough_for_a_shape_but_not_for_a_model(tmp_path):
    (tmp_path / "config.json").write_text(QWEN3_8B_CONFIG.read_text())
    assert resolve_model_config(str(tmp_path)) == tmp_path / "config.json"
    with pytest.raises(ModelError, match="no \\*.safetensors weights"):
        resolve_model(str(tmp_path))


def test_a_cached_hub_model_resolves_to_its_snapshot_and_a_revision_pins_one(offline, tmp_path):
    default = resolve_model("default")
    files = {name: default / name for name in ("config.json", "tokenizer.json", "model.safetensors")}
    main = add_to_hub_cache(offline, "echo2-test/tiny", files)
    pinned = add_to_hub_cache(offline, "echo2-test/tiny", files, revision="1" * 40)
    assert resolve_model("echo2-test/tiny") == main
    assert resolve_model("echo2-test/tiny", revision="1" * 40) == pinned != main
    with pytest.raises(ModelError, match="not in the Hugging Face cache"):
        resolve_model("echo2-test/tiny", revision="2" * 40)


def test_only_the_config_of_a_hub_id_is_needed_for_its_shape(offline):
    add_to_hub_cache(offline, "Qwen/Qwen3-8B", {"config.json": QWEN3_8B_CONFIG})
    assert json.loads(resolve_model_config("Qwen/Qwen3-8B").read_text())["hidden_size"] == 4096
    with pytest.raises(ModelError, match="no \\*.safetensors weights"):
        resolve_model("Qwen/Qwen3-8B")  # a model to train or sample needs its weights


def test_a_local_directory_wins_over_a_hub_id_of_the_same_name(tmp_path, monkeypatch, offline):
    local = tmp_path / "org" / "name"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("org/name") and resolve_model_config("org/name") == local / "config.json"
    assert is_hub_id("Qwen/Qwen3-8B") and not is_hub_id("./Qwen3-8B") and not is_hub_id("a/b/c")


@pytest.mark.parametrize(
    ("spec", "revision", "message"),
    [
        ("default", "main", "the default model is built offline"),
        (".", "main", "is a local directory"),
        ("/no/such/dir", None, "no such directory, and not a Hugging Face Hub id"),
    ],
)
def test_what_cannot_be_resolved_is_one_line(spec, revision, message):
    with pytest.raises(ModelError, match=message):
        resolve_model(spec, revision)


def test_the_weight_files_are_the_shards_the_index_names(tmp_path):
    """A repository may hold another copy beside the shards (Mistral's consolidated.safetensors): only the index's
    shards are fetched from the Hub and read by the sharded learner; without an index, every *.safetensors file."""
    import torch
    from safetensors.torch import save_file

    from echo2cli.models import INDEX_FILE, safetensors_files

    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "consolidated.safetensors"):
        save_file({"w": torch.zeros(1)}, str(tmp_path / name))
    assert [p.name for p in safetensors_files(tmp_path)] == [
        "consolidated.safetensors", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
    ]  # fmt: skip
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert [p.name for p in safetensors_files(tmp_path)] == sorted(weight_map.values())
    (tmp_path / INDEX_FILE).write_text("[]")
    with pytest.raises(ModelError, match="is not a safetensors index"):
        safetensors_files(tmp_path)
