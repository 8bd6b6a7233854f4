"""Cost-aware activation with real processes: a cheap slow worker and an expensive fast one join a learner.

The slow worker is throttled to 1 rollout/s at $0.75/h (rho = 2.1e-4 $/rollout); the fast one runs vLLM
unthrottled at $1/h, so it is cheaper per rollout whenever it makes more than 4/3 rollouts/s (on the default model
cut to two layers, `plumbing_model.py`, a CPU engine makes tens), and alone it covers gamma*mu_min of this small run
(B = 16 rollouts per step of a second or two). The slow worker's lease is one prompt (4 rollouts, 4 s), so it comes
back within the run, and S = STEPS, so no lease can come back stale. Every decision the learner logs must be the
one `plan()` makes from the measurements it logged, and a worker on standby must get no lease until a later
decision wakes it.
"""

from __future__ import annotations

import json
import os

import pytest
from procs import finish, spawn, wait_listening

from echo2cli.demo import free_port
from echo2cli.metrics import read_metrics
from echo2cli.plan.model import PlanInputs, WorkerSpec, plan

pytestmark = pytest.mark.integration

STEPS = 16
SLOW_USD, SLOW_MU, FAST_USD = 0.75, 1.0, 1.0  # the fast worker is cheaper per rollout above 4/3 rollouts/s


@pytest.fixture(scope="module")
def run(tmp_path_factory, plumbing_model):
    out = tmp_path_factory.mktemp("activation")
    port = free_port()
    learner = spawn(
        [
            "learner",
            "--model",
            str(plumbing_model),  # the decisions depend on measured rates, not on what the model says
            "--out",
            str(out),
            "--steps",
            str(STEPS),
            "--prompts-per-step",
            "4",
            "-G",
            "4",
            "--max-new-tokens",
            "8",
            "-S",
            str(STEPS),  # a stale lease is measured at 0 rollouts/s: the slow worker would never be planned for
            "--port",
            str(port),
            "--bt-listen",
            "127.0.0.1:0",
            "--checkpoint-every",
            "0",
            "--activation",
            "cost",
            "--learner-usd-per-hour",
            "2.0",
            "--quiet",
        ],
        out / "learner.log",
        env={"ECHO2_PLAN_EVERY": "1"},
    )
    wait_listening(learner, out)
    url = f"http://127.0.0.1:{port}"
    specs = {
        "cheap-slow": [
            "--usd-per-hour",
            str(SLOW_USD),
            "--max-rollouts-per-s",
            str(SLOW_MU),
            "--prompts-per-lease",
            "1",
        ],
        "pricey-fast": ["--usd-per-hour", str(FAST_USD), "--prompts-per-lease", "2"],
    }
    workers = [
        spawn(
            [
                "worker",
                "--join",
                url,
                "--name",
                name,
                "--work-dir",
                str(out / name),
                "--bt-listen",
                "127.0.0.1:0",
                "--kv-cache-gib",
                "0.5",
                *extra,
            ],
            out / f"{name}.log",
            env={"VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))},
        )
        for i, (name, extra) in enumerate(specs.items())
    ]
    finish(learner, workers, out)
    return out


def _decisions(run):
    return [d for d in read_metrics(run / "decisions.jsonl") if "inputs" in d]


def test_every_decision_is_the_one_the_model_predicts(run):
    decisions = _decisions(run)
    assert decisions, read_metrics(run / "decisions.jsonl")
    for d in decisions:
        pool = [
            WorkerSpec(w["worker_id"], w["usd_per_hour"], w["rollouts_per_s"], w["lease_rollouts"])
            for w in d["workers"]
            if w["rollouts_per_s"]
        ]
        names = {w["worker_id"]: w["name"] for w in d["workers"]}
        expected = plan(PlanInputs(**d["inputs"]), pool)
        assert sorted(names[w] for w in expected.standby) == d["standby"]
        assert d["mu_min_echo2"] == pytest.approx(expected.mu_min_echo2)


def test_cheap_slow_worker_stands_by_while_the_fast_one_is_cheaper_per_rollout(run):
    both = [d for d in _decisions(run) if sum(1 for w in d["workers"] if w["rollouts_per_s"]) == 2]
    assert both, "no decision saw both workers' throughput"
    last = both[-1]
    mu = {w["name"]: w["rollouts_per_s"] for w in last["workers"]}
    assert mu["cheap-slow"] <= SLOW_MU * 1.02, mu  # the throttle held
    # the premise: fast is cheaper per rollout (rho = $/h / rollouts/s), with a margin of 3x on the fast's rate
    assert FAST_USD / mu["pricey-fast"] < SLOW_USD / mu["cheap-slow"], mu
    assert last["active"] == ["pricey-fast"] and last["standby"] == ["cheap-slow"]


def test_a_worker_on_standby_gets_no_lease_until_woken(run):
    decisions = [d for d in read_metrics(run / "decisions.jsonl") if d.get("kind") != "staleness"]
    summary = json.loads((run / "summary.json").read_text())
    final = {w["name"]: w["leases"] for w in summary["workers"]}
    for d, nxt in zip(decisions, decisions[1:] + [None], strict=True):
        later = final if nxt is None else {w["name"]: w["leases"] for w in nxt["workers"]}
        for name in d["standby"]:
            assert later[name] == d["leases_after"][name], f"{name} got a lease while on standby"
    log = (run / "cheap-slow.log").read_text()
    assert "standby" in log
