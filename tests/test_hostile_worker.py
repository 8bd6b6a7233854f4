"""One joined worker must not stall, crash or fool the run: its numbers are bounded on the wire, its claims can buy
at most a bounded share of anything, and nothing it sends changes what another worker's calls answer.

Each test is a case a hostile worker was seen (or could be seen) to try against a live learner.
"""

from __future__ import annotations

import statistics

import pytest
from conftest import JOIN_INFO, make_coord
from fastapi.testclient import TestClient

from echo2cli import __version__
from echo2cli.learner.fleet import UPLINK_HALF_LIFE_S, FleetFull
from echo2cli.learner.server import build_app
from echo2cli.protocol import Heartbeat, PolicyInfo

TOKEN = "s3cret"


def policy(version: int) -> PolicyInfo:
    return PolicyInfo(
        version=version, info_hash="ab" * 20, torrent_b64="", digest="cd" * 32, size_bytes=1, published_at=0.0
    )


@pytest.fixture
def live(tmp_path, clock):
    """A learner app with a real coordinator and two joined workers: (http, coord, honest, hostile, clock)."""
    coord = make_coord(clock)
    coord.publish(policy(0))
    (tmp_path / "config.json").write_text("{}")
    app = build_app(
        coord,
        run_id="r",
        join_info=JOIN_INFO,
        model_dir=tmp_path,
        model_files=["config.json"],
        token=TOKEN,
        status_extra=dict,
        target_steps=3,
    )
    http = TestClient(app, raise_server_exceptions=False)
    joined = [
        http.post(
            "/v1/join", json={"name": name, "echo2_version": __version__}, headers={"Authorization": f"Bearer {TOKEN}"}
        ).json()
        for name in ("honest", "hostile")
    ]
    return http, coord, joined[0], joined[1], clock


def call_as(http: TestClient, worker: dict, path: str, body: dict | None = None):
    headers = {"Authorization": f"Bearer {worker['session_token']}"}
    if body is None:
        return http.get(path, params={"worker_id": worker["worker_id"]}, headers=headers)
    return http.post(path, json={"worker_id": worker["worker_id"], **body}, headers=headers)


