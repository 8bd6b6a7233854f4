"""End to end with real parts: a learner and two workers as separate processes, vLLM on CPU, libtorrent peers and the
learner's tracker on loopback, HTTP between them. Nothing is faked.

The learner starts from a Hugging Face Hub id with HF_HUB_OFFLINE=1, the weights in ~100 MB shards
(`integration_fixtures.hf_home`); the workers have empty Hub caches of their own (the learner serves them
everything). Before the workers start, a stock BitTorrent client (Debian's aria2c, installed by scripts/setup.sh as
root) fetches version 0 from the learner's tracker and seed. After the run, a learner resumes from its checkpoint by
the same id.

Takes ~3-4 minutes on a 2-core machine (two vLLM engine starts dominate)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from hub_cache import HUB_REPO, hub_only
from procs import finish, kill_group, log_tail, spawn, wait_for, wait_listening
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from echo2cli import __version__
from echo2cli.broadcast.digest import file_digest
from echo2cli.broadcast.image import WIRE_DTYPES
from echo2cli.demo import free_port
from echo2cli.layout import VersionKey, checkpoint_dir
from echo2cli.learner.checkpoint import STATE_FILE
from echo2cli.learner.divergence import DivergenceGuard, Thresholds
from echo2cli.metrics import read_metrics
from echo2cli.models import prepare_default_model
from echo2cli.worker.client import LearnerClient

pytestmark = pytest.mark.integration

S = 1
STEPS = 3
REQUIRED_KEYS = {
    "step",
    "version",
    "rollout/reward_mean",
    "rollout/reward_std",
    "rollout/staleness_hist",
    "rollout/staleness_max",
    "learner/t_train_s",
    "learner/t_wait_s",
    "learner/bubble_ratio",
    "perf/train_tokens_per_s",
    "workers/active",
    "train/loss",
    "train/trained_frac",
    "train/clipfrac",
    "train/is_weight_mean",
}
HEALTH_KEYS = {"train/clipfrac", "train/is_weight_mean"}  # absent where no token was trained (flat groups only)


TOKEN = "t0k3n"


def fetch_with_aria2c(url: str, out: Path) -> dict | None:
    """Join as "aria2" for a tracker key and version 0's .torrent, fetch it with aria2c from the learner's tracker and
    seed, leave; what it got. None where aria2c is not installed."""
    client = shutil.which("aria2c")
    if client is None:
        return None
    auth = {"Authorization": f"Bearer {TOKEN}"}
    joined = httpx.post(f"{url}/v1/join", json={"name": "aria2", "echo2_version": __version__}, headers=auth).json()
    policy = joined["policy"]
    torrent = out / "aria2" / "v0.torrent"
    torrent.parent.mkdir()
    torrent.write_bytes(base64.b64decode(policy["torrent_b64"]))
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            client,
            "--dir",
            str(out / "aria2"),
            f"--bt-tracker={url}/announce/{joined['tracker_key']}",
            "--bt-exclude-tracker=*",
            "--seed-time=0",
            "--enable-dht=false",
            "--bt-enable-lpd=false",
            "--enable-peer-exchange=false",
            "--bt-stop-timeout=120",
            "--summary-interval=0",
            f"--listen-port={free_port()}",
            "--console-log-level=warn",
            str(torrent),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    seconds = time.monotonic() - t0
    session = {"Authorization": f"Bearer {joined['session_token']}"}
    httpx.post(f"{url}/v1/leave", json={"worker_id": joined["worker_id"]}, headers=session)
    got = out / "aria2" / "v000000" / "model.safetensors"
    return {
        "rc": proc.returncode,
        "output": proc.stdout[-2000:] + proc.stderr[-2000:],
        "path": str(got),
        "digest": file_digest(got) if got.exists() else None,
        "announced_digest": policy["digest"],
        "seconds": seconds,
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory, hf_home):
    out = tmp_path_factory.mktemp("e2e")
    port = free_port()
    learner = spawn(
        [
            "learner",
            "--model",
            HUB_REPO,
            "--out",
            str(out),
            "--steps",
            str(STEPS),
            "--prompts-per-step",
            "2",
            "-G",
            "4",
            "--max-new-tokens",
            "8",
            "-S",
            str(S),
            "--port",
            str(port),
            "--bt-listen",
            "127.0.0.1:0",
            "--checkpoint-every",
            "0",
            "--token",
            TOKEN,
            "--eval-every",
            "2",
            "--adaptive-staleness",  # with bounds no real step meets: every step is flagged
            "--guard-kl-max",
            "1e-9",
            "--guard-ess-min",
            "1.0",  # any engine/trainer mismatch at all puts the ESS below 1
            "--kl-coef",
            "0.001",  # flat groups get a pass too (their KL term): every step is measured
            "--report-to",
            "jsonl,tensorboard,wandb,trackio",
            "--quiet",
        ],
        out / "learner.log",
        env={
            "ECHO2_EVAL_LIMIT": "10",
            "ECHO2_EVAL_K": "2",
            "TRACKIO_DIR": str(out / "trackio"),
            "WANDB_MODE": "offline",
            **hub_only(hf_home),
        },
    )
    url = f"http://127.0.0.1:{port}"
    wait_listening(learner, out)
    os.link(VersionKey(0).path(out / "versions"), out / "v0.safetensors")  # kept when the learner prunes version 0
    (out / "aria2.json").write_text(json.dumps(fetch_with_aria2c(url, out)))
    workers = [
        spawn(
            [
                "worker",
                "--join",
                url,
                "--token",
                TOKEN,
                "--name",
                f"w{i}",
                "--work-dir",
                str(out / f"w{i}"),
                "--bt-listen",
                "127.0.0.1:0",
                "--prompts-per-lease",
                "1",
                "--kv-cache-gib",
                "0.5",
            ],
            out / f"worker{i}.log",
            env={"VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1)), **hub_only(out / f"empty-hf{i}")},
        )
        for i in range(2)
    ]
    watch_status(learner, url, out)
    finish(learner, workers, out)
    return out


def echo2_status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "echo2cli", "status", *args], capture_output=True, text=True)


def watch_status(learner, url: str, out: Path) -> None:
    """`echo2 status URL` while the learner trains: once a step is done, as JSON and as the view; with a wrong
    token. Kept in out/status-*.txt for the tests below."""
    client = LearnerClient(url, "t0k3n")
    # the step counter advances when a step's version is handed to the publisher; its metrics follow
    wait_for(lambda: learner.poll() is not None or client.status().history, 600, "the first step's metrics")
    for name, args in (
        ("json", [url, "--token", "t0k3n", "--json"]),
        ("view", [url, "--token", "t0k3n"]),
        ("wrong-token", [url, "--token", "nope"]),
    ):
        proc = echo2_status(*args)
        (out / f"status-{name}.txt").write_text(f"{proc.returncode}\n{proc.stdout}\n{proc.stderr}")


def test_learner_runs_all_steps_with_versions_advancing_and_complete_metrics(run):
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [r["version"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        required = REQUIRED_KEYS - (HEALTH_KEYS if r["train/trained_frac"] == 0 else set())
        assert required <= r.keys(), required - r.keys()
    assert any(r.get("bcast/t_s") is not None for r in rows)


def test_every_trained_sample_is_at_most_S_versions_old(run):
    for r in read_metrics(run / "metrics.jsonl"):
        assert all(0 <= int(k) <= S for k in r["rollout/staleness_hist"])
        assert sum(r["rollout/staleness_hist"].values()) == r["rollout/samples"] == 2 * 4


def test_workers_loaded_every_version_they_used_from_the_swarm_with_verified_hashes(run):
    loads: dict[str, dict[int, dict]] = {}
    for i in range(2):
        for e in read_metrics(run / f"w{i}" / "events.jsonl"):
            if e["event"] == "loaded":
                loads.setdefault(e["worker_id"], {})[e["version"]] = e
    assert len(loads) == 2
    for r in read_metrics(run / "metrics.jsonl"):
        for worker_id, version in r["rollout/worker_versions"]:
            assert version in loads[worker_id], f"{worker_id} trained on v{version} it never loaded"
    for versions in loads.values():
        for e in versions.values():
            assert e["digest_verified"] and len(e["digest"]) == 64
            if e["via"] == "full":
                assert e["downloaded_bytes"] >= e["size_bytes"]  # the bytes came over the swarm
            else:  # a delta against the version loaded before, rebuilt and hash-checked
                assert e["version"] - 1 in versions
                assert 0 < e["downloaded_bytes"] < 0.2 * e["size_bytes"]
    assert len({v for versions in loads.values() for v in versions}) >= 3  # three versions went around
    assert any(e["via"] == "delta" for versions in loads.values() for e in versions.values())


def test_learner_publishes_small_deltas(run):
    ratios = [r["bcast/delta_ratio"] for r in read_metrics(run / "metrics.jsonl") if "bcast/delta_ratio" in r]
    assert ratios and all(0 < x < 0.5 for x in ratios)


def test_final_checkpoint_and_summary_are_written(run):
    summary = json.loads((run / "summary.json").read_text())
    assert Path(summary["checkpoint"], "model.safetensors").exists()
    assert len(summary["bcast_s"]) >= 2


def test_every_leased_prompt_is_accounted_for(run):
    last = read_metrics(run / "metrics.jsonl")[-1]
    a = {k.split("/", 1)[1]: v for k, v in last.items() if k.startswith("ledger/")}
    assert a["leased"] == a["admitted"] + a["rejected"] + a["expired"] + a["returned"] + a["outstanding"], a
    assert a["admitted"] == a["trained"] + a["waiting"] + a["dropped_stale"], a
    assert a["trained"] == STEPS * 2  # B = 2 prompts per step


def test_the_learner_evaluates_every_second_version_beside_training(run):
    summary = json.loads((run / "summary.json").read_text())
    assert [e["version"] for e in summary["eval"]] == [2]
    assert 0.0 <= summary["eval"][0]["greedy_accuracy"] <= 1.0
    assert json.loads((run / "eval" / "v000002.json").read_text())["problems"] == 10
    assert not any("eval/failed" in r for r in read_metrics(run / "metrics.jsonl"))
    assert {"reward/correct", "reward/format", "reward/errors_total"} <= read_metrics(run / "metrics.jsonl")[-1].keys()


def test_the_divergence_guard_flags_the_run_and_sizes_leases_with_a_lower_s(run):
    """The learner's guard decides as the same guard replayed over the run's recorded health, and its first verdict
    (on the median of steps 0-2) lowers S. With --kl-coef every group gets a pass, so every step is measured (a batch
    of flat groups only would otherwise measure nothing, and in one run in six left the window unfilled), and an ESS
    bound of 1 is crossed by the mismatch between the engine's and the trainer's log-probs alone, whether or not
    step 0 moved the policy."""
    rows = read_metrics(run / "metrics.jsonl")
    cfg = json.loads((run / "config.json").read_text())
    limits = Thresholds(cfg["guard_ess_min"], cfg["guard_kl_max"], cfg["guard_clip_max"])
    replay = DivergenceGuard(S, limits, adaptive=True)
    replayed = [d for r in rows if (d := replay.observe(r["step"], r)) is not None]
    guard = [d for d in read_metrics(run / "decisions.jsonl") if d.get("kind") == "staleness"]
    decided = [(d["step"], d["action"], d["effective_from"], d["effective_to"]) for d in guard]
    assert decided == [(d["step"], d["action"], d["effective_from"], d["effective_to"]) for d in replayed]
    assert all(r["train/trained_frac"] > 0 for r in rows), [r["train/trained_frac"] for r in rows]
    assert decided == [(2, "lower", S, 0)]
    assert any("ESS" in reason for reason in guard[0]["reasons"]), guard[0]["reasons"]
    assert "leases now sized with S = 0" in (run / "learner.log").read_text()
    assert [r["guard/staleness_effective"] for r in rows] == [S, S, 0]
    saved = json.loads((checkpoint_dir(run, STEPS) / STATE_FILE).read_text())["guard"]
    assert saved == json.loads(json.dumps(replay.state_dict()))  # a resumed learner keeps the lowered S
    for r in rows:
        buckets = r["offpolicy/by_staleness"]
        assert set(buckets) <= set(r["rollout/staleness_hist"])
        assert sum(b["tokens"] for b in buckets.values()) == pytest.approx(r["train/tokens"] * r["train/trained_frac"])
        if r["train/trained_frac"] > 0:
            assert 0 < r["train/is_ess"] <= 1 + 1e-6


def test_echo2_status_shows_the_live_learner_and_refuses_a_wrong_token(run):
    code, stdout, _ = (run / "status-json.txt").read_text().split("\n", 2)
    status = json.loads(stdout.strip().splitlines()[-1])
    assert code == "0" and status["step"] >= 1 and status["target_steps"] == STEPS
    workers = {w["name"]: w for w in status["workers"]}
    assert {"w0", "w1"} <= workers.keys() <= {"w0", "w1", "aria2"}
    assert "aria2" not in workers or not workers["aria2"]["active"]  # it left after its fetch
    assert status["history"] and status["history"][0]["step"] == 0
    assert "rollout/reward_mean" in status["last_metrics"]
    view = (run / "status-view.txt").read_text()
    assert view.startswith("0\n") and f"/{STEPS}" in view and "w0" in view and "rejected samples" in view
    code, _, stderr = (run / "status-wrong-token.txt").read_text().split("\n", 2)
    assert code == "2" and "token" in stderr and "Traceback" not in stderr


def test_echo2_status_of_the_finished_run_and_its_plot(run, tmp_path):
    proc = echo2_status(str(run), "--json", "--plot", str(tmp_path / "run.png"))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["steps"] == STEPS and summary["version"] == STEPS and len(summary["rewards"]) == STEPS
    assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"


def test_every_logger_has_the_step_records(run):
    rows = read_metrics(run / "metrics.jsonl")
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    board = [(e.step, e.value) for e in acc.Scalars("rollout/reward_mean")]
    assert board == [(r["step"], pytest.approx(r["rollout/reward_mean"])) for r in rows]
    assert [h.step for h in acc.Histograms("rollout/staleness")] == list(range(STEPS))
    with sqlite3.connect(run / "trackio" / "echo2.db") as db:
        logged = [json.loads(m) for (m,) in db.execute("SELECT metrics FROM metrics ORDER BY step")]
    assert [m["rollout/reward_mean"] for m in logged] == pytest.approx([r["rollout/reward_mean"] for r in rows])
    (wandb_run,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    assert b"rollout/reward_mean" in wandb_run.read_bytes()


def test_the_learner_trains_a_sharded_hub_model_offline_and_publishes_its_weights_bit_for_bit(run):
    config = json.loads((run / "config.json").read_text())
    assert config["model"] == HUB_REPO
    published = load_file(str(run / "v0.safetensors"))
    original = load_file(str(prepare_default_model() / "model.safetensors"))
    assert published.keys() == original.keys()
    wire = WIRE_DTYPES[config["wire_dtype"]]  # the run's --wire-dtype
    for name, tensor in original.items():
        assert torch.equal(published[name], tensor.to(wire)), name


def test_a_learner_resumes_from_the_checkpoint_by_the_same_hub_id(run, hf_home, tmp_path):
    """Into a directory of its own, so the run's files stay as the tests above read them."""
    out = tmp_path / "resumed"
    args = ["learner", "--resume", str(checkpoint_dir(run, STEPS)), "--out", str(out), "--steps", str(STEPS + 1)]
    args += ["--port", str(free_port()), "--bt-listen", "127.0.0.1:0", "--token", TOKEN, "--quiet"]
    resumed = spawn(args, tmp_path / "resumed.log", env=hub_only(hf_home))
    try:
        wait_listening(resumed, out)  # the model resolved from the cache by the saved id, the checkpoint loaded
        resumed.send_signal(signal.SIGTERM)
        assert resumed.wait(timeout=120) == 0, log_tail(tmp_path / "resumed.log")
    finally:
        if resumed.poll() is None:
            kill_group(resumed)
    summary = json.loads((tmp_path / "resumed.log").read_text().strip().splitlines()[-1])
    assert summary["start_step"] == STEPS and summary["stopped_at"] is not None


def test_a_stock_bittorrent_client_fetches_version_0_and_its_digest_matches(run):
    got = json.loads((run / "aria2.json").read_text())
    if got is None:
        pytest.skip("aria2c is not installed (scripts/setup.sh installs it as root)")
    assert got["rc"] == 0 and got["digest"] is not None, got["output"]
    assert got["digest"] == got["announced_digest"]
    print(f"aria2c fetched version 0 in {got['seconds']:.1f} s")
