"""What the integration modules share, so a run of the suite starts each expensive thing once (a plugin of
tests/conftest.py):

plumbing_model   the default model cut to two layers (`plumbing_model.py`), for runs whose checks do not
                 depend on what the model says
engine           one vLLM engine (CPU) on the default model for the whole session: every evaluation and
                 log-prob check that needs only weights loaded uses it (`evaluate(..., engine=)`); each
                 user swaps the weights it needs in first
hf_home          a Hugging Face Hub cache holding the default model as ~100 MB bf16 shards under HUB_REPO
                 (`hub_cache.py`), for runs that start from a Hub id offline
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from plumbing_model import plumbing_model as build_plumbing_model


@pytest.fixture(scope="session")
def plumbing_model() -> Path:
    """ECHO2_PLUMBING_MODEL=default runs these on the full default model instead (to compare, or to rule the
    smaller model out when one fails)."""
    if os.environ.get("ECHO2_PLUMBING_MODEL") == "default":
        from echo2cli.models import prepare_default_model

        return prepare_default_model()
    return build_plumbing_model()


@pytest.fixture(scope="session")
def hf_home() -> Path:
    """(Outside pytest's base directory, whose new entries go when each module ends: `module_dirs_removed`.)"""
    import torch
    from hub_cache import HUB_REPO, add_to_hub_cache
    from transformers import AutoModelForCausalLM

    from echo2cli.models import prepare_default_model
    from echo2cli.protocol import MODEL_FILES

    default = prepare_default_model()
    with tempfile.TemporaryDirectory(prefix="echo2-hub-") as tmp:
        staging, home = Path(tmp) / "sharded", Path(tmp) / "hf"
        model = AutoModelForCausalLM.from_pretrained(default, dtype=torch.bfloat16)
        model.save_pretrained(staging, max_shard_size="100MB")
        files = {f.name: f for f in staging.iterdir()}
        assert "model.safetensors.index.json" in files and len([n for n in files if n.endswith(".safetensors")]) >= 2
        files |= {name: default / name for name in MODEL_FILES if (default / name).exists() and name not in files}
        add_to_hub_cache(home, HUB_REPO, files)
        yield home


SHARED: dict[str, object] = {}  # "engine": the running engine, "last": the node id of the last test that uses it


@pytest.hookimpl(trylast=True)  # after any deselection or reordering
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    users = [item.nodeid for item in items if "engine" in getattr(item, "fixturenames", ())]
    if users:
        SHARED["last"] = users[-1]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """The engine stops after the last test that uses it, not at the session's end: its three processes and its
    memory would otherwise sit beside every run after it."""
    if item.nodeid == SHARED.get("last") and (running := SHARED.pop("engine", None)) is not None:
        running.close()  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def engine():
    from echo2cli.evaluate import EPISODE_CONTEXT
    from echo2cli.models import prepare_default_model
    from echo2cli.worker.engine import Engine

    # vLLM names its ZMQ sockets as files in the temp directory and never removes them: a directory of its own
    with tempfile.TemporaryDirectory(prefix="e2-") as tmp, pytest.MonkeyPatch.context() as env:
        env.setenv("TMPDIR", tmp)
        env.setattr(tempfile, "tempdir", None)  # read TMPDIR again
        SHARED["engine"] = Engine(prepare_default_model(), kv_cache_gib=1.0, max_model_len=EPISODE_CONTEXT, seed=0)
        env.undo()
        yield SHARED["engine"]
        if (running := SHARED.pop("engine", None)) is not None:
            running.close()  # type: ignore[attr-defined]
