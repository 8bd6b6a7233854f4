"""Delta size, encode (learner) and rebuild (worker) on real versions of the default model, against the
previous format (`ECHO2DELTA2`: the same streams with the changed words in file order, not by exponent) and a
lower bound, all measured in the same run.

    taskset -c 0 .venv/bin/python scripts/bench_delta.py [--repeats 3] [--dir runs/bench-delta]

Versions: the default model's bf16 weights before and after real learner steps (AdamW, lr 5e-5, one GRPO
batch of random tokens each): v1 -> v2 is a second step, as in a run. Each call is timed in a fresh process
(median of the repeats): the publisher and the worker call these once per version, between other work, on
memory not yet touched; repeated in one process, the whole-array passes reuse already-faulted memory and look
several times cheaper than they are in a run.
  size     the delta's bytes ÷ the version's, against the previous format's
  encode   `encode_delta` with both digests known (the publisher's case) vs the previous format
  apply    `apply_delta` on a verified base (the worker's case: rebuild, hash, write) vs the previous format
  bound    one digest pass over the target file: a rebuild must at least hash what it writes
Run it pinned to one core (`taskset -c 0`, one torch thread): the learner of `echo2 bench staleness` runs so,
and on one core the background publish competes with training for the same cycles.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_checkpoint import make_trainer  # noqa: E402
from bench_train import make_groups  # noqa: E402

from echo2cli.broadcast import kernels  # noqa: E402
from echo2cli.broadcast.delta import apply_delta, encode_delta  # noqa: E402
from echo2cli.broadcast.digest import file_digest  # noqa: E402
from echo2cli.learner.trainer import write_weights  # noqa: E402
from echo2cli.models import prepare_default_model  # noqa: E402


def file_order() -> None:
    """The previous format in this process (`ECHO2DELTA2`): the same streams, with the changed words visited in
    file order instead of by exponent."""

    def changes(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        at = np.flatnonzero(a != b)
        return at, kernels.position(b[at]) - kernels.position(a[at])

    kernels.changes_in_visit_order = changes

    def patch(words: np.ndarray, places: np.ndarray, steps: np.ndarray) -> bool:
        words[places] = kernels.from_position(kernels.position(words[places]) + steps)
        return True

    kernels.patch = patch


def one(variant: str, root: Path) -> None:
    """Time one call of `variant` in this (fresh) process; print the seconds."""
    base, target, delta = root / "v1.safetensors", root / "v2.safetensors", root / "v2.delta"
    meta = json.loads((root / "meta.json").read_text())
    hb, ht = meta["base_digest"], meta["target_digest"]
    if variant.endswith("_file_order_s"):
        file_order()
    previous = root / "file_order.delta"
    calls = {
        "encode_s": lambda: encode_delta(base, target, delta, base_digest=hb, target_digest=ht),
        "encode_file_order_s": lambda: encode_delta(base, target, previous, base_digest=hb, target_digest=ht),
        "apply_s": lambda: apply_delta(base, delta, root / "out", ht, base_verified=True),
        "apply_file_order_s": lambda: apply_delta(base, previous, root / "file_order.out", ht, base_verified=True),
        "digest_s": lambda: file_digest(target),
    }
    t0 = time.perf_counter()
    calls[variant]()
    print(time.perf_counter() - t0)


def timed(variant: str, root: Path, repeats: int) -> float:
    argv = [sys.executable, __file__, "--one", variant, "--dir", str(root)]
    return statistics.median(float(subprocess.check_output(argv, text=True).split()[-1]) for _ in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("runs/bench-delta"))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: time one call in this process
    args = ap.parse_args()
    if args.one:
        return one(args.one, args.dir)
    torch.set_num_threads(1)
    root = args.dir
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    try:
        trainer = make_trainer(prepare_default_model())
        files = []
        for v in range(3):
            if v:
                trainer.step(make_groups(4, 8, 12, seed=v), version=v)
            tensors = trainer.published_weights()
            assert tensors is not None
            write_weights(tensors, path := root / f"v{v}.safetensors")
            files.append(path)
        base, target = files[1], files[2]
        hb, ht = file_digest(base), file_digest(target)
        delta = root / "v2.delta"
        header = encode_delta(base, target, delta, base_digest=hb, target_digest=ht)
        assert apply_delta(base, delta, root / "out", ht, base_verified=True) == ht
        (root / "meta.json").write_text(json.dumps({"base_digest": hb, "target_digest": ht}))
        variants = ("encode_s", "encode_file_order_s", "apply_s", "apply_file_order_s", "digest_s")
        figures = {v: timed(v, root, args.repeats) for v in variants}
        previous_bytes = (root / "file_order.delta").stat().st_size
        full = target.stat().st_size
        print(
            f"version {full / 1e6:.0f} MB, {header['changed'] / header['words']:.2%} of words changed; delta "
            f"{header['delta_bytes'] / 1e6:.2f} MB ({header['delta_bytes'] / full:.2%}), previous format "
            f"{previous_bytes / 1e6:.2f} MB ({previous_bytes / full:.2%}): "
            f"{header['delta_bytes'] / previous_bytes:.3f}x"
        )
        print(
            f"encode  {figures['encode_s']:.3f} s   previous {figures['encode_file_order_s']:.3f} s   "
            f"{figures['encode_s'] / figures['encode_file_order_s']:.2f}x its time"
        )
        print(
            f"apply   {figures['apply_s']:.3f} s   previous {figures['apply_file_order_s']:.3f} s   "
            f"{figures['apply_s'] / figures['apply_file_order_s']:.2f}x its time; "
            f"{figures['apply_s'] / figures['digest_s']:.2f}x one digest pass ({figures['digest_s']:.3f} s)"
        )
        fractions = {"delta_fraction": header["delta_bytes"] / full, "previous_fraction": previous_bytes / full}
        print(json.dumps(figures | fractions | {"threads": os.cpu_count()}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
