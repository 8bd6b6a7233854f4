"""Delta versions: version v as a compact patch against version v-1 of the same bf16 safetensors file.

With a small learning rate, one optimizer step moves most bf16 weights by less than half a unit in
the last place, so they round to the same 16 bits: measured on the default model at lr 5e-5, about
5 % of the 16-bit words change per step. The delta stores

    a bitmap of the changed 16-bit words (np.packbits)   ─┐
    the XOR of old and new for those words, as two byte   ├─ each zstd-compressed
    planes (low bytes, then high bytes)                   ─┘

so that unchanged words cost one bit before compression, and the XOR values (mostly a few low
mantissa bits) compress well once their high and low bytes are separated. A header records the base
and target SHA-256; `apply_delta` refuses a base with the wrong hash and checks the rebuilt file
against the target hash before it is renamed into place, so a version is never half-built or wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

from echo2cli.errors import BroadcastError

MAGIC = b"ECHO2DELTA1\n"


def _words(path: Path) -> np.ndarray:
    data = np.fromfile(path, dtype=np.uint8)
    if data.size % 2:
        raise BroadcastError(f"{path} has an odd length: not a bf16 safetensors file")
    return data.view(np.uint16)


def _sha256(data: np.ndarray) -> str:
    return hashlib.sha256(data.view(np.uint8).data).hexdigest()


def encode_delta(
    base: Path, target: Path, out: Path, *, base_sha256: str = "", target_sha256: str = "", level: int = 3
) -> dict:
    """Write the delta that turns `base` into `target`; returns its header (sizes, hashes).

    Pass the files' SHA-256 if already known (the publisher has them) to skip hashing them again.
    """
    import zstandard

    old, new = _words(base), _words(target)
    if old.size != new.size:
        raise BroadcastError("base and target differ in size: a delta needs the same tensor layout")
    changed = old != new
    xor = np.bitwise_xor(old[changed], new[changed])
    planes = xor.view(np.uint8).reshape(-1, 2).T  # row 0: low bytes, row 1: high bytes
    z = zstandard.ZstdCompressor(level=level, threads=-1)
    blobs = [z.compress(np.packbits(changed).tobytes()), z.compress(np.ascontiguousarray(planes).tobytes())]
    header = {
        "words": int(new.size),
        "changed": int(xor.size),
        "blob_bytes": [len(b) for b in blobs],
        "base_sha256": base_sha256 or _sha256(old),
        "target_sha256": target_sha256 or _sha256(new),
    }
    raw = json.dumps(header).encode()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<I", len(raw)) + raw)
        for blob in blobs:
            f.write(blob)
    tmp.rename(out)
    return header | {"delta_bytes": out.stat().st_size, "full_bytes": int(new.nbytes)}


def read_header(delta: Path) -> tuple[dict, int]:
    with open(delta, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise BroadcastError(f"{delta} is not an echo2 delta")
        (n,) = struct.unpack("<I", f.read(4))
        return json.loads(f.read(n)), len(MAGIC) + 4 + n


def apply_delta(
    base: Path, delta: Path, out: Path, expected_sha256: str | None = None, *, base_verified: bool = False
) -> str:
    """Rebuild the target from `base` + `delta` into `out`; returns its SHA-256 (verified).

    `base_verified=True` skips re-hashing a base the caller has already checked (a loaded version).
    """
    import zstandard

    header, offset = read_header(delta)
    old = _words(base)
    if old.size != header["words"] or (not base_verified and _sha256(old) != header["base_sha256"]):
        raise BroadcastError(f"{base} is not the base this delta was made against")
    data = delta.read_bytes()[offset:]
    bits_len, planes_len = header["blob_bytes"]
    try:
        z = zstandard.ZstdDecompressor()
        bits = np.frombuffer(z.decompress(data[:bits_len]), np.uint8)
        planes = np.frombuffer(z.decompress(data[bits_len : bits_len + planes_len]), np.uint8)
    except zstandard.ZstdError as exc:
        raise BroadcastError(f"delta {delta} is corrupt: {exc}") from exc
    changed = np.unpackbits(bits, count=header["words"]).view(bool)  # 0/1 bytes: a view, not a 134 MB copy
    if planes.size != 2 * header["changed"] or int(changed.sum()) != header["changed"]:
        raise BroadcastError(f"delta {delta} is inconsistent with its header")
    new = old  # read from the file into a buffer of its own: patched in place
    new[changed] ^= np.ascontiguousarray(planes.reshape(2, -1).T).view(np.uint16).ravel()
    digest = _sha256(new)
    want = expected_sha256 or header["target_sha256"]
    if digest != want:
        raise BroadcastError(f"rebuilt version does not match its SHA-256 ({digest[:12]} != {want[:12]})")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    new.tofile(tmp)
    os.replace(tmp, out)
    return digest
