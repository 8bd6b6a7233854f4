"""Emulated wide-area links: every node in its own network namespace, with capped up- and downlinks.

    ns <tag>-hub:   bridge br0 ── veth h<i> ─┐           (egress of h<i> = node i's downlink: tbf)
    ns <tag>-n<i>:                 veth eth0 ┘ 10.x.y.i   (egress of eth0 = node i's uplink: tbf [+ netem delay])

Each node gets its own address in a private /24 and a real rate limit (`tc tbf`; measured: 50 mbit
configured → 48 Mbit/s through the veth), so a star and a swarm are compared over the same links.
Traffic never leaves the namespaces: the hub has no route out. `Fleet` is a context manager and
deletes every namespace it made, also when the code inside raises (deleting a namespace deletes its
veths and qdiscs).

NAT'd and firewalled nodes (`Link.behind`) are routed and masqueraded by the hub: see `Fleet`.

Creating namespaces needs root (CAP_NET_ADMIN). `namespaces_available()` probes for it, so callers
fall back to loopback with application-level rate limits (libtorrent peer classes, a token bucket on
HTTP) and tests skip cleanly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from echo2cli.errors import Echo2Error
from echo2cli.units import mbps_to_bytes_per_s


class NetemError(Echo2Error):
    pass


BEHIND = ("", "nat", "firewall")


@dataclass(frozen=True)
class Link:
    up_mbps: float
    down_mbps: float
    delay_ms: float = 0.0  # one-way, added on the uplink
    behind: str = ""  # "" = reachable; "nat": outbound connections only; "firewall": NAT'd and only `Fleet.open_to`

    def __post_init__(self) -> None:
        if self.behind not in BEHIND:
            raise NetemError(f"a link is behind nothing, nat or firewall, not {self.behind!r}")


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise NetemError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")


def nat_available() -> bool:
    """True if NAT'd nodes can be emulated too: namespaces plus the iptables command."""
    return shutil.which("iptables") is not None and namespaces_available()


