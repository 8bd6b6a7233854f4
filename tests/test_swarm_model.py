"""The swarm model's limits (`echo2cli/plan/swarm.py`) and `echo2 plan --fleet`."""

from __future__ import annotations

import json
import math

import pytest

from echo2cli.errors import ConfigError
from echo2cli.plan.model import min_staleness
from echo2cli.plan.swarm import (
    FIREWALL,
    MAX_CLASSES,
    NAT,
    UNCHOKE_SLOTS,
    Constants,
    Run,
    Worker,
    _exchange,
    _reach,
    fit,
    parse_fleet,
    spread,
)

MBPS = 1e6 / 8
M = 100e6
IDEAL = Constants(eta=1.0, beta=0.0, start_s=0.0)


def w(up: float, down: float | None = None, behind: str = "") -> Worker:
    return Worker(up * MBPS, (down or up) * MBPS, behind)


def test_one_worker_takes_one_download_at_the_slower_of_the_two_links():
    assert spread(M, 100 * MBPS, [w(10, 50)], IDEAL).t100_s == pytest.approx(M / (50 * MBPS), rel=0.01)
    assert spread(M, 20 * MBPS, [w(10, 50)], IDEAL).t100_s == pytest.approx(M / (20 * MBPS), rel=0.01)
    got = spread(M, 100 * MBPS, [w(100)], Constants(eta=0.8, beta=0.5, start_s=2.0))
    assert got.t100_s == pytest.approx(2.0 + M / (0.8 * 100 * MBPS), rel=0.01)  # one connection: beta plays no part
    assert got.learner_upload_over_size == pytest.approx(1.0)


@pytest.mark.parametrize("n", [2, 3, 8, 64, 1024])
def test_equal_open_links_reach_the_fluid_bound_and_the_learner_sends_one_copy(n):
    got = spread(M, 100 * MBPS, [w(100)] * n, IDEAL)
    assert got.ratio == pytest.approx(1.0, abs=0.02)
    assert got.t50_s <= got.t95_s <= got.t100_s
    assert got.learner_upload_over_size == pytest.approx(1.0, abs=0.01)
    assert got.classes == 1


def test_a_learner_faster_than_eight_downlinks_is_held_to_its_eight_upload_slots():
    # 1 Gbit/s learner, 64 workers at 10/100 Mbit/s: the learner cannot send faster than 8 downlinks (800 Mbit/s)
    got = spread(M, 1000 * MBPS, [w(1000, 100)] * 64, IDEAL)
    assert got.t100_s == pytest.approx(M / (100 * MBPS), rel=0.02)  # the downlink bound still holds: peers fill it
    alone = spread(M, 1000 * MBPS, [w(1, 100, NAT)] * 16, IDEAL)  # nobody to trade with: all from the learner
    assert alone.t100_s == pytest.approx(16 * M / (UNCHOKE_SLOTS * 100 * MBPS), rel=0.02)


def test_no_nat_d_worker_ever_serves_another():
    nat, open_, walled = Worker(1e6, 1e6, NAT), Worker(1e6, 1e6), Worker(1e6, 1e6, FIREWALL)

    def exchange(kinds, count):
        return _exchange(_reach(kinds, count), count, [0.5] * len(kinds), [1e5] * len(kinds), [1e5] * len(kinds))

    assert exchange([nat], [5]) == [0.0]  # five NAT'd workers, each holding half: nothing moves
    got = exchange([nat, open_], [4, 4])
    assert got[0] > 0 and got[1] > 0  # across the NAT boundary both ways: the NAT'd side dials
    assert exchange([walled, open_], [1, 3])[0] == 0.0
    assert exchange([open_], [1]) == [0.0]  # a worker alone does not send to itself


def test_a_fleet_all_behind_nat_gets_a_copy_each_from_the_learner_over_bittorrent():
    got = spread(M, 100 * MBPS, [w(100, 100, NAT)] * 8, IDEAL)
    assert got.learner_upload_over_size == pytest.approx(8.0, rel=0.01)
    assert got.web_seed_over_size == 0.0
    assert got.t100_s == pytest.approx(8 * M / (100 * MBPS), rel=0.02)


