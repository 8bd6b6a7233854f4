"""`echo2 learner`: the training loop that ties coordinator, trainer, publisher and server together.

    serve: publish the start version, open the API and tracker, write learner.json
    for t in start..steps-1:
        wait until B admissible groups are ready            (learner/t_wait_s: the bubble)
        one GRPO step on them                               (learner/t_train_s: T_train)
        publish version t+1 every kappa steps               (learner/t_publish_s: the copy of the weights;
                                                             written and announced in the background;
                                                             learner/t_publish_wait_s: waiting for the last one)
        record: one metrics line; re-plan cost-aware activation every plan_every steps and on joins and
            deaths (activation.py); evaluate every eval_every-th version in a subprocess (periodic_eval.py);
            checkpoint every checkpoint_every steps
    finish: tell workers, final checkpoint, linger so they hear it
    summarise: summary.json

SIGTERM / Ctrl-C (`request_stop`) ends the loop at the next step boundary with a checkpoint and without
telling workers to finish: `echo2 learner --resume OUT` continues at the same step and version, and the
workers, which kept retrying, join it again. A second signal stops at once (the last checkpoint stands).
So does any error: only a run that reached its last step tells workers it finished.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from echo2cli.broadcast.image import WIRE_DTYPES
from echo2cli.broadcast.node import TorrentNode
from echo2cli.config import LearnerConfig
from echo2cli.errors import ConfigError, ModelError
from echo2cli.hardware import pin_thread, usable_cpus
from echo2cli.launch import announce_learner
from echo2cli.layout import VERSIONS_DIR, checkpoint_dir
from echo2cli.learner.activation import Activation
from echo2cli.learner.checkpoint import read_state, write_checkpoint
from echo2cli.learner.connections import Admission
from echo2cli.learner.coordinator import Coordinator
from echo2cli.learner.divergence import DivergenceGuard
from echo2cli.learner.episode_host import episode_host
from echo2cli.learner.periodic_eval import PeriodicEval
from echo2cli.learner.publisher import Publisher
from echo2cli.learner.records import (
    Bubble,
    StepLog,
    batch_histograms,
    batch_metrics,
    bcast_metrics,
    delta_metrics,
    usd_per_hour,
)
from echo2cli.learner.schedule import LrSchedule
from echo2cli.learner.server import bind_socket, build_app, serving
from echo2cli.learner.sharded import ShardedTrainer, closed_on_success, under_torchrun
from echo2cli.learner.trainer import Trainer
from echo2cli.learner.types import Group
from echo2cli.loggers import Reporters, parse_report_to
from echo2cli.lora import lora_spec
from echo2cli.models import MODEL_FILES, resolve_model
from echo2cli.protocol import LoraSpec
from echo2cli.tasks import encode_chat, load_task
from echo2cli.tasks.episodes import is_episodic
from echo2cli.tasks.scoring import Scorer
from echo2cli.tls import check_server_files, trust_for_torrents
from echo2cli.units import mbps_to_bytes_per_s

WAIT_TICK_S = 0.2  # while waiting for a batch: poll the torrent session, re-plan, measure T_bcast this often


def ensure_writable(directory: Path, what: str) -> None:
    """Fail at start, in one line, rather than at the first checkpoint an hour in."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".echo2-write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot write to {what} {directory} ({exc.strerror}): pick another one") from exc


