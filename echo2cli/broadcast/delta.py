"""Delta versions: version v as a compact patch against version v-1 of the same safetensors file of 16-bit
floats (bf16 or fp16, the learner's wire dtype; the figures below are bf16's).

With a small learning rate, one optimizer step moves most bf16 weights by less than half a unit in
the last place, so they round to the same 16 bits: measured on the default model at lr 5e-5, about
5 % of the 16-bit words change per step, and 84 % of those by exactly one unit in the last place. Whether a
word changes depends mostly on its size: a step moves a small weight by more units in its last place than a
large one (P(change) ranges from under 1 % to over 30 % across exponents). So each chunk's words are visited in
order of their exponent in the base (a stable sort: file order within an exponent), which the rebuilding side
knows too, and the changed words are coded in that order: the gaps between them are short where changes are
dense and long where they are rare, which costs 28 % fewer bytes than gaps in file order (2.15 % of the
version where file order took 2.89 %, one step of the default model at lr 5e-5). The delta stores, for the
changed words in that order,

    counts   how many words change in each chunk of CHUNK_WORDS (uint32)
    gaps     unchanged words before each changed one, within its chunk (uint8; 255 = see `long`)
    long     the gaps of 255 or more (uint32)
    signs    whether the word moved down (one bit each)
    big      whether it moved by more than one step (one bit each)
    steps    how far, less 2, for the words that moved more than one step (uint16: low bytes, then high)

each zstd-compressed. A word's "position" orders bit patterns by value (+0 at 0, -0 at -1, the largest negative
at -32768; bf16 and fp16 alike, both sign and magnitude), so a step of one is one unit in the last place, also
across a power of two. For fp16 the "exponent" that orders a chunk is bits 7-14 of the word, bf16's exponent: fp16's
whole exponent and the first three bits of its mantissa, an order that still groups words by size. Gap coding
costs about the entropy of which words changed (a bitmap compressed by zstd cost a third more), and a signed
step costs ~2.3 bits a changed word where the XOR of old and new cost ~3.9, compressed (`docs/BENCHMARKS.md`,
"Delta size, encode and rebuild"). A header records the base's and the target's digests (BLAKE3, digest.py);
`apply_delta` refuses a base with the wrong digest, checks every stream against the header, and checks the rebuilt
file against the target's digest before it is renamed into place, so a version is never half-built or wrong.
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from echo2cli.broadcast import kernels
from echo2cli.broadcast.digest import file_digest, memory_digest
from echo2cli.broadcast.torrent import spare_cores
from echo2cli.errors import BroadcastError
from echo2cli.hardware import keep_freed_memory

MAGIC = b"ECHO2DELTA4\n"
STREAMS = ("counts", "gaps", "long", "signs", "big", "steps")

CHUNK_WORDS = 1 << 18  # words per pass (512 KB of each file)
LONG_GAP = 255  # a gap this long or longer is in `long`


def _words(path: Path) -> np.ndarray:
    """The file as 16-bit words, mapped rather than read: each pass touches a chunk at a time (a 135 M-word file
    read whole, then compared, indexed and XORed whole, made the encode 2.3x slower: scripts/bench_delta.py)."""
    size = path.stat().st_size
    if size % 2:
        raise BroadcastError(f"{path} has an odd length: not a safetensors file of 16-bit weights")
    return np.memmap(path, dtype=np.uint16, mode="r") if size else np.zeros(0, np.uint16)


def _chunks(n: int) -> range:
    return range(0, n, CHUNK_WORDS)


def _encode_chunk(a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    """One chunk's part of each stream (before the bit packing and the byte planes)."""
    idx, step = kernels.changes_in_visit_order(a, b)  # the changed words' places in the visit order, their steps
    gaps = np.diff(idx, prepend=-1) - 1
    size = np.abs(step)
    return {
        "counts": np.array([idx.size], np.uint32),
        "gaps": np.minimum(gaps, LONG_GAP).astype(np.uint8),
        "long": gaps[gaps >= LONG_GAP].astype(np.uint32),
        "signs": step < 0,
        "big": size > 1,
        "steps": (size[size > 1] - 2).astype(np.uint16),
    }


