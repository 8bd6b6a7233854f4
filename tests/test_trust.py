"""A worker does not trust the learner it joined: hostile file names, torrents and sizes are refused.

Pure checks on real .torrent files made here and on the wire models; the HTTP client against a
MockTransport (no sockets)."""

from __future__ import annotations

import os

import httpx
import pytest
from pydantic import ValidationError

from echo2cli.broadcast.digest import file_digest
from echo2cli.broadcast.torrent import make_torrent
from echo2cli.errors import BroadcastError, ProtocolError
from echo2cli.protocol import MAX_MODEL_FILE_BYTES, JoinResponse, PolicyInfo
from echo2cli.worker.client import LearnerClient
from echo2cli.worker.trust import check_torrent, safe_model_file


def published(root, name: str, files: dict[str, int]):
    vdir = root / name
    vdir.mkdir(parents=True)
    for fname, size in files.items():
        (vdir / fname).write_bytes(os.urandom(size))
    return vdir, make_torrent(vdir, "http://127.0.0.1:9/announce")


def policy_for(version: int, torrent, size: int, vdir) -> PolicyInfo:
    return PolicyInfo(
        version=version,
        info_hash=torrent.info_hash,
        torrent_b64=torrent.b64,
        digest=file_digest(vdir / "model.safetensors"),
        size_bytes=size,
        published_at=0.0,
    )


def join_response(**overrides) -> dict:
    vdir_policy = {
        "version": 0,
        "info_hash": "ab" * 20,
        "torrent_b64": "eA==",
        "digest": "cd" * 32,
        "size_bytes": 1,
        "published_at": 0.0,
    }
    body = {
        "worker_id": "w1",
        "session_token": "s",
        "tracker_key": "ab12",
        "run_id": "r",
        "task": "arithmetic",
        "group_size": 8,
        "max_new_tokens": 16,
        "temperature": 1.0,
        "staleness": 2,
        "heartbeat_s": 2.0,
        "model_files": ["config.json", "tokenizer.json"],
        "policy": vdir_policy,
    }
    return {**body, **overrides}


@pytest.mark.parametrize(
    "name", ["/home/u/.bashrc", "../../x.pth", "a/config.json", "x.pth", "", "..", "config.json/../../x"]
)
def test_a_join_response_naming_a_file_outside_the_allow_list_fails_validation(name):
    with pytest.raises(ValidationError, match="model file"):
        JoinResponse.model_validate(join_response(model_files=["config.json", name]))


@pytest.mark.parametrize(
    "field,value",
    [
        ("group_size", 10**9),
        ("max_new_tokens", 10**9),
        ("staleness", -1),
        ("heartbeat_s", 0.0),
        ("tracker_key", "../x"),
    ],
)
def test_a_join_response_with_values_out_of_bounds_fails_validation(field, value):
    with pytest.raises(ValidationError):
        JoinResponse.model_validate(join_response(**{field: value}))


def test_a_policy_with_a_malformed_hash_or_an_absurd_size_fails_validation():
    good = join_response()["policy"]
    for bad in ({"info_hash": "../../etc"}, {"digest": "x" * 64}, {"size_bytes": 1 << 50}):
        with pytest.raises(ValidationError):
            PolicyInfo.model_validate({**good, **bad})


def test_model_files_are_written_only_inside_the_engine_directory(tmp_path):
    assert safe_model_file(tmp_path, "config.json") == (tmp_path / "config.json").resolve()
    for name in ["../x.pth", "/etc/passwd", "sub/config.json", "model.safetensors"]:
        with pytest.raises(ProtocolError, match="not a model file"):
            safe_model_file(tmp_path, name)


def test_a_torrent_that_matches_its_announcement_passes(tmp_path):
    vdir, torrent = published(tmp_path, "v000003", {"model.safetensors": 50_000})
    check_torrent(policy_for(3, torrent, 50_000, vdir), torrent.data)


def test_a_torrent_for_another_path_size_hash_or_more_files_is_refused(tmp_path):
    vdir, torrent = published(tmp_path / "a", "v000003", {"model.safetensors": 50_000})
    policy = policy_for(3, torrent, 50_000, vdir)
    with pytest.raises(BroadcastError, match="not only v000004/model.safetensors"):
        check_torrent(policy.model_copy(update={"version": 4}), torrent.data)  # would land in another version
    with pytest.raises(BroadcastError, match="the learner announced 49999"):
        check_torrent(policy.model_copy(update={"size_bytes": 49_999}), torrent.data)
    with pytest.raises(BroadcastError, match="announced info-hash"):
        check_torrent(policy.model_copy(update={"info_hash": "00" * 20}), torrent.data)
    _, two = published(tmp_path / "b", "v000003", {"model.safetensors": 50_000, "evil.pth": 10})
    with pytest.raises(BroadcastError, match="not only"):
        check_torrent(policy.model_copy(update={"info_hash": two.info_hash}), two.data)
    with pytest.raises(BroadcastError, match="does not parse"):
        check_torrent(policy, b"d4:infoi1ee")


def test_a_model_file_larger_than_the_cap_is_refused_without_reading_it_all():
    sent = []

    def huge(request: httpx.Request) -> httpx.Response:
        def body():
            for _ in range(MAX_MODEL_FILE_BYTES // (1 << 20) + 8):
                sent.append(1)
                yield b"x" * (1 << 20)

        return httpx.Response(200, content=body())

    client = LearnerClient("http://learner", transport=httpx.MockTransport(huge))
    with pytest.raises(ProtocolError, match="exceeds 64 MiB"):
        client.model_file("tokenizer.json")
    assert len(sent) <= MAX_MODEL_FILE_BYTES // (1 << 20) + 1
