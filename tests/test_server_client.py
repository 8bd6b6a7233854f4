"""The HTTP API through FastAPI's TestClient and the worker client through httpx.MockTransport."""

import httpx
import pytest
from conftest import JOIN_INFO, make_coord
from fastapi.testclient import TestClient

from echo2cli import __version__
from echo2cli.errors import AuthError, LearnerUnreachable, ProtocolError
from echo2cli.learner.server import build_app
from echo2cli.protocol import JoinRequest, LeaseRequest, PolicyInfo
from echo2cli.worker.client import LearnerClient


@pytest.fixture
def app(clock, tmp_path):
    coord = make_coord(clock)
    coord.publish(
        PolicyInfo(version=0, info_hash="ab" * 20, torrent_b64="", digest="cd" * 32, size_bytes=1, published_at=0)
    )
    (tmp_path / "config.json").write_text("{}")
    return build_app(
        coord,
        run_id="r",
        join_info=JOIN_INFO,
        model_dir=tmp_path,
        model_files=["config.json"],
        token="s3cret",
        status_extra=dict,
        target_steps=3,
    )


def test_wrong_token_is_401_and_the_client_says_what_to_do(app):
    http = TestClient(app)
    assert http.post("/v1/join", json={"name": "w", "echo2_version": __version__}).status_code == 401
    assert (
        http.post(
            "/v1/join", json={"name": "w", "echo2_version": __version__}, headers={"Authorization": "Bearer s3cret"}
        ).status_code
        == 200
    )


def test_join_lease_round_trip_through_the_client(app):
    http = TestClient(app)
    transport = httpx.MockTransport(lambda req: _forward(http, req))
    client = LearnerClient("http://learner", "s3cret", transport=transport)
    info = client.join(JoinRequest(name="w"))
    assert info.policy.version == 0 and info.group_size == 2
    resp = client.lease(LeaseRequest(worker_id=info.worker_id, version=0, max_prompts=2))
    assert resp.status == "ok" and len(resp.lease.prompts) == 2
    assert client.model_file("config.json") == b"{}"


def test_unknown_worker_gets_a_protocol_error_not_a_retry(app):
    http = TestClient(app)
    client = LearnerClient("http://learner", "s3cret", transport=httpx.MockTransport(lambda r: _forward(http, r)))
    with pytest.raises(ProtocolError, match="join again"):
        client.lease(LeaseRequest(worker_id="ghost", version=0))


def test_client_maps_401_to_auth_error():
    client = LearnerClient("http://l", "x", transport=httpx.MockTransport(lambda r: httpx.Response(401)))
    with pytest.raises(AuthError, match="--token"):
        client.join(JoinRequest(name="w"))


def test_client_maps_413_to_one_protocol_error_line():
    detail = "request body over 4096 bytes, the most /v1/rollouts takes in this run"
    client = LearnerClient(
        "http://l", "x", transport=httpx.MockTransport(lambda r: httpx.Response(413, json={"detail": detail}))
    )
    with pytest.raises(ProtocolError, match="413") as err:
        client.join(JoinRequest(name="w"))
    assert detail in str(err.value) and "\n" not in str(err.value)


def test_client_retries_5xx_then_gives_up_with_one_line():
    calls = []

    def handler(request):
        calls.append(1)
        return httpx.Response(503)

    client = LearnerClient("http://l", transport=httpx.MockTransport(handler), unreachable_s=0.6)
    with pytest.raises(LearnerUnreachable, match="unreachable"):
        client.join(JoinRequest(name="w"))
    assert len(calls) >= 2


def test_client_does_not_retry_4xx():
    calls = []

    def handler(request):
        calls.append(1)
        return httpx.Response(422, json={"detail": "bad"})

    client = LearnerClient("http://l", transport=httpx.MockTransport(handler))
    with pytest.raises(ProtocolError, match="bad"):
        client.join(JoinRequest(name="w"))
    assert len(calls) == 1


