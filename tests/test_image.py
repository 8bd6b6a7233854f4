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


def test_piece_hashes_and_digest_from_memory_equal_those_of_the_written_file(tmp_path):
    image = VersionImage(weights())
    path = tmp_path / "v000001" / "model.safetensors"
    image.write(path)
    hashes = image.piece_hashes(piece_size_for(image.nbytes), workers=3)
    tracker = "http://127.0.0.1:9/announce"
    assert make_torrent(path.parent, tracker, hashes=hashes).data == make_torrent(path.parent, tracker).data
    assert image.digest(workers=2) == file_digest(path)
