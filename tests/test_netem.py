"""The namespace harness: nodes reach each other over capped links and nothing is left behind.

Needs root (ip netns, tc); skips cleanly elsewhere. Rates are checked in the qdisc configuration, not
by timing a transfer: these machines are shared.
"""

import subprocess
import sys

import pytest

from echo2cli.bench.netem import Fleet, Link, NetemError, namespaces_available

pytestmark = pytest.mark.skipif(not namespaces_available(), reason="needs permission to create network namespaces")


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_nodes_talk_across_namespaces_through_tbf_caps():
    before = namespaces()
    with Fleet({"learner": Link(100, 400), "w0": Link(50, 80)}) as fleet:
        assert len(namespaces() - before) == 3  # hub + two nodes
        qdisc = subprocess.run(
            fleet.argv("w0") + ["tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True
        ).stdout
        assert "tbf" in qdisc and "50Mbit" in qdisc
        server = subprocess.Popen(
            fleet.argv("learner")
            + [
                sys.executable,
                "-c",
                "import socket; s = socket.create_server(('0.0.0.0', 9000)); c, _ = s.accept(); c.sendall(b'pong')",
            ]
        )
        try:
            client = subprocess.run(
                fleet.argv("w0")
                + [
                    sys.executable,
                    "-c",
                    "import socket, sys, time\n"
                    "for _ in range(50):\n"
                    "    try: s = socket.create_connection((sys.argv[1], 9000), timeout=5); break\n"
                    "    except OSError: time.sleep(0.1)\n"
                    "print(s.recv(4).decode())",
                    fleet.addr("learner"),
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert client.stdout.strip() == "pong"
        finally:
            server.kill()
            server.wait()
        # The host's loopback is not reachable from inside: traffic stays in the namespaces.
        assert subprocess.run(fleet.argv("w0") + ["ip", "route", "get", "8.8.8.8"], capture_output=True).returncode != 0
    assert namespaces() == before


def test_fleet_cleans_up_when_the_body_raises():
    before = namespaces()
    with pytest.raises(RuntimeError), Fleet({"a": Link(10, 10)}):
        raise RuntimeError("boom")
    assert namespaces() == before


def test_a_bad_fleet_is_a_clear_error_and_leaves_nothing():
    before = namespaces()
    with pytest.raises(NetemError), Fleet({"a": Link(0, 10)}):  # tc refuses a zero rate
        pass
    assert namespaces() == before
