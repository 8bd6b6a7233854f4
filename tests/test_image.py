"""A version's file built in memory (broadcast/image.py): the bytes safetensors writes, the torrent's piece hashes
and the digest of the written file, whatever the tensors' dtype."""

import torch
from safetensors.torch import load_file, save_file

from echo2cli.broadcast.digest import file_digest
from echo2cli.broadcast.image import VersionImage
from echo2cli.broadcast.torrent import make_torrent, piece_size_for


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.layers.1.w": torch.randn(300, 257, generator=g),  # fp32, cast to bf16 on the way in
        "model.embed_tokens.weight": torch.randn(1000, 64, generator=g).bfloat16(),
        "a.norm": torch.randn(3, generator=g),  # an odd element count: the header is padded, the data not
    }


def test_the_image_is_the_file_safetensors_writes_and_is_written_whole(tmp_path):
    tensors = weights()
    bf16 = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
    save_file(bf16, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    image = VersionImage(tensors)
    assert image.data.tobytes() == (tmp_path / "ref.safetensors").read_bytes()
    image.write(tmp_path / "v" / "model.safetensors")
    loaded = load_file(str(tmp_path / "v" / "model.safetensors"))
    assert all(torch.equal(loaded[k], bf16[k]) for k in bf16)
    assert not list((tmp_path / "v").glob("*.tmp"))


def test_an_fp16_image_is_the_file_safetensors_writes_for_fp16(tmp_path):
    """`--wire-dtype fp16`: the same layout, an F16 header, each weight cast to fp16 (bf16 ones exactly)."""
    tensors = weights()
    fp16 = {k: v.to(torch.float16) for k, v in tensors.items()}
    save_file(fp16, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    image = VersionImage(tensors, dtype=torch.float16)
    assert image.data.tobytes() == (tmp_path / "ref.safetensors").read_bytes()
    embed = tensors["model.embed_tokens.weight"].float()
    lost = (fp16["model.embed_tokens.weight"].float() - embed).abs()
    assert lost[embed.abs() >= 2**-14].max() == 0  # bf16 values in fp16's normal range fit it exactly
    assert lost.max() <= 2**-25  # below it, half of fp16's smallest step


def test_piece_hashes_and_digest_from_memory_equal_those_of_the_written_file(tmp_path):
    image = VersionImage(weights())
    path = tmp_path / "v000001" / "model.safetensors"
    image.write(path)
    hashes = image.piece_hashes(piece_size_for(image.nbytes), workers=3)
    tracker = "http://127.0.0.1:9/announce"
    assert make_torrent(path.parent, tracker, hashes=hashes).data == make_torrent(path.parent, tracker).data
    assert image.digest(workers=2) == file_digest(path)


def test_the_direct_write_and_its_buffered_tail_and_fallback_give_the_same_file(tmp_path, monkeypatch):
    """Whole 4 KiB blocks go O_DIRECT (in blocks of WRITE_BLOCK), the tail buffered; where the filesystem refuses
    O_DIRECT (EINVAL at the open, as older tmpfs does, or at the first write) the file is written buffered. Each
    way gives safetensors' bytes and leaves no temporary file."""
    import errno
    import os

    from echo2cli.broadcast import image as image_module

    monkeypatch.setattr(image_module, "WRITE_BLOCK", 3 * image_module.ALIGN)  # several direct blocks, and a short one
    image = VersionImage(weights())
    assert image.nbytes % image_module.ALIGN and image.data.ctypes.data % image_module.ALIGN == 0
    want = image.data.tobytes()
    assert image._write_direct(tmp_path / "probe") == image.nbytes - image.nbytes % image_module.ALIGN
    image.write(tmp_path / "direct" / "model.safetensors")
    real_open = os.open

    def refuse_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    def refuse_write(fd, data, at):  # only the direct part writes with os.pwrite
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "open", refuse_open)
    image.write(tmp_path / "refused-open" / "model.safetensors")
    monkeypatch.setattr(os, "open", real_open)
    monkeypatch.setattr(os, "pwrite", refuse_write)
    image.write(tmp_path / "refused-write" / "model.safetensors")
    for name in ("direct", "refused-open", "refused-write"):
        assert (tmp_path / name / "model.safetensors").read_bytes() == want
        assert not list((tmp_path / name).glob("*.tmp"))


def test_a_full_disk_during_the_direct_write_leaves_no_file(tmp_path, monkeypatch):
    import errno
    import os

    import pytest

    image = VersionImage(weights())
    real = os.pwrite

    def full(fd, data, at):
        if at > 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, at)

    monkeypatch.setattr("echo2cli.broadcast.image.WRITE_BLOCK", 4096)
    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match="No space left"):
        image.write(tmp_path / "v" / "model.safetensors")
    assert not list((tmp_path / "v").iterdir())


def test_an_image_reuses_the_memory_of_a_finished_one_of_the_same_size_only():
    first = VersionImage(weights())
    moved = {k: v + 1 for k, v in weights().items()}
    second = VersionImage(moved, reuse=first)
    assert second.buf.data_ptr() == first.buf.data_ptr()
    assert second.data.tobytes() == VersionImage(moved).data.tobytes()  # every byte rewritten, header included
    smaller = VersionImage({"w": torch.ones(10)}, reuse=second)
    assert smaller.buf.data_ptr() != second.buf.data_ptr() and smaller.nbytes < second.nbytes
