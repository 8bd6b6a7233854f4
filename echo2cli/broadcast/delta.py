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

from echo2cli.broadcast.torrent import sha256_file
from echo2cli.errors import BroadcastError

MAGIC = b"ECHO2DELTA1\n"


CHUNK_WORDS = 1 << 18  # words per pass (512 KB of each file): a multiple of 8, so a chunk's bitmap is whole bytes


def _words(path: Path) -> np.ndarray:
    """The file as 16-bit words, mapped rather than read: each pass touches a chunk at a time (a 135 M-word file
    read whole, then compared, indexed and XORed whole, made the encode 2.3x slower: scripts/bench_delta.py)."""
    size = path.stat().st_size
    if size % 2:
        raise BroadcastError(f"{path} has an odd length: not a bf16 safetensors file")
    return np.memmap(path, dtype=np.uint16, mode="r") if size else np.zeros(0, np.uint16)


def _chunks(n: int) -> range:
    return range(0, n, CHUNK_WORDS)


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
    hashes = {name: hashlib.sha256() for name, known in (("base", base_sha256), ("target", target_sha256)) if not known}
    changed: np.ndarray = np.empty(min(CHUNK_WORDS, new.size), bool)
    bits: list[np.ndarray] = []
    low: list[np.ndarray] = []
    high: list[np.ndarray] = []
    for start in _chunks(new.size):
        a, b = old[start : start + CHUNK_WORDS], new[start : start + CHUNK_WORDS]
        c = changed[: a.size]
        np.not_equal(a, b, out=c)
        bits.append(np.packbits(c))
        xor = np.bitwise_xor(a[c], b[c]).view(np.uint8)
        low.append(xor[0::2])
        high.append(xor[1::2])
        for name, words in (("base", a), ("target", b)):
            if name in hashes:
                hashes[name].update(words.data)
    n_changed = sum(x.size for x in low)
    z = zstandard.ZstdCompressor(level=level, threads=-1)
    blobs = [z.compress(_joined(bits)), z.compress(_joined(low + high))]  # low bytes, then high bytes
    header = {
        "words": int(new.size),
        "changed": int(n_changed),
        "blob_bytes": [len(b) for b in blobs],
        "base_sha256": base_sha256 or hashes["base"].hexdigest(),
        "target_sha256": target_sha256 or hashes["target"].hexdigest(),
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


def _joined(parts: list[np.ndarray]) -> bytes:
    return np.concatenate(parts).tobytes() if parts else b""


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

    One pass, a chunk at a time: patch, hash and write each chunk of the base. The result is renamed into
    place only once its SHA-256 matches, so a wrong or corrupt delta leaves nothing at `out`.
    `base_verified=True` skips re-hashing a base the caller has already checked (a loaded version).
    """
    import zstandard

    header, offset = read_header(delta)
    old = _words(base)
    words, n_changed = header["words"], header["changed"]
    if old.size != words or (not base_verified and sha256_file(base) != header["base_sha256"]):
        raise BroadcastError(f"{base} is not the base this delta was made against")
    data = delta.read_bytes()[offset:]
    bits_len, planes_len = header["blob_bytes"]
    try:
        z = zstandard.ZstdDecompressor()
        bits = np.frombuffer(z.decompress(data[:bits_len]), np.uint8)
        planes = np.frombuffer(z.decompress(data[bits_len : bits_len + planes_len]), np.uint8)
    except zstandard.ZstdError as exc:
        raise BroadcastError(f"delta {delta} is corrupt: {exc}") from exc
    if bits.size != (words + 7) // 8 or planes.size != 2 * n_changed:
        raise BroadcastError(f"delta {delta} is inconsistent with its header")
    low, high = planes[:n_changed], planes[n_changed:]
    digest, used = hashlib.sha256(), 0
    buf, xor = np.empty(min(CHUNK_WORDS, words), np.uint16), np.empty(min(CHUNK_WORDS, words), np.uint16)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    try:
        with open(tmp, "wb") as f:
            for start in _chunks(words):
                n = min(CHUNK_WORDS, words - start)
                c = np.unpackbits(bits[start // 8 : (start + n + 7) // 8], count=n).view(bool)
                k = int(np.count_nonzero(c))
                if used + k > n_changed:
                    raise BroadcastError(f"delta {delta} is inconsistent with its header")
                x = xor[:k].view(np.uint8)
                x[0::2], x[1::2] = low[used : used + k], high[used : used + k]
                chunk = buf[:n]
                chunk[:] = old[start : start + n]
                chunk[c] ^= xor[:k]
                used += k
                digest.update(chunk.data)
                f.write(chunk.data)
        if used != n_changed:
            raise BroadcastError(f"delta {delta} is inconsistent with its header")
        got, want = digest.hexdigest(), expected_sha256 or header["target_sha256"]
        if got != want:
            raise BroadcastError(f"rebuilt version does not match its SHA-256 ({got[:12]} != {want[:12]})")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return got
