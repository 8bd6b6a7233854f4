"""Fault injection with real processes: nothing lost, nothing trained twice, training goes on.

One run, one learner process at a time on loopback, two long-lived workers and churn workers:

    phase 1  churn workers are started together and killed with SIGKILL (each one's whole process group, vLLM
             included): every other one at a random moment after it joined (fetch, engine load or a lease), the
             others while they hold a lease. Then one long-lived worker is frozen with SIGSTOP while it holds a
             lease, until the learner has expired that lease, and thawed: its late copy is rejected.
    phase 2  the learner gets SIGTERM: it checkpoints at the step boundary; `--resume` continues at that
             step and version (checkpointing every step from now on); the workers join it again.
    phase 3  the learner is killed with SIGKILL; `--resume` continues from its last checkpoint, with at
             most one step of work redone; the workers, one of them now a version ahead, join again.

Then the learner is stopped and its ledger must add up, per prompt and in counts. Every wait is a wait on the
learner's `/v1/status`, not on time. The checks do not depend on what the model says, so the run trains the default
model cut to two layers (`plumbing_model.py`). Per push: 2 kills; `--extended`: 6 kills, and a second run that cuts
a worker's network link (network namespaces) past the lease deadline. The random moments come from
ECHO2_CHURN_SEED (printed; drawn at random when unset).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from procs import kill_group, log_tail, spawn, wait_listening

from echo2cli.bench.netem import namespaces_available
from echo2cli.demo import free_port
from echo2cli.learner.checkpoint import complete_checkpoints
from echo2cli.metrics import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = "churn-test-token"
KILLS, EXTENDED_KILLS = 2, 6  # per push, and with --extended
LEASE_TIMEOUT_S = 15
B = 2  # prompts per step
LEARNER = [
    "--steps",
    "100000",
    "--prompts-per-step",
    str(B),
    "-G",
    "4",
    "--max-new-tokens",
    "8",
    "-S",
    "2",
    "--bt-listen",
    "127.0.0.1:0",
    "--token",
    TOKEN,
    "--lease-timeout-s",
    str(LEASE_TIMEOUT_S),
    "--activation",
    "all",
    "--quiet",
]


def worker_args(url: str, out: Path, name: str, *extra: str) -> list[str]:
    return [
        "worker",
        "--join",
        url,
        "--token",
        TOKEN,
        "--name",
        name,
        "--work-dir",
        str(out / name),
        "--bt-listen",
        "127.0.0.1:0",
        "--prompts-per-lease",
        "1",
        "--kv-cache-gib",
        "0.5",
        *extra,
    ]


class Learner:
    """The learner's process and API, across restarts."""

    def __init__(
        self, out: Path, port: int, host: str = "127.0.0.1", prefix: list[str] | None = None, model: Path | None = None
    ) -> None:
        self.out, self.port, self.prefix = out, port, prefix
        self.model = [] if model is None else ["--model", str(model)]
        self.url = f"http://{host}:{port}"
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
        self.proc = None

    def start(self, *extra: str) -> None:
        (self.out / "learner.json").unlink(missing_ok=True)
        self.proc = spawn(
            ["learner", "--out", str(self.out), "--port", str(self.port), *self.model, *LEARNER, *extra],
            self.out / "learner.log",
            prefix=self.prefix,
        )
        wait_listening(self.proc, self.out)

    def status(self) -> dict | None:
        try:
            return self.http.get("/v1/status").json()
        except (httpx.HTTPError, ValueError):
            return None  # between steps, restarting

    def worker(self, name: str) -> dict | None:
        status = self.status() or {"workers": []}
        alive = [w for w in status["workers"] if w["name"] == name and w["active"]]
        return alive[-1] if alive else None

    def step(self) -> int:
        wait_for(lambda: self.status() is not None, 120, "the learner's status")
        return self.status()["step"]

    def wait_step(self, step: int, timeout_s: float = 600) -> None:
        wait_for(lambda: (self.status() or {}).get("step", -1) >= step, timeout_s, f"learner step {step}")

    def stop(self) -> dict:
        """SIGTERM: the learner finishes its step, checkpoints and exits 0."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=300) == 0, log_tail(self.out / "learner.log")
        return json.loads((self.out / "summary.json").read_text())


def wait_for(predicate, timeout_s: float, what: str, logs: tuple[Path, ...] = ()) -> None:
    """Poll `predicate`; on a timeout, fail with the ends of `logs` (CI keeps nothing else of a run)."""
    deadline = time.time() + timeout_s
    while not predicate():
        if time.time() > deadline:
            tails = "\n".join(
                f"--- {log.name}\n{log.read_text(errors='replace')[-2500:]}" for log in logs if log.exists()
            )
            raise AssertionError(f"timed out waiting for {what}\n{tails}")
        time.sleep(0.3)


def holding_lease(learner: Learner, name: str) -> bool:
    w = learner.worker(name)
    return w is not None and w["leased_prompts"] > 0


def check_ledger(summary: dict, metrics: list[dict]) -> None:
    a, audit = summary["ledger"], summary["audit"]
    assert a["leased"] == a["admitted"] + a["rejected"] + a["expired"] + a["returned"] + a["outstanding"], a
    assert a["admitted"] == a["trained"] + a["waiting"] + a["dropped_stale"], a
    assert audit["lost"] == [] and audit["trained_twice"] == 0, audit
    # the metrics file is the other witness: contiguous steps, every prompt in exactly one of them
    assert [r["step"] for r in metrics] == list(range(len(metrics)))
    trained = [i for r in metrics for i in r["rollout/prompt_ids"]]
    assert len(trained) == len(set(trained)) == len(metrics) * B == a["trained"] == audit["trained"]


def churn_seed() -> int:
    seed = int(os.environ.get("ECHO2_CHURN_SEED") or random.SystemRandom().randrange(1 << 31))
    print(f"churn seed: ECHO2_CHURN_SEED={seed}")
    return seed


def leased(learner: Learner, name: str) -> int:
    """Prompts the learner counts as leased to `name`'s workers, active or not (a frozen one goes inactive)."""
    status = learner.status() or {"workers": []}
    return sum(w["leased_prompts"] for w in status["workers"] if w["name"] == name)


