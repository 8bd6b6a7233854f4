"""Checkpoints: everything a learner needs to continue a run as if it had never stopped.

    <out>/checkpoints/step_000012/
        model.safetensors, config.json   fp32 weights after 12 optimizer steps (= policy version 12)
        tokenizer files                  so the directory is also a model (`echo2 eval --model`, `--model`)
        optimizer.pt, rng.pt             AdamW moments, torch and Python RNG states
        learner_state.json               step, version, run id, resolved config (no secrets), the
                                         coordinator's state (prompt position, queue, admitted groups,
                                         ledger) and the metrics line count

A checkpoint is written to `step_N.tmp/`, flushed to disk (fsync) and renamed into place, so a crash,
a power cut or a full disk while writing leaves the previous checkpoint as it was; only complete ones
(with learner_state.json) are ever read. The two newest are kept.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from echo2cli.errors import ConfigError, DiskFullError, Echo2Error, is_disk_full
from echo2cli.layout import CHECKPOINTS_DIR, checkpoint_step

STATE_FILE = "learner_state.json"
KEEP = 2


def complete_checkpoints(out: Path) -> list[Path]:
    found = (p for p in (out / CHECKPOINTS_DIR).glob("step_*") if checkpoint_step(p) is not None)  # not .tmp
    return sorted(p for p in found if (p / STATE_FILE).exists())


def write_checkpoint(target: Path, write_files: Any, state: dict[str, Any]) -> Path:
    """`write_files(tmp_dir)` writes the payload; then the state file; then the rename makes it visible."""
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        write_files(tmp)
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1, default=str))
        _fsync(tmp)
    except Exception as exc:  # OSError; torch.save and safetensors report a failed write as their own errors
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc) or shutil.disk_usage(target.parent.parent).free < 64 << 20:
            raise DiskFullError(
                f"disk full writing checkpoint {target}: free space or move --out (the previous checkpoint is intact)"
            ) from exc
        raise Echo2Error(f"cannot write checkpoint {target}: {exc}") from exc
    old = target.with_name(target.name + ".old")
    if target.exists():  # the same step again (a resumed run's interruption): swap, then drop the old one
        target.rename(old)
    tmp.rename(target)
    _fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)
    for stale in complete_checkpoints(target.parent.parent)[:-KEEP]:
        shutil.rmtree(stale, ignore_errors=True)
    return target


def _fsync(directory: Path) -> None:
    """Every file's data on disk before the rename publishes the directory."""
    for path in directory.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def find_checkpoint(path: Path) -> Path:
    """`path` is a checkpoint directory, or a run directory whose newest complete checkpoint is used."""
    path = path.expanduser()
    if (path / STATE_FILE).exists():
        return path
    found = complete_checkpoints(path)
    if not found:
        raise ConfigError(
            f"no checkpoint in {path}: pass a run directory (with checkpoints/step_N/) "
            f"or a checkpoint directory holding {STATE_FILE}"
        )
    return found[-1]


FIXED_ON_RESUME = (
    "model",
    "revision",
    "task",
    "task_options",
    "seed",
    "group_size",
    "prompts_per_step",
    "max_new_tokens",
    "lora_rank",
    "lora_alpha",
    "lora_targets",
)


def resume_check(saved: dict[str, Any], step: int, cfg: Any, had_token: bool = True) -> None:
    """A resumed run may train longer or move ports, not change what its state means — nor come back open:
    a run that had a join token (`had_token`; assumed for checkpoints that do not say) needs one again."""
    if had_token and cfg.token is None and not cfg.insecure_no_token:
        raise ConfigError(
            "this run had a join token, and resuming without one would let anyone join: pass --token "
            "(or --token-file) with the run's secret, or --insecure-no-token if you mean it"
        )
    for key in FIXED_ON_RESUME:
        if key in saved and saved[key] != getattr(cfg, key):
            raise ConfigError(
                f"cannot change {key} on resume ({saved[key]!r} in the checkpoint, "
                f"{getattr(cfg, key)!r} given): start a new run instead"
            )
    if step >= cfg.steps:
        raise ConfigError(
            f"the checkpoint is at step {step} and the run has {cfg.steps} steps: "
            f"pass --steps N with N > {step} to train further"
        )


def read_state(checkpoint: Path) -> dict[str, Any]:
    try:
        state = json.loads((checkpoint / STATE_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {checkpoint / STATE_FILE}: {exc}") from exc
    for key in ("step", "config", "coordinator"):
        if key not in state:
            raise ConfigError(f"{checkpoint / STATE_FILE} has no {key!r}: not an echo2 learner checkpoint")
    return state
