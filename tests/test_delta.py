from pathlib import Path

import numpy as np
import pytest

from echo2cli.broadcast.delta import CHUNK_WORDS, apply_delta, encode_delta
from echo2cli.broadcast.digest import file_digest
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
    digest = apply_delta(base, tmp_path / "d" / "model.delta", out, expected_digest=file_digest(target))
    assert digest == file_digest(out) == file_digest(target)


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
    with pytest.raises(BroadcastError, match="does not match its digest"):
        apply_delta(base, tmp_path / "model.delta", tmp_path / "out", expected_digest="0" * 64)
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


def test_every_kind_of_change_rebuilds_exactly_across_chunks(tmp_path, monkeypatch):
    """Chunks of 512 words over a file of 2,003 (the last chunk partial): one-step moves, arbitrary new words
    (sign flips, other exponents), +0 <-> -0, the extremes, a run of unchanged words longer than a gap byte holds,
    and a change in the last word. The base's words share one exponent but for four, so words are visited in file
    order (`visit_order`) and unchanged runs make gaps."""
    from echo2cli.broadcast import delta as delta_module
    from echo2cli.broadcast import kernels

    monkeypatch.setattr(delta_module, "CHUNK_WORDS", 512)
    rng = np.random.default_rng(1)
    signs = rng.integers(0, 2, size=2003, dtype=np.uint16) << 15
    old = signs | 0x3F00 | rng.integers(0, 1 << 7, size=2003, dtype=np.uint16)
    old[[10, 11, 12, 13]] = [0x0000, 0x8000, 0x7FFF, 0xFFFF]
    new = old.copy()
    new[[10, 11, 12, 13]] = [0x8000, 0x0000, 0xFFFF, 0x7FFF]
    small = rng.choice(np.arange(20, 500), 60, replace=False)
    new[small] = kernels.from_position(kernels.position(old[small]).clip(-32767, 32766) + 1)
    new[rng.choice(np.arange(1200, 1500), 30, replace=False)] = rng.integers(0, 1 << 16, 30, dtype=np.uint16)
    new[-1] ^= 1  # words 500-1199 and 1500-2001 do not change: gaps of 255 and more, in and across chunks
    old.tofile(base := tmp_path / "a")
    new.tofile(target := tmp_path / "b")
    header = encode_delta(base, target, tmp_path / "d")
    assert header["changed"] == int(np.count_nonzero(old != new))
    streams = delta_module._streams(tmp_path / "d", *delta_module.read_header(tmp_path / "d"))
    assert streams["long"].size > 0 and streams["steps"].size > 0 and streams["counts"].tolist()[1:3] == [0, 30]
    assert apply_delta(base, tmp_path / "d", tmp_path / "out") == file_digest(target)
    assert (tmp_path / "out").read_bytes() == target.read_bytes()


def test_words_are_visited_by_exponent_and_a_delta_of_mixed_exponents_rebuilds(tmp_path):
    from echo2cli.broadcast.kernels import visit_order

    words = np.array([0x4000, 0x3F80, 0xBF81, 0x3C00, 0x3F82], np.uint16)  # exponents 128, 127, 127, 120, 127
    assert visit_order(words).tolist() == [3, 1, 2, 4, 0]
    rng = np.random.default_rng(2)
    old = rng.integers(0, 1 << 16, size=5000, dtype=np.uint16)
    new = old.copy()
    new[rng.choice(5000, 400, replace=False)] ^= 1
    old.tofile(base := tmp_path / "a")
    new.tofile(target := tmp_path / "b")
    encode_delta(base, target, tmp_path / "d")
    assert apply_delta(base, tmp_path / "d", tmp_path / "out") == file_digest(target)


def test_position_orders_bf16_by_value_and_round_trips():
    from echo2cli.broadcast.kernels import from_position, position

    words = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    pos = position(words)
    assert (from_position(pos) == words).all() and np.unique(pos).size == 1 << 16
    assert pos.min() == -(1 << 15) and pos.max() == (1 << 15) - 1
    values = (words.astype(np.uint32) << 16).view(np.float32)
    order = np.argsort(pos)
    ordered = values[order][~np.isnan(values[order])]
    assert (np.diff(ordered) >= 0).all()  # one step up in position is one unit in the last place up in value


