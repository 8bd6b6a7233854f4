"""Fuzz every endpoint of the learner's API from its own OpenAPI schema, plus hand-written hostile requests:
the server must never answer 5xx to client input, and one worker's requests never change what another
worker's calls answer.

Schemathesis generates request bodies, paths and queries from `/openapi.json` (property-based, via
hypothesis), extreme numbers included (the schema carries every field's bounds, and it generates values on
and past them). Most generated bodies get a real worker id and that worker's session token, so requests reach
the coordinator instead of stopping at the credential checks. The app runs in process with a real
coordinator (fake tokenizer). Every generated request is sent as one hostile worker, and an honest worker's calls
are checked after each: about 1,700 per push; more than 10,000 with `--extended` (about five minutes).
"""

from __future__ import annotations

import os
import random
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import schemathesis
from conftest import JOIN_INFO, make_coord
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings

from echo2cli import __version__
from echo2cli.learner.episode_host import EpisodeHost
from echo2cli.learner.server import build_app
from echo2cli.protocol import PolicyInfo
from echo2cli.tasks.poker_hands import PokerHandsTask

TOKEN = "s3cret"
EXAMPLES_PER_OPERATION = 150  # x 10 operations: about 1,700 requests per run
LONG_EXAMPLES_PER_OPERATION = 1100  # x 10 operations: more than 10,000 requests (--extended)
MIN_REQUESTS, MIN_LONG_REQUESTS = 100, 1000  # per operation, at least (150 examples sent 159-313 each)


class TextTurns:
    """The chat template's turn boundary, faked (pure logic): an action is its ids as text, an observation 3 tokens."""

    def action(self, ids):
        return "ACTION: " + " ".join(map(str, ids))

    def env_tokens(self, observation, ids):
        return [1, 2, 3]


def episode_host(coord):
    """The learner's host of hidden-state episodes (real poker hands; every live leased prompt deals one)."""

    def spec_of(worker_id, lease_id, prompt_id):
        lease = coord.leases.live(lease_id, worker_id)
        return "200:7:call" if lease is not None and prompt_id in lease.outstanding else None

    return EpisodeHost(
        PokerHandsTask(unreadable="call"),
        TextTurns(),
        spec_of=spec_of,
        live_leases=lambda: set(coord.leases.leases),
        group_size=2,
        max_turns=4,
        turn_tokens=8,
    )


def make_app(model_dir: Path):
    coord = make_coord(lambda dt=0.0: 1000.0)
    coord.publish(
        PolicyInfo(version=0, info_hash="ab" * 20, torrent_b64="", digest="cd" * 32, size_bytes=1, published_at=0)
    )
    (model_dir / "config.json").write_text("{}")
    return build_app(
        coord,
        run_id="r",
        join_info=JOIN_INFO,
        model_dir=model_dir,
        model_files=["config.json"],
        token=TOKEN,
        status_extra=dict,
        target_steps=3,
        episodes=episode_host(coord),
    )


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    app = make_app(tmp_path_factory.mktemp("model"))
    http = TestClient(app, raise_server_exceptions=False)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    joined = [
        http.post("/v1/join", json={"name": f"w{i}", "echo2_version": __version__}, headers=auth).json()
        for i in range(2)
    ]
    return app, joined


# the schema is read at import (collection) time; the app it comes from is only asked for /openapi.json.
# Its model directory is removed when the test process exits (TemporaryDirectory's finalizer).
SCHEMA_DIR = tempfile.TemporaryDirectory(prefix="echo2-fuzz-")
schema = schemathesis.openapi.from_asgi(
    "/openapi.json",
    make_app(Path(SCHEMA_DIR.name)),
    headers={"Authorization": f"Bearer {TOKEN}"},
)  # the schema needs a token
FUZZ_SEED = int(os.environ.get("ECHO2_FUZZ_SEED", "0"))  # which credentials and ids each generated request carries


class Tally:
    """One fuzzing test's requests, counted, and its own random choices (seeded by ECHO2_FUZZ_SEED and the test's
    name, so a test's requests do not depend on which tests ran before it)."""

    def __init__(self, name: str) -> None:
        self.sent: Counter[str] = Counter()
        self.rng = random.Random(f"{FUZZ_SEED}:{name}")


@pytest.fixture
def tally(request):
    """Schemathesis runs every generated case of an operation within one test, so this fixture's teardown sees all
    that operation's requests, whatever else ran (-k, --lf, any order): a parametrization that generated almost
    nothing would otherwise pass vacuously."""
    counted = Tally(request.node.name)
    yield counted
    least = request.node.get_closest_marker("least_requests").args[0]
    total = sum(counted.sent.values())
    print(f"{request.node.name}: {total} requests (ECHO2_FUZZ_SEED={FUZZ_SEED})")
    assert total >= least, (request.node.name, counted.sent)


def hostile_and_honest_workers(tmp_path_factory):
    """A fresh learner with two workers: one sends the generated requests, the other only honest calls."""
    app = make_app(tmp_path_factory.mktemp("model"))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(app, raise_server_exceptions=False) as http:  # one event loop for all its calls: 5x faster
        honest, hostile = (
            http.post("/v1/join", json={"name": name, "echo2_version": __version__}, headers=auth).json()
            for name in ("honest", "hostile")
        )
        yield app, http, honest, hostile


