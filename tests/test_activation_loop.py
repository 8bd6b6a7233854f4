"""The learner's closed loop (`learner/activation.py`) on a coordinator with a fake clock: measured
throughput, the first T_bcast, joins and deaths re-plan at once, standby workers get no leases."""

from conftest import batch_for, make_coord

from echo2cli.config import LearnerConfig
from echo2cli.learner.activation import Activation
from echo2cli.metrics import read_metrics
from echo2cli.protocol import Heartbeat


def lease_and_return(coord, clock, wid, seconds):
    lease = coord.lease(wid, coord.version, 2).lease
    clock(seconds)
    coord.submit(batch_for(coord, wid, lease))
    coord.admission.ready.clear()  # the test drives measurements, not training
    coord.admission.done.clear()


def one_measured_worker(coord, clock, act, t_train_s):
    """A worker whose throughput is measured (two leases returned), and a step time."""
    a = coord.join("a", 1.0)
    lease_and_return(coord, clock, a, 1.0)
    lease_and_return(coord, clock, a, 1.0)
    act.observe_step(t_train_s)


def setup(clock, tmp_path):
    # B = 2 prompts x G 2 = 4 rollouts per step; S = 2
    coord = make_coord(clock, G=2, S=2, B=2)
    cfg = LearnerConfig(prompts_per_step=2, group_size=2, staleness=2, plan_every=100)
    act = Activation(cfg, coord, tmp_path / "decisions.jsonl")
    return coord, act


def test_joins_first_measurements_and_deaths_replan_and_standby_gets_no_lease(clock, tmp_path):
    coord, act = setup(clock, tmp_path)
    fast = coord.join("fast", 1.0)
    slow = coord.join("slow", 0.9)
    assert act.update(0)["reason"] == "joined: fast, slow"
    assert act.update(0) is None  # nothing changed, not yet plan_every steps
    # fast returns 4 rollouts per 1 s lease (4/s); slow per 8 s (0.5/s): rho fast = 1/(3600*4), slow = 0.9/1800
    for _ in range(3):
        lease_and_return(coord, clock, fast, 1.0)
        lease_and_return(coord, clock, slow, 8.0)
        coord.heartbeat(Heartbeat(worker_id=fast, version_loaded=0))
        coord.heartbeat(Heartbeat(worker_id=slow, version_loaded=0))
    act.observe_step(10.0)  # T_train = 10 s -> rate bound 0.4/s
    coord.published.ready_s[1] = 2.0
    decision = act.update(1)
    assert decision["reason"].startswith("first throughput")
    assert decision["active"] == ["fast"] and decision["standby"] == ["slow"] and decision["changed"]
    assert coord.lease(slow, 0, 2).status == "standby"
    assert coord.lease(fast, 0, 2).status == "ok"
    # fast stops heartbeating: it is dead after 3 heartbeat periods; the next update re-plans without it
    clock(7.0)
    coord.heartbeat(Heartbeat(worker_id=slow, version_loaded=0))
    decision = act.update(2)
    assert decision["reason"] == "gone: fast"
    assert decision["active"] == ["slow"] and decision["standby"] == []
    assert coord.lease(slow, 0, 2).status in ("ok", "wait")
    logged = read_metrics(tmp_path / "decisions.jsonl")
    assert [d["reason"].split(":")[0] for d in logged] == ["joined", "first throughput of", "gone"]


def test_infeasible_setting_keeps_everyone_active_and_says_why(clock, tmp_path):
    coord, act = setup(clock, tmp_path)
    one_measured_worker(coord, clock, act, t_train_s=1.0)
    coord.published.ready_s[1] = 50.0  # T_bcast 50 s vs S_e*T_train = 2 s: no throughput keeps the learner busy
    decision = act.update(1)
    assert decision["standby"] == [] and "need S >=" in decision["decision"]


def test_activation_all_never_puts_anyone_on_standby(clock, tmp_path):
    coord = make_coord(clock, G=2, S=2, B=2)
    act = Activation(LearnerConfig(activation="all"), coord, tmp_path / "d.jsonl")
    coord.join("a", 1.0)
    assert act.update(0) is None and not (tmp_path / "d.jsonl").read_text()


def test_the_first_t_bcast_measured_replans_at_once(clock, tmp_path):
    coord, act = setup(clock, tmp_path)
    one_measured_worker(coord, clock, act, t_train_s=10.0)
    assert act.update(1)["decision"].startswith("all active: waiting for measurements")
    assert act.update(2) is None
    coord.published.ready_s[0] = 30.0  # v0's includes the engine start: not a measurement the plan uses
    assert act.update(2) is None
    coord.published.ready_s[1] = 2.0
    decision = act.update(2)
    assert decision["reason"] == "first T_bcast" and "inputs" in decision
    assert act.update(3) is None
