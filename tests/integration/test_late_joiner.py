"""A late joiner on a slow link converges: real learner, real workers, libtorrent capping the late one's download.

    worker a generates; the learner steps and publishes a version per step (S = 1: it keeps S + 1 = 2 back)
    worker late joins with --downlink-mbps 30: the 269 MB version takes ~70 s, many learner steps
    once the learner is S + 3 versions past the one `late` fetches (it would have pruned it), a stops
    late must still get its version (the learner keeps seeding it), start its engine, fetch the newest
    and generate admissible rollouts: the learner trains on them

Before echo2 kept seeding versions that a worker still fetched, `late` waited forever on a version nobody
seeded. Slow: ~4-5 minutes on 2 cores. The figures land in <tmp>/late_joiner.json (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest
from procs import spawn, stop_all, wait_for, wait_listening

from echo2cli.demo import free_port
from echo2cli.metrics import read_metrics
from echo2cli.units import mbps_to_bytes_per_s

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = "late-joiner-token"
S = 1
DOWNLINK_MBPS = 30.0


def loads(work_dir) -> list[dict]:
    path = work_dir / "events.jsonl"
    return [e for e in read_metrics(path) if e.get("event") == "loaded"] if path.exists() else []


def test_a_late_joiner_on_a_slow_link_gets_its_version_and_converges(tmp_path):
    out, port = tmp_path, free_port()
    url = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)

    def status() -> dict:
        try:
            return http.get("/v1/status").json()
        except (httpx.HTTPError, ValueError):
            return {}

    def worker(name: str, core: int, *extra: str):
        return spawn(
            [
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
            ],
            out / f"{name}.log",
            env={"VLLM_CPU_OMP_THREADS_BIND": str(core)},
        )

    learner = spawn(
        [
            "learner",
            "--out",
            str(out),
            "--port",
            str(port),
            "--steps",
            "100000",
            "--prompts-per-step",
            "1",
            "-G",
            "2",
            "--max-new-tokens",
            "8",
            "-S",
            str(S),
            "--bt-listen",
            "127.0.0.1:0",
            "--token",
            TOKEN,
            "--activation",
            "all",
            "--checkpoint-every",
            "0",
            "--lease-timeout-s",
            "30",
            "--quiet",
        ],
        out / "learner.log",
    )
    procs = [learner]
    try:
        wait_listening(learner, out)
        procs.append(a := worker("a", 0))
        wait_for(lambda: status().get("step", 0) >= 2, 300, "learner step 2")
        t_join = time.time()
        v_join = status()["version"]  # announced before `late` starts: the version it fetches is at least this one
        procs.append(worker("late", 1, "--downlink-mbps", str(DOWNLINK_MBPS)))
        wait_for(lambda: any(w["name"] == "late" for w in status().get("workers", [])), 120, "late to join")
        wait_for(lambda: status().get("version", 0) >= v_join + S + 3, 300, "S + 3 more versions")
        assert not loads(out / "late"), "the late joiner finished too fast for this test: lower DOWNLINK_MBPS"
        a.send_signal(signal.SIGTERM)  # the fleet is `late` alone from now on
        a.wait(timeout=60)
        t_alone = time.time()
        stalled_at = status()["step"]

        def late_rollouts() -> int:
            return sum(w["rollouts"] for w in status().get("workers", []) if w["name"] == "late")

        wait_for(lambda: late_rollouts() > 0, 600, "the late joiner's rollouts to be admitted")
        t_converged = time.time()
        wait_for(lambda: status().get("step", 0) > stalled_at, 300, "the learner to train on them")
        last = read_metrics(out / "metrics.jsonl")[-1]
    finally:
        stop_all(procs)
    loaded = loads(out / "late")
    assert loaded[0]["version"] >= v_join and loaded[-1]["version"] >= stalled_at - S
    size = loaded[0]["size_bytes"]
    figures = {
        "downlink_mbps": DOWNLINK_MBPS,
        "size_bytes": size,
        "version_at_join": v_join,
        "download_alone_s": size / mbps_to_bytes_per_s(DOWNLINK_MBPS),
        "first_load_after_join_s": loaded[0]["time"] - t_join,
        "first_download_s": loaded[0]["t_download_s"],
        "loads": [(e["version"], e["via"], round(e["t_download_s"], 1)) for e in loaded],
        "fleet_alone_to_training_s": t_converged - t_alone,
        "join_to_training_s": t_converged - t_join,
        "bcast_version_measured": last.get("bcast/version"),
    }
    (out / "late_joiner.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures, indent=1))
    # T_bcast went on being measured while the late joiner fetched its first version
    assert (last.get("bcast/version") or -1) >= v_join + 1