def test_a_fleet_all_behind_firewalls_runs_on_the_web_seed():
    got = spread(M, 100 * MBPS, [w(100, 100, FIREWALL)] * 4, IDEAL)
    assert got.web_seed_over_size == pytest.approx(4.0, rel=0.01) == got.learner_upload_over_size
    assert got.t100_s == pytest.approx(8.0 + 4 * M / (100 * MBPS), rel=0.02)  # after WEB_SEED_AFTER_S without a byte


def test_firewalled_workers_cost_the_learner_a_copy_each_and_their_shares_come_from_it_again():
    got = spread(M, 100 * MBPS, [w(100)] * 2 + [w(100, 100, FIREWALL)] * 2, IDEAL)
    assert got.learner_upload_over_size == pytest.approx(3.0, rel=0.01)
    assert got.web_seed_over_size == pytest.approx(2.0, rel=0.01)
    assert got.t50_s < got.t100_s


def test_half_nat_d_does_about_as_well_as_open_and_the_nat_d_finish_last():
    open_ = spread(M, 100 * MBPS, [w(100)] * 8, IDEAL)
    half = spread(M, 100 * MBPS, [w(100)] * 4 + [w(100, 100, NAT)] * 4, IDEAL)
    assert open_.t100_s <= half.t100_s < 1.5 * open_.t100_s
    assert half.learner_upload_over_size == pytest.approx(1.0, abs=0.01)


def test_slow_downlinks_set_the_last_time_and_fast_ones_the_median():
    got = spread(M, 1000 * MBPS, [w(1000)] * 6 + [w(10)] * 2, IDEAL)
    assert got.t100_s == pytest.approx(M / (10 * MBPS), rel=0.02)
    assert got.t50_s < 0.2 * got.t100_s


def test_more_distinct_links_than_classes_are_binned_and_keep_the_fleets_capacity():
    fleet = [w(10 + i, 50 + 2 * i, NAT if i % 3 == 0 else "") for i in range(600)]
    got = spread(M, 1000 * MBPS, fleet, IDEAL)
    assert got.classes <= MAX_CLASSES + 2
    assert got.learner_upload_over_size == pytest.approx(1.0, abs=0.02)
    assert got.t50_s <= got.t95_s <= got.t100_s < 3 * got.lower_bound_s


def test_the_fit_recovers_the_constants_a_model_run_was_made_with():
    truth = Constants(eta=0.85, beta=0.04, start_s=1.5)
    runs = [
        Run(M, 100 * MBPS, tuple([w(100)] * n), spread(M, 100 * MBPS, [w(100)] * n, truth).t100_s) for n in (1, 2, 4, 8)
    ]
    got = fit(runs)
    assert (got.eta, got.beta, got.start_s) == pytest.approx((0.85, 0.04, 1.5), abs=0.011)


def test_min_staleness():
    assert min_staleness(0.5, 10.0) == 1
    assert min_staleness(10.0, 10.0) == 2  # S_e * T must exceed T_bcast
    assert min_staleness(25.0, 10.0, kappa=2) == 4


def test_fleet_files():
    workers = parse_fleet("# a comment\n350x 1000 1000\n150x 1000 500 nat  # behind CGNAT\n10 10 firewall\n")
    assert len(workers) == 501
    assert workers[0] == Worker(1000 * MBPS, 1000 * MBPS)
    assert workers[350].behind == NAT and workers[350].down == 500 * MBPS
    assert workers[-1].behind == FIREWALL
    for bad in ("", "# nothing\n", "100\n", "0x 10 10\n", "10 -1\n", "10 10 behind\n", "x 10 10\n", "5000x 10 10\n",
                "100000000000x 10 10\n"):  # fmt: skip
        with pytest.raises(ConfigError) as err:
            parse_fleet(bad, "f.txt")
        assert "f.txt" in str(err.value) and "\n" not in str(err.value)


