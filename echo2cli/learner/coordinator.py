"""The coordinator: the one object the HTTP server and the training loop talk to, behind one lock.

It joins the learner's side of the protocol, each part in its own module, each pure Python:

    credentials.py   the secrets issued at join: session tokens and tracker keys
    prompts.py       the task's prompt stream, numbered, and the queue of prompts to lease again
    leases.py        which prompts each worker holds until when, and how many it may hold
    dispatch.py      leases out, and their prompts back into the queue when they do not come home
    fleet.py         joined workers: liveness, versions, measured throughput, standby, cut-offs
    intake.py        a returned batch: check, score (rewards.py, outside the lock), check again, admit
    admission.py     verdicts, the buffer of admitted groups, batches for the trainer, the ledger
    published.py     published versions and how long each took to reach the fleet (T_bcast)

Semantics every part agrees on:
- Version v = parameters after v optimizer steps. Learner step t turns version t into t+1 and may use a
  rollout generated with version x iff t - x <= S.
- A lease is a set of prompt ids with a deadline; an expired lease puts its unfinished prompts back in the
  queue, and a worker that leaves hands them back at once. Each (prompt id, sample index) is trained on at
  most once, and no prompt is lost (`accounting`, `audit`).
- Rewards are computed here, from the returned tokens; behaviour log-probs are only checked and used for
  importance weights.
- A multi-turn task (`tasks/episodes.py`): `max_new_tokens` caps a whole transcript, `turns` = (max_turns,
  tokens per policy turn), and `replay` rebuilds environment tokens where `score` is the task's own.
- Checkpoints carry the coordinator's state (`state_dict`), taken between steps. Leases do not survive a
  restart (workers join again with new ids): a resumed coordinator queues their prompts again, counted as
  returned.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from echo2cli.learner.admission import Admission
from echo2cli.learner.credentials import Credentials
from echo2cli.learner.dispatch import Dispatcher
from echo2cli.learner.fleet import WORKERS_PER_ADDRESS, Fleet
from echo2cli.learner.intake import Intake
from echo2cli.learner.leases import LeaseBook
from echo2cli.learner.prompts import PromptSource
from echo2cli.learner.published import PublishedVersions
from echo2cli.learner.rewards import RewardStage, ScoreFn
from echo2cli.learner.types import Group
from echo2cli.protocol import Heartbeat, LeaseResponse, PolicyInfo, RolloutBatch, SubmitResult, WorkerView
from echo2cli.tasks import Task
from echo2cli.tasks.episodes import Turns


class Coordinator:
    def __init__(
        self,
        task: Task,
        *,
        encode_prompt: Callable[[Sequence[dict[str, str]]], list[int]],
        decode: Callable[[list[int]], str],
        group_size: int,
        staleness: int,
        prompts_per_step: int,
        max_new_tokens: int,
        vocab_size: int,
        lease_timeout_s: float,
        heartbeat_s: float,
        seed: int,
        clock: Callable[[], float] = time.time,
        score: ScoreFn | None = None,
        max_seq_len: int | None = None,
        turns: tuple[int, int] | None = None,
        replay: Turns | None = None,
        workers_per_address: int = WORKERS_PER_ADDRESS,
    ) -> None:
        self.G, self.S, self.B, self.max_new_tokens = group_size, staleness, prompts_per_step, max_new_tokens
        self.clock, self.lock, self.version, self.finished = clock, threading.RLock(), 0, False
        self._batch_ready = threading.Condition(self.lock)  # notified when a group is admitted
        self.counters: Counter[str] = Counter()  # run totals: stale_samples, leases_expired, reward_errors, ...
        self.credentials = Credentials()
        self.prompts = PromptSource(task, seed, encode_prompt, max_new_tokens, max_seq_len, self.counters)
        self.leases = LeaseBook(
            batch_prompts=prompts_per_step,
            group_size=group_size,
            staleness=staleness,
            timeout_s=lease_timeout_s,
            clock=clock,
        )
        self.fleet = Fleet(heartbeat_s, clock, per_address=workers_per_address)
        self.max_bad_batches = self.fleet.max_bad_batches
        self.admission = Admission(
            batch_prompts=prompts_per_step,
            group_size=group_size,
            staleness=staleness,
            max_new_tokens=max_new_tokens,
            vocab_size=vocab_size,
            requeue=self.prompts.requeue,
            counters=self.counters,
            turns=turns,
        )
        self.published = PublishedVersions()
        self.dispatcher = Dispatcher(
            prompts=self.prompts, leases=self.leases, fleet=self.fleet, admission=self.admission, counters=self.counters
        )
        self.intake = Intake(
            lock=self._batch_ready,
            prompts=self.prompts,
            leases=self.leases,
            fleet=self.fleet,
            admission=self.admission,
            rewards=RewardStage(task, decode, score, replay),
            dispatcher=self.dispatcher,
            cut_off=lambda worker_id: self.leave(worker_id, cut_off=True),
        )

    # -- workers -------------------------------------------------------------------------------------

    def join(self, name: str, usd_per_hour: float, max_model_len: int | None = None, address: str | None = None) -> str:
        """A new worker's id (`max_model_len`: its engine's context, None = any; from `address`); FleetFull: no room."""
        with self.lock:
            for silent in self.fleet.silent():  # gone for long without a word: let go first
                self.leave(silent)
            worker_id = self.fleet.join(name, usd_per_hour, max_model_len, address)
            self.credentials.issue(worker_id)
            return worker_id

    def secrets_of(self, worker_id: str) -> tuple[str, str]:
        """(session token, tracker key) of a worker that has just joined."""
        with self.lock:
            return self.credentials.session(worker_id), self.credentials.tracker_key(worker_id)

    def session_owner(self, token: str) -> str | None:
        """The live worker a session token belongs to (a worker that left or was cut off has none)."""
        with self.lock:
            return self.credentials.owner(token)

    def cut_off_session(self, token: str) -> bool:
        """The token of a worker cut off for invalid data (it gets 403, not 'join again')."""
        with self.lock:
            return self.credentials.is_cut_off(token)

    def tracker_key_ok(self, key: str) -> bool:
        with self.lock:
            return self.credentials.tracker_key_ok(key)

    def known(self, worker_id: str) -> bool:
        with self.lock:
            return self.fleet.known(worker_id)

    def cut_off(self, worker_id: str) -> bool:
        with self.lock:
            return self.fleet.cut_off(worker_id)

    def heartbeat(self, hb: Heartbeat) -> None:
        with self.lock:
            self.fleet.heartbeat(hb, latest=max(self.published.policies, default=0))

    def leave(self, worker_id: str, *, cut_off: bool = False) -> int:
        """The worker is gone: its unfinished prompts go back to the queue. Returns how many."""
        with self.lock:
            returned = self.dispatcher.hand_back(worker_id)
            self.fleet.workers[worker_id].left = True
            self.credentials.revoke(worker_id, cut_off=cut_off)
            return returned

    def active_workers(self) -> list[str]:
        with self.lock:
            return self.fleet.active()

    # -- leases --------------------------------------------------------------------------------------

    def lease(self, worker_id: str, version: int, max_prompts: int) -> LeaseResponse:
        """Prompts for a worker generating with `version`, as many as the room, its cap and its ask allow."""
        with self.lock:
            latest = max(self.published.policies, default=self.version)  # self.version may still be written
            return self.dispatcher.lease(
                worker_id, version, max_prompts, current=self.version, finished=self.finished, latest=latest
            )

    def expire_leases(self) -> None:
        with self.lock:
            self.dispatcher.expire()

    def set_effective_staleness(self, staleness: int) -> None:
        """The guard's S: it sizes new leases and bounds admission (staler admitted groups are dropped, requeued)."""
        with self.lock:
            self.leases.S = self.admission.S = staleness

    def set_step_time(self, seconds: float) -> None:
        """The learner's wall seconds per step (waiting included): how long a group stays admissible."""
        with self.lock:
            self.leases.record_step_time(seconds)

    # -- rollouts ------------------------------------------------------------------------------------

    def submit(self, batch: RolloutBatch) -> SubmitResult:
        """Admit each leased group once; reject the rest with a reason (intake.py)."""
        return self.intake.submit(batch, current=lambda: self.version)

    # -- the training loop's side --------------------------------------------------------------------

    def take_batch(self, wait_s: float = 0.0) -> list[Group] | None:
        """B admissible groups for step t = self.version, oldest first; None if not enough even after waiting up
        to `wait_s` seconds for a submission to complete them."""
        with self._batch_ready:
            batch = self._take()
            if batch is None and wait_s > 0:
                self._batch_ready.wait(wait_s)
                batch = self._take()
            return batch

    def _take(self) -> list[Group] | None:
        self.dispatcher.expire()
        return self.admission.take_batch(self.version)

    def advance(self, version: int) -> None:
        with self.lock:
            self.version = version
            self.admission.step_done()
            self.leases.advanced()

    def publish(self, policy: PolicyInfo) -> None:
        with self.lock:
            self.published.publish(policy)

    def latest_policy(self, worker_id: str | None = None) -> PolicyInfo:
        """The newest version; for a worker, with its fetch slot (`Fleet.hand`)."""
        with self.lock:
            return self.fleet.hand(self.published.latest(), worker_id)

    def policy_of(self, version: int, worker_id: str | None = None) -> PolicyInfo | None:
        """An older version, handed out alike (the next link of a worker's delta chain); None if never published."""
        with self.lock:
            policy = self.published.policies.get(version)
            return None if policy is None else self.fleet.hand(policy, worker_id)

    def finish(self) -> None:
        with self.lock:
            self.finished = True

    def versions_in_download(self) -> set[int]:
        """Versions live workers are fetching: the publisher keeps seeding them, however old, or a worker on a
        slow link would wait forever for a version nobody seeds any more."""
        with self.lock:
            return self.fleet.versions_in_download()

    def update_bcast(self) -> list[int]:
        """Measure T_bcast and T_ready of every version the fleet now runs; returns the versions newly measured."""
        with self.lock:
            return self.published.measure([self.fleet.workers[w] for w in self.fleet.active()])

    def bcast_times(self) -> tuple[dict[int, float], dict[int, float]]:
        """(T_bcast, T_ready) per measured version."""
        with self.lock:
            return dict(self.published.bcast_s), dict(self.published.ready_s)

    def set_standby(self, standby: set[str]) -> None:
        with self.lock:
            self.fleet.set_standby(standby)

    def measured(self) -> list[dict[str, Any]]:
        with self.lock:
            return self.fleet.measured()

    def worker_views(self) -> list[WorkerView]:
        with self.lock:
            return self.fleet.views(self.leases.held_by)

    # -- reports and checkpoints ---------------------------------------------------------------------

    def accounting(self) -> dict[str, int]:
        """The ledger: leased = admitted + rejected + expired + returned + outstanding, and
        admitted = trained + waiting + dropped_stale."""
        with self.lock:
            return self.admission.accounting(self.leases.outstanding_count())

    def audit(self) -> dict[str, int | list[int]]:
        """The ledger per prompt: `lost` lists any prompt drawn that is nowhere; none is trained twice."""
        with self.lock:
            elsewhere = self.leases.outstanding() | set(self.prompts.pending) | self.prompts.skipped
            return self.admission.audit(len(self.prompts.problems), elsewhere)

    def totals(self) -> dict[str, Any]:
        """Run totals for the step's metrics line."""
        with self.lock:
            c = self.counters
            return {
                "rollout/stale_dropped_total": c["stale_samples"],
                "rollout/duplicate_total": c["duplicate_samples"],
                "rollout/invalid_total": c["invalid_samples"],
                "rollout/leases_expired_total": c["leases_expired"],
                "reward/errors_total": c["reward_errors"],
                "reward/timeouts_total": c["reward_timeouts"],
                **{f"ledger/{k}": v for k, v in self.accounting().items()},
                "workers/active": len(self.fleet.active()),
            }

    def rejected_samples(self) -> dict[str, int]:
        with self.lock:
            return self.admission.rejected_samples()

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state for a checkpoint taken between steps (nothing in training)."""
        with self.lock:
            return {
                "version": self.version,
                **self.prompts.state_dict(),
                "leased_out": sorted(self.leases.outstanding()),
                **self.admission.state_dict(),
                "counters": dict(self.counters),
            }

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue where `state_dict` left off: the prompt stream is replayed to the same position (a task
        yields the same prompts for the same seed), so prompt ids mean the same problems."""
        with self.lock:
            self.version = int(state["version"])
            leased_out = [int(i) for i in state["leased_out"]]
            self.prompts.load_state(state, leased_out)
            self.admission.load_state(state, self.prompts.token_ids)
            self.admission.ledger["returned"] += len(leased_out)  # their workers join again: leased again
            self.counters.clear()
            self.counters.update(state["counters"])