def kill_at(learner: Learner, proc, name: str, mode: str, rng: random.Random, out: Path) -> dict:
    """Kill `name`'s whole process group: once it holds a lease ("mid-lease"), or a random moment of up to 20 s
    after it joined ("random": fetching, loading its engine or on a lease)."""
    started = time.time()
    logs = (out / f"{name}.log", out / "learner.log")

    def running(state: bool) -> bool:
        assert proc.poll() is None, f"{name} exited before it was killed\n{log_tail(out / f'{name}.log')}"
        return state

    if mode == "mid-lease":
        wait_for(lambda: running(holding_lease(learner, name)), 480, f"{name} to hold a lease", logs=logs)
        time.sleep(rng.uniform(0, 0.3))
    else:
        wait_for(lambda: running(learner.worker(name) is not None), 480, f"{name} to join", logs=logs)
        time.sleep(rng.uniform(0, 20))
    w = learner.worker(name)
    kill_group(proc)
    return {
        "worker": name,
        "mode": mode,
        "at_step": (learner.status() or {}).get("step"),
        "joined": w is not None,
        "held_prompts": w["leased_prompts"] if w else 0,
        "after_s": round(time.time() - started, 1),
    }


@pytest.fixture(scope="module", params=[KILLS, pytest.param(EXTENDED_KILLS, marks=pytest.mark.extended)])
def churn(request, tmp_path_factory, plumbing_model):
    kills_wanted = request.param
    out = tmp_path_factory.mktemp("churn")
    seed = churn_seed()
    rng = random.Random(seed)
    learner = Learner(out, free_port(), model=plumbing_model)
    learner.start("--checkpoint-every", "0")
    # w0 at 8 rollouts/s: a version a second at most, as the full model's steps come on a fast day (the smaller
    # model unthrottled made three a second; that found a worker reading a delta libtorrent had not yet written,
    # fixed in `Transfer.written`, and test_swarm's regression test keeps it fixed)
    steady = [
        spawn(
            worker_args(learner.url, out, "w0", "--max-rollouts-per-s", "8"),
            out / "w0.log",
            env={"VLLM_CPU_OMP_THREADS_BIND": "0"},
        ),
        spawn(
            worker_args(learner.url, out, "w1", "--max-rollouts-per-s", "2"),
            out / "w1.log",
            env={"VLLM_CPU_OMP_THREADS_BIND": "1"},
        ),
    ]
    kills: list[dict] = []
    report: dict = {"kills": kills, "seed": seed}
    try:
        learner.wait_step(1)
        # phase 1: churn, two workers at a time (their engines start side by side), one killed at a random moment
        # and one mid-lease
        for first in range(0, kills_wanted, 2):
            names = [f"c{i}" for i in range(first, min(first + 2, kills_wanted))]
            procs = {
                name: spawn(
                    worker_args(learner.url, out, name, "--max-rollouts-per-s", "4"),
                    out / f"{name}.log",
                    env={"VLLM_CPU_OMP_THREADS_BIND": str(i % 2)},
                )
                for i, name in enumerate(names)
            }
            for i, name in enumerate(names):
                kills.append(kill_at(learner, procs[name], name, "random" if i == 0 else "mid-lease", rng, out))
        # freeze w1 while it holds a lease, until the learner has expired it, then thaw it: its copy comes late
        logs = (out / "w1.log", out / "learner.log")
        wait_for(lambda: holding_lease(learner, "w1"), 240, "w1 to hold a lease", logs=logs)
        kill_group(steady[1], signal.SIGSTOP)
        wait_for(lambda: leased(learner, "w1") == 0, 4 * LEASE_TIMEOUT_S, "w1's lease to expire", logs=logs)
        kill_group(steady[1], signal.SIGCONT)
        # the killed workers' leases expire while this learner runs
        churned = [k["worker"] for k in kills]
        wait_for(
            lambda: not any(leased(learner, n) for n in churned),
            4 * LEASE_TIMEOUT_S,
            "the killed workers' leases to expire",
        )
        # phase 2: graceful restart
        stopped = learner.stop()
        report["graceful"] = {"stopped_at": stopped["stopped_at"], "ledger": stopped["ledger"]}
        learner.start("--resume", str(out), "--checkpoint-every", "1")
        report["graceful"]["resumed_at"] = learner.step()
        learner.wait_step(stopped["stopped_at"] + 2)
        # phase 3: crash
        learner.wait_step(learner.step() + 1)
        kill_group(learner.proc)
        last_done = read_metrics(out / "metrics.jsonl")[-1]["version"]
        newest = int(complete_checkpoints(out)[-1].name.removeprefix("step_"))
        learner.start("--resume", str(out), "--checkpoint-every", "1")
        report["crash"] = {"last_step_done": last_done, "checkpoint": newest, "resumed_at": learner.step()}
        learner.wait_step(last_done + 2)
        report["steady_alive"] = [p.poll() is None for p in steady]
        report["final"] = learner.stop()
    finally:
        for p in [learner.proc, *steady]:
            if p is not None and p.poll() is None:
                kill_group(p, signal.SIGTERM)
        for p in [learner.proc, *steady]:
            if p is not None:
                try:
                    p.wait(timeout=30)
                except Exception:
                    kill_group(p)
    report["rejoins"] = {n: (out / f"{n}.log").read_text().count("joined again as") for n in ("w0", "w1")}
    (out / "churn_report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("seed", "kills", "graceful", "crash", "rejoins")}, indent=1))
    return out, report, kills_wanted


def test_churn_loses_nothing_and_trains_nothing_twice(churn):
    out, report, kills_wanted = churn
    final = report["final"]
    check_ledger(final, read_metrics(out / "metrics.jsonl"))
    kills = report["kills"]
    assert len(kills) == kills_wanted
    assert sum(k["held_prompts"] > 0 for k in kills) >= kills_wanted // 2, report  # half were killed mid-lease
    assert final["ledger"]["expired"] >= sum(k["held_prompts"] for k in kills)
    rejected = final["rejected_samples"]
    assert rejected.get("late", 0) + rejected.get("duplicate", 0) > 0  # the frozen worker's late copy
    assert not {"not_leased", "version_mismatch", "invalid_samples"} & set(rejected)  # honest workers only


def test_learner_resumes_at_the_same_step_after_sigterm(churn):
    _, report, _ = churn
    assert report["graceful"]["resumed_at"] == report["graceful"]["stopped_at"]


def test_learner_resumes_after_sigkill_with_at_most_one_step_redone(churn):
    _, report, _ = churn
    crash = report["crash"]
    assert crash["resumed_at"] == crash["checkpoint"]
    assert crash["last_step_done"] - crash["checkpoint"] <= 1


def test_workers_ride_through_both_restarts(churn):
    """Neither restart told them "finished" (a worker that hears it leaves and exits): both are alive at the end and
    joined each new learner."""
    _, report, _ = churn
    assert report["steady_alive"] == [True, True]
    assert all(n >= 2 for n in report["rejoins"].values()), report["rejoins"]


class Tether:
    """One network namespace joined to this one by a veth pair: 10.<x>.<y>.1 here, .2 inside. Taking
    the host side down cuts the node off (packets lost, connections left open), as a pulled cable does."""

    def __init__(self) -> None:
        self.ns, self.host_dev = f"e2cut{os.getpid() % 100000}", f"e2c{os.getpid() % 100000}"
        self.subnet = f"10.{150 + os.getpid() % 50}.{(os.getpid() // 50) % 250}"
        self.here, self.inside = f"{self.subnet}.1", f"{self.subnet}.2"

    def __enter__(self) -> Tether:
        run = [
            ["ip", "netns", "add", self.ns],
            ["ip", "link", "add", self.host_dev, "type", "veth", "peer", "name", "eth0", "netns", self.ns],
            ["ip", "addr", "add", f"{self.here}/24", "dev", self.host_dev],
            ["ip", "link", "set", self.host_dev, "up"],
            ["ip", "netns", "exec", self.ns, "ip", "addr", "add", f"{self.inside}/24", "dev", "eth0"],
            ["ip", "netns", "exec", self.ns, "ip", "link", "set", "eth0", "up"],
            ["ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up"],
        ]
        for cmd in run:
            subprocess.run(cmd, check=True, capture_output=True)
        return self

    def set_link(self, up: bool) -> None:
        subprocess.run(["ip", "link", "set", self.host_dev, "up" if up else "down"], check=True)

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)  # takes the veth pair with it

    @property
    def argv(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]


