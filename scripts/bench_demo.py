"""Where the default demo's cycles go: `echo2 demo` with every process's CPU time sampled, by role.

    .venv/bin/python scripts/bench_demo.py [--steps 20] [--out runs/bench-demo] [-- demo flags...]

Runs the demo as a user does (learner + local workers, each a process tree), reads each process's CPU seconds
from /proc once a second (psutil) and sums them by role: the learner (and its children), each worker (its
main process, its vLLM engine core and model-runner processes). Then, in the same run and with nothing else
running, it times the learner's step alone on a batch of the same shape (scripts/bench_train.py's synthetic
batch, the learner's thread count) as the lower bound: the demo's median T_train over it says how much the
learner loses to sharing the cores. Prints a table and writes OUT/bench_demo.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil


def role_of(proc: psutil.Process) -> str:
    """learner, worker-<name> or demo: the nearest echo2 command among the process and its parents."""
    for p in [proc, *proc.parents()]:
        argv = p.cmdline()
        if "echo2cli" in " ".join(argv[:3]):
            if "learner" in argv:
                return "learner"
            if "worker" in argv:
                return "worker-" + argv[argv.index("--name") + 1] if "--name" in argv else "worker"
    return "demo"


def sample(root: psutil.Process, seen: dict[int, tuple[str, str, float]]) -> None:
    """Update seen[pid] = (role, name, cpu seconds) for every live process of the tree (an exited one keeps its
    last reading)."""
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            t = p.cpu_times()
            name = p.name()
            role = seen[p.pid][0] if p.pid in seen else role_of(p)
            seen[p.pid] = (role, name, t.user + t.system)
        except psutil.Error:
            continue


def learner_alone(threads: int, repeats: int = 3) -> float:
    """Median seconds of the learner's step alone on the demo's batch shape, with `threads` torch threads."""
    code = (
        "import statistics, time, torch, sys; sys.path.insert(0, 'scripts');"
        f"torch.set_num_threads({threads});"
        "from bench_train import make_groups; from echo2cli.learner.trainer import Trainer;"
        "from echo2cli.models import prepare_default_model;"
        "t = Trainer(prepare_default_model(), lr=1e-6, clip_eps=0.2, is_cap=3.0, kl_coef=0.0, max_grad_norm=1.0,"
        " micro_batch=16); g = make_groups(4, 8, 12); t.step(g); s = []\n"
        f"for _ in range({repeats}):\n"
        "    t0 = time.perf_counter(); t.step(g); s.append(time.perf_counter() - t0)\n"
        "print(statistics.median(s))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("runs/bench-demo"))
    ap.add_argument("demo_args", nargs="*", help="more `echo2 demo` flags (after --)")
    args = ap.parse_args()
    argv = [sys.executable, "-m", "echo2cli", "demo", "--out", str(args.out), "--steps", str(args.steps)]
    seen: dict[int, tuple[str, str, float]] = {}
    t0 = time.time()
    demo = subprocess.Popen([*argv, *args.demo_args], stdout=subprocess.DEVNULL)
    root = psutil.Process(demo.pid)
    while demo.poll() is None:
        sample(root, seen)
        time.sleep(1.0)
    wall = time.time() - t0
    if demo.returncode != 0:
        raise SystemExit(f"echo2 demo exited with code {demo.returncode}: see {args.out}/logs")
    rows = [json.loads(line) for line in (args.out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    threads = json.loads((args.out / "config.json").read_text()).get("torch_threads") or 0
    alone = learner_alone(threads or 1)
    by_role: Counter[str] = Counter()
    by_process: Counter[tuple[str, str]] = Counter()
    for role, name, cpu in seen.values():
        by_role[role] += cpu
        by_process[(role, name)] += cpu
    t_train = statistics.median(r["learner/t_train_s"] for r in rows)
    result: dict[str, Any] = {
        "wall_s": wall,
        "steps": len(rows),
        "t_train_median_s": t_train,
        "t_train_alone_s": alone,
        "learner_threads": threads,
        "t_wait_first_s": rows[0]["learner/t_wait_s"],
        "t_publish_median_s": statistics.median(r["learner/t_publish_s"] for r in rows),
        "cpu_s_by_role": dict(by_role),
        "cpu_s_by_process": {f"{r} {n}": v for (r, n), v in sorted(by_process.items())},
    }
    (args.out / "bench_demo.json").write_text(json.dumps(result, indent=2))
    total = sum(by_role.values())
    print(
        f"demo: {len(rows)} steps in {wall:.0f} s (command start to exit); "
        f"first batch waited {result['t_wait_first_s']:.1f} s"
    )
    print(f"CPU seconds by process ({total:.0f} in all, {total / wall:.2f} cores on average):")
    for (role, name), cpu in sorted(by_process.items(), key=lambda kv: -kv[1]):
        if cpu >= 0.5:
            print(f"  {role:12s} {name:22s} {cpu:7.1f}   ({cpu / max(len(rows), 1):.2f} per step)")
    print(
        f"learner T_train: median {t_train:.2f} s in the demo, {alone:.2f} s alone with {threads or 1} thread(s) "
        f"(same run): {t_train / alone:.2f}x the lower bound"
    )


if __name__ == "__main__":
    main()