def build_trainer_and_coordinator(cfg: LearnerConfig, model_dir: Path, scorer: Scorer) -> tuple[Trainer, Coordinator]:
    """The trainer on the model, and the coordinator on the task with the model's tokenizer and limits."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the tokenizer of {model_dir}: {exc}") from exc
    trainer = build_trainer(cfg, model_dir)
    positions = getattr(trainer.model.config, "max_position_embeddings", None) or 1 << 30
    if cfg.max_new_tokens >= positions:
        raise ConfigError(
            f"max_new_tokens {cfg.max_new_tokens} leaves no room for a prompt in the model's {positions} positions: "
            "lower it"
        )
    task = load_task(cfg.task, cfg.task_options)
    completion_cap, turns = completion_limits(cfg, task)
    coord = Coordinator(
        task,
        encode_prompt=lambda messages: encode_chat(tok, messages),
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        group_size=cfg.group_size,
        staleness=cfg.staleness,
        prompts_per_step=cfg.prompts_per_step,
        max_new_tokens=completion_cap,
        vocab_size=int(trainer.model.config.vocab_size),
        lease_timeout_s=cfg.lease_timeout(),
        heartbeat_s=cfg.heartbeat_s,
        seed=cfg.seed,
        score=scorer,
        max_seq_len=min(positions, cfg.max_prompt_tokens + completion_cap),
        turns=turns,
        workers_per_address=cfg.max_workers_per_address,
    )
    return trainer, coord


def completion_limits(cfg: LearnerConfig, task: Any) -> tuple[int, tuple[int, int] | None]:
    """Tokens after the prompt, at most, and a multi-turn task's (max_turns, tokens per policy turn). A transcript
    holds max_turns policy turns of max_new_tokens and the observations between them, each at most
    max_prompt_tokens."""
    if not is_episodic(task):
        return cfg.max_new_tokens, None
    turns = int(task.max_turns)
    return turns * cfg.max_new_tokens + (turns - 1) * cfg.max_prompt_tokens, (turns, cfg.max_new_tokens)


def training_cpus(cfg: LearnerConfig) -> set[int] | None:
    """The CPUs `--train-cpus` names, if any; ConfigError if this process may not run on all of them."""
    try:
        return usable_cpus(cfg.train_cpus) if cfg.train_cpus else None
    except ValueError as exc:
        raise ConfigError(f"--train-cpus {cfg.train_cpus}: {exc}") from None


def build_trainer(cfg: LearnerConfig, model_dir: Path) -> Trainer:
    """One process: the plain trainer. Under torchrun: this rank's part of the sharded one (`sharded.py`)."""
    if cfg.torch_threads:
        import torch

        torch.set_num_threads(cfg.torch_threads)
    kind: type[Trainer] = ShardedTrainer if under_torchrun() else Trainer
    return kind(
        model_dir,
        lr=cfg.lr,
        clip_eps=cfg.clip_eps,
        is_cap=cfg.is_cap,
        kl_coef=cfg.kl_coef,
        max_grad_norm=cfg.max_grad_norm,
        micro_batch=cfg.micro_batch,
        minibatches=cfg.minibatches,
        skip_flat_groups=cfg.skip_flat_groups,
        temperature=cfg.temperature,
        max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch,
        activation_checkpointing=cfg.activation_checkpointing,
        compile=cfg.compile,
        off_policy=cfg.off_policy,
        geo_low=cfg.geo_low,
        geo_high=cfg.geo_high,
        share_prompts=cfg.share_prompts,
        lora=lora_spec(cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets),
        dither_seed=cfg.seed if cfg.master_dither else None,
        wire_dtype=WIRE_DTYPES[cfg.wire_dtype],
        lr_schedule=LrSchedule(cfg.lr, cfg.steps, cfg.lr_schedule, cfg.lr_warmup_steps, cfg.lr_min_ratio),
    )


def divergence_guard(cfg: LearnerConfig) -> DivergenceGuard:
    """The guard as configured; without a correction (`--off-policy none`) a flag under --adaptive-staleness means
    lag 0 from then on (`DivergenceGuard`)."""
    limits, corrected = cfg.guard_thresholds(), cfg.off_policy != "none"
    return DivergenceGuard(cfg.staleness, limits, adaptive=cfg.adaptive_staleness, corrected=corrected)