@pytest.mark.extended  # what it asserts, the churn run's freeze asserts per push (expired, a late copy rejected)
@pytest.mark.skipif(not namespaces_available(), reason="needs root to create network namespaces")
def test_worker_cut_off_the_network_loses_its_lease_and_its_late_copy_is_rejected(tmp_path):
    with Tether() as tether:
        learner = Learner(tmp_path, free_port(), host=tether.here)
        learner.start(
            "--checkpoint-every", "0", "--host", "0.0.0.0", "--public-url", learner.url, "--bt-listen", "0.0.0.0:0"
        )
        workers = [
            spawn(
                worker_args(learner.url, tmp_path, "w0", "--bt-listen", "0.0.0.0:0"),
                tmp_path / "w0.log",
                env={"VLLM_CPU_OMP_THREADS_BIND": "0"},
            ),
            spawn(
                worker_args(learner.url, tmp_path, "w1", "--bt-listen", "0.0.0.0:0", "--max-rollouts-per-s", "2"),
                tmp_path / "w1.log",
                prefix=tether.argv,
                env={"VLLM_CPU_OMP_THREADS_BIND": "1"},
            ),
        ]
        try:
            learner.wait_step(1)
            # 480 s, as for the churn workers: on CI a fresh engine beside a training learner once took over 240 s
            logs = (tmp_path / "w1.log", tmp_path / "learner.log")
            wait_for(lambda: holding_lease(learner, "w1"), 480, "w1 to hold a lease", logs)
            step_at_cut = learner.step()
            tether.set_link(up=False)
            wait_for(lambda: leased(learner, "w1") == 0, 4 * LEASE_TIMEOUT_S, "w1's lease to expire", logs)
            learner.wait_step(step_at_cut + 2)  # training went on without w1
            tether.set_link(up=True)
            wait_for(lambda: learner.worker("w1") is not None, 120, "w1 back", logs)
            learner.wait_step(learner.step() + 2)
            assert all(w.poll() is None for w in workers)
            summary = learner.stop()
        finally:
            for p in [learner.proc, *workers]:
                if p is not None and p.poll() is None:
                    kill_group(p, signal.SIGTERM)
            for p in [learner.proc, *workers]:
                if p is None:
                    continue
                try:
                    p.wait(timeout=30)
                except Exception:
                    kill_group(p)
    check_ledger(summary, read_metrics(tmp_path / "metrics.jsonl"))
    assert summary["ledger"]["expired"] >= 1
    assert summary["rejected_samples"].get("late", 0) + summary["rejected_samples"].get("duplicate", 0) > 0
