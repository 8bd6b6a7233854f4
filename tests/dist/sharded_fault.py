"""Run under torchrun: a rank that fails inside a step, or a rank 0 that waits a long time for nothing, with the
sharded trainer on sharded_step.py's batches. Used by tests/integration/test_sharded_failure.py.

    sharded_fault.py MODEL_DIR OUT --fail-rank R --fail-in {forward,clip,abort}
        rank R raises inside the step: in the forward of the second decoder layer (the others go on to the
        backward's all-gathers), or where the gradient norm is all-reduced (the others wait in that all-reduce);
        or, with abort, dies of SIGABRT in that forward (as glibc ends a process whose heap it finds corrupt)
    sharded_fault.py MODEL_DIR OUT --idle-s S [--no-keepalive]
        rank 0 steps, waits S seconds polling as the learner's wait loop does (`keep_alive` every 0.2 s, or not at
        all), steps again and finishes; OUT/metrics.json holds both steps' losses

Each rank lives and ends as a rank of `echo2 learner` does: rank 0 holds the trainer in `closed_on_success` and
takes SIGTERM as a request to stop (`stop_on_signal`); ranks > 0 ignore SIGTERM and SIGINT (`follow_learner`) and
`follow()`; an exception ends a rank through `exit_failed_rank`, as `echo2`'s `main` does. Each rank writes its pid
to OUT/rank{R}.pid at start and, if it fails, its exception to OUT/rank{R}.error; the failing rank writes
OUT/failed_at (its time.time()) just before it raises.
"""

import argparse
import json
import os
import signal
import threading
import time
from pathlib import Path

from sharded_step import batch

from echo2cli.cli import stop_on_signal
from echo2cli.learner.sharded import ShardedTrainer, closed_on_success, exit_failed_rank, leave

WAIT_TICK_S = 0.2  # as the learner's loop.WAIT_TICK_S


def inject_failure(trainer: ShardedTrainer, out: Path, where: str) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        (out / "failed_at").write_text(repr(time.time()))
        if where == "abort":
            os.abort()
        raise RuntimeError(f"injected failure on rank {trainer.rank} ({where})")

    if where in ("forward", "abort"):
        trainer.policy.model.get_decoder().layers[1].forward = fail
    else:
        trainer._clip_grad_norm = fail


def lead(trainer: ShardedTrainer, a: argparse.Namespace) -> None:
    """Rank 0: like the learner, it notices a stop request (SIGTERM) only between steps, then makes a last call."""
    stop = threading.Event()
    stop_on_signal(stop.set)
    with closed_on_success(trainer):
        losses = [trainer.step(batch(0))["train/loss"]]
        if a.idle_s:
            deadline = time.monotonic() + a.idle_s
            while time.monotonic() < deadline and not stop.is_set():
                time.sleep(WAIT_TICK_S)
                if not a.no_keepalive:
                    trainer.keep_alive()
            losses.append(trainer.step(batch(1))["train/loss"])
    (a.out / "metrics.json").write_text(json.dumps(losses))


def main(a: argparse.Namespace) -> None:
    kwargs = dict(lr=1e-2, clip_eps=0.2, is_cap=3.0, kl_coef=0.0, max_grad_norm=1.0, micro_batch=3)
    trainer = ShardedTrainer(a.model, max_tokens_per_micro_batch=40, bf16=False, **kwargs)
    if trainer.rank == a.fail_rank:
        inject_failure(trainer, a.out, a.fail_in)
    if trainer.rank == 0:
        lead(trainer, a)
    else:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        trainer.follow()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("model", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-in", choices=("forward", "clip", "abort"), default="forward")
    p.add_argument("--idle-s", type=float, default=0.0)
    p.add_argument("--no-keepalive", action="store_true")
    args = p.parse_args()
    rank = os.environ["RANK"]
    (args.out / f"rank{rank}.pid").write_text(str(os.getpid()))
    try:
        main(args)
    except Exception as exc:
        (args.out / f"rank{rank}.error").write_text(repr(exc))
        exit_failed_rank()
        raise
    leave(0)
