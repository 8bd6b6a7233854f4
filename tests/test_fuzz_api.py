"""Fuzz every endpoint of the learner's API from its own OpenAPI schema, plus hand-written hostile requests:
the server must never answer 5xx to client input.

Schemathesis generates request bodies, paths and queries from `/openapi.json` (property-based, via
hypothesis). Most generated bodies get a real worker id and that worker's session token, so requests reach
the coordinator instead of stopping at the credential checks. The app runs in process with a real
coordinator (fake tokenizer).
"""

from __future__ import annotations

import random
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import schemathesis
from conftest import make_coord
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings

from echo2cli import __version__
from echo2cli.learner.server import build_app
from echo2cli.protocol import PolicyInfo

TOKEN = "s3cret"
JOIN_INFO = dict(
    task="arithmetic",
    group_size=2,
    max_new_tokens=8,
    temperature=1.0,
    staleness=1,
    heartbeat_s=2.0,
    model_files=["config.json"],
)
EXAMPLES_PER_OPERATION = 150  # x 9 operations: about 1,700 requests per run (at least 1,000 asserted)
SEEN: Counter[str] = Counter()


def make_app(model_dir: Path):
    coord = make_coord(lambda dt=0.0: 1000.0)
    coord.publish(
        PolicyInfo(version=0, info_hash="ab" * 20, torrent_b64="", sha256="cd" * 32, size_bytes=1, published_at=0)
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