def encode_delta(
    base: Path,
    target: Path | np.ndarray,
    out: Path,
    *,
    base_digest: str = "",
    target_digest: str = "",
    level: int = 3,
    workers: int | None = None,
) -> dict:
    """Write the delta that turns `base` into `target` (a file, or its bytes as 16-bit words in memory: the
    publisher's `VersionImage.words`); returns its header (sizes, hashes).

    Pass the files' digests if already known (the publisher has them) to skip hashing them again. The chunks
    are coded on `workers` threads (default: `spare_cores()`; the compiled kernels and numpy release the
    GIL) and joined in file order, so the delta is the same bytes whatever the thread count.
    """
    import zstandard

    keep_freed_memory()
    old, new = _words(base), target if isinstance(target, np.ndarray) else _words(target)
    if old.size != new.size:
        raise BroadcastError("base and target differ in size: a delta needs the same tensor layout")
    workers = workers or spare_cores()
    base_digest = base_digest or file_digest(base, workers)
    if not target_digest:
        target_digest = file_digest(target, workers) if isinstance(target, Path) else memory_digest(new, workers)
    with ThreadPoolExecutor(workers, thread_name_prefix="delta") as pool:
        coded = list(pool.map(lambda at: _encode_chunk(old[at : at + CHUNK_WORDS], new[at : at + CHUNK_WORDS]),
                              _chunks(new.size)))  # fmt: skip
    parts = {name: [c[name] for c in coded] for name in STREAMS}
    del coded
    streams = {name: np.concatenate(p) if p else np.zeros(0, np.uint8) for name, p in parts.items()}
    streams["signs"], streams["big"] = np.packbits(streams["signs"]), np.packbits(streams["big"])
    steps = streams["steps"].astype(np.uint16).view(np.uint8)
    streams["steps"] = np.concatenate([steps[0::2], steps[1::2]])  # low bytes, then high bytes (mostly 0)
    z = zstandard.ZstdCompressor(level=level, threads=workers)  # threads >= 1: the same frames for any count
    blobs = [z.compress(streams[name].tobytes()) for name in STREAMS]
    header = {
        "words": int(new.size),
        "chunk_words": CHUNK_WORDS,
        "changed": int(streams["gaps"].size),
        "blob_bytes": [len(b) for b in blobs],
        "base_digest": base_digest,
        "target_digest": target_digest,
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
    """The delta's JSON header and where its streams start; BroadcastError for anything but a JSON object whose
    length field fits the file (the learner that wrote it may be hostile)."""
    with open(delta, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise BroadcastError(f"{delta} is not an echo2 delta of this version (ECHO2DELTA4)")
        size = f.read(4)
        (n,) = struct.unpack("<I", size) if len(size) == 4 else (-1,)
        raw = f.read(n) if n >= 0 else b""
        if n < 0 or len(raw) != n:
            raise BroadcastError(f"delta {delta} is truncated in its header")
        try:
            header = json.loads(raw)
        except ValueError as exc:  # UnicodeDecodeError too
            raise BroadcastError(f"delta {delta} has a corrupt header") from exc
        if not isinstance(header, dict):
            raise BroadcastError(f"delta {delta} has a corrupt header: a JSON {type(header).__name__}, not an object")
        return header, len(MAGIC) + 4 + n


def _streams(delta: Path, header: dict, offset: int) -> dict[str, np.ndarray]:
    """The six streams, decompressed and checked against the header and each other."""
    import zstandard

    dtypes = {"counts": np.uint32, "long": np.uint32}
    sizes, words = header.get("blob_bytes"), header["words"]
    data, streams, at = delta.read_bytes()[offset:], {}, 0
    if (
        not isinstance(sizes, list)
        or len(sizes) != len(STREAMS)
        or not all(type(size) is int and size >= 0 for size in sizes)
        or sum(sizes) != len(data)
        or header.get("chunk_words") != CHUNK_WORDS
    ):
        raise BroadcastError(f"delta {delta} is inconsistent with its header")
    # no stream of a delta against `words` words decompresses to more than 4 bytes a word: a frame that claims
    # more (a decompression bomb) is refused before its memory is taken
    limit = 4 * words + 64
    try:
        z = zstandard.ZstdDecompressor()
        for name, size in zip(STREAMS, sizes, strict=True):
            with z.stream_reader(data[at : at + size]) as reader:
                raw = reader.read(limit + 1)
            if len(raw) > limit:
                raise BroadcastError(f"delta {delta} is inconsistent with its header")
            at += size
            dtype = dtypes.get(name, np.uint8)
            if len(raw) % np.dtype(dtype).itemsize:
                raise BroadcastError(f"delta {delta} is inconsistent with its header")
            streams[name] = np.frombuffer(raw, dtype)
    except zstandard.ZstdError as exc:
        raise BroadcastError(f"delta {delta} is corrupt: {exc}") from exc
    n, counts = header.get("changed"), streams["counts"]
    consistent = (
        isinstance(n, int)
        and counts.size == len(_chunks(header["words"]))
        and int(counts.sum(dtype=np.int64)) == n == streams["gaps"].size
        and streams["long"].size == int(np.count_nonzero(streams["gaps"] == LONG_GAP))
        and streams["signs"].size == streams["big"].size == (n + 7) // 8
    )
    if consistent:
        streams["signs"] = np.unpackbits(streams["signs"], count=n).view(bool)
        streams["big"] = np.unpackbits(streams["big"], count=n).view(bool)
        planes = streams["steps"]
        consistent = planes.size == 2 * int(np.count_nonzero(streams["big"]))
        half = planes.size // 2
        streams["steps"] = planes[:half].astype(np.int32) | planes[half:].astype(np.int32) << 8
    if not consistent:
        raise BroadcastError(f"delta {delta} is inconsistent with its header")
    return streams


def apply_delta(
    base: Path,
    delta: Path,
    out: Path,
    expected_digest: str | None = None,
    *,
    base_verified: bool = False,
    workers: int | None = None,
) -> str:
    """Rebuild the target from `base` + `delta` into `out`; returns its digest (verified).

    Each chunk is patched and written at its place in the file by one of `workers` threads (default:
    `spare_cores()`); the file's digest is then computed on as many. The result is renamed into place only once its
    digest matches, so a wrong or corrupt delta leaves nothing at `out`. `base_verified=True` skips re-hashing a
    base the caller has already checked (a loaded version).
    """
    header, offset = read_header(delta)
    keep_freed_memory()
    workers = workers or spare_cores()
    old = _words(base)
    words = header.get("words")
    if (
        not isinstance(words, int)
        or old.size != words
        or (not base_verified and file_digest(base, workers) != header.get("base_digest"))
    ):
        raise BroadcastError(f"{base} is not the base this delta was made against")
    patch = _Patcher(old, _streams(delta, header, offset), delta)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:

            def write(k: int) -> None:
                data, at = patch(k).data.cast("B"), 2 * patch.starts[k]
                while data:
                    done = os.pwrite(fd, data, at)
                    data, at = data[done:], at + done

            with ThreadPoolExecutor(workers, thread_name_prefix="rebuild") as pool:
                list(pool.map(write, range(len(patch.starts))))
        finally:
            os.close(fd)
        got, want = file_digest(tmp, workers), expected_digest or header.get("target_digest")
        if got != want:
            raise BroadcastError(f"rebuilt version does not match its digest ({got[:12]} != {str(want)[:12]})")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return got


class _Patcher:
    """Chunk k of the target from the base's chunk k and the streams; chunks are independent (each knows where
    its changes start in every stream), so any number of threads can patch them at once."""

    def __init__(self, old: np.ndarray, s: dict[str, np.ndarray], delta: Path) -> None:
        self.old, self.s, self.delta = old, s, delta
        self.starts = list(_chunks(old.size))
        counts: np.ndarray = s["counts"].astype(np.int64)
        self.used = np.concatenate([[0], np.cumsum(counts)])  # chunk k's changes: used[k] .. used[k + 1]
        self.used_long = self._offsets(s["gaps"] == LONG_GAP)  # chunk k's long gaps: used_long[k] .. [k + 1]
        self.used_big = self._offsets(s["big"])

    def _offsets(self, flags: np.ndarray) -> np.ndarray:
        """Where each chunk's part of a stream with one entry per set flag starts (per-chunk counts, then their
        cumulative sum: a cumulative sum over every changed word took a second at 1.2 GB)."""
        padded = np.concatenate([flags.view(np.uint8), np.zeros(1, np.uint8)])  # every chunk's start is an index
        per_chunk = np.add.reduceat(padded, self.used[:-1], dtype=np.int64)
        per_chunk[self.used[1:] == self.used[:-1]] = 0  # reduceat gives an empty chunk one item, not none
        return np.concatenate([[0], np.cumsum(per_chunk)]).astype(np.int64)

    def __call__(self, k: int) -> np.ndarray:
        s, start = self.s, self.starts[k]
        n = min(CHUNK_WORDS, self.old.size - start)
        base = self.old[start : start + n]
        lo, hi = int(self.used[k]), int(self.used[k + 1])
        chunk = np.array(base)  # a copy in memory, patched below
        if hi == lo:
            return chunk
        gaps: np.ndarray = s["gaps"][lo:hi].astype(np.int64)
        long = gaps == LONG_GAP
        gaps[long] = s["long"][int(self.used_long[k]) : int(self.used_long[k + 1])]
        visited = np.cumsum(gaps + 1) - 1  # positions in the chunk's visit order
        if visited[-1] >= n:
            raise BroadcastError(f"delta {self.delta} is inconsistent with its header")
        big = s["big"][lo:hi]
        steps: np.ndarray = np.ones(hi - lo, np.int32)
        steps[big] = s["steps"][int(self.used_big[k]) : int(self.used_big[k + 1])] + 2
        steps[s["signs"][lo:hi]] *= -1
        if not kernels.patch(chunk, visited, steps):
            raise BroadcastError(f"delta {self.delta} is inconsistent with its header")
        return chunk
