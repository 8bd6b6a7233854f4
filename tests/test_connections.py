"""The learner's connection rules (`learner/connections.py`) on a real uvicorn on loopback: one address holds at most
its share of connections, a request header arrives whole in time or the connection goes, and a worker on another
address is answered throughout. The attacker connects from 127.0.0.1, the worker from 127.0.0.2 (both loopback on
Linux). Each wait below is a wait on the server's state, bounded generously; nothing asserts a duration."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from test_webseed import learner_app

from echo2cli.learner.connections import Admission
from echo2cli.learner.server import bind_socket, serving

TOKEN = "s3cret"
WAIT_S = 30.0


@pytest.fixture
def server(clock, tmp_path):
    """`start(admission)` serves a learner's app (`test_webseed.learner_app`) with those rules; returns its port."""
    contexts = []

    def start(admission: Admission) -> int:
        app, _ = learner_app(clock, tmp_path, None)
        sock = bind_socket("0.0.0.0", 0)
        ctx = serving(app, sock, admission=admission)
        ctx.__enter__()
        contexts.append(ctx)
        return sock.getsockname()[1]

    yield start
    for ctx in contexts:
        ctx.__exit__(None, None, None)


def worker_status(port: int) -> int:
    """GET /v1/status from 127.0.0.2, as a worker on another address: the status code."""
    transport = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(transport=transport, timeout=WAIT_S) as http:
        return http.get(f"http://127.0.0.1:{port}/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}).status_code


def closed_by_server(sock: socket.socket, within_s: float = WAIT_S) -> bool:
    """Whether the server closed `sock` (EOF or reset) within `within_s`, reading whatever it sent."""
    sock.settimeout(within_s)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:  # reset
        return True
    return True


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)


def wait_until(pred, within_s: float = WAIT_S) -> bool:
    end = time.monotonic() + within_s
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def test_one_address_holds_at_most_its_connections_and_a_worker_elsewhere_is_answered(server):
    """Before, ~2,100 idle connections that never sent a byte turned every request into a 503 (uvicorn counts a
    connection against its cap from the moment it opens), with no token needed."""
    admission = Admission(per_address=8, header_deadline_s=3600)
    port = server(admission)
    idle = [connect(port) for _ in range(8)]
    try:
        assert wait_until(lambda: admission.open.get("127.0.0.1", 0) == 8)
        extra = connect(port)
        assert closed_by_server(extra)  # the ninth is closed as it opens
        assert admission.refused >= 1 and admission.open["127.0.0.1"] == 8
        assert worker_status(port) == 200
    finally:
        for sock in idle:
            sock.close()
    assert wait_until(lambda: "127.0.0.1" not in admission.open)  # closed connections give their places back
    with connect(port) as again:
        again.sendall(b"GET /v1/status HTTP/1.1\r\nHost: l\r\nAuthorization: Bearer s3cret\r\n\r\n")
        assert again.recv(12).startswith(b"HTTP/1.1 200")


def test_a_header_that_does_not_arrive_whole_in_time_closes_its_connection(server):
    """A slow-header sender (a byte every few seconds) held its connection, and its place under the cap, forever.
    The deadline applies to a new connection's first request and to each later request on a kept-alive one."""
    admission = Admission(per_address=100, header_deadline_s=1.0)
    port = server(admission)
    silent, trickle, kept = connect(port), connect(port), connect(port)
    trickle.sendall(b"GET /v1/status HTTP/1.1\r\n")
    kept.sendall(b"GET /v1/status HTTP/1.1\r\nHost: l\r\nAuthorization: Bearer s3cret\r\n\r\n")
    assert kept.recv(12).startswith(b"HTTP/1.1 200")  # a whole request is answered
    kept.sendall(b"GET /v1/sta")  # the next one on the same connection never ends
    end = time.monotonic() + WAIT_S
    while admission.timed_out < 3 and time.monotonic() < end:
        try:
            trickle.sendall(b"X")  # one byte of a header line, again and again
        except OSError:
            pass
        time.sleep(0.2)
    assert admission.timed_out == 3
    assert all(closed_by_server(sock) for sock in (silent, trickle, kept))
    for sock in (silent, trickle, kept):
        sock.close()
    assert worker_status(port) == 200


def test_a_request_whose_header_came_in_time_is_not_cut_while_the_app_answers(server):
    """The deadline is the header's alone: a request whose answer takes longer than it (a long poll, a web seed
    stream) keeps its connection."""
    admission = Admission(per_address=100, header_deadline_s=0.5)
    port = server(admission)
    with connect(port) as sock:
        sock.sendall(b"POST /v1/join HTTP/1.1\r\nHost: l\r\nAuthorization: Bearer s3cret\r\n")
        sock.sendall(b"Content-Type: application/json\r\nContent-Length: 40\r\n\r\n")
        time.sleep(1.5)  # the body comes after three deadlines: the header was in on time
        sock.sendall(b'{"name": "w", "echo2_version": "0.0.0"}'.ljust(40))
        assert sock.recv(12).startswith(b"HTTP/1.1 ")
    assert admission.timed_out == 0