def test_a_delta_whose_streams_disagree_with_its_header_is_refused(versions, tmp_path):
    """Hostile deltas: valid zstd, but the header's count is off by one, or the gaps run past their chunk."""
    import json
    import struct

    import zstandard

    from echo2cli.broadcast.delta import MAGIC, STREAMS, read_header

    base, target = versions
    encode_delta(base, target, tmp_path / "d")
    header, offset = read_header(tmp_path / "d")
    data = (tmp_path / "d").read_bytes()[offset:]
    ends = np.cumsum(header["blob_bytes"])
    blobs = [data[end - size : end] for end, size in zip(ends, header["blob_bytes"], strict=True)]

    def write(header: dict, blobs: list[bytes]) -> Path:
        raw = json.dumps(header | {"blob_bytes": [len(b) for b in blobs]}).encode()
        (tmp_path / "bad").write_bytes(MAGIC + struct.pack("<I", len(raw)) + raw + b"".join(blobs))
        return tmp_path / "bad"

    gaps = STREAMS.index("gaps")
    long_gaps = bytearray(zstandard.ZstdDecompressor().decompress(blobs[gaps]))
    long_gaps[:2000] = b"\xfe" * 2000  # 2,000 gaps of 254 reach past the first chunk
    for bad in (
        write(header | {"changed": header["changed"] + 1}, blobs),
        write(header, [*blobs[:gaps], zstandard.ZstdCompressor().compress(bytes(long_gaps)), *blobs[gaps + 1 :]]),
    ):
        with pytest.raises(BroadcastError, match="inconsistent"):
            apply_delta(base, bad, tmp_path / "out")
        assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_a_step_reports_the_newest_delta_written_not_the_one_still_encoding():
    """The version a step publishes is encoded in the background after the step is recorded: the step's metrics
    carry the newest delta already written (before, they looked up the one still encoding and never found it)."""
    from echo2cli.learner.records import delta_metrics

    assert delta_metrics({}) == {}
    stats = {v: {"delta_bytes": 3.0 * v, "full_bytes": 100.0, "encode_s": 0.5} for v in (1, 2)}
    assert delta_metrics(stats) == {"bcast/delta_version": 2, "bcast/delta_ratio": 0.06, "bcast/delta_encode_s": 0.5}


def test_threads_code_the_same_delta_bytes_and_rebuild_the_same_file(tmp_path):
    """Chunks coded and patched on several threads: the delta is the one-thread delta byte for byte, and the
    rebuild is exact, across chunks with no change, with only long gaps, with big steps, and a short last one."""
    rng = np.random.default_rng(1)
    words = 5 * (1 << 18) + 1234
    old = rng.integers(0x3C00, 0x3D00, size=words, dtype=np.uint16)
    new = old.copy()
    dense = rng.choice(1 << 18, size=5000, replace=False)  # chunk 0: dense changes of one unit
    new[dense] += 1
    sparse = (1 << 19) + rng.choice(1 << 18, size=40, replace=False)  # chunk 2: gaps of 255 or more
    new[sparse] -= 1
    big = (3 << 18) + rng.choice(1 << 18, size=3000, replace=False)  # chunk 3: steps of 2-300 either way
    new[big] += rng.integers(-300, 300, size=big.size).astype(np.uint16)
    new[-7:] ^= 1  # the short last chunk; chunks 1 and 4 unchanged
    base, target = tmp_path / "v1", tmp_path / "v2"
    old.tofile(base)
    new.tofile(target)
    encode_delta(base, target, tmp_path / "one.delta", workers=1)
    encode_delta(base, target, tmp_path / "four.delta", workers=4)
    assert (tmp_path / "one.delta").read_bytes() == (tmp_path / "four.delta").read_bytes()
    for workers in (1, 4):
        out = tmp_path / f"rebuilt{workers}"
        assert apply_delta(base, tmp_path / "four.delta", out, workers=workers) == file_digest(target)
        assert out.read_bytes() == target.read_bytes()


def test_a_delta_whose_last_chunks_are_unchanged_rebuilds_and_one_from_memory_is_the_same_bytes(tmp_path):
    """Long gaps and big steps in the first chunk only, then unchanged chunks to the end of the file (each chunk's
    start in the long-gap and step streams is then the stream's end); and the target given as words in memory
    (the publisher's image) codes the delta the file codes."""
    rng = np.random.default_rng(2)
    old = rng.integers(0x3C00, 0x3D00, size=3 * (1 << 18) + 99, dtype=np.uint16)
    new = old.copy()
    new[rng.choice(1 << 18, size=50, replace=False)] += rng.integers(2, 300, size=50).astype(np.uint16)
    base, target = tmp_path / "v1", tmp_path / "v2"
    old.tofile(base)
    new.tofile(target)
    header = encode_delta(base, target, tmp_path / "file.delta", workers=2)
    encode_delta(base, new, tmp_path / "memory.delta", workers=2)
    assert header["changed"] == 50
    assert (tmp_path / "file.delta").read_bytes() == (tmp_path / "memory.delta").read_bytes()
    assert apply_delta(base, tmp_path / "memory.delta", tmp_path / "out", workers=2) == file_digest(target)
    assert (tmp_path / "out").read_bytes() == target.read_bytes()


