"""What a worker checks before it acts on anything a learner sent.

A worker may have joined someone else's learner, and over plain http anyone on the path can answer for
it. So the worker writes only files it names itself inside its own work directory, and a version's
.torrent must describe exactly the file the authenticated API announced: one file, at the path the
worker expects (`v000007/model.safetensors`, or `v000007.delta/model.delta` for a delta), of the
announced size, under the announced info-hash. libtorrent then verifies every piece against that torrent
and the worker checks the whole file's digest before loading it.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from echo2cli.errors import BroadcastError, ProtocolError
from echo2cli.layout import VersionKey
from echo2cli.protocol import MODEL_FILES, PolicyInfo


def safe_model_file(engine_dir: Path, name: str) -> Path:
    """The path to write model file `name` to: a plain, allow-listed name that resolves inside `engine_dir`."""
    target = (engine_dir / name).resolve()
    if name not in MODEL_FILES or "/" in name or "\\" in name or target.parent != engine_dir.resolve():
        raise ProtocolError(f"the learner asked to write {name[:80]!r}: not a model file this worker accepts")
    return target


def check_torrent(policy: PolicyInfo, data: bytes, *, delta: bool = False) -> None:
    """The .torrent holds exactly the one file announced for this version (or its delta)."""
    import libtorrent as lt

    expected = VersionKey(policy.version, delta).relpath
    if delta:
        size, info_hash = policy.delta_size_bytes, policy.delta_info_hash
    else:
        size, info_hash = policy.size_bytes, policy.info_hash
    what = f"the {'delta ' if delta else ''}torrent of version {policy.version}"
    try:
        info = lt.torrent_info(data)
    except RuntimeError as exc:
        raise BroadcastError(f"{what} does not parse: {exc}") from exc
    files = info.files()  # deprecated in libtorrent 2 in favour of a file_storage view; same data
    if info.num_files() != 1 or PurePosixPath(files.file_path(0).replace("\\", "/")) != expected:
        names = [files.file_path(i) for i in range(min(info.num_files(), 3))]
        raise BroadcastError(f"{what} holds {names}, not only {expected}: refusing it")
    if files.file_size(0) != size:
        raise BroadcastError(f"{what} is {files.file_size(0)} bytes, the learner announced {size}: refusing it")
    if str(info.info_hashes().v1) != info_hash:
        raise BroadcastError(f"{what} does not match its announced info-hash")
