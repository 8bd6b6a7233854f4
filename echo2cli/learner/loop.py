"""`echo2 learner`: the training loop that ties coordinator, trainer, publisher and server together.

    publish v0 → serve → for t in 0..steps-1:
        wait until B admissible groups are ready            (learner/t_wait_s: the bubble)
        one GRPO step on them                               (learner/t_train_s: T_train)
        publish version t+1 every kappa steps               (learner/t_publish_s)
        re-plan cost-aware activation every plan_every steps and on joins/deaths (learner/activation.py)
        evaluate every eval_every-th version in a subprocess (learner/periodic_eval.py)
        log one metrics line; checkpoint every N steps
    finish: tell workers, final checkpoint, linger so they hear it, stop.

SIGTERM / Ctrl-C (`request_stop`) ends the loop at the next step boundary with a checkpoint and without
telling workers to finish: `echo2 learner --resume OUT` continues at the same step and version, and the
workers, which kept retrying, join it again. A second signal stops at once (the last checkpoint stands).

Bubble ratio = time waiting for rollouts / wall time, counted from the end of the first wait: the first
wait is fleet start-up (engines loading), which a capacity model of steady state does not describe.
T_bcast(v) = from publishing v until every active worker generates with v or newer.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from echo2cli.broadcast.node import TorrentNode
from echo2cli.config import LearnerConfig
from echo2cli.errors import ConfigError, ModelError
from echo2cli.launch import announce_learner
from echo2cli.layout import VERSIONS_DIR, checkpoint_dir
from echo2cli.learner.activation import Activation
from echo2cli.learner.checkpoint import read_state, write_checkpoint
from echo2cli.learner.coordinator import Coordinator, Group
from echo2cli.learner.periodic_eval import PeriodicEval
from echo2cli.learner.publisher import Publisher
from echo2cli.learner.server import build_app
from echo2cli.learner.trainer import Trainer
from echo2cli.metrics import MetricsWriter
from echo2cli.models import MODEL_FILES, resolve_model
from echo2cli.tasks import encode_chat, load_task
from echo2cli.tasks.scoring import Scorer
from echo2cli.tls import check_server_files, trust_for_torrents
from echo2cli.units import mbps_to_bytes_per_s

SCALARS_IN_STATUS = (
    "rollout/reward_mean",
    "learner/t_train_s",
    "learner/t_wait_s",
    "bcast/t_s",
    "bcast/version",
    "learner/bubble_ratio",
    "bcast/upload_ratio",
    "rollout/staleness_max",
    "train/loss",
    "time_s",
    "plan/mu_min",
    "plan/mu_min_echo2",
    "plan/active_workers",
    "plan/standby_workers",
    "cost/usd_per_step",
)


def bind_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror}): pick another --port") from exc
    sock.listen(128)
    return sock


def serve_in_thread(app: Any, sock: socket.socket, tls: tuple[Path, Path] | None = None):
    import uvicorn

    cert, key = tls or (None, None)
    server = uvicorn.Server(
        uvicorn.Config(
            app, log_level="warning", access_log=False, timeout_keep_alive=30, ssl_certfile=cert, ssl_keyfile=key
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="http")
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.01)
    return server, thread


def batch_metrics(groups: list[Group], step: int) -> dict[str, Any]:
    rewards = [r for g in groups for r in g.rewards]
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
    hist = Counter(step - g.version for g in groups for _ in g.samples)  # every trained sample
    return {
        "rollout/reward_mean": mean,
        "rollout/reward_std": std,
        "rollout/samples": len(rewards),
        "rollout/staleness_hist": {str(k): v for k, v in sorted(hist.items())},
        "rollout/staleness_max": max(hist),
        "rollout/staleness_mean": sum(k * v for k, v in hist.items()) / len(rewards),
        "rollout/versions": sorted({g.version for g in groups}),
        "rollout/worker_versions": sorted({(g.worker_id, g.version) for g in groups}),
        "rollout/gen_tokens": sum(len(s.completion_token_ids) for g in groups for s in g.samples),
        "rollout/prompt_ids": [g.prompt_id for g in groups],
        **component_means(groups),
    }


def component_means(groups: list[Group]) -> dict[str, float]:
    """`reward/<name>`: the mean of each reward component over the batch's samples (0 where one is absent)."""
    rows = [c for g in groups for c in g.components]
    names = sorted({k for c in rows for k in c})
    return {f"reward/{k}": sum(c.get(k, 0.0) for c in rows) / len(rows) for k in names}


