"""The version digest (broadcast/digest.py): BLAKE3 against the official test vectors, the same on any thread count,
and one corrupted chunk anywhere in a version caught."""

import pytest

from echo2cli.broadcast.digest import file_digest, hasher

# BLAKE3's official vectors (test_vectors.json in the BLAKE3 repository): input byte i is i % 251.
VECTORS = {
    0: "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262",
    102400: "bc3e3d41a1146b069abffad3c0d44860cf664390afce4d9661f7902e7943e085",
}


def vector_input(n: int) -> bytes:
    return bytes(i % 251 for i in range(n))


@pytest.mark.parametrize("n", sorted(VECTORS))
@pytest.mark.parametrize("workers", [1, 4])
def test_the_file_digest_is_blake3_on_any_thread_count(tmp_path, n, workers):
    path = tmp_path / "v"
    path.write_bytes(vector_input(n))
    assert file_digest(path, workers) == VECTORS[n]


def test_an_incremental_digest_in_chunks_equals_the_file_digest(tmp_path):
    data = vector_input(102400)
    h = hasher(workers=2)
    for at in range(0, len(data), 4096):
        h.update(data[at : at + 4096])
    assert h.hexdigest() == VECTORS[102400]


def test_one_corrupted_chunk_anywhere_changes_the_digest(tmp_path):
    data = bytearray(vector_input(1 << 22))  # 4 MiB: 4,096 BLAKE3 chunks, hashed on several threads
    path = tmp_path / "v"
    path.write_bytes(bytes(data))
    good = file_digest(path, 4)
    for at in (0, 1 << 21, (1 << 22) - 1):  # the first chunk, one in the middle of the tree, the last byte
        bad = bytearray(data)
        bad[at] ^= 0x01
        path.write_bytes(bytes(bad))
        assert file_digest(path, 4) != good