honest_and_hostile = pytest.fixture(scope="module")(hostile_and_honest_workers)
honest_and_hostile_long = pytest.fixture(scope="module")(hostile_and_honest_workers)


def honest_answers(http: TestClient, honest: dict, which: int | None = None) -> list[int]:
    """An honest worker's calls: its policy, a heartbeat, a lease, and the operator's status (`which`: one of them)."""
    me, wid = {"Authorization": f"Bearer {honest['session_token']}"}, honest["worker_id"]
    calls = [
        lambda: http.get("/v1/policy", params={"worker_id": wid}, headers=me),
        lambda: http.post("/v1/heartbeat", json={"worker_id": wid, "version_loaded": 0}, headers=me),
        lambda: http.post("/v1/lease", json={"worker_id": wid, "version": 0}, headers=me),
        lambda: http.get("/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}),
    ]
    return [call().status_code for call in (calls if which is None else [calls[which % len(calls)]])]


def send_as_the_hostile_worker(case, workers, tally: Tally) -> None:
    """The generated request, with the hostile worker's credentials or the run token, its ids or the honest one's
    (impersonation); it must not get a 5xx. Then one of the honest worker's calls, in turn (every 100th request all
    four): each must still get a 200."""
    app, http, honest, hostile = workers
    rng = tally.rng
    token = rng.choice([TOKEN, hostile["session_token"], hostile["session_token"], hostile["session_token"]])
    if isinstance(case.body, dict) and "worker_id" in case.body and rng.random() < 0.8:
        case.body["worker_id"] = rng.choice([hostile["worker_id"]] * 3 + [honest["worker_id"]])  # or impersonate
    if case.query and "worker_id" in case.query and rng.random() < 0.5:
        case.query["worker_id"] = hostile["worker_id"]
    if case.path_parameters and "key" in case.path_parameters and rng.random() < 0.5:
        case.path_parameters["key"] = hostile["tracker_key"]
    case.headers = {**(case.headers or {}), "Authorization": f"Bearer {token}"}
    response = case.call(app=app)
    n = sum(tally.sent.values())
    tally.sent[f"{case.method} {case.operation.path}"] += 1
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])
    honest_now = honest_answers(http, honest, which=None if n % 100 == 0 else n)
    assert set(honest_now) == {200}, (case.method, case.path, case.body, honest_now)


@pytest.mark.least_requests(MIN_REQUESTS)
@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_generated_request_gets_a_5xx_or_changes_another_workers_answers(case, honest_and_hostile, tally):
    send_as_the_hostile_worker(case, honest_and_hostile, tally)


@pytest.mark.integration
@pytest.mark.extended  # about five minutes: the same checks as the test above, with 7x the requests
@pytest.mark.least_requests(MIN_LONG_REQUESTS)
@schema.parametrize()
@settings(
    max_examples=LONG_EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
)
def test_ten_thousand_requests_from_one_worker_get_no_5xx_and_change_no_other_workers_answers(
    case, honest_and_hostile_long, tally
):
    send_as_the_hostile_worker(case, honest_and_hostile_long, tally)


HOSTILE = [
    ("post", "/v1/join", b"{", "application/json"),
    ("post", "/v1/join", b"\xff\xfe\x00", "application/json"),
    ("post", "/v1/join", b'{"name": "' + b"x" * 100_000 + b'"}', "application/json"),
    ("post", "/v1/lease", b'{"worker_id": null, "version": -1}', "application/json"),
    ("post", "/v1/lease", b'{"worker_id": "a", "version": 1e400}', "application/json"),
    (
        "post",
        "/v1/rollouts",
        b'{"worker_id": "a", "lease_id": "b", "version": 0, "samples": [' + b"{}," * 5000 + b"{}]}",
        "application/json",
    ),
    ("post", "/v1/rollouts", b"[" * 10_000 + b"]" * 10_000, "application/json"),
    ("post", "/v1/heartbeat", b'{"worker_id": "a", "version_loaded": "NaN"}', "application/json"),
    ("post", "/v1/leave", b"worker_id=a", "application/x-www-form-urlencoded"),
    ("get", "/v1/model/files/..%2F..%2Fetc%2Fpasswd", b"", ""),
    ("get", "/v1/model/files/%00", b"", ""),
    ("get", "/announce/{key}?info_hash=%ZZ&port=abc&left=-1", b"", ""),
    ("get", "/announce/{key}?" + "&".join(f"k{i}=v" for i in range(2000)), b"", ""),
    ("get", "/announce/{key}", b"", ""),
    ("get", "/announce/%ff%fe", b"", ""),
    ("get", "/announce", b"", ""),
]


@pytest.mark.parametrize("method, path, body, content_type", HOSTILE)
def test_hostile_requests_get_a_4xx_not_a_crash(api, method, path, body, content_type):
    app, joined = api
    http = TestClient(app, raise_server_exceptions=False)
    headers = {
        "Authorization": f"Bearer {joined[0]['session_token']}",
        **({"Content-Type": content_type} if content_type else {}),
    }
    body = body.replace(b'"a"', f'"{joined[0]["worker_id"]}"'.encode())  # a real worker: past the auth check
    response = http.request(
        method, path.replace("{key}", joined[0]["tracker_key"]), content=body or None, headers=headers
    )
    assert response.status_code < 500, response.text[:300]
    assert http.get("/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200  # still serving
