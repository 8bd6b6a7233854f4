"""Workers behind NAT and behind a firewall, in network namespaces: every fetcher gets the whole, verified version.

Real libtorrent processes and the learner side's tracker and web seed (`echo2 bench broadcast`'s nodes) on
capped links. Needs root, `ip netns` and iptables; skips cleanly elsewhere.
"""

import subprocess
import sys

import pytest

from echo2cli.bench.broadcast import run_bench
from echo2cli.bench.netem import Fleet, Link, nat_available

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not nat_available(), reason="needs root, network namespaces and iptables"),
]

SIZE_MB = 16
PUBLIC, NAT, FIREWALL = Link(100, 100), Link(100, 100, behind="nat"), Link(100, 100, behind="firewall")


def swarm(links: list[Link], tmp_path):
    [row] = run_bench([len(links)], up_mbps=100, links=links, size_mb=SIZE_MB, methods=("swarm",), work_dir=tmp_path)
    assert row.mode == "netns" and row.behind == sum(1 for link in links if link.behind)
    return row


def test_nat_d_workers_get_the_version_through_the_reachable_ones(tmp_path):
    row = swarm([PUBLIC, NAT, PUBLIC, NAT], tmp_path)
    # A star would send 4 copies; the NAT'd workers dial the reachable ones and trade with them.
    assert row.learner_upload_over_size < 2.0
    assert row.web_seed_workers == 0


def test_a_fleet_of_only_nat_d_workers_converges_and_the_learner_sends_each_a_copy(tmp_path):
    row = swarm([NAT, NAT, NAT], tmp_path)
    assert row.learner_upload_over_size >= 2.5  # no two NAT'd workers can connect: the cost, reported


def test_a_worker_that_can_reach_only_the_learners_http_port_gets_the_version_from_the_web_seed(tmp_path):
    row = swarm([PUBLIC, FIREWALL], tmp_path)
    assert row.web_seed_workers == 1 and row.web_seed_over_size >= 1.0
    assert row.learner_upload_over_size >= 2.0 - 0.05  # the web seed's bytes count as the learner's upload


def test_nat_d_nodes_accept_no_connection_and_firewalled_ones_reach_only_the_open_port():
    serve = (
        "import socket,sys,time; s=socket.create_server((sys.argv[1], 9000)); print('up', flush=True); time.sleep(30)"
    )
    dial = (
        "import socket,sys\ntry:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2); print('ok')\n"
        "except OSError: print('no')"
    )
    links = {"learner": PUBLIC, "pub": PUBLIC, "nat": NAT, "fw": FIREWALL}
    with Fleet(links, open_to=("learner", 9000)) as fleet:
        servers = [
            subprocess.Popen(
                fleet.argv(n) + [sys.executable, "-c", serve, fleet.addr(n)], stdout=subprocess.PIPE, text=True
            )
            for n in links
        ]

        def reach(a: str, b: str) -> str:
            argv = fleet.argv(a) + [sys.executable, "-c", dial, fleet.public_addr(b), "9000"]
            return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()

        try:
            assert [s.stdout.readline().strip() for s in servers] == ["up"] * len(servers)  # each one listens
            assert reach("nat", "learner") == "ok" and reach("nat", "pub") == "ok"
            assert reach("pub", "nat") == "no" and reach("learner", "nat") == "no" and reach("nat", "fw") == "no"
            assert reach("fw", "learner") == "ok" and reach("fw", "pub") == "no"
        finally:
            for s in servers:
                s.kill()
                s.wait()
