"""Fuzz every endpoint of the learner's API from its own OpenAPI schema, plus hand-written hostile requests:
the server must never answer 5xx to client input, and one worker's requests never change what another
worker's calls answer.

Schemathesis generates request bodies, paths and queries from `/openapi.json` (property-based, via
hypothesis), extreme numbers included (the schema carries every field's bounds, and it generates values on
and past them). Most generated bodies get a real worker id and that worker's session token, so requests reach
the coordinator instead of stopping at the credential checks. The app runs in process with a real
coordinator (fake tokenizer). The quick run sends about 1,700 requests; the long one (marked integration, about
five minutes) sends more than 10,000 as one hostile worker and checks an honest worker's calls after each.
"""

from __future__ import annotations

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
EXAMPLES_PER_OPERATION = 150  # x 10 operations: about 1,700 requests per run (at least 1,000 asserted)
LONG_EXAMPLES_PER_OPERATION = 1100  # x 10 operations: more than 10,000 requests (asserted)
SEEN: Counter[str] = Counter()
SEEN_LONG: Counter[str] = Counter()


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
RNG = random.Random(0)


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_generated_request_gets_a_server_error(case, api):
    app, joined = api
    me = RNG.choice(joined)
    token = RNG.choice([TOKEN, me["session_token"], me["session_token"]])
    if isinstance(case.body, dict) and "worker_id" in case.body and RNG.random() < 0.7:
        case.body["worker_id"] = me["worker_id"]
    if case.query and "worker_id" in case.query and RNG.random() < 0.5:
        case.query["worker_id"] = me["worker_id"]
    if case.path_parameters and "key" in case.path_parameters and RNG.random() < 0.5:
        case.path_parameters["key"] = me["tracker_key"]
    case.headers = {**(case.headers or {}), "Authorization": f"Bearer {token}"}
    response = case.call(app=app)
    SEEN[f"{case.method} {case.path}"] += 1
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])


def test_the_fuzzer_sent_at_least_1000_requests():
    # runs after the parametrized test in file order
    print(f"fuzzed requests: {sum(SEEN.values())}")
    assert sum(SEEN.values()) >= 1000, SEEN


@pytest.fixture(scope="module")
def honest_and_hostile(tmp_path_factory):
    """A fresh learner with two workers: one sends the generated requests, the other only honest calls."""
    app = make_app(tmp_path_factory.mktemp("model-long"))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(app, raise_server_exceptions=False) as http:  # one event loop for all its calls: 5x faster
        honest, hostile = (
            http.post("/v1/join", json={"name": name, "echo2_version": __version__}, headers=auth).json()
            for name in ("honest", "hostile")
        )
        yield app, http, honest, hostile


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


@pytest.mark.integration  # about five minutes: CI runs it, the quick subset does not
@schema.parametrize()
@settings(
    max_examples=LONG_EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
)
def test_ten_thousand_requests_from_one_worker_get_no_5xx_and_change_no_other_workers_answers(case, honest_and_hostile):
    app, http, honest, hostile = honest_and_hostile
    token = RNG.choice([TOKEN, hostile["session_token"], hostile["session_token"], hostile["session_token"]])
    if isinstance(case.body, dict) and "worker_id" in case.body and RNG.random() < 0.8:
        case.body["worker_id"] = RNG.choice([hostile["worker_id"]] * 3 + [honest["worker_id"]])  # or impersonate
    if case.query and "worker_id" in case.query and RNG.random() < 0.5:
        case.query["worker_id"] = hostile["worker_id"]
    if case.path_parameters and "key" in case.path_parameters and RNG.random() < 0.5:
        case.path_parameters["key"] = hostile["tracker_key"]
    case.headers = {**(case.headers or {}), "Authorization": f"Bearer {token}"}
    response = case.call(app=app)
    n = sum(SEEN_LONG.values())
    SEEN_LONG[f"{case.method} {case.operation.path}"] += 1
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])
    # after each request one of the honest worker's calls, in turn, and every 100th request all four
    honest_now = honest_answers(http, honest, which=None if n % 100 == 0 else n)
    assert set(honest_now) == {200}, (case.method, case.path, case.body, honest_now)


@pytest.mark.integration
def test_the_long_fuzz_sent_more_than_10000_requests():
    paths = {key.split(" ", 1)[1] for key in SEEN_LONG}  # the methods vary too: negative cases try others
    print(f"fuzzed requests (long run): {sum(SEEN_LONG.values())} over {len(paths)} paths")
    assert sum(SEEN_LONG.values()) >= 10_000, SEEN_LONG


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