def ensure_writable(directory: Path, what: str) -> None:
    """Fail at start, in one line, rather than at the first checkpoint an hour in."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".echo2-write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot write to {what} {directory} ({exc.strerror}): pick another one") from exc


class Learner:
    def __init__(self, cfg: LearnerConfig, resume_from: Path | None = None) -> None:
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.out = cfg.out_dir
        ensure_writable(self.out, "--out")
        self.run_id = uuid.uuid4().hex[:8]
        self.start_step = 0
        self.stop = threading.Event()
        self.model_dir = resolve_model(cfg.model)
        task = load_task(cfg.task, cfg.task_options)
        self.scorer = Scorer(cfg.task, cfg.task_options, timeout_s=cfg.reward_timeout_s)
        try:
            tok = AutoTokenizer.from_pretrained(self.model_dir)
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot load the tokenizer of {self.model_dir}: {exc}") from exc

        if cfg.torch_threads:
            import torch

            torch.set_num_threads(cfg.torch_threads)
        self.trainer = Trainer(
            self.model_dir,
            lr=cfg.lr,
            clip_eps=cfg.clip_eps,
            is_cap=cfg.is_cap,
            kl_coef=cfg.kl_coef,
            max_grad_norm=cfg.max_grad_norm,
            micro_batch=cfg.micro_batch,
            temperature=cfg.temperature,
        )
        self.coord = Coordinator(
            task,
            encode_prompt=lambda messages: encode_chat(tok, messages),
            decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
            group_size=cfg.group_size,
            staleness=cfg.staleness,
            prompts_per_step=cfg.prompts_per_step,
            max_new_tokens=cfg.max_new_tokens,
            vocab_size=int(self.trainer.model.config.vocab_size),
            lease_timeout_s=cfg.lease_timeout_s,
            heartbeat_s=cfg.heartbeat_s,
            seed=cfg.seed,
            score=self.scorer,
            max_seq_len=getattr(self.trainer.model.config, "max_position_embeddings", None),
        )
        if resume_from is not None:
            self._restore(resume_from)
        self.sock = bind_socket(cfg.host, cfg.port)
        host, port = self.sock.getsockname()[:2]
        self.tls = (cfg.tls_cert, cfg.tls_key) if cfg.tls_cert and cfg.tls_key else None
        if self.tls:
            check_server_files(*self.tls)
            trust_for_torrents(cfg.tls_cert, self.out)  # our own node announces to our https tracker
        self.url = cfg.public_url or f"{'https' if self.tls else 'http'}://{host}:{port}"
        self.node = TorrentNode(
            cfg.bt_listen,
            upload_limit_bytes_s=mbps_to_bytes_per_s(cfg.uplink_mbps),
            tracker_key=self.coord.learner_tracker_key,
        )
        self.publisher = Publisher(
            self.trainer,
            self.node,
            self.coord,
            self.out / VERSIONS_DIR,
            f"{self.url}/announce",
            keep=cfg.staleness + 1,
        )
        self._trim_metrics()
        self.metrics = MetricsWriter(self.out / "metrics.jsonl")
        self.mismatch = MetricsWriter(self.out / "mismatch.jsonl")  # per step, the tokens of largest |log w|
        self.activation = Activation(cfg, self.coord, self.out / "decisions.jsonl")
        self.evals = PeriodicEval(cfg, self.model_dir, self.out)
        self.on_decision: Callable[[dict[str, Any]], None] | None = None
        self.last: dict[str, Any] = {}
        self.upload_ratio: dict[int, float] = {}

    def _restore(self, checkpoint: Path) -> None:
        state = read_state(checkpoint)
        try:
            self.trainer.load_checkpoint(checkpoint)
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            raise ModelError(f"checkpoint {checkpoint} does not load: {exc}") from exc
        self.coord.load_state(state["coordinator"])
        self.run_id, self.start_step = state["run_id"], int(state["step"])

    def request_stop(self) -> None:
        """Checkpoint at the next step boundary and stop, leaving workers waiting for a resume."""
        self.stop.set()

    def _usd_per_hour(self) -> float:
        """Learner plus every live worker not on standby: what the run pays for right now."""
        live = [w for w in self.coord.measured() if w["active"] and not w["standby"]]
        return self.cfg.learner_usd_per_hour + sum(w["usd_per_hour"] for w in live)

    def _model_files(self) -> list[str]:
        return [f for f in MODEL_FILES if (self.model_dir / f).exists()]

    def _status_extra(self) -> dict:
        return {k: self.last[k] for k in SCALARS_IN_STATUS if k in self.last}

    def _tick(self, step: int) -> None:
        self.node.poll()
        decision = self.activation.update(step)
        if decision is not None and decision["changed"] and self.on_decision:
            self.on_decision(decision)
        for v in self.coord.update_bcast():
            size = self.publisher.sizes.get(v)
            if size:
                self.upload_ratio[v] = self.publisher.upload_bytes(v) / size

    def _bcast_metrics(self) -> dict[str, Any]:
        if not self.coord.bcast_s:
            return {}
        v = max(self.coord.bcast_s)
        return {
            "bcast/version": v,
            "bcast/t_s": self.coord.bcast_s[v],
            "bcast/t_ready_s": self.coord.ready_s[v],
            "bcast/upload_ratio": self.upload_ratio.get(v),
        }

    def _delta_metrics(self, version: int) -> dict[str, Any]:
        stats = self.publisher.delta_stats.get(version)
        if not stats:
            return {}
        ratio = stats["delta_bytes"] / stats["full_bytes"]
        return {"bcast/delta_ratio": ratio, "bcast/delta_encode_s": stats["encode_s"]}

    def checkpoint(self, step: int) -> Path:
        """Between steps: weights and optimizer at version `step`, RNG, coordinator state, resolved config."""
        state = {
            "step": step,
            "version": step,
            "run_id": self.run_id,
            "time": time.time(),
            "token_required": self.cfg.token is not None,
            "config": self.cfg.model_dump(mode="json"),
            "coordinator": self.coord.state_dict(),
        }

        def write_files(tmp: Path) -> None:
            self.trainer.save_checkpoint(tmp)
            for name in self._model_files():
                if name not in ("config.json", "generation_config.json"):
                    shutil.copy2(self.model_dir / name, tmp / name)

        return write_checkpoint(checkpoint_dir(self.out, step), write_files, state)

    def _trim_metrics(self) -> None:
        """A resumed run rewrites the steps after its checkpoint: drop their old lines."""
        path = self.out / "metrics.jsonl"
        if path.exists():
            keep = [
                line
                for line in path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", -1) < self.start_step
            ]
            path.write_text("".join(line + "\n" for line in keep))

    def run(self, on_step: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        cfg = self.cfg
        shutil.rmtree(self.out / VERSIONS_DIR, ignore_errors=True)  # a previous run's versions: never served again
        self.publisher.publish(self.start_step)
        join_info = dict(
            task=cfg.task,
            group_size=cfg.group_size,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            staleness=cfg.staleness,
            heartbeat_s=cfg.heartbeat_s,
            model_files=self._model_files(),
        )
        app = build_app(
            self.coord,
            run_id=self.run_id,
            join_info=join_info,
            model_dir=self.model_dir,
            model_files=self._model_files(),
            token=cfg.token,
            status_extra=self._status_extra,
            target_steps=cfg.steps,
        )
        server, thread = serve_in_thread(app, self.sock, self.tls)
        (self.out / "config.json").write_text(cfg.model_dump_json(indent=2))
        announce_learner(self.out, {"url": self.url, "run_id": self.run_id, "pid": os.getpid()})
        t_start = time.time()
        steady_since: float | None = None
        waited_steady = 0.0
        stopped_at: int | None = None
        try:
            for t in range(self.start_step, cfg.steps):
                t0 = time.time()
                groups = None
                while groups is None and not self.stop.is_set():
                    if (groups := self.coord.take_batch()) is None:
                        time.sleep(0.02)
                        self._tick(t)
                if groups is None:  # asked to stop while waiting; a batch once taken is always trained
                    stopped_at = t
                    break
                t_wait = time.time() - t0
                if steady_since is None:
                    steady_since = time.time()
                else:
                    waited_steady += t_wait
                record: dict[str, Any] = {"step": t, **batch_metrics(groups, t)}
                record.update(self.trainer.step(groups))
                version = t + 1
                t1 = time.time()
                if version % cfg.kappa == 0 or version == cfg.steps:
                    self.publisher.publish(version)
                    if self.evals.due(version):
                        self.evals.start(version, self.publisher.weights_path(version))
                self.coord.advance(version)
                self._tick(version)
                now = time.time()
                c = self.coord.counters
                record.update(
                    {
                        "version": version,
                        "time_s": now - t_start,
                        "learner/t_wait_s": t_wait,
                        "learner/t_publish_s": now - t1,
                        "learner/t_busy_s": now - t0 - t_wait,  # T_train of the capacity model
                        "learner/bubble_ratio": waited_steady / max(now - steady_since, 1e-9),
                        "learner/bubble_ratio_step": t_wait / max(now - t0, 1e-9),
                        "rollout/stale_dropped_total": c["stale_samples"],
                        "rollout/duplicate_total": c["duplicate_samples"],
                        "rollout/invalid_total": c["invalid_samples"],
                        "rollout/leases_expired_total": c["leases_expired"],
                        "reward/errors_total": c["reward_errors"],
                        "reward/timeouts_total": c["reward_timeouts"],
                        **{f"ledger/{k}": v for k, v in self.coord.accounting().items()},
                        "workers/active": len(self.coord.active_workers()),
                        **self._bcast_metrics(),
                        **self._delta_metrics(version),
                        **self.activation.metrics,
                        "cost/usd_per_step": self._usd_per_hour() * (now - t0) / 3600.0,
                    }
                )
                # the model's T_train is all the learner's busy time per step: training plus publishing
                record.update(self.evals.poll())
                self.activation.observe_step(record["learner/t_busy_s"])
                self.coord.set_step_time(now - t0)  # sizes leases by each worker's speed
                self.metrics.write(record)
                self.mismatch.write(
                    {"step": t, "tokens": [{**o, "staleness": t - o["version"]} for o in self.trainer.outliers]}
                )
                self.last = record
                if on_step:
                    on_step(record)
                if self.stop.is_set():
                    stopped_at = version
                    break
                if cfg.checkpoint_every and version % cfg.checkpoint_every == 0 and version != cfg.steps:
                    self.checkpoint(version)
            if stopped_at is not None:  # workers are not told to finish: they wait for the resumed learner
                final = self.checkpoint(stopped_at)
            else:
                self.coord.finish()
                final = self.checkpoint(cfg.steps)
                self.evals.poll(wait=True)
                self._linger()
        finally:
            # Not `coord.finish()`: only a run that reached its last step says "finished". A stop request,
            # a full disk or a crash must leave workers retrying, so they join the resumed learner.
            server.should_exit = True
            thread.join(timeout=10)
            self.node.close()
            self.metrics.close()
            self.mismatch.close()
            self.activation.close()
            self.scorer.close()
            self.evals.close()
        summary = {
            "run_id": self.run_id,
            "steps": cfg.steps,
            "wall_s": time.time() - t_start,
            "start_step": self.start_step,
            "stopped_at": stopped_at,
            "checkpoint": str(final),
            "metrics": str(self.metrics.path),
            "ledger": self.coord.accounting(),
            "audit": self.coord.audit(),
            "rejected_samples": {
                k.removeprefix("rejected_").removesuffix("_samples"): v
                for k, v in sorted(self.coord.counters.items())
                if k.startswith("rejected_")
            },
            "bcast_s": {str(k): v for k, v in sorted(self.coord.bcast_s.items())},
            "bcast_ready_s": {str(k): v for k, v in sorted(self.coord.ready_s.items())},
            "upload_ratio": {str(k): v for k, v in sorted(self.upload_ratio.items())},
            "workers": self.coord.measured(),
            "eval": self.evals.results,
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _linger(self) -> None:
        """Serve on until every worker has heard 'finished' and left, or linger_s passes."""
        deadline = time.time() + self.cfg.linger_s
        while time.time() < deadline and self.coord.active_workers():
            self._tick(self.cfg.steps)
            time.sleep(0.1)
