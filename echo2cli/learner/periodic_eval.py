"""`--eval-every N`: the learner evaluates every N-th version on the task's held-out split, beside training.

Each evaluation is `echo2 eval` in a subprocess (its own vLLM engine) on a model directory made of the
base model's config and tokenizer and the version's published weights (hard-linked, so pruning the
version does not disturb it). One runs at a time; a version due while one runs is skipped. Results join
the next metrics line as `eval/*` (with `eval/version`) and are listed in summary.json.

On a GPU learner the engine never lands on the trainer's GPU unasked: vLLM takes a fixed share of a GPU's memory
at start, and beside a trainer near its peak that fails or starves it. `--eval-devices` names the evaluation's
GPUs (CUDA_VISIBLE_DEVICES of the subprocess); without it a CUDA learner refuses --eval-every at start.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from echo2cli.config import LearnerConfig
from echo2cli.errors import ConfigError
from echo2cli.layout import VersionKey
from echo2cli.models import model_dir_with_weights

REPORTED = ("greedy_accuracy", "greedy_reward", "pass_at_k", "sampled_reward", "t_eval_s")


class PeriodicEval:
    def __init__(self, cfg: LearnerConfig, model_dir: Path, out: Path, cuda: bool = False) -> None:
        """`cuda`: the trainer runs on CUDA (then --eval-every needs --eval-devices)."""
        if cfg.eval_every and cuda and not cfg.eval_devices:
            raise ConfigError(
                "--eval-every would start vLLM on the trainer's GPU: give --eval-devices with a GPU the trainer "
                "does not use (e.g. --eval-devices 1), or drop --eval-every and run `echo2 eval` on a checkpoint"
            )
        self.cfg, self.model_dir = cfg, model_dir
        self.root = out / "eval"
        self.running: tuple[int, subprocess.Popen] | None = None
        self.results: list[dict[str, Any]] = []

    def _file(self, version: int, suffix: str) -> Path:
        return self.root / (VersionKey(version).dir_name + suffix)

    def due(self, version: int) -> bool:
        return bool(self.cfg.eval_every) and version % self.cfg.eval_every == 0 and self.running is None

    def start(self, version: int, weights: Path) -> None:
        mdir = self.root / f"model_{VersionKey(version).dir_name}"
        shutil.rmtree(mdir, ignore_errors=True)
        model_dir_with_weights(mdir, self.model_dir, weights)
        cfg = self.cfg
        options = [f"--option={k}={json.dumps(v)}" for k, v in cfg.task_options.items()]
        argv = [
            sys.executable,
            "-m",
            "echo2cli",
            "eval",
            "--model",
            str(mdir),
            "--task",
            cfg.task,
            *options,
            "--limit",
            str(cfg.eval_limit),
            "--k",
            str(cfg.eval_k),
            "--max-new-tokens",
            str(cfg.max_new_tokens),
            "--seed",
            str(cfg.seed),
            "--out",
            str(self._file(version, ".json")),
            "--json",
        ]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": cfg.eval_devices} if cfg.eval_devices else None
        with open(self._file(version, ".log"), "w") as log:  # the child keeps its own handle
            self.running = (version, subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, env=env))

    def poll(self, wait: bool = False) -> dict[str, Any]:
        """`eval/*` of an evaluation that has just finished, else {}."""
        if self.running is None:
            return {}
        version, proc = self.running
        if wait:
            proc.wait()
        if proc.poll() is None:
            return {}
        self.running = None
        shutil.rmtree(self.root / f"model_{VersionKey(version).dir_name}", ignore_errors=True)
        result_file = self._file(version, ".json")
        if proc.returncode != 0 or not result_file.exists():
            return {"eval/version": version, "eval/failed": 1}  # the log beside it says why
        result = json.loads(result_file.read_text())
        self.results.append({"version": version, **{k: result[k] for k in REPORTED}})
        return {"eval/version": version, **{f"eval/{k}": result[k] for k in REPORTED}}

    def close(self) -> None:
        if self.running is not None:
            self.running[1].kill()
            self.running[1].wait()
