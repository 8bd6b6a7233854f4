import numpy as np
import pytest

from echo2cli.broadcast.delta import apply_delta, encode_delta
from echo2cli.broadcast.torrent import sha256_file
from echo2cli.errors import BroadcastError


@pytest.fixture
def versions(tmp_path):
    """Two 'bf16 files' of 1 M words where ~5 % of the words change by a unit in the last place."""
    rng = np.random.default_rng(0)
    old = rng.integers(0x3C00, 0x3D00, size=1 << 20, dtype=np.uint16)
    new = old.copy()
    idx = rng.choice(old.size, size=old.size // 20, replace=False)
    new[idx] += rng.choice(np.array([1, 0xFFFF], dtype=np.uint16), size=idx.size)
    base, target = tmp_path / "v1.safetensors", tmp_path / "v2.safetensors"
    old.tofile(base)
    new.tofile(target)
    return base, target


def test_delta_rebuilds_the_exact_file_and_is_small(versions, tmp_path):
    base, target = versions
    header = encode_delta(base, target, tmp_path / "d" / "model.delta")
    assert header["changed"] == (1 << 20) // 20
    assert header["delta_bytes"] < 0.1 * header["full_bytes"]
    out = tmp_path / "rebuilt" / "model.safetensors"
    digest = apply_delta(base, tmp_path / "d" / "model.delta", out, expected_sha256=sha256_file(target))
    assert digest == sha256_file(out) == sha256_file(target)


def test_delta_refuses_a_different_base(versions, tmp_path):
    base, target = versions
    encode_delta(base, target, tmp_path / "model.delta")
    other = tmp_path / "other"
    other.write_bytes(target.read_bytes())
    with pytest.raises(BroadcastError, match="not the base"):
        apply_delta(other, tmp_path / "model.delta", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_rebuilt_file_with_the_wrong_hash_is_never_written(versions, tmp_path):
    base, target = versions
    encode_delta(base, target, tmp_path / "model.delta")
    with pytest.raises(BroadcastError, match="SHA-256"):
        apply_delta(base, tmp_path / "model.delta", tmp_path / "out", expected_sha256="0" * 64)
    assert not (tmp_path / "out").exists()


def test_corrupt_delta_is_an_error_not_a_crash(versions, tmp_path):
    base, target = versions
    encode_delta(base, target, tmp_path / "model.delta")
    data = bytearray((tmp_path / "model.delta").read_bytes())
    data[-100:] = b"\0" * 100
    (tmp_path / "model.delta").write_bytes(bytes(data))
    with pytest.raises(BroadcastError):
        apply_delta(base, tmp_path / "model.delta", tmp_path / "out")
    (tmp_path / "junk").write_bytes(b"not a delta")
    with pytest.raises(BroadcastError, match="not an echo2 delta"):
        apply_delta(base, tmp_path / "junk", tmp_path / "out")


def test_delta_needs_the_same_layout(tmp_path):
    (tmp_path / "a").write_bytes(b"\0" * 8)
    (tmp_path / "b").write_bytes(b"\0" * 10)
    with pytest.raises(BroadcastError, match="size"):
        encode_delta(tmp_path / "a", tmp_path / "b", tmp_path / "d")


def test_chunked_passes_match_a_whole_file_xor(tmp_path, monkeypatch):
    """Chunks of 64 words over a file of 1,003 words (not a multiple of 8 or of the chunk): same bitmap and XOR
    bytes as computing them over the whole file at once, and the rebuild is exact."""
    import zstandard

    from echo2cli.broadcast import delta as delta_module

    monkeypatch.setattr(delta_module, "CHUNK_WORDS", 64)
    rng = np.random.default_rng(1)
    old = rng.integers(0, 1 << 16, size=1003, dtype=np.uint16)
    new = old.copy()
    new[rng.choice(old.size, 90, replace=False)] ^= 3
    new[-1] ^= 1  # the last, partial chunk changes too
    old.tofile(base := tmp_path / "a")
    new.tofile(target := tmp_path / "b")
    header = encode_delta(base, target, tmp_path / "d")
    _, offset = delta_module.read_header(tmp_path / "d")
    data = (tmp_path / "d").read_bytes()[offset:]
    z = zstandard.ZstdDecompressor()
    bits, planes = z.decompress(data[: header["blob_bytes"][0]]), z.decompress(data[header["blob_bytes"][0] :])
    changed = old != new
    assert bits == np.packbits(changed).tobytes()
    assert planes == np.ascontiguousarray((old[changed] ^ new[changed]).view(np.uint8).reshape(-1, 2).T).tobytes()
    assert apply_delta(base, tmp_path / "d", tmp_path / "out") == sha256_file(target)
    assert (tmp_path / "out").read_bytes() == target.read_bytes()


def test_a_delta_whose_bitmap_disagrees_with_its_header_is_refused(versions, tmp_path):
    """A hostile delta: valid zstd, header sizes right, but its bitmap marks one word more than it carries."""
    import json
    import struct

    import zstandard

    from echo2cli.broadcast.delta import MAGIC, read_header

    base, target = versions
    encode_delta(base, target, tmp_path / "d")
    header, offset = read_header(tmp_path / "d")
    data = (tmp_path / "d").read_bytes()[offset:]
    z = zstandard.ZstdDecompressor()
    bits = bytearray(z.decompress(data[: header["blob_bytes"][0]]))
    bits[bits.index(0)] = 1  # one more changed word, no XOR value for it
    blobs = [zstandard.ZstdCompressor().compress(bytes(bits)), data[header["blob_bytes"][0] :]]
    header["blob_bytes"] = [len(b) for b in blobs]
    raw = json.dumps(header).encode()
    (tmp_path / "bad").write_bytes(MAGIC + struct.pack("<I", len(raw)) + raw + b"".join(blobs))
    with pytest.raises(BroadcastError, match="inconsistent"):
        apply_delta(base, tmp_path / "bad", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()