def honest_calls_answer(http: TestClient, honest: dict) -> list[int]:
    return [
        call_as(http, honest, "/v1/policy").status_code,
        call_as(http, honest, "/v1/heartbeat", {"version_loaded": 0}).status_code,
        call_as(http, honest, "/v1/lease", {"version": 0, "max_prompts": 1}).status_code,
        http.get("/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}).status_code,
    ]


@pytest.mark.parametrize(
    "field, claims",
    [
        ("upload_bytes", [0, 10**6, 10**308, 10**309]),  # the last took every worker's /v1/policy down with a 500
        ("upload_bytes", [0, 10**308]),  # an uplink of inf, then a median of inf and a share of nan
        ("upload_bytes", [0, 2**50 + 1]),
        ("tokens_per_s", [1e308]),
        ("swap_s", [1e300]),
        ("version_loaded", [10**12]),
        ("downloading_version", [2**63]),
        ("ready_version", [10**40]),
    ],
)
def test_an_absurd_heartbeat_is_a_4xx_and_changes_no_other_workers_answers(live, field, claims):
    http, coord, honest, hostile, clock = live
    call_as(http, honest, "/v1/heartbeat", {"version_loaded": 0, "upload_bytes": 0})
    for claim in claims:
        clock(2.0)
        call_as(http, honest, "/v1/heartbeat", {"version_loaded": 0, "upload_bytes": 10**6})
        answer = call_as(http, hostile, "/v1/heartbeat", {"version_loaded": 0, field: claim})
        assert answer.status_code in (200, 422), answer.text
    assert honest_calls_answer(http, honest) == [200, 200, 200, 200]


def test_an_infinite_json_number_is_refused_not_turned_into_inf(live):
    http, _, honest, hostile, _ = live
    headers = {"Authorization": f"Bearer {hostile['session_token']}", "Content-Type": "application/json"}
    body = f'{{"worker_id": "{hostile["worker_id"]}", "version_loaded": 0, "tokens_per_s": 1e400}}'
    assert http.post("/v1/heartbeat", content=body, headers=headers).status_code == 422
    body = f'{{"name": "x", "echo2_version": "{__version__}", "usd_per_hour": NaN}}'
    operator = {**headers, "Authorization": f"Bearer {TOKEN}"}
    assert http.post("/v1/join", content=body, headers=operator).status_code == 422
    assert honest_calls_answer(http, honest) == [200, 200, 200, 200]


def uplink_shares(n: int, clock, liar_rate: float) -> tuple[int, list[int]]:
    """n workers, the last one a liar claiming `liar_rate` bytes/s, the others 10 MB/s: (liar's share, honest ones)."""
    coord = make_coord(clock)
    coord.publish(policy(0))
    workers = [coord.join(f"w{i}", 0.0) for i in range(n)]
    for w in workers:
        coord.heartbeat(Heartbeat(worker_id=w, version_loaded=0, upload_bytes=0))
    clock(2.0)
    for w in workers[:-1]:
        coord.heartbeat(Heartbeat(worker_id=w, version_loaded=0, upload_bytes=20_000_000))
    coord.heartbeat(Heartbeat(worker_id=workers[-1], version_loaded=0, upload_bytes=min(2**50, int(2 * liar_rate))))
    widths = [coord.latest_policy(w).slot_width for w in workers]
    return widths[-1], widths[:-1]


@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("liar_rate", [1e8, 1e12, 2.0**49])
def test_a_lying_uplink_gets_at_most_2x_the_median_share(clock, n, liar_rate):
    liar, honest = uplink_shares(n, clock, liar_rate)
    assert liar <= 2 * statistics.median(honest), (liar, honest)
    assert liar <= 2 * statistics.median([liar, *honest]), (liar, honest)


def test_a_measured_uplink_decays_and_a_burst_of_heartbeats_makes_no_rate(clock):
    coord = make_coord(clock)
    coord.publish(policy(0))
    w = coord.join("w", 0.0)
    coord.heartbeat(Heartbeat(worker_id=w, version_loaded=0, upload_bytes=0))
    clock(0.001)  # a heartbeat right after the last: a rate over a millisecond is noise
    coord.heartbeat(Heartbeat(worker_id=w, version_loaded=0, upload_bytes=10_000_000))
    assert coord.fleet.workers[w].uplink == 0.0
    clock(2.0)
    coord.heartbeat(Heartbeat(worker_id=w, version_loaded=0, upload_bytes=20_000_000))
    peak = coord.fleet.workers[w].uplink
    assert peak == pytest.approx(20_000_000 / 2.001)
    clock(UPLINK_HALF_LIFE_S)  # idle for one half-life
    coord.heartbeat(Heartbeat(worker_id=w, version_loaded=0, upload_bytes=20_000_000))
    assert coord.fleet.workers[w].uplink == pytest.approx(peak / 2)


def test_claims_of_versions_never_published_are_not_recorded(clock):
    coord = make_coord(clock)
    coord.publish(policy(0))
    w = coord.join("w", 0.0)
    for v in range(1, 50):  # each claim a new version: the records must not grow with them
        coord.heartbeat(Heartbeat(worker_id=w, version_loaded=v, ready_version=v, downloading_version=v))
    record = coord.fleet.workers[w]
    assert record.first_seen_with == {} and record.first_ready_with == {} and record.downloading_version is None
    assert coord.versions_in_download() == set()
    coord.publish(policy(1))
    coord.heartbeat(Heartbeat(worker_id=w, version_loaded=1))
    assert set(record.first_seen_with) == {1}


def test_asking_for_a_version_in_another_workers_name_records_nothing_for_it(live):
    """`GET /v1/policy?worker_id=<another worker>&version=v` once marked that worker as fetching v (status showed it,
    and the learner kept seeding v for it); now only the caller's own session token records its worker."""
    http, coord, honest, hostile, _ = live
    coord.publish(policy(1))
    coord.heartbeat(Heartbeat(worker_id=honest["worker_id"], version_loaded=1))
    before = coord.versions_in_download()  # the hostile worker's own fetch of version 0, from its join
    for token in (hostile["session_token"], TOKEN):  # another worker's session, or the join token (reads only)
        for version in (0, None):
            params = {"worker_id": honest["worker_id"], **({} if version is None else {"version": version})}
            got = http.get("/v1/policy", params=params, headers={"Authorization": f"Bearer {token}"})
            # the version alone, as anyone may read it: no fetch slot of the worker named
            assert got.status_code == 200 and got.json() == coord.policy_of(got.json()["version"]).model_dump()
    assert coord.fleet.workers[honest["worker_id"]].downloading_version is None
    assert coord.versions_in_download() == before
    # the worker's own call still records it
    coord.publish(policy(2))
    assert call_as(http, honest, "/v1/policy").json()["version"] == 2
    assert coord.fleet.workers[honest["worker_id"]].downloading_version == 2


def test_joins_past_the_fleets_cap_get_429_and_the_joined_workers_carry_on(live, monkeypatch):
    from echo2cli.learner import fleet

    http, coord, honest, hostile, _ = live
    monkeypatch.setattr(fleet, "MAX_WORKERS", 5)
    operator = {"Authorization": f"Bearer {TOKEN}"}
    answers = [
        http.post("/v1/join", json={"name": f"sybil{i}", "echo2_version": __version__}, headers=operator).status_code
        for i in range(6)
    ]
    assert answers == [200, 200, 200, 429, 429, 429]
    assert honest_calls_answer(http, honest) == [200, 200, 200, 200]


def test_one_address_joins_at_most_its_share_of_the_fleet_and_others_still_join(clock):
    """One token holder joined 4,096 times (heartbeating every few minutes) and every honest join got 429."""
    coord = make_coord(clock)
    coord.fleet.per_address = 3
    for i in range(3):
        coord.join(f"sybil{i}", 0.0, address="203.0.113.7")
    with pytest.raises(FleetFull, match="3 workers from 203.0.113.7 have joined"):
        coord.join("sybil3", 0.0, address="203.0.113.7")
    coord.join("honest", 0.0, address="198.51.100.2")  # another address
    gone = next(wid for wid, w in coord.fleet.workers.items() if w.name == "sybil0")
    coord.leave(gone)
    coord.join("sybil4", 0.0, address="203.0.113.7")  # a place given back by a leave


def test_a_silent_worker_is_let_go_and_departed_records_stay_bounded(clock, monkeypatch):
    from echo2cli.learner import fleet

    monkeypatch.setattr(fleet, "DEPARTED_KEPT", 3)
    coord = make_coord(clock)
    coord.publish(policy(0))
    quiet = coord.join("quiet", 0.0)
    clock(fleet.FORGET_AFTER_S + 1)
    coord.join("new", 0.0)
    assert not coord.known(quiet) and coord.session_owner(coord.credentials.session(coord.join("x", 0.0))) is not None
    for i in range(10):
        coord.leave(coord.join(f"w{i}", 0.0))
    coord.join("last", 0.0)
    assert sum(w.left for w in coord.fleet.workers.values()) <= 3
