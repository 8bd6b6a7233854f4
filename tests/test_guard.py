"""The learner checks credentials and body size before it reads a body (FastAPI TestClient, no sockets)."""

from __future__ import annotations

import pytest
from conftest import JOIN_INFO, make_coord
from fastapi.testclient import TestClient

from echo2cli import __version__
from echo2cli.learner.guard import rollout_body_limit
from echo2cli.learner.server import build_app
from echo2cli.protocol import PolicyInfo


@pytest.fixture
def api(clock, tmp_path):
    coord = make_coord(clock)  # B = 2 prompts, G = 2, 8 new tokens
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
    http = TestClient(app)
    info = http.post(
        "/v1/join", json={"name": "w", "echo2_version": __version__}, headers={"Authorization": "Bearer s3cret"}
    ).json()
    return http, info, coord


def test_a_body_without_credentials_is_refused_before_it_is_parsed(api):
    http, _, _ = api
    # not JSON at all: a parsed body would be a 422; refusing it from the headers is a 401
    r = http.post("/v1/rollouts", content=b"{" * 200_000, headers={"Content-Type": "application/json"})
    assert r.status_code == 401 and "session token" in r.json()["detail"]


def test_a_body_over_the_runs_limit_is_413_before_it_is_read(api):
    http, info, coord = api
    limit = rollout_body_limit(coord.B, coord.G, coord.max_new_tokens)
    auth = {"Authorization": f"Bearer {info['session_token']}", "Content-Type": "application/json"}
    r = http.post("/v1/rollouts", content=b"{" * (limit + 1), headers=auth)
    assert r.status_code == 413 and "bytes" in r.json()["detail"]
    r = http.post("/v1/heartbeat", content=b" " * (64 << 10), headers=auth)
    assert r.status_code == 413


def test_a_streamed_body_is_cut_off_at_the_limit(api):
    http, info, coord = api
    sent = []

    def chunks():  # no Content-Length: chunked transfer
        for _ in range(100):
            sent.append(1)
            yield b" " * (16 << 10)

    auth = {"Authorization": f"Bearer {info['session_token']}", "Content-Type": "application/json"}
    r = http.post("/v1/rollouts", content=chunks(), headers=auth)
    assert r.status_code == 413
    assert rollout_body_limit(coord.B, coord.G, coord.max_new_tokens) < 100 * (16 << 10)


def test_a_batch_with_more_samples_than_a_lease_can_hold_is_refused(api):
    http, info, coord = api
    auth = {"Authorization": f"Bearer {info['session_token']}"}
    samples = [
        {"prompt_id": 0, "sample_idx": i, "completion_token_ids": [1], "logprobs": [-0.1]}
        for i in range(coord.B * coord.G + 1)
    ]
    r = http.post(
        "/v1/rollouts",
        json={"worker_id": info["worker_id"], "lease_id": "x", "version": 0, "samples": samples},
        headers=auth,
    )
    assert r.status_code == 422 and "at most" in r.json()["detail"]


def test_docs_and_schema_need_a_token_when_the_learner_has_one(api):
    http, info, _ = api
    for path in ("/docs", "/openapi.json"):
        assert http.get(path).status_code == 401
        assert http.get(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert http.get(path, headers={"Authorization": f"Bearer {info['session_token']}"}).status_code == 200