def namespaces_available() -> bool:
    """True if this process may create network namespaces and tc qdiscs (root with CAP_NET_ADMIN)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False
    probe = f"e2probe{os.getpid()}"
    try:
        _ip("ip", "netns", "add", probe)
    except NetemError:
        return False
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True


def _tbf(dev: str, mbps: float, ns: str, delay_ms: float = 0.0) -> None:
    rate_bytes = mbps_to_bytes_per_s(mbps)
    burst = max(64 * 1024, int(rate_bytes / 100))  # ≥ one 10 ms tick of data, or tbf under-delivers
    parent = ["root"]
    if delay_ms > 0:
        try:
            _ip("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{delay_ms}ms", ns=ns)
        except NetemError as exc:
            msg = f"cannot add {delay_ms} ms of delay (kernel without sch_netem?): drop the delay option"
            raise NetemError(msg) from exc
        parent = ["parent", "1:"]
    _ip(
        "tc",
        "qdisc",
        "add",
        "dev",
        dev,
        *parent,
        "handle",
        "2:",
        "tbf",
        "rate",
        f"{mbps}mbit",
        "burst",
        str(burst),
        "latency",
        "100ms",
        ns=ns,
    )


class Fleet:
    """Network namespaces for named nodes, joined by a bridge, each behind its own `Link`.

    with Fleet({"learner": Link(100, 1000), "w0": Link(100, 100)}) as fleet:
        subprocess.Popen(fleet.argv("w0") + ["python", ...])   # runs inside w0's namespace
        fleet.addr("learner")                                   # "10.x.y.1"

    A node behind "nat" is not on the bridge: the hub routes its private /24 (192.168.i.0/24) and masquerades
    it as 10.x.y.254, the address every NAT'd node shares, as behind a carrier-grade NAT. It can open
    connections to anyone on the bridge; nobody can open one to it (the hub has no port forwarding). A node
    behind "firewall" is NAT'd too, and may open connections only to `open_to` (a node's name and TCP port:
    the learner's HTTP port), as behind a corporate proxy. Both need the iptables command (`nat_available`).
    """

    def __init__(self, links: dict[str, Link], tag: str | None = None, open_to: tuple[str, int] | None = None) -> None:
        if not 0 < len(links) < 250:
            raise NetemError("a fleet needs between 1 and 249 nodes")
        if any(link.behind == "firewall" for link in links.values()) and open_to is None:
            raise NetemError("a firewalled node needs `open_to`, the one address and port it may reach")
        self.links, self.open_to = links, open_to
        self.tag = tag or f"e2{os.getpid() % 100000}"
        # A /24 chosen from the pid, so two fleets on one machine do not collide.
        self.subnet = f"10.{200 + os.getpid() % 50}.{(os.getpid() // 50) % 250}"
        self.names = list(links)
        self.namespaces: list[str] = []

    def ns(self, name: str) -> str:
        return f"{self.tag}-n{self.names.index(name)}"

    def addr(self, name: str) -> str:
        """The node's own address (to bind to); a NAT'd node's is private, seen by others as `public_addr`."""
        i = self.names.index(name)
        return f"192.168.{i}.2" if self.links[name].behind else f"{self.subnet}.{i + 1}"

    def public_addr(self, name: str) -> str:
        return f"{self.subnet}.254" if self.links[name].behind else self.addr(name)

    def argv(self, name: str) -> list[str]:
        """Prefix that runs a command inside `name`'s namespace."""
        return ["ip", "netns", "exec", self.ns(name)]

    def __enter__(self) -> Fleet:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_ns(self, ns: str) -> None:
        _ip("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        _ip("ip", "link", "set", "lo", "up", ns=ns)

    def _build(self) -> None:
        hub = f"{self.tag}-hub"
        self._add_ns(hub)
        _ip("ip", "link", "add", "br0", "type", "bridge", ns=hub)
        _ip("ip", "link", "set", "br0", "up", ns=hub)
        if any(link.behind for link in self.links.values()):
            _ip("ip", "addr", "add", f"{self.subnet}.254/24", "dev", "br0", ns=hub)
            _ip("sysctl", "-q", "-w", "net.ipv4.ip_forward=1", ns=hub)
            _ip(
                "iptables",
                "-t",
                "nat",
                "-A",
                "POSTROUTING",
                "-s",
                "192.168.0.0/16",
                "-o",
                "br0",
                "-j",
                "MASQUERADE",
                ns=hub,
            )
        for i, name in enumerate(self.names):
            ns, link, host_side = self.ns(name), self.links[name], f"h{i}"
            self._add_ns(ns)
            _ip("ip", "link", "add", host_side, "type", "veth", "peer", "name", "eth0", "netns", ns, ns=hub)
            if link.behind:
                _ip("ip", "addr", "add", f"192.168.{i}.1/24", "dev", host_side, ns=hub)
            else:
                _ip("ip", "link", "set", host_side, "master", "br0", ns=hub)
            _ip("ip", "link", "set", host_side, "up", ns=hub)
            _ip("ip", "addr", "add", f"{self.addr(name)}/24", "dev", "eth0", ns=ns)
            _ip("ip", "link", "set", "eth0", "up", ns=ns)
            if link.behind:
                _ip("ip", "route", "add", "default", "via", f"192.168.{i}.1", ns=ns)
            if link.behind == "firewall":
                self._firewall(ns)
            _tbf("eth0", link.up_mbps, ns, link.delay_ms)
            _tbf(host_side, link.down_mbps, hub)

    def _firewall(self, ns: str) -> None:
        """Outbound: replies, and new connections to `open_to` only."""
        assert self.open_to is not None
        name, port = self.open_to
        rules = [
            ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
            ["-p", "tcp", "-d", self.public_addr(name), "--dport", str(port), "-j", "ACCEPT"],
            ["-j", "DROP"],
        ]
        for rule in rules:
            _ip("iptables", "-A", "OUTPUT", "-o", "eth0", *rule, ns=ns)

    def close(self) -> None:
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()
