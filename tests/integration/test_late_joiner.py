"""A late joiner on a slow link converges: real learner, real workers, libtorrent capping the late one's download.

    worker a generates; the learner steps and publishes a version per step (S = 1: it keeps S + 1 = 2 back)
    worker late joins with --downlink-mbps 30 (100 when frozen, below)
    once the learner is S + 3 versions past the one `late` fetches (it would have pruned it), a stops
    late must still get its version (the learner keeps seeding it), start its engine, fetch the newest
    and generate admissible rollouts: the learner trains on them

Before echo2 kept seeding versions that a worker still fetched, `late` waited forever on a version nobody
seeded. Per push, the run trains the default model cut to two layers (a 71 MB version) and `late` is frozen
(SIGSTOP) from its join until the learner is S + 3 versions on, so it cannot finish first however fast the box;
its heartbeat period is long enough that the learner still counts it as live meanwhile. With `--extended`, the
full model's 269 MB version at 30 Mbit/s takes ~70 s, many learner steps, with no freeze (~4-5 minutes on 2
cores). The figures land in <tmp>/late_joiner.json.
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest
from procs import kill_group, spawn, stop_all, wait_for, wait_listening

from echo2cli.demo import free_port
from echo2cli.metrics import read_metrics
from echo2cli.units import mbps_to_bytes_per_s

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = "late-joiner-token"
S = 1
DOWNLINK_MBPS = 30.0
FROZEN_HEARTBEAT_S = 30.0  # the frozen variant's: `late` stays live through 90 s of silence
FROZEN_DOWNLINK_MBPS = 100.0  # the frozen variant's: the freeze, not the link, holds `late` back (71 MB in 6 s)


def loads(work_dir) -> list[dict]:
    path = work_dir / "events.jsonl"
    return [e for e in read_metrics(path) if e.get("event") == "loaded"] if path.exists() else []


@pytest.mark.parametrize("variant", ["frozen", pytest.param("full", marks=pytest.mark.extended)])
def test_a_late_joiner_on_a_slow_link_gets_its_version_and_converges(tmp_path, plumbing_model, variant):
    frozen = variant == "frozen"
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
            *(["--model", str(plumbing_model), "--heartbeat-s", str(FROZEN_HEARTBEAT_S)] if frozen else []),
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
        downlink = FROZEN_DOWNLINK_MBPS if frozen else DOWNLINK_MBPS
        procs.append(late := worker("late", 1, "--downlink-mbps", str(downlink)))
        wait_for(lambda: any(w["name"] == "late" for w in status().get("workers", [])), 120, "late to join")
        if frozen:
            kill_group(late, signal.SIGSTOP)
        t_frozen = time.time()
        wait_for(lambda: status().get("version", 0) >= v_join + S + 3, 300, "S + 3 more versions")
        if frozen:
            # the learner has counted `late` as live all along (3 heartbeat periods of silence make a worker gone)
            assert time.time() - t_frozen < 3 * FROZEN_HEARTBEAT_S, "the learner stepped too slowly for this test"
            kill_group(late, signal.SIGCONT)
        assert not loads(out / "late"), "the late joiner finished too fast for this test: lower DOWNLINK_MBPS"
        kill_group(a)  # the fleet is `late` alone from now on (a's lease, if any, expires)
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
        "downlink_mbps": downlink,
        "size_bytes": size,
        "version_at_join": v_join,
        "download_alone_s": size / mbps_to_bytes_per_s(downlink),
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
