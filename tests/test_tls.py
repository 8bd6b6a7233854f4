"""TLS with real sockets: the learner's app served by uvicorn over HTTPS with a self-signed certificate,
the worker's client verifying it, and two libtorrent nodes announcing to the HTTPS tracker."""

from __future__ import annotations

import datetime
import ipaddress
import os
import time

import pytest
from conftest import JOIN_INFO, make_coord

from echo2cli.broadcast.node import TorrentNode
from echo2cli.broadcast.torrent import make_torrent
from echo2cli.errors import ConfigError, LearnerUnreachable
from echo2cli.learner.server import bind_socket, build_app, serve_in_thread
from echo2cli.protocol import JoinRequest, PolicyInfo
from echo2cli.tls import check_server_files, trust_for_torrents
from echo2cli.worker.client import LearnerClient


def self_signed(directory, host="127.0.0.1"):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@pytest.fixture
def https_learner(clock, tmp_path):
    cert, key = self_signed(tmp_path)
    coord = make_coord(clock)
    coord.publish(
        PolicyInfo(version=0, info_hash="ab" * 20, torrent_b64="", digest="cd" * 32, size_bytes=1, published_at=0)
    )
    (tmp_path / "config.json").write_text("{}")
    app = build_app(
        coord,
        run_id="r",
        join_info=JOIN_INFO,
        model_dir=tmp_path,
        model_files=["config.json"],
        token="s3cret",
        status_extra=dict,
        target_steps=3,
    )
    sock = bind_socket("127.0.0.1", 0)
    server, thread = serve_in_thread(app, sock, (cert, key))
    yield f"https://127.0.0.1:{sock.getsockname()[1]}", cert, coord
    server.should_exit = True
    thread.join(timeout=10)


def test_worker_client_joins_over_https_trusting_the_learners_certificate(https_learner):
    url, cert, _ = https_learner
    client = LearnerClient(url, "s3cret", ca_cert=cert)
    try:
        info = client.join(JoinRequest(name="w"))
        assert info.run_id == "r"
        assert client.model_file("config.json") == b"{}"
    finally:
        client.close()  # an open keep-alive connection holds the server's shutdown (10 s in the fixture's teardown)


def test_an_untrusted_certificate_fails_at_once_naming_ca_cert(https_learner):
    url, _, _ = https_learner
    t0 = time.monotonic()
    with pytest.raises(LearnerUnreachable, match="--ca-cert"):
        LearnerClient(url, "s3cret", unreachable_s=30).join(JoinRequest(name="w"))
    assert time.monotonic() - t0 < 25  # not retried until the patience runs out


def test_plain_http_to_a_tls_learner_says_https(https_learner):
    url, _, _ = https_learner
    with pytest.raises(LearnerUnreachable, match="https://"):
        LearnerClient(url.replace("https", "http"), "s3cret", unreachable_s=0.5).join(JoinRequest(name="w"))


def test_a_key_that_does_not_match_the_certificate_is_a_config_error(tmp_path):
    cert, _ = self_signed(tmp_path)
    (tmp_path / "other").mkdir()
    _, other_key = self_signed(tmp_path / "other")
    with pytest.raises(ConfigError, match="cannot serve TLS"):
        check_server_files(cert, other_key)
    with pytest.raises(ConfigError, match="not found"):
        check_server_files(tmp_path / "missing.pem", other_key)


def test_torrent_peers_find_each_other_through_the_https_tracker(https_learner, tmp_path, monkeypatch):
    url, cert, coord = https_learner
    monkeypatch.setenv("SSL_CERT_FILE", "")  # restored after the test; trust_for_torrents replaces it
    trust_for_torrents(cert, tmp_path / "trust")
    worker_id = coord.join("w", 0.0)
    vdir = tmp_path / "seed" / "v000000"
    vdir.mkdir(parents=True)
    (vdir / "model.safetensors").write_bytes(os.urandom(3 << 20))
    torrent = make_torrent(vdir, f"{url}/announce")
    seed = TorrentNode("127.0.0.1:0", tracker_key=coord.credentials.learner_tracker_key)
    leech = TorrentNode("127.0.0.1:0", tracker_key=coord.credentials.tracker_key(worker_id))
    try:
        seed.seed(0, torrent.data, vdir.parent)
        leech.fetch(0, torrent.data, tmp_path / "leech")
        deadline = time.time() + 60
        while leech.transfers[0].finished_at is None and time.time() < deadline:
            seed.poll()
            leech.poll()
            time.sleep(0.2)
        assert leech.transfers[0].finished_at is not None, "the leecher never found the seed via the tracker"
        assert (tmp_path / "leech" / "v000000" / "model.safetensors").read_bytes() == (
            vdir / "model.safetensors"
        ).read_bytes()
    finally:
        seed.close()
        leech.close()


def test_the_web_seed_works_over_https_for_a_worker_trusting_the_certificate(clock, tmp_path, monkeypatch):
    """A worker no peer can reach gets the version from the web seed of a TLS learner (libtorrent verifies it
    with the same trust bundle as the tracker)."""
    from test_webseed import learner_app, serve_files

    from echo2cli.broadcast import node as node_module
    from echo2cli.layout import VersionKey

    monkeypatch.setattr(node_module, "WEB_SEED_AFTER_S", 0.2)
    monkeypatch.setenv("SSL_CERT_FILE", "")
    cert, key = self_signed(tmp_path)
    trust_for_torrents(cert, tmp_path / "trust")
    root, version = tmp_path / "learner", VersionKey(1)
    version.path(root).parent.mkdir(parents=True)
    version.path(root).write_bytes(os.urandom(3 << 20))
    web_seed = serve_files(root, version)
    app, coord = learner_app(clock, tmp_path, web_seed)
    sock = bind_socket("127.0.0.1", 0)
    server, thread = serve_in_thread(app, sock, (cert, key))
    url = f"https://127.0.0.1:{sock.getsockname()[1]}"
    worker = TorrentNode("127.0.0.1:0", tracker_key=coord.credentials.tracker_key(coord.join("w", 0.0)), web_seed=url)
    try:
        transfer = worker.fetch(
            version, make_torrent(version.dir(root), "http://127.0.0.1:9/announce").data, tmp_path / "w"
        )
        deadline = time.time() + 60
        while transfer.finished_at is None and time.time() < deadline:
            worker.poll()
            time.sleep(0.1)
        assert transfer.finished_at is not None and web_seed.sent(version) >= 3 << 20
        assert version.path(tmp_path / "w").read_bytes() == version.path(root).read_bytes()
    finally:
        worker.close()
        server.should_exit = True
        thread.join(timeout=10)
