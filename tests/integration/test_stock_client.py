"""A stock BitTorrent client fetches a published version: Debian's aria2c, the learner as tracker and seed.

The learner publishes v0 (no workers needed); the test joins over the API for a tracker key and the
version's .torrent, runs `aria2c` against the learner's tracker, and checks the file's SHA-256 against the
one the API announced. aria2c is installed with apt-get when missing (root); without it the test skips.
"""

from __future__ import annotations

import base64
import shutil
import signal
import subprocess
import time

import httpx
import pytest
from procs import kill_group, spawn, wait_listening

from echo2cli import __version__
from echo2cli.broadcast.digest import file_digest
from echo2cli.demo import free_port

pytestmark = pytest.mark.integration

TOKEN = "stock-client-token"


def aria2c() -> str:
    if shutil.which("aria2c") is None and shutil.which("apt-get") is not None:
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=300)
        subprocess.run(["apt-get", "install", "-y", "-qq", "aria2"], capture_output=True, timeout=300)
    path = shutil.which("aria2c")
    if path is None:
        pytest.skip("aria2c is not installed and apt-get could not install it (needs root and Debian's archive)")
    return path


def test_aria2c_fetches_a_published_version_and_its_digest_matches(tmp_path):
    client = aria2c()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    learner = spawn(
        [
            "learner",
            "--out",
            str(tmp_path / "run"),
            "--port",
            str(port),
            "--steps",
            "1",
            "--bt-listen",
            "127.0.0.1:0",
            "--token",
            TOKEN,
            "--quiet",
        ],
        tmp_path / "learner.log",
    )
    try:
        wait_listening(learner, tmp_path / "run")
        joined = httpx.post(
            f"{url}/v1/join",
            json={"name": "aria2", "echo2_version": __version__},
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=10,
        ).json()
        policy = joined["policy"]
        torrent = tmp_path / "v0.torrent"
        torrent.write_bytes(base64.b64decode(policy["torrent_b64"]))
        t0 = time.monotonic()
        proc = subprocess.run(
            [
                client,
                "--dir",
                str(tmp_path / "got"),
                f"--bt-tracker={url}/announce/{joined['tracker_key']}",
                "--bt-exclude-tracker=*",
                "--seed-time=0",
                "--enable-dht=false",
                "--bt-enable-lpd=false",
                "--enable-peer-exchange=false",
                "--bt-stop-timeout=120",
                "--summary-interval=0",
                f"--listen-port={free_port()}",
                "--console-log-level=warn",
                str(torrent),
            ],
            capture_output=True,
            text=True,
            timeout=240,
        )
        seconds = time.monotonic() - t0
    finally:
        kill_group(learner, signal.SIGTERM)
        try:
            learner.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_group(learner)
    got = tmp_path / "got" / "v000000" / "model.safetensors"
    assert proc.returncode == 0 and got.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    assert file_digest(got) == policy["digest"]
    print(f"aria2c fetched {got.stat().st_size / 1e6:.0f} MB in {seconds:.1f} s")
