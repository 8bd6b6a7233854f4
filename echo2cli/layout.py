"""Names on disk that the learner, the workers, `echo2 eval` and the tests agree on.

<out>/                                    a learner run (`echo2 learner --out`)
    learner.json                          written once the API serves: url, run id, pid
    config.json  metrics.jsonl  mismatch.jsonl  decisions.jsonl  summary.json
    versions/v000007/model.safetensors    version 7 in bf16: its torrent's one file
    versions/v000007.delta/model.delta    version 7 as a delta against version 6
    checkpoints/step_000010/              learner/checkpoint.py
    eval/v000010.json                     `--eval-every` results
<work_dir>/                               a worker
    engine/                               config and tokenizer files; model.safetensors -> the loaded version
    versions/                             as above: the versions it fetches and seeds
    events.jsonl                          every version it loaded
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import NamedTuple

WEIGHTS_FILE = "model.safetensors"
DELTA_FILE = "model.delta"
LEARNER_FILE = "learner.json"
VERSIONS_DIR = "versions"
CHECKPOINTS_DIR = "checkpoints"


class VersionKey(NamedTuple):
    """A version's full file or its delta: the key of its torrent and the directory it is stored in."""

    version: int
    delta: bool = False

    def __str__(self) -> str:
        return f"the delta of version {self.version}" if self.delta else f"version {self.version}"

    @property
    def dir_name(self) -> str:
        return f"v{self.version:06d}" + (".delta" if self.delta else "")

    @property
    def file_name(self) -> str:
        return DELTA_FILE if self.delta else WEIGHTS_FILE

    @property
    def relpath(self) -> PurePosixPath:
        """The one path inside the version's torrent."""
        return PurePosixPath(self.dir_name, self.file_name)

    def dir(self, root: Path) -> Path:
        return root / self.dir_name

    @classmethod
    def from_relpath(cls, dir_name: str, file_name: str) -> VersionKey | None:
        """The key whose `relpath` is dir_name/file_name (`v000007/model.safetensors`), or None."""
        delta = dir_name.endswith(".delta")
        digits = dir_name.removesuffix(".delta")[1:]
        if not (dir_name.startswith("v") and len(digits) == 6 and digits.isdigit()):
            return None
        key = cls(int(digits), delta)
        return key if key.relpath == PurePosixPath(dir_name, file_name) else None

    def path(self, root: Path) -> Path:
        return root / self.dir_name / self.file_name


def weights_path(root: Path, version: int) -> Path:
    """`root/v000007/model.safetensors`."""
    return VersionKey(version).path(root)


def kept_versions(root: Path) -> list[int]:
    """Full versions whose weights are in `root`, oldest first."""
    found = (d for d in root.glob("v[0-9]*") if d.name[1:].isdigit() and (d / WEIGHTS_FILE).is_file())
    return sorted(int(d.name[1:]) for d in found)


def checkpoint_dir(out: Path, step: int) -> Path:
    return out / CHECKPOINTS_DIR / f"step_{step:06d}"


def checkpoint_step(path: Path) -> int | None:
    """The step of a complete checkpoint's directory name (`step_000012` -> 12); None for `.tmp` or `.old`."""
    digits = path.name.removeprefix("step_")
    return int(digits) if path.name.startswith("step_") and digits.isdigit() else None
