"""The learner hashes a version's pieces on several threads (`torrent.piece_hashes`): the torrent must be the one
libtorrent's own one-thread hasher makes, for one file and for several, whatever the thread count."""

import os

import libtorrent as lt
import pytest

from echo2cli.broadcast.torrent import make_torrent, piece_size_for


def libtorrents_own(version_dir) -> str:
    files = lt.list_files(str(version_dir))
    ct = lt.create_torrent(files, piece_size_for(sum(f.size for f in files)), lt.create_torrent.v1_only)
    ct.add_tracker("http://127.0.0.1:9/announce")
    ct.set_priv(True)
    ct.set_creator("echo2")
    lt.set_piece_hashes(ct, str(version_dir.parent))
    return str(lt.torrent_info(lt.bencode(ct.generate())).info_hashes().v1)


@pytest.mark.parametrize("sizes", [[(3 << 20) + 12345], [700_001, 5, (1 << 20) + 3]], ids=["one file", "three files"])
@pytest.mark.parametrize("workers", [1, 3])
def test_threaded_piece_hashes_make_libtorrents_torrent(tmp_path, sizes, workers):
    version_dir = tmp_path / "v7"
    version_dir.mkdir()
    for i, size in enumerate(sizes):
        (version_dir / f"part{i}.bin").write_bytes(os.urandom(size))
    ours = make_torrent(version_dir, "http://127.0.0.1:9/announce", workers=workers)
    info = lt.torrent_info(ours.data)
    assert info.num_pieces() > 1
    assert ours.info_hash == libtorrents_own(version_dir)
