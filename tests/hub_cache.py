"""A Hugging Face Hub cache built on disk, for tests that resolve `ORG/NAME` ids without a network: the layout
`huggingface_hub` writes (`hub/models--ORG--NAME/{blobs,snapshots/COMMIT,refs/REVISION}`, snapshot files linked
to their blobs), so `snapshot_download` and `hf_hub_download` with HF_HUB_OFFLINE=1 find them as if downloaded."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

HUB_REPO = "echo2-test/SmolLM2-135M-sharded"  # the default model in shards (`integration_fixtures.hf_home`)


def add_to_hub_cache(hf_home: Path, repo_id: str, files: dict[str, Path], revision: str = "main") -> Path:
    """`files` (name in the repo -> a file here) as repo `repo_id` at `revision` under `hf_home`; the snapshot."""
    repo = Path(hf_home) / "hub" / ("models--" + repo_id.replace("/", "--"))
    pinned = len(revision) == 40  # a commit hash names its snapshot; a branch or tag names a ref to one
    commit = revision if pinned else hashlib.sha1(f"{repo_id}@{revision}:{sorted(files)}".encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, source in files.items():
        blob = repo / "blobs" / hashlib.sha256(f"{commit}/{name}".encode()).hexdigest()
        try:
            os.link(source, blob)
        except OSError:
            shutil.copy2(source, blob)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    if not pinned:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / revision).write_text(commit)
    return snapshot


def offline_env(hf_home: Path) -> dict[str, str]:
    """The environment of a process that may read only this cache."""
    return {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}


def hub_only(hf_home: Path) -> dict[str, str]:
    """The environment additions of a process that may read only this cache, offline."""
    return {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