def follow_learner(cfg: LearnerConfig) -> None:
    """Ranks > 0 of a sharded learner: hold a shard and make rank 0's trainer calls until it finishes.
    Signals are rank 0's to handle (it checkpoints at the next step and then releases the others)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    trainer = build_trainer(cfg, resolve_model(cfg.model, cfg.revision))
    assert isinstance(trainer, ShardedTrainer)
    trainer.follow()


def run_settings(
    cfg: LearnerConfig, coord: Coordinator, model_files: list[str], lora: LoraSpec | None
) -> dict[str, Any]:
    """What every join answer tells a worker of the run (besides its own credentials and the newest version)."""
    turns = coord.admission.turns
    return dict(
        task=cfg.task,
        group_size=cfg.group_size,
        max_new_tokens=cfg.max_new_tokens,
        context_len=coord.prompts.max_seq_len,
        max_turns=turns[0] if turns else 0,
        transcript_tokens=coord.max_new_tokens if turns else 0,
        hidden_state=coord.prompts.hidden,
        temperature=cfg.temperature,
        staleness=cfg.staleness,
        heartbeat_s=cfg.heartbeat_s,
        model_files=model_files,
        lora=lora,
        wire_dtype=cfg.wire_dtype,
    )


class Learner:
    def __init__(self, cfg: LearnerConfig, resume_from: Path | None = None) -> None:
        self.cfg, self.out = cfg, cfg.out_dir
        ensure_writable(self.out, "--out")
        self.train_cpus = training_cpus(cfg)  # checked before anything starts; pinned when training starts
        self.run_id, self.start_step = uuid.uuid4().hex[:8], 0
        self.stop = threading.Event()
        self.model_dir = resolve_model(cfg.model, cfg.revision)
        self.model_files = [f for f in MODEL_FILES if (self.model_dir / f).exists()]
        self._closing = contextlib.ExitStack()  # everything opened here, closed when `run` ends
        self.scorer = self._closing.enter_context(
            contextlib.closing(
                Scorer(cfg.task, cfg.task_options, timeout_s=cfg.reward_timeout_s, tokenizer_dir=str(self.model_dir))
            )
        )
        self.trainer, self.coord = build_trainer_and_coordinator(cfg, self.model_dir, self.scorer)
        # a sharded trainer's other ranks stop with this one: told STOP after a clean finish, never after an error
        self._closing.enter_context(closed_on_success(self.trainer))
        self.guard = divergence_guard(cfg)
        if resume_from is not None:
            self._restore(resume_from)
        self.sock = bind_socket(cfg.host, cfg.port)
        self.tls = (cfg.tls_cert, cfg.tls_key) if cfg.tls_cert and cfg.tls_key else None
        if self.tls:
            check_server_files(*self.tls)
            trust_for_torrents(cfg.tls_cert, self.out)  # our own node announces to our https tracker
        host, port = self.sock.getsockname()[:2]
        self.url = cfg.public_url or f"{'https' if self.tls else 'http'}://{host}:{port}"
        uplink, tracker_key = mbps_to_bytes_per_s(cfg.uplink_mbps), self.coord.credentials.learner_tracker_key
        self.node = self._close_later(TorrentNode(cfg.bt_listen, upload_limit_bytes_s=uplink, tracker_key=tracker_key))
        self.publisher = self._close_later(
            Publisher(
                self.trainer,
                self.node,
                self.coord,
                self.out / VERSIONS_DIR,
                f"{self.url}/announce",
                keep=cfg.staleness + 1,
                web_seed_rate=uplink,
                keep_every=cfg.keep_versions_every,
                web_seed_streams_per_address=cfg.web_seed_streams_per_address,
            )
        )
        reporters = Reporters(parse_report_to(cfg.report_to), self.out, cfg.model_dump(mode="json"))
        self.log = self._close_later(StepLog(self.out, self.start_step, reporters))
        self.activation = self._close_later(Activation(cfg, self.coord, self.out / "decisions.jsonl"))
        cuda = self.trainer.device.type == "cuda"
        self.evals = self._close_later(PeriodicEval(cfg, self.model_dir, self.out, cuda))
        self.on_decision: Callable[[dict[str, Any]], None] | None = None
        self.upload_ratio: dict[int, float] = {}
        self.bubble = Bubble()

    def _close_later(self, resource: Any) -> Any:
        return self._closing.enter_context(contextlib.closing(resource))

    def _restore(self, checkpoint: Path) -> None:
        state = read_state(checkpoint)
        try:
            self.trainer.load_checkpoint(checkpoint)
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            raise ModelError(f"checkpoint {checkpoint} does not load: {exc}") from exc
        self.coord.load_state(state["coordinator"])
        if "guard" in state:  # checkpoints from before 2026-11-29 have none: the guard starts afresh
            self.guard.load_state(state["guard"])
            self.coord.set_effective_staleness(self.guard.effective)
        self.run_id, self.start_step = state["run_id"], int(state["step"])

    def request_stop(self) -> None:
        """Checkpoint at the next step boundary and stop, leaving workers waiting for a resume."""
        self.stop.set()

    # -- the run -------------------------------------------------------------------------------------

    def run(self, on_step: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Serve, train, finish; returns (and writes) the summary. `on_step(record)` after every step."""
        t_start = time.time()
        with self._closing, self._serve():
            stopped_at = self._train(t_start, on_step)
            final = self._finish(stopped_at)
        return self._summarize(t_start, stopped_at, final)

    @contextlib.contextmanager
    def _serve(self) -> Iterator[None]:
        """Publish the start version, then serve the API and tracker; learner.json says we are up."""
        shutil.rmtree(self.out / VERSIONS_DIR, ignore_errors=True)  # a previous run's versions: never served again
        self.publisher.publish(self.start_step)
        self.publisher.wait()
        cfg = self.cfg
        join_info = run_settings(cfg, self.coord, self.model_files, self.trainer.lora)
        app = build_app(
            self.coord,
            run_id=self.run_id,
            join_info=join_info,
            model_dir=self.model_dir,
            model_files=self.model_files,
            token=cfg.token,
            status_extra=self.log.status,
            target_steps=cfg.steps,
            web_seed=self.publisher.web_seed,
            episodes=episode_host(self.coord, self.model_dir),
        )
        with serving(app, self.sock, self.tls, Admission(cfg.max_connections_per_address)):
            (self.out / "config.json").write_text(cfg.model_dump_json(indent=2))
            announce_learner(self.out, {"url": self.url, "run_id": self.run_id, "pid": os.getpid()})
            yield

    def _train(self, t_start: float, on_step: Callable[[dict[str, Any]], None] | None) -> int | None:
        """Steps start..steps-1; the version it stopped at if asked to stop, else None."""
        if self.train_cpus:
            pin_thread(self.train_cpus)
        for t in range(self.start_step, self.cfg.steps):
            t0 = time.time()
            groups = self._wait_for_batch(t)
            if groups is None:  # asked to stop while waiting; a batch once taken is always trained
                return t
            t_wait = time.time() - t0
            self.bubble.waited_for(t_wait, time.time())
            record: dict[str, Any] = {
                "step": t,
                **batch_metrics(groups, t, self.cfg.max_new_tokens),
                **self.trainer.step(groups, t),
            }
            version = t + 1
            t_publish, record["learner/t_publish_wait_s"] = self._publish(version)  # the wait: of t_publish
            self.coord.advance(version)
            self._tick(version)
            self._record(record, version, t_start=t_start, t0=t0, t_wait=t_wait, t_publish=t_publish)
            self.log.write(record, self.trainer.outliers, batch_histograms(groups, t))
            if on_step:
                on_step(record)
            if self.stop.is_set():
                return version
            if self.cfg.checkpoint_every and version % self.cfg.checkpoint_every == 0 and version != self.cfg.steps:
                self.checkpoint(version)
        return None

    def _wait_for_batch(self, step: int) -> list[Group] | None:
        while not self.stop.is_set():
            groups = self.coord.take_batch(wait_s=WAIT_TICK_S)
            if groups is not None:
                return groups
            self._tick(step)
            if isinstance(self.trainer, ShardedTrainer):
                self.trainer.keep_alive()  # the other ranks wait for the next step in a collective that times out
        return None

    def _publish(self, version: int) -> tuple[float, float]:
        """Publish every kappa-th version (and the last); start its evaluation if one is due. Returns the seconds
        the training loop spent on it (waiting for the previous version to be announced, and copying the
        weights) and of those the wait alone."""
        t0, waited = time.time(), 0.0
        if version % self.cfg.kappa == 0 or version == self.cfg.steps:
            waited = self.publisher.publish(version)
            if self.evals.due(version):
                self.publisher.wait()  # the evaluation reads the file
                self.evals.start(version, self.publisher.weights_path(version))
        return time.time() - t0, waited

    def _tick(self, step: int) -> None:
        """Torrent alerts, cost-aware activation, and T_bcast of versions the fleet now runs."""
        self.node.poll()
        decision = self.activation.update(step)
        if decision is not None and decision["changed"] and self.on_decision:
            self.on_decision(decision)
        for v in self.coord.update_bcast():
            size = self.publisher.sizes.get(v)
            if size:
                self.upload_ratio[v] = self.publisher.upload_bytes(v) / size

    def _record(
        self, record: dict[str, Any], version: int, *, t_start: float, t0: float, t_wait: float, t_publish: float
    ) -> None:
        """Complete the step's metrics line; feed the measured step time back."""
        now = time.time()
        bcast_s, ready_s = self.coord.bcast_times()
        record.update(
            {
                "version": version,
                "time_s": now - t_start,
                "learner/t_wait_s": t_wait,
                "learner/t_publish_s": t_publish,
                "bcast/t_announce_s": self.publisher.announce_s,
                "learner/t_busy_s": now - t0 - t_wait,  # the capacity model's T_train: training plus publishing
                "learner/bubble_ratio": self.bubble.ratio(now),
                "learner/bubble_ratio_step": t_wait / max(now - t0, 1e-9),
                **self.coord.totals(),
                **bcast_metrics(bcast_s, ready_s, self.upload_ratio),
                **delta_metrics(self.publisher.delta_stats),
                **self.activation.metrics,
                "cost/usd_per_step": usd_per_hour(self.coord.measured(), self.cfg.learner_usd_per_hour)
                * (now - t0)
                / 3600.0,
                **self.evals.poll(),
            }
        )
        self._check_health(record)
        self.activation.observe_step(record["learner/t_busy_s"])
        self.coord.set_step_time(now - t0)  # sizes leases by each worker's speed

    def _check_health(self, record: dict[str, Any]) -> None:
        """The divergence guard's verdict on this step: a warning on stderr and a line of decisions.jsonl when it
        flags the step, and the lease book's S when it changes it."""
        decision = self.guard.observe(record["step"], record)
        record["guard/staleness_effective"] = self.guard.effective
        if decision is None:
            return
        self.coord.set_effective_staleness(self.guard.effective)
        self.activation.log.write(decision)
        change = f"; leases now sized with S = {decision['effective_to']}" if decision["action"] != "warn" else ""
        print(f"echo2 learner: step {record['step']}: {'; '.join(decision['reasons'])}{change}", file=sys.stderr)

    def _finish(self, stopped_at: int | None) -> Path:
        """The final checkpoint. A run that reached its last step tells workers it finished and lingers until they
        heard it; a stopped one does not, so they keep retrying and join the resumed learner."""
        self.publisher.wait()
        if stopped_at is not None:
            return self.checkpoint(stopped_at)
        self.coord.finish()
        final = self.checkpoint(self.cfg.steps)
        self.evals.poll(wait=True)
        deadline = time.time() + self.cfg.linger_s
        while time.time() < deadline and self.coord.active_workers():
            self._tick(self.cfg.steps)
            time.sleep(0.1)
        return final

    def _summarize(self, t_start: float, stopped_at: int | None, final: Path) -> dict[str, Any]:
        bcast_s, ready_s = self.coord.bcast_times()
        summary = {
            "run_id": self.run_id,
            "steps": self.cfg.steps,
            "wall_s": time.time() - t_start,
            "start_step": self.start_step,
            "stopped_at": stopped_at,
            "checkpoint": str(final),
            "metrics": str(self.log.metrics.path),
            "ledger": self.coord.accounting(),
            "audit": self.coord.audit(),
            "rejected_samples": self.coord.rejected_samples(),
            "bcast_s": {str(k): v for k, v in sorted(bcast_s.items())},
            "bcast_ready_s": {str(k): v for k, v in sorted(ready_s.items())},
            "upload_ratio": {str(k): v for k, v in sorted(self.upload_ratio.items())},
            "workers": self.coord.measured(),
            "eval": self.evals.results,
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    # -- checkpoints ---------------------------------------------------------------------------------

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
            "guard": self.guard.state_dict(),  # a bound the guard lowered stays lowered after a resume
        }

        def write_files(tmp: Path) -> None:
            self.trainer.save_checkpoint(tmp)
            for name in self.model_files:
                if name not in ("config.json", "generation_config.json"):
                    shutil.copy2(self.model_dir / name, tmp / name)

        return write_checkpoint(checkpoint_dir(self.out, step), write_files, state)