def test_a_fleet_far_slower_than_its_bound_is_modelled_in_steps_that_grow_with_the_log_of_its_time(monkeypatch):
    """T* counts uplinks NAT-to-NAT and firewalled pairs never use. Three hundred NAT'd workers that only one open
    worker reaches took more than 200 T*, where the model stopped with "did not converge" (a traceback from `echo2
    plan --fleet`); a firewalled worker on a tiny version waits out the web seed's 8 s at T*/600 a step (0.01 MB:
    ~100 s to model). Steps are counted here, not seconds."""
    from echo2cli.plan import swarm

    steps = [0]
    step = swarm._Swarm.step

    def counted(self, policy):
        steps[0] += 1
        step(self, policy)

    monkeypatch.setattr(swarm._Swarm, "step", counted)
    cases = [  # (version bytes, fleet)
        (8000e6, [w(1000)] + [w(1000, 1000, NAT)] * 300),
        (0.01e6, [w(1000), w(10, 10, FIREWALL)]),
        (1e3, [w(10 + i % 997, 50 + i % 991, ("", NAT, FIREWALL)[i % 3]) for i in range(4096)]),
    ]
    results = []
    for size, fleet in cases:
        steps[0] = 0
        got = spread(size, 10_000 * MBPS, fleet)
        assert got.t50_s <= got.t100_s
        assert steps[0] <= swarm.STEPS * (2 + math.log(got.t100_s / got.lower_bound_s)), (size, steps[0])
        results.append(got)
    assert results[0].t100_s > 200 * results[0].lower_bound_s
    assert results[1].t100_s > 8.0 and results[2].t100_s > 8.0  # the firewalled waited out the web seed's delay


def test_bad_inputs_are_one_line_errors():
    for args in ((0, 1.0, [w(1)]), (M, 0, [w(1)]), (M, 1.0, [])):
        with pytest.raises(ConfigError):
            spread(*args)
    with pytest.raises(ConfigError):
        spread(M, 1.0, [Worker(0.0, 1.0)])


def test_echo2_plan_with_a_fleet_predicts_t_bcast_and_the_s_it_forces(tmp_path, capsys):
    from typer.testing import CliRunner

    from echo2cli.cli import app

    fleet = tmp_path / "fleet.txt"
    fleet.write_text("700x 1000 1000\n300x 1000 1000 nat\n")
    args = ["plan", "--fleet", str(fleet), "--version-mb", "8000", "--batch", "512", "--t-train", "20", "-S", "1"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    f = out["fleet"]
    assert f["workers"] == 1000 and f["behind_nat"] == 300
    assert f["full"]["lower_bound_s"] == pytest.approx(64.0)  # 8 GB over a 1 Gbit/s downlink
    assert f["full"]["t50_s"] <= f["full"]["t95_s"] <= f["full"]["t100_s"]
    assert f["delta"]["size_mb"] == pytest.approx(320.0) and f["delta"]["t95_s"] < f["full"]["t95_s"]
    assert out["inputs"]["t_bcast_s"] == pytest.approx(f["delta"]["t95_s"]) == pytest.approx(f["t_bcast_s"])
    assert f["min_staleness"] == 1
    # --t-bcast given wins over the fleet's prediction
    given = json.loads(CliRunner().invoke(app, [*args, "--t-bcast", "7", "--json"]).output)
    assert given["inputs"]["t_bcast_s"] == 7.0
    # a slow fleet forces a larger S: the planner says which
    fleet.write_text("100x 10 10\n")
    slow = CliRunner().invoke(app, [*args, "--delta-ratio", "1"])
    assert slow.exit_code != 0 and "need S >= " in str(slow.exception)
    missing = CliRunner().invoke(app, ["plan", "--fleet", str(fleet), "--batch", "8", "--t-train", "1", "-S", "1"])
    assert missing.exit_code != 0 and "--version-mb" in str(missing.exception)


def test_serving_the_furthest_behind_first_brings_a_mixed_fleet_nearer_its_bound():
    fleet = [w(1000)] * 20 + [w(100, 500)] * 40 + [w(20, 200)] * 40
    fair = spread(M, 10000 * MBPS, fleet, IDEAL)
    behind = spread(M, 10000 * MBPS, fleet, IDEAL, policy="behind_first")
    assert behind.t100_s < 0.9 * fair.t100_s
    assert behind.ratio == pytest.approx(1.0, abs=0.05)
    assert fair.t50_s < behind.t50_s  # the fast ones wait their turn


def test_the_example_fleet_and_every_links_file_are_fleet_files():
    from pathlib import Path

    examples = Path(__file__).parent.parent / "examples"
    assert len(parse_fleet((examples / "fleet-mixed-1024.txt").read_text())) == 1024
    for path in (examples / "links").glob("*.txt"):
        assert parse_fleet(path.read_text(), str(path))