@pytest.mark.parametrize("n", [0, 1, 7, 5000, CHUNK_WORDS])
@pytest.mark.parametrize("changed_frac", [0.0, 0.05, 1.0])
@pytest.mark.parametrize("compiled", [True, False])
def test_the_kernels_agree_with_the_visit_order_word_for_word(n, changed_frac, compiled):
    """kernels.py's counting sorts (compiled, and the numpy fallback) against `visit_order` (numpy's stable
    argsort), on every exponent and the bf16 words a model has, with none, some and all words changed."""
    from echo2cli.broadcast import kernels

    changes = kernels.changes_in_visit_order if compiled else kernels._changes_numpy
    patch = kernels.patch if compiled else kernels._patch_numpy
    assert kernels.COMPILED  # numba is a dependency
    rng = np.random.default_rng(n)
    weights = (rng.standard_normal(n).astype(np.float32) * 0.02).view(np.uint32) >> 16
    a = np.where(rng.random(n) < 0.5, weights, rng.integers(0, 1 << 16, n)).astype(np.uint16)
    b = a.copy()
    changed = rng.random(n) < changed_frac
    b[changed] ^= rng.integers(1, 1 << 16, int(changed.sum())).astype(np.uint16)
    order = kernels.visit_order(a)
    places, steps = changes(a, b)
    assert places.tolist() == np.flatnonzero((a != b)[order]).tolist()
    at = order[places]
    assert steps.tolist() == (kernels.position(b[at]) - kernels.position(a[at])).tolist()
    some = np.sort(rng.choice(n, n // 3, replace=False)) if n else np.zeros(0, np.int64)
    moves = rng.integers(-3, 4, some.size).astype(np.int32)
    inside = (kernels.position(a[order[some]]) + moves).clip(-0x8000, 0x7FFF) - kernels.position(a[order[some]])
    patched, want = a.copy(), a.copy()
    want[order[some]] = kernels.from_position(kernels.position(a[order[some]]) + inside)
    assert patch(patched, some, inside.astype(np.int32)) and patched.tolist() == want.tolist()
    if n:  # a step past the largest bf16 pattern is refused, not wrapped
        top = np.array([0x7FFF] * 3, np.uint16)
        assert not patch(top, np.array([1], np.int64), np.array([1], np.int32))


def _hostile(kind: str, good: bytes) -> bytes:
    """A delta a hostile learner could send, made from a good one (issue: each of these stopped the worker with an
    AttributeError, struct.error or MemoryError instead of a BroadcastError, so it never fell back to the full
    version)."""
    import json
    import struct

    import zstandard

    from echo2cli.broadcast.delta import MAGIC

    (n,) = struct.unpack("<I", good[len(MAGIC) : len(MAGIC) + 4])
    header, blobs = json.loads(good[len(MAGIC) + 4 : len(MAGIC) + 4 + n]), good[len(MAGIC) + 4 + n :]

    def framed(raw: bytes) -> bytes:
        return MAGIC + struct.pack("<I", len(raw)) + raw

    if kind == "no length":
        return MAGIC + b"\x01"
    if kind == "length past the end":
        return MAGIC + struct.pack("<I", 1 << 20) + b"{}"
    if kind == "a JSON list":
        return framed(b"[1, 2, 3]") + blobs
    if kind == "not UTF-8":
        return framed(b'{"words": "\xff\xfe"}') + blobs
    if kind == "sizes that are not byte counts":
        return framed(json.dumps(header | {"blob_bytes": ["1", None, -1, 2.5, 0, 0]}).encode()) + blobs
    if kind == "streams cut short":
        return good[: len(good) - 10]
    if kind == "a decompression bomb":  # a frame that claims 64 MB of gaps for a delta against 1 M words
        bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))
        sizes = [header["blob_bytes"][0], len(bomb), *[0] * 4]
        counts = blobs[: header["blob_bytes"][0]]
        return framed(json.dumps(header | {"blob_bytes": sizes}).encode()) + counts + bomb
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    [
        "no length",
        "length past the end",
        "a JSON list",
        "not UTF-8",
        "sizes that are not byte counts",
        "streams cut short",
        "a decompression bomb",
    ],
)
def test_any_malformed_delta_is_a_broadcast_error_and_writes_nothing(versions, tmp_path, kind):
    base, target = versions
    encode_delta(base, target, tmp_path / "good")
    (tmp_path / "bad").write_bytes(_hostile(kind, (tmp_path / "good").read_bytes()))
    with pytest.raises(BroadcastError):
        apply_delta(base, tmp_path / "bad", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()