def test_malformed_rollout_body_is_422(app):
    http = TestClient(app)
    r = http.post("/v1/rollouts", json={"worker_id": "x"}, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 422  # the body is checked before the credentials of the worker it names


ANNOUNCE_QUERY = (
    "?info_hash=%01%01%01%01%01%01%01%01%01%01%01%01%01%01%01%01%01%01%01%01&peer_id=aaaaaaaaaaaaaaaaaaaa&port=1234"
)


def test_tracker_serves_joined_peers_only(app):
    http = TestClient(app)
    info = http.post(
        "/v1/join", json={"name": "w", "echo2_version": __version__}, headers={"Authorization": "Bearer s3cret"}
    ).json()
    r = http.get(f"/announce/{info['tracker_key']}{ANNOUNCE_QUERY}")
    assert r.status_code == 200 and r.content.startswith(b"d") and b"peers" in r.content
    for path in (f"/announce/not-a-key{ANNOUNCE_QUERY}", f"/announce{ANNOUNCE_QUERY}"):
        r = http.get(path)
        assert b"peers" not in r.content and r.status_code in (200, 404)
    assert b"not a joined peer" in http.get(f"/announce/nope{ANNOUNCE_QUERY}").content


def test_calls_as_a_worker_need_that_workers_own_session_token(app):
    http = TestClient(app)

    def join(name):
        body = {"name": name, "echo2_version": __version__}
        return http.post("/v1/join", json=body, headers={"Authorization": "Bearer s3cret"}).json()

    a, b = join("a"), join("b")
    assert a["session_token"] != b["session_token"] and len(a["session_token"]) >= 32
    lease = {"worker_id": a["worker_id"], "version": 0, "max_prompts": 1}
    assert http.post("/v1/lease", json=lease, headers={"Authorization": "Bearer s3cret"}).status_code == 401
    r = http.post("/v1/lease", json=lease, headers={"Authorization": f"Bearer {b['session_token']}"})
    assert r.status_code == 403 and "another worker" in r.json()["detail"]
    assert (
        http.post("/v1/lease", json=lease, headers={"Authorization": f"Bearer {a['session_token']}"}).status_code == 200
    )
    # read-only calls take the join token or a session token, nothing else
    assert http.get("/v1/status", headers={"Authorization": f"Bearer {a['session_token']}"}).status_code == 200
    assert http.get("/v1/status", headers={"Authorization": "Bearer guess"}).status_code == 401


def _forward(http: TestClient, request: httpx.Request) -> httpx.Response:
    target = request.url.path + (f"?{request.url.query.decode()}" if request.url.query else "")
    r = http.request(request.method, target, content=request.content, headers=dict(request.headers))
    return httpx.Response(r.status_code, content=r.content, headers=r.headers)


def test_a_cut_off_worker_hears_why(app):
    http = TestClient(app)
    client = LearnerClient("http://learner", "s3cret", transport=httpx.MockTransport(lambda r: _forward(http, r)))
    info = client.join(JoinRequest(name="w"))
    coord = app.state.coord
    coord.fleet.workers[info.worker_id].cut_off = True
    with pytest.raises(AuthError, match="cut off after 5 batches of invalid rollouts"):
        client.lease(LeaseRequest(worker_id=info.worker_id, version=0))


def test_a_worker_of_another_echo2_version_is_refused_with_one_line(app):
    http = TestClient(app)
    r = http.post(
        "/v1/join", json={"name": "old", "echo2_version": "0.0.9"}, headers={"Authorization": "Bearer s3cret"}
    )
    assert r.status_code == 409 and "install the same version on both" in r.json()["detail"]
    client = LearnerClient("http://learner", "s3cret", transport=httpx.MockTransport(lambda q: _forward(http, q)))
    with pytest.raises(ProtocolError, match="refused us: worker runs echo2 0.0.9"):
        client.join(JoinRequest(name="old", echo2_version="0.0.9"))
    assert client.join(JoinRequest(name="current")).worker_id  # the client sends its own version


def test_a_restarted_learner_answers_session_lost_and_the_client_can_join_again(app, clock, tmp_path):
    from echo2cli.errors import SessionLost

    target = {"app": TestClient(app)}
    client = LearnerClient(
        "http://learner", "s3cret", transport=httpx.MockTransport(lambda r: _forward(target["app"], r))
    )
    info = client.join(JoinRequest(name="w"))
    restarted = make_coord(clock)
    restarted.publish(
        PolicyInfo(version=0, info_hash="ab" * 20, torrent_b64="", digest="cd" * 32, size_bytes=1, published_at=0)
    )
    target["app"] = TestClient(
        build_app(
            restarted,
            run_id="r",
            join_info=JOIN_INFO,
            model_dir=tmp_path,
            model_files=["config.json"],
            token="s3cret",
            status_extra=dict,
            target_steps=3,
        )
    )
    with pytest.raises(SessionLost, match="no longer knows"):
        client.lease(LeaseRequest(worker_id=info.worker_id, version=0))
    again = client.join(JoinRequest(name="w"))  # with the join token, not the lost session's
    assert client.lease(LeaseRequest(worker_id=again.worker_id, version=0)).status == "ok"


def test_policy_of_an_older_version_for_a_delta_chain_and_404_for_one_never_published(app):
    http = TestClient(app)
    auth = {"Authorization": "Bearer s3cret"}
    assert http.get("/v1/policy?version=0", headers=auth).json()["version"] == 0
    r = http.get("/v1/policy?version=7", headers=auth)
    assert r.status_code == 404 and "never published" in r.json()["detail"]
    client = LearnerClient("http://learner", "s3cret", transport=httpx.MockTransport(lambda q: _forward(http, q)))
    assert client.policy(version=0).version == 0
    with pytest.raises(ProtocolError, match="never published"):
        client.policy(version=7)
