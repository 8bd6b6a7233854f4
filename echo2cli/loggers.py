"""Where a learner's per-step metrics go besides metrics.jsonl: TensorBoard, Weights & Biases, trackio.

`--report-to jsonl,tensorboard,wandb,trackio`. metrics.jsonl is always written (`learner/records.StepLog`): the
demo, `echo2 status`, `echo2 plan --from-run` and the benchmarks read it. Every backend gets the same names
(`rollout/reward_mean`, `learner/t_train_s`, `bcast/t_s`, ...) at step = the learner step, every finite number of
the step's record as a scalar, and two histograms: the batch's rewards and its samples' staleness.

All three work offline: TensorBoard writes `<out>/tensorboard/`, W&B runs in offline mode in `<out>/wandb/`
unless WANDB_MODE says otherwise (`wandb sync` uploads later), trackio writes its local database (TRACKIO_DIR,
default ~/.cache/huggingface/trackio; `trackio show` opens it). A backend that fails mid-run is dropped with
one warning: a logger never stops training.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from echo2cli.errors import ConfigError

BACKENDS = ("jsonl", "tensorboard", "wandb", "trackio")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}
PROJECT = "echo2"


def parse_report_to(text: str) -> list[str]:
    """'jsonl,tensorboard' -> the backends, checked and importable; jsonl is implied."""
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    if unknown := [n for n in names if n not in BACKENDS]:
        raise ConfigError(f"--report-to: unknown logger(s) {unknown}; choose from {', '.join(BACKENDS)}")
    for name in names:
        if name in PACKAGES and importlib.util.find_spec(PACKAGES[name]) is None:
            raise ConfigError(f"--report-to {name} needs the {PACKAGES[name]} package: pip install 'echo2cli[{name}]'")
    return ["jsonl"] + sorted(set(names) - {"jsonl"}, key=BACKENDS.index)


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's finite numbers (booleans and lists left out), without the step itself."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


class Backend(Protocol):
    def log(self, step: int, values: dict[str, float], histograms: dict[str, list[float]]) -> None: ...

    def close(self) -> None: ...


class TensorBoard:
    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))
        self.writer.add_text("config", "\n".join(f"    {k} = {v}" for k, v in sorted(config.items())))

    def log(self, step: int, values: dict[str, float], histograms: dict[str, list[float]]) -> None:
        import numpy as np

        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        for k, xs in histograms.items():
            if xs:
                self.writer.add_histogram(k, np.asarray(xs, dtype=np.float64), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Wandb:
    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        mode = os.environ.get("WANDB_MODE", "offline")
        self.run = wandb.init(project=PROJECT, name=out.name, dir=str(out), mode=mode, config=config)  # type: ignore[arg-type]

    def log(self, step: int, values: dict[str, float], histograms: dict[str, list[float]]) -> None:
        hists = {k: self.wandb.Histogram(xs) for k, xs in histograms.items() if xs}
        self.run.log({**values, **hists}, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackio:
    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        import trackio

        self.trackio = trackio
        trackio.init(project=PROJECT, name=out.name, config=config, embed=False, auto_log_gpu=False, auto_log_cpu=False)

    def log(self, step: int, values: dict[str, float], histograms: dict[str, list[float]]) -> None:
        hists = {k: self.trackio.Histogram(xs) for k, xs in histograms.items() if xs}
        self.trackio.log({**values, **hists}, step=step)

    def close(self) -> None:
        self.trackio.finish()


OPENERS: dict[str, Callable[[Path, dict[str, Any]], Backend]] = {
    "tensorboard": TensorBoard,
    "wandb": Wandb,
    "trackio": Trackio,
}


class Reporters:
    """The chosen backends beside metrics.jsonl. `config` is the run's config, shown where a backend has a place
    for it."""

    def __init__(self, names: list[str], out: Path, config: dict[str, Any]) -> None:
        self.backends: dict[str, Backend] = {}
        for name in names:
            if name in OPENERS:
                try:
                    self.backends[name] = OPENERS[name](out, config)
                except Exception as exc:  # noqa: BLE001 - any failure of a third-party logger at start
                    raise ConfigError(f"--report-to {name} failed to start: {type(exc).__name__}: {exc}") from exc

    def log(self, record: dict[str, Any], histograms: dict[str, list[float]]) -> None:
        values = scalars(record)
        for name, backend in list(self.backends.items()):
            try:
                backend.log(int(record["step"]), values, histograms)
            except Exception as exc:  # noqa: BLE001 - a logger never stops training
                print(f"echo2: warning: {name} logging failed, dropped for the rest of the run: {exc}", file=sys.stderr)
                del self.backends[name]

    def close(self) -> None:
        for name, backend in self.backends.items():
            try:
                backend.close()
            except Exception as exc:  # noqa: BLE001
                print(f"echo2: warning: closing {name} failed: {exc}", file=sys.stderr)
        self.backends = {}
