"""Checkpoint cost on the default model, against lower bounds measured in the same run.

    .venv/bin/python scripts/bench_checkpoint.py [--repeats 3] [--dir runs/bench-checkpoint]

write:   `write_checkpoint` (fp32 weights, AdamW moments after one step, RNG, a coordinator state of
         1,000 steps x 64 prompts, fsync, rename) vs writing the same number of bytes from memory as one
         file with one fsync: the disk's own cost for those bytes.
restore: building a Trainer from the base model and loading the checkpoint into it (what `--resume` adds
         to a learner's start) vs building the Trainer alone (what every start pays).
Prints the median of each and the ratios; the figures are recorded in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_train import make_groups  # noqa: E402

from echo2cli.layout import checkpoint_dir  # noqa: E402
from echo2cli.learner.checkpoint import complete_checkpoints, write_checkpoint  # noqa: E402
from echo2cli.learner.trainer import Trainer  # noqa: E402
from echo2cli.models import prepare_default_model  # noqa: E402


def make_trainer(model_dir: Path, lr: float = 5e-5, **kwargs: Any) -> Trainer:
    """The default demo's trainer settings; `kwargs`: more `Trainer` arguments (`lora=`)."""
    return Trainer(model_dir, lr=lr, clip_eps=0.2, is_cap=3.0, kl_coef=0.0, max_grad_norm=1.0, micro_batch=16, **kwargs)


def coordinator_state(steps: int = 1000, batch: int = 64) -> dict:
    """The shape of a long run's coordinator state: every trained prompt id is kept."""
    n = steps * batch
    return {
        "version": steps,
        "problems_drawn": n + 2 * batch,
        "pending": list(range(n, n + batch)),
        "leased_out": [],
        "done": list(range(n + batch)),
        "trained": list(range(n)),
        "ready": [],
        "ledger": {"leased": n + 2 * batch},
        "counters": {},
    }


def raw_write(path: Path, nbytes: int) -> float:
    block = os.urandom(1 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes >> 20):
            f.write(block)
        f.write(block[: nbytes & ((1 << 20) - 1)])
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("runs/bench-checkpoint"))
    args = ap.parse_args()
    out = args.dir
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model_dir = prepare_default_model()
    trainer = make_trainer(model_dir)
    trainer.step(make_groups(2, 4, 8))  # AdamW moments exist only after a step
    state = {"step": 1000, "config": {}, "coordinator": coordinator_state()}

    writes, raws, nbytes = [], [], 0
    for i in range(args.repeats):
        target = checkpoint_dir(out, i)
        t0 = time.perf_counter()
        write_checkpoint(target, trainer.save_checkpoint, state)
        writes.append(time.perf_counter() - t0)
        nbytes = sum(p.stat().st_size for p in target.iterdir())
        raws.append(raw_write(out / "raw.bin", nbytes))
        (out / "raw.bin").unlink()
    ckpt = complete_checkpoints(out)[-1]

    builds, restores = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        fresh = make_trainer(model_dir)
        builds.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fresh.load_checkpoint(ckpt)
        restores.append(time.perf_counter() - t0 + builds[-1])
        del fresh

    w, r = statistics.median(writes), statistics.median(raws)
    b, s = statistics.median(builds), statistics.median(restores)
    print(f"checkpoint size        {nbytes / 1e9:.2f} GB ({len(list(ckpt.iterdir()))} files)")
    print(f"write_checkpoint       {w:.2f} s   ({nbytes / w / 1e6:.0f} MB/s)")
    print(f"raw write + fsync      {r:.2f} s   ({nbytes / r / 1e6:.0f} MB/s)   lower bound")
    print(f"write ratio            {w / r:.2f}x the lower bound")
    print(f"trainer build          {b:.2f} s   (every learner start)")
    print(f"build + restore        {s:.2f} s   (a resumed start)")
    print(f"restore ratio          {s / b:.2f}x a fresh start")
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
