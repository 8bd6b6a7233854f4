"""A version's file built in host memory: the safetensors header and every tensor in the run's wire dtype (bf16 or
fp16, 2 bytes a weight), in the file's layout.

The learner's snapshot of its weights is this image: each tensor is cast and copied straight to its place in one
buffer (pinned on a CUDA learner, so the device-to-host copies run asynchronously, all behind one synchronize).
The publisher then writes the file from it on one thread while the piece hashes, the digest and the delta are
computed from the same memory on the others, instead of writing first and reading the file back for each.

The file is written with O_DIRECT where the filesystem takes it: the disk's DMA reads the buffer (page-aligned
for that), where a buffered write spends a core copying 1–16 GB into the page cache, a core the hashes and the
delta need (an encode beside a buffered write took 1.4x its time beside a direct one: docs/BENCHMARKS.md).

The bytes are those of `safetensors.torch.save_file(tensors, metadata={"format": "pt"})` for tensors of that dtype
(tests/test_image.py): the tensors sorted by name, the JSON header padded with spaces to a multiple of 8.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

WRITE_BLOCK = 64 << 20  # bytes per write call
ALIGN = 4096  # what O_DIRECT asks of a write's memory, offset and length
WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # what a version's weights may travel in
SAFETENSORS_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16"}


def wire_name(dtype: torch.dtype) -> str:
    """'bf16' or 'fp16': a wire dtype's name in options and configs."""
    return next(name for name, d in WIRE_DTYPES.items() if d == dtype)


def _header(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[bytes, dict[str, int]]:
    """The file's first bytes (length, JSON header, padding) and each tensor's offset after them."""
    entries: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offsets, at = {}, 0
    for name in sorted(tensors):
        n = tensors[name].numel() * 2
        entries[name] = {
            "dtype": SAFETENSORS_NAMES[dtype],
            "shape": list(tensors[name].shape),
            "data_offsets": [at, at + n],
        }
        offsets[name], at = at, at + n
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets


class VersionImage:
    """One version's safetensors file in memory (`data`: bytes; `words`: the same bytes as 16-bit words)."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], reuse: VersionImage | None = None, dtype: torch.dtype = torch.bfloat16
    ) -> None:
        """Copy `tensors` (any device, any floating dtype; cast to `dtype`, bf16 or fp16) into a new image.
        `reuse`: an image nobody needs any more (the learner's last version, once announced) whose memory this one
        takes over where the sizes match: refilling mapped memory took 0.2 s for 1.19 GB on one core where a fresh
        buffer took 1.2-2 s, mostly page faults (docs/BENCHMARKS.md)."""
        header, offsets = _header(tensors, dtype)
        size = len(header) + 2 * sum(t.numel() for t in tensors.values())
        cuda = any(t.is_cuda for t in tensors.values())
        self.buf: torch.Tensor
        if reuse is not None and reuse.nbytes == size and reuse.buf.is_pinned() == cuda:
            self.buf = reuse.buf
        elif cuda:  # page-locked, so the device-to-host copies are asynchronous (and page-aligned)
            self.buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        else:  # torch's allocator (faster to fill than a fresh mmap here), page-aligned for the direct write
            raw = torch.empty(size + ALIGN, dtype=torch.uint8)
            skip = -raw.data_ptr() % ALIGN
            self.buf = raw[skip : skip + size]
        self.buf[: len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        for name, t in tensors.items():
            at = len(header) + offsets[name]
            place = self.buf[at : at + 2 * t.numel()].view(dtype).view(t.shape)
            place.copy_(t.detach(), non_blocking=cuda)  # cast on the tensor's device, then one copy to the host
        if cuda:
            torch.cuda.synchronize()
        self.data: np.ndarray = self.buf.numpy()

    @property
    def nbytes(self) -> int:
        return int(self.data.size)

    @property
    def words(self) -> np.ndarray:
        return self.data.view(np.uint16)

    def write(self, path: Path) -> None:
        """The file at `path`, whole or not at all (a full disk leaves no half file)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        try:
            done = self._write_direct(tmp)
            with open(tmp, "r+b" if done else "wb") as f:  # the rest (all of it where O_DIRECT is refused)
                f.seek(done)
                view = self.data.data
                for at in range(done, self.nbytes, WRITE_BLOCK):
                    f.write(view[at : at + WRITE_BLOCK])
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _write_direct(self, tmp: Path) -> int:
        """Write the whole 4 KiB blocks of the image to `tmp` with O_DIRECT; returns how many bytes it wrote (0
        where the filesystem (tmpfs), the platform or the buffer's alignment does not allow it)."""
        whole = self.nbytes - self.nbytes % ALIGN
        if not hasattr(os, "O_DIRECT") or whole == 0 or self.data.ctypes.data % ALIGN:
            return 0
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return 0
            raise
        view, at = self.data.data, 0
        try:
            while at < whole:
                at += os.pwrite(fd, view[at : min(at + WRITE_BLOCK, whole)], at)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            return 0  # refused (a filesystem that opens but does not write O_DIRECT): written buffered instead
        finally:
            os.close(fd)
        return whole

    def piece_hashes(self, piece_size: int, workers: int) -> list[bytes]:
        """SHA-1 of each `piece_size` piece of the file (a one-file v1 torrent's pieces), `workers` at a time."""
        import hashlib

        view = self.data.data
        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="hash") as pool:
            return list(pool.map(lambda at: hashlib.sha1(view[at : at + piece_size]).digest(),
                                 range(0, self.nbytes, piece_size)))  # fmt: skip

    def digest(self, workers: int) -> str:
        """The file's digest (`digest.py`), on `workers` threads."""
        from echo2cli.broadcast.digest import memory_digest

        return memory_digest(self.data, workers)
