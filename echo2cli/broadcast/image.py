"""A version's file built in host memory: the safetensors header and every tensor in bf16, in the file's layout.

The learner's snapshot of its weights is this image: each tensor is cast and copied straight to its place in one
buffer (pinned on a CUDA learner, so the device-to-host copies run asynchronously, all behind one synchronize).
The publisher then writes the file from it on one thread while the piece hashes, the digest and the delta are
computed from the same memory on the others, instead of writing first and reading the file back for each.

The bytes are those of `safetensors.torch.save_file(tensors, metadata={"format": "pt"})` for bf16 tensors
(tests/test_image.py): the tensors sorted by name, the JSON header padded with spaces to a multiple of 8.
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

WRITE_BLOCK = 64 << 20  # bytes per write call


def _header(tensors: dict[str, torch.Tensor]) -> tuple[bytes, dict[str, int]]:
    """The file's first bytes (length, JSON header, padding) and each tensor's offset after them."""
    entries: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offsets, at = {}, 0
    for name in sorted(tensors):
        n = tensors[name].numel() * 2
        entries[name] = {"dtype": "BF16", "shape": list(tensors[name].shape), "data_offsets": [at, at + n]}
        offsets[name], at = at, at + n
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets


class VersionImage:
    """One version's safetensors file in memory (`data`: bytes; `words`: the same bytes as 16-bit words)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy `tensors` (any device, any floating dtype; cast to bf16) into a new image."""
        header, offsets = _header(tensors)
        size = len(header) + 2 * sum(t.numel() for t in tensors.values())
        cuda = any(t.is_cuda for t in tensors.values())
        self.buf = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
        self.buf[: len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        for name, t in tensors.items():
            at = len(header) + offsets[name]
            place = self.buf[at : at + 2 * t.numel()].view(torch.bfloat16).view(t.shape)
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
            with open(tmp, "wb") as f:
                view = self.data.data
                for at in range(0, self.nbytes, WRITE_BLOCK):
                    f.write(view[at : at + WRITE_BLOCK])
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

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
