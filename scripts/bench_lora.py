"""LoRA versions against full fine-tuning on the default model: bytes per version, the learner's memory, T_train.

    .venv/bin/python scripts/bench_lora.py [--ranks 16,64] [--steps 3] [--json]

Each setting runs in its own process (so that one's memory does not hide the other's): the trainer is built, then
`--steps` GRPO steps on a synthetic batch shaped like the default demo's (scripts/bench_train.py), then the version
is exported as the learner publishes it (bf16 safetensors: all weights, or the adapters alone). It reports the
version file's bytes, the process's peak RSS, the bytes of what training keeps besides the frozen weights
(trainable parameters, their gradients and AdamW's two moments, fp32), and the median step time. Full fine-tuning
is the baseline of every ratio, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_checkpoint import make_trainer
from bench_train import make_groups

from echo2cli.learner.trainer import write_weights
from echo2cli.lora import DEFAULT_TARGETS, lora_spec
from echo2cli.models import prepare_default_model


def one(rank: int, steps: int) -> dict:
    """Build, train `steps` steps and export one setting, in this process."""
    import torch

    torch.set_num_threads(1)
    spec = lora_spec(rank, 0, DEFAULT_TARGETS)
    trainer = make_trainer(prepare_default_model(), lr=5e-4 if spec else 5e-5, lora=spec)
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        trainer.step(make_groups(4, 8, 12, seed=step))
        times.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        tensors = trainer.published_weights()
        assert tensors is not None
        write_weights(tensors, path)
        version_bytes = path.stat().st_size
    return {
        "lora_rank": rank,
        "version_bytes": version_bytes,
        "trainable_params": sum(p.numel() for p in trainable),
        # fp32 parameter, gradient, and AdamW's exp_avg and exp_avg_sq for each trainable parameter
        "training_state_bytes": 16 * sum(p.numel() for p in trainable),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "t_train_s": statistics.median(times[1:] or times),  # the first step warms up
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="16,64", help="LoRA ranks to compare with full fine-tuning")
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps per setting (the first is not timed)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child: this rank (0 = full)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, args.steps)))
        return
    rows = []
    for rank in [0, *(int(r) for r in args.ranks.split(","))]:
        child = [sys.executable, __file__, "--one", str(rank), "--steps", str(args.steps)]
        proc = subprocess.run(child, capture_output=True, text=True, check=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    full = rows[0]
    for r in rows:
        for key in ("version_bytes", "training_state_bytes", "peak_rss_bytes", "t_train_s"):
            r[f"{key}_vs_full"] = r[key] / full[key]
    if args.json:
        print(json.dumps(rows))
        return
    print(
        "setting        version MB  (vs full)   training state MB  (vs full)"
        "   peak RSS MB  (vs full)   T_train s  (vs full)"
    )
    for r in rows:
        name = f"LoRA r={r['lora_rank']}" if r["lora_rank"] else "full"
        print(
            f"{name:<14} {r['version_bytes'] / 1e6:10.1f}  ({r['version_bytes_vs_full']:.4f})"
            f"   {r['training_state_bytes'] / 1e6:17.1f}  ({r['training_state_bytes_vs_full']:.4f})"
            f"   {r['peak_rss_bytes'] / 1e6:11.0f}  ({r['peak_rss_bytes_vs_full']:.2f})"
            f"   {r['t_train_s']:9.2f}  ({r['t_train_s_vs_full']:.2f})"
        )


if __name__ == "__main__":
    main()
