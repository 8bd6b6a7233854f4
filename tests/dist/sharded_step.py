"""Run under torchrun: GRPO steps with the sharded trainer (or, with --plain, the one-process trainer) on fixed
batches; rank 0 writes the metrics, the exported bf16 version and a checkpoint to OUT, and the bf16 version of the
weights it started from to OUT/start.safetensors. With --snapshot-after K it also writes the version and checkpoint
after K steps to OUT/after-K/, so one run answers for a shorter one. Used by tests/test_sharded.py.

    sharded_step.py MODEL_DIR OUT [--plain] [--fp32] [--kl-coef K] [--steps N] [--resume CHECKPOINT --first K]
                    [--minibatches M --off-policy MODE] [--snapshot-after K]
"""

import argparse
import json
from pathlib import Path

import torch

from echo2cli.learner.trainer import Trainer
from echo2cli.learner.types import Group
from echo2cli.protocol import Sample

KEEP = (  # a step of flat groups only has no health metrics
    "train/loss",
    "train/trained_frac",
    "train/grad_norm",
    "train/is_weight_mean",
    "train/tokens",
    "train/abs_log_ratio_max",
    "train/kl_ref",
    "train/clipfrac",
)


def batch(step: int) -> list[Group]:
    """4 prompts x 4 samples of different lengths, fixed rewards and behaviour log-probs. Step 1's first group is flat
    (all rewards equal) and so is every group of step 2: without a KL term, those get no pass."""
    g = torch.Generator().manual_seed(step)
    groups = []
    for p in range(4):
        prompt = torch.randint(1, 64, (3 + 2 * p,), generator=g).tolist()
        samples = []
        for i in range(4):
            n = 2 + (3 * p + 5 * i) % 9
            samples.append(
                Sample(
                    prompt_id=p,
                    sample_idx=i,
                    completion_token_ids=torch.randint(1, 64, (n,), generator=g).tolist(),
                    logprobs=(-4.0 + 0.1 * torch.rand(n, generator=g)).tolist(),
                )
            )
        rewards = [float((p + i) % 3 == 0) for i in range(4)]
        if step == 2 or (step == 1 and p == 0):
            rewards = [1.0] * 4
        groups.append(Group(p, step, prompt, samples, rewards, "w"))
    return groups


def main(a: argparse.Namespace) -> None:
    kwargs = dict(lr=1e-2, clip_eps=0.2, is_cap=3.0, kl_coef=a.kl_coef, max_grad_norm=1.0, micro_batch=3)
    kwargs |= dict(minibatches=a.minibatches, off_policy=a.off_policy)
    kwargs["bf16"] = False if a.fp32 else None
    if a.plain:
        trainer = Trainer(a.model, **kwargs)
    else:
        from echo2cli.learner.sharded import ShardedTrainer

        trainer = ShardedTrainer(a.model, max_tokens_per_micro_batch=40, **kwargs)
    if getattr(trainer, "rank", 0) != 0:
        trainer.follow()  # makes rank 0's calls below
        return
    if a.resume:
        trainer.load_checkpoint(a.resume)
    trainer.export_weights(a.out / "start.safetensors")
    metrics = []
    for s in range(a.first, a.first + a.steps):
        metrics.append(trainer.step(batch(s)))
        if len(metrics) == a.snapshot_after:
            trainer.export_weights(a.out / f"after-{a.snapshot_after}" / "model.safetensors")
            trainer.save_checkpoint(a.out / f"after-{a.snapshot_after}" / "checkpoint")
    trainer.export_weights(a.out / "model.safetensors")
    trainer.save_checkpoint(a.out / "checkpoint")  # fp32 weights in checkpoint/model.safetensors
    if not a.plain:
        trainer.close()
    (a.out / "metrics.json").write_text(json.dumps([{k: m[k] for k in KEEP if k in m} for m in metrics]))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("model", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--plain", action="store_true")
    p.add_argument("--fp32", action="store_true")
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--resume", type=Path)
    p.add_argument("--minibatches", type=int, default=1)
    p.add_argument("--off-policy", default="token_tis")
    p.add_argument("--snapshot-after", type=int, default=0)
    args = p.parse_args()
    main(args)
    if not args.plain:
        from echo2cli.learner.sharded import leave

        leave(0)
