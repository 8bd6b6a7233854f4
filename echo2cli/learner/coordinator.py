"""The coordinator: prompts, leases, rollout admission (staleness S) and fleet bookkeeping.

Pure Python with one lock; the HTTP server (`server.py`) and the training loop (`loop.py`) call it.

Semantics (DESIGN.md):
- Version v = parameters after v optimizer steps. Learner step t turns version t into t+1 and may use a
  rollout generated with version x iff t - x <= S. A group that becomes inadmissible while it waits is
  dropped, counted, and its prompt is leased again, so nothing is lost.
- A lease is a set of prompt ids with a deadline. An expired lease (worker died, left or too slow) puts
  its unfinished prompts back in the queue; a worker that leaves hands them back at once.
- Each (prompt id, sample index) is trained on at most once: a prompt's group is accepted once, and any
  later copy (a late worker whose lease had expired) is counted as a duplicate and dropped.
- Rewards are computed here from the returned tokens, decoded by the learner's tokenizer, outside the lock
  and through `score` (in the learner: tasks/scoring.Scorer, which bounds time and catches errors). Behaviour
  log-probs are checked (finite, <= 0, one per token) and used only for importance weights.
- Leases are capped so that a new group is still admissible when its turn comes: a worker whose version
  lags the learner's by `lag` gets work only while fewer than B * (S - lag + 1) prompts are in flight,
  waiting or in the step being trained. With S = 0 the fleet generates exactly one batch per version
  (synchronous GRPO); larger S lets fresh workers run ahead while stale ones do not produce groups that
  would be dropped. No lease holds more than B prompts, so one worker's lease never spans a whole
  step's work (the capacity model in `plan.py` relies on this).
- Each worker holds at most what it can return while its groups stay admissible (`_lease_cap`), from its
  measured speed and the learner's measured step time. A worker too slow to return even one group in time
  gets none ('wait'): its groups would only be dropped, and the prompts it held would shrink the room above.
- Checkpoints carry the coordinator's state (`state_dict`): prompts drawn, the queue, groups admitted and
  waiting, prompts admitted and trained, the ledger. Leases do not survive a restart (workers join again
  with new ids): a resumed coordinator queues their prompts again, counted as returned.
- Each worker's throughput mu_i is measured here: rollouts admitted / wall time its leases were out
  (generation plus the round trips), over its last MU_WINDOW leases; its speed, for lease sizes, counts
  every valid rollout it returned, admitted or not (a stale group was still generated). Workers on standby (cost-aware
  activation) get no leases; they keep fetching and seeding versions.
"""

from __future__ import annotations

import math
import secrets
import statistics
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from echo2cli.protocol import (
    Heartbeat,
    Lease,
    LeaseResponse,
    PolicyInfo,
    PromptItem,
    RolloutBatch,
    Sample,
    SubmitResult,
    WorkerView,
)
from echo2cli.tasks import Problem, Score, Task
from echo2cli.tasks.scoring import safe_score

LOGPROB_TOLERANCE = 1e-3  # engines may round a near-certain token's log-prob slightly above 0
MAX_BAD_BATCHES = 5  # batches in a row with invalid data before a worker is cut off
LEDGER_KEYS = ("leased", "admitted", "rejected", "expired", "returned", "trained", "dropped_stale")
UNTRUSTED = {"not_leased", "version_mismatch", "invalid_samples", "revoked"}  # an honest worker never causes these
REVOKED_KEPT = 4096  # lease ids remembered as revoked, so a later copy is told so rather than "expired"
REJECT_DETAIL = {
    "duplicate": "the prompt was already admitted",
    "late": "the lease expired; the prompt was leased again",
    "revoked": "the lease was revoked after invalid samples; its prompts were leased again",
    "not_leased": "prompt was not leased to this worker",
    "version_mismatch": "version does not match the lease",
    "stale": "more than S versions behind the learner",
}
MU_WINDOW = 8  # a worker's mu_i is measured over its last 8 leases
MAX_DRAWS_PER_PROMPT = 16  # new prompts drawn in search of one that fits a worker's context


@dataclass
class Group:
    """G samples of one prompt, all generated with one policy version, with learner-computed rewards."""

    prompt_id: int
    version: int
    prompt_token_ids: list[int]
    samples: list[Sample]
    rewards: list[float]
    worker_id: str
    components: list[dict[str, float]] = field(default_factory=list)  # per sample: format, correct, ...


@dataclass
class _Lease:
    worker_id: str
    version: int
    outstanding: set[int]
    deadline: float
    granted_at: float
    size: int


@dataclass
class _Worker:
    name: str
    usd_per_hour: float
    last_seen: float
    session_token: str = ""
    tracker_key: str = ""
    version_loaded: int = -1
    downloading_version: int | None = None
    download_progress: float = 0.0
    tokens_per_s: float = 0.0
    upload_bytes: int = 0
    rollouts: int = 0
    left: bool = False
    standby: bool = False
    cut_off: bool = False
    bad_streak: int = 0
    rejected: Counter[str] = field(default_factory=Counter)  # samples, by reason
    leases: int = 0
    returned: int = 0  # leases returned
    recent: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=MU_WINDOW))  # (samples, s)
    generated: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=MU_WINDOW))  # valid ones
    first_seen_with: dict[int, float] = field(default_factory=dict)  # version -> coordinator clock
    first_ready_with: dict[int, float] = field(default_factory=dict)  # downloaded, not yet loaded
    swap_s: float = 0.0
    max_model_len: int | None = None  # its engine's context: prompts that cannot fit are never leased to it


def same_secret(a: str, b: str) -> bool:
    """Constant-time comparison that takes any text (a client may send non-ASCII)."""
    return secrets.compare_digest(a.encode(), b.encode())


def _rate(recent: deque[tuple[int, float]]) -> float | None:
    seconds = sum(s for _, s in recent)
    return sum(n for n, _ in recent) / seconds if seconds > 0 else None


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
        score: Callable[[Problem, list[str]], list[Score]] | None = None,
        max_seq_len: int | None = None,
    ) -> None:
        self.task = task
        self.score = score or (lambda problem, texts: [safe_score(task, problem, t) for t in texts])
        self.encode_prompt, self.decode = encode_prompt, decode
        self.G, self.S, self.B = group_size, staleness, prompts_per_step
        self.max_new_tokens, self.vocab_size = max_new_tokens, vocab_size
        self.lease_timeout_s, self.heartbeat_s = lease_timeout_s, heartbeat_s
        self.clock = clock
        self.lock = threading.RLock()
        self.version = 0
        self.finished = False
        self._problem_iter: Iterator[Problem] = task.prompts(seed, "train")
        self.problems: dict[int, Problem] = {}
        self.prompt_ids: dict[int, list[int]] = {}
        self.pending: deque[int] = deque()
        self.leases: dict[str, _Lease] = {}
        self.revoked: dict[str, str] = {}  # lease id -> worker id, oldest first
        self.step_times: deque[float] = deque(maxlen=5)
        self.step_began = clock()  # the last advance: how long the learner has been on this step
        self.max_seq_len = max_seq_len
        self.skipped: set[int] = set()  # prompts longer than the learner's own limit: never leased
        self.done: set[int] = set()
        self.ready: deque[Group] = deque()
        self.training = 0  # groups of the step in progress: taken from `ready`, version not yet advanced
        self.workers: dict[str, _Worker] = {}
        self.policies: dict[int, PolicyInfo] = {}
        self.bcast_s: dict[int, float] = {}
        self.ready_s: dict[int, float] = {}
        self.counters: Counter[str] = Counter()
        self.ledger: Counter[str] = Counter()  # prompts: leased, admitted, rejected, expired, returned, trained...
        self.max_bad_batches = MAX_BAD_BATCHES
        self.learner_tracker_key = secrets.token_hex(16)
        self.trained_ids: set[int] = set()  # prompts whose group went into an optimizer step
        self.training_ids: list[int] = []

    # -- workers -------------------------------------------------------------------------------------

    def join(self, name: str, usd_per_hour: float, max_model_len: int | None = None) -> str:
        """`max_model_len`: the worker's engine context (prompt + completion); None = not limited."""
        with self.lock:
            worker_id = uuid.uuid4().hex[:12]
            self.workers[worker_id] = _Worker(
                name,
                usd_per_hour,
                self.clock(),
                session_token=secrets.token_urlsafe(24),
                tracker_key=secrets.token_hex(16),
                max_model_len=max_model_len,
            )
            return worker_id

    def session_owner(self, token: str) -> str | None:
        """The worker a session token belongs to (a worker that left or was cut off has none)."""
        with self.lock:
            for wid, w in self.workers.items():
                if not w.left and same_secret(w.session_token, token):
                    return wid
            return None

    def cut_off_session(self, token: str) -> bool:
        """The session token of a worker that was cut off for invalid data (it gets 403, not 'join again')."""
        with self.lock:
            return any(w.cut_off and same_secret(w.session_token, token) for w in self.workers.values())

    def tracker_key_ok(self, key: str) -> bool:
        """The tracker serves the learner's own node and workers that joined and have not left."""
        with self.lock:
            return same_secret(key, self.learner_tracker_key) or any(
                not w.left and same_secret(w.tracker_key, key) for w in self.workers.values()
            )

    def known(self, worker_id: str) -> bool:
        return worker_id in self.workers and not self.workers[worker_id].left

    def cut_off(self, worker_id: str) -> bool:
        return worker_id in self.workers and self.workers[worker_id].cut_off

    def _saw(self, worker_id: str, version: int) -> None:
        w = self.workers[worker_id]
        w.last_seen = self.clock()
        if version >= 0:
            w.version_loaded = version
            w.first_seen_with.setdefault(version, w.last_seen)

    def heartbeat(self, hb: Heartbeat) -> None:
        with self.lock:
            self._saw(hb.worker_id, hb.version_loaded)
            w = self.workers[hb.worker_id]
            w.downloading_version, w.download_progress = hb.downloading_version, hb.download_progress
            w.tokens_per_s, w.upload_bytes = hb.tokens_per_s, hb.upload_bytes
            if hb.ready_version >= 0:
                w.first_ready_with.setdefault(hb.ready_version, w.last_seen)
            w.swap_s = hb.swap_s or w.swap_s

    def leave(self, worker_id: str) -> int:
        """The worker is gone: its unfinished prompts go back to the queue. Returns how many."""
        with self.lock:
            returned = 0
            for lease_id in [k for k, ls in self.leases.items() if ls.worker_id == worker_id]:
                returned += self._requeue_lease(lease_id, "returned")
            self.workers[worker_id].left = True
            return returned

    def active_workers(self) -> list[str]:
        now = self.clock()
        return [wid for wid, w in self.workers.items() if not w.left and now - w.last_seen < 3 * self.heartbeat_s]

    # -- leases --------------------------------------------------------------------------------------

    def _next_prompt(self, context: int | None) -> int | None:
        """The oldest queued prompt that fits a worker's context (prompt + max_new_tokens <= context), else a
        new one. Prompts that do not fit stay queued, in order, for a worker with a longer context."""

        def fits(prompt_id: int) -> bool:
            return context is None or len(self.prompt_ids[prompt_id]) + self.max_new_tokens <= context

        self.pending = deque(i for i in self.pending if i not in self.done)  # a late copy may have finished one
        for i, prompt_id in enumerate(self.pending):
            if fits(prompt_id):
                del self.pending[i]
                return prompt_id
        for _ in range(MAX_DRAWS_PER_PROMPT):
            prompt_id = self._draw()
            if prompt_id is None:
                continue  # too long for the learner itself: skipped
            if fits(prompt_id):
                return prompt_id
            self.pending.append(prompt_id)
        return None

    def _draw(self) -> int | None:
        """A new prompt; None if it cannot fit the learner's own sequence limit (skipped, and counted)."""
        prompt_id = len(self.problems)
        problem = next(self._problem_iter)
        self.problems[prompt_id] = problem
        self.prompt_ids[prompt_id] = self.encode_prompt(problem.messages)
        if self.max_seq_len is not None and len(self.prompt_ids[prompt_id]) + self.max_new_tokens > self.max_seq_len:
            self.skipped.add(prompt_id)
            self.counters["prompts_too_long"] += 1
            return None
        return prompt_id

    def _in_flight(self) -> int:
        return sum(len(ls.outstanding) for ls in self.leases.values()) + len(self.ready) + self.training

    def lease(self, worker_id: str, version: int, max_prompts: int) -> LeaseResponse:
        with self.lock:
            if version > self.version:  # never published: a lag below 0 would make the room unbounded
                self.workers[worker_id].last_seen = self.clock()
                return LeaseResponse(
                    status="update",
                    latest_version=self.version,
                    detail=f"version {version} was never published (the learner is at "
                    f"{self.version}): load {self.version}",
                )
            self._saw(worker_id, version)
            self.expire_leases()
            if self.finished:
                return LeaseResponse(status="finished", latest_version=self.version)
            if self.workers[worker_id].standby:
                return LeaseResponse(
                    status="standby",
                    latest_version=self.version,
                    detail="on standby: the active workers already keep the learner busy",
                )
            if self.version - version > self.S:
                return LeaseResponse(
                    status="update",
                    latest_version=self.version,
                    detail=f"version {version} is more than S={self.S} behind {self.version}",
                )
            # A group queued behind q others is trained about q // B steps from now, so one made with
            # `version` stays admissible only while q < B * (S - lag + 1): lease no more than that.
            lag = self.version - version
            room = self.B * (self.S - lag + 1) - self._in_flight()
            held = sum(len(ls.outstanding) for ls in self.leases.values() if ls.worker_id == worker_id)
            cap = self._lease_cap(self.workers[worker_id], lag)
            if cap == 0:
                return LeaseResponse(
                    status="wait",
                    latest_version=self.version,
                    detail="too slow for S: one group would be stale before it came back",
                )
            n = min(max_prompts, room, cap - held)
            if n <= 0:
                return LeaseResponse(status="wait", latest_version=self.version)
            context = self.workers[worker_id].max_model_len
            ids = [i for i in (self._next_prompt(context) for _ in range(n)) if i is not None]
            if not ids:
                return LeaseResponse(
                    status="wait",
                    latest_version=self.version,
                    detail=f"no queued prompt fits this worker's context of {context} tokens",
                )
            n = len(ids)
            self.ledger["leased"] += n
            lease_id = uuid.uuid4().hex[:16]
            now = self.clock()
            self.leases[lease_id] = _Lease(worker_id, version, set(ids), now + self.lease_timeout_s, now, n)
            self.workers[worker_id].leases += 1
            items = [PromptItem(prompt_id=i, prompt_token_ids=self.prompt_ids[i]) for i in ids]
            lease = Lease(lease_id=lease_id, version=version, prompts=items, deadline_s=self.lease_timeout_s)
            return LeaseResponse(status="ok", lease=lease, latest_version=self.version)

    def _lease_cap(self, w: _Worker, lag: int) -> int:
        """Prompts a worker may hold at once. B until its speed is measured; then what it returns while a group
        made now stays admissible — (S - lag + 1) learner steps of the measured step time. So one worker cannot
        take the fleet's work by asking again and again, and a slow one gets small leases, or none, instead of
        holding prompts until their groups are stale. Measured on a cold engine only (its first lease), it
        still gets one prompt, to be measured warm. A step that has lasted longer than usual counts as long as
        it has lasted (groups stay admissible while the learner waits), so leases resume if every worker was
        too slow for the usual step."""
        speed = _rate(w.generated)  # valid rollouts/s
        if speed is None or not self.step_times:
            return self.B
        step_s = max(statistics.median(self.step_times), self.clock() - self.step_began)
        return max(int(w.returned < 2), min(self.B, math.floor(speed * (self.S - lag + 1) * step_s / self.G)))

    def set_step_time(self, seconds: float) -> None:
        """The learner's wall seconds per step (waiting included): how long a group stays admissible."""
        with self.lock:
            self.step_times.append(seconds)

    def _requeue_lease(self, lease_id: str, outcome: str) -> int:
        lease = self.leases.pop(lease_id)
        self.ledger[outcome] += len(lease.outstanding)
        back = sorted(i for i in lease.outstanding if i not in self.done)
        self.pending.extendleft(reversed(back))  # oldest prompts first
        return len(back)

    def expire_leases(self) -> None:
        with self.lock:
            now = self.clock()
            for lease_id in [k for k, ls in self.leases.items() if ls.deadline < now]:
                self.counters["leases_expired"] += 1
                self._requeue_lease(lease_id, "expired")

    # -- rollouts ------------------------------------------------------------------------------------

    def _invalid_reason(self, samples: list[Sample]) -> str:
        if sorted(s.sample_idx for s in samples) != list(range(self.G)):
            return f"a group needs sample_idx 0..{self.G - 1} exactly once"
        for s in samples:
            if not 0 < len(s.completion_token_ids) <= self.max_new_tokens:
                return f"completion length {len(s.completion_token_ids)} not in 1..{self.max_new_tokens}"
            if len(s.logprobs) != len(s.completion_token_ids):
                return "logprobs and completion_token_ids differ in length"
            if any(not 0 <= t < self.vocab_size for t in s.completion_token_ids):
                return "token id outside the vocabulary"
            if any(not math.isfinite(lp) or lp > LOGPROB_TOLERANCE for lp in s.logprobs):
                return "log-probs must be finite and <= 0"
        return ""

    def _verdict(
        self, prompt_id: int, samples: list[Sample], leased: bool, version_ok: bool, stale: bool, revoked: bool = False
    ) -> str:
        """'' to admit the group, else the machine-readable reason it is rejected."""
        if prompt_id in self.done:
            return "duplicate"
        if not leased:
            if revoked:
                return "revoked"
            return "late" if prompt_id in self.problems else "not_leased"
        if not version_ok:
            return "version_mismatch"
        if self._invalid_reason(samples):
            return "invalid_samples"
        return "stale" if stale else ""

    def submit(self, batch: RolloutBatch) -> SubmitResult:
        """Admit each leased group once; reject the rest with a reason. Rejected leased prompts are leased
        again at once. Only groups of a live lease of this worker are admitted: a copy that arrives after
        its lease expired is 'late' (the prompt has been leased again).

        Rewards are computed outside the lock (a task's score may be slow): the groups that would be
        admitted are scored first, then every verdict is made again under the lock."""
        by_prompt: dict[int, list[Sample]] = {}
        for s in batch.samples:
            by_prompt.setdefault(s.prompt_id, []).append(s)
        with self.lock:
            lease, version_ok, stale = self._lease_of(batch)
            admissible = [
                pid
                for pid, samples in by_prompt.items()
                if not self._verdict(pid, samples, lease is not None and pid in lease.outstanding, version_ok, stale)
            ]
            problems = {pid: self.problems[pid] for pid in admissible}
        scores = {
            pid: self.score(
                problems[pid],
                [self.decode(s.completion_token_ids) for s in sorted(by_prompt[pid], key=lambda s: s.sample_idx)],
            )
            for pid in admissible
        }
        with self.lock:
            self._saw(batch.worker_id, -1)
            worker = self.workers[batch.worker_id]
            lease, version_ok, stale = self._lease_of(batch)
            result = SubmitResult()
            self._unservable(worker, lease, batch.unservable)
            for prompt_id, samples in by_prompt.items():
                leased = lease is not None and prompt_id in lease.outstanding
                reason = self._verdict(
                    prompt_id,
                    samples,
                    leased,
                    version_ok,
                    stale,
                    revoked=self.revoked.get(batch.lease_id) == batch.worker_id,
                )
                if not reason and prompt_id not in scores:
                    reason = "late"  # admissible only now: its lease was re-granted while we scored
                if not reason:
                    self._accept(prompt_id, batch, samples, scores[prompt_id])
                    result.accepted += len(samples)
                else:
                    result.rejected[reason] = result.rejected.get(reason, 0) + len(samples)
                    worker.rejected[reason] += len(samples)
                    self.counters[f"rejected_{reason}_samples"] += len(samples)
                    if reason == "invalid_samples":
                        result.detail = self._invalid_reason(samples)
                    elif not result.detail:
                        result.detail = REJECT_DETAIL[reason]
                if leased:
                    lease.outstanding.discard(prompt_id)
                    self.ledger["admitted" if not reason else "rejected"] += 1
                    if reason and prompt_id not in self.done:
                        self.pending.appendleft(prompt_id)  # lease it again: nothing lost
            result.stale = result.rejected.get("stale", 0)
            result.duplicate = result.rejected.get("duplicate", 0) + result.rejected.get("late", 0)
            result.invalid = sum(n for r, n in result.rejected.items() if r in UNTRUSTED)
            for key in ("stale", "duplicate", "invalid"):
                self.counters[f"{key}_samples"] += getattr(result, key)
            if lease is not None and not lease.outstanding:
                del self.leases[batch.lease_id]
                if result.invalid:  # closed by invalid data: a later copy of it is told "revoked", not "late"
                    self.revoked[batch.lease_id] = batch.worker_id
                    while len(self.revoked) > REVOKED_KEPT:
                        del self.revoked[next(iter(self.revoked))]
            if lease is not None:
                worker.returned += 1
                if worker.returned == 2:  # the first lease ran on a cold engine: keep it only until a second
                    worker.recent.clear()
                    worker.generated.clear()
                # mu_i: accepted samples only (a junk worker must not look fast); speed: every valid one
                held_s = self.clock() - lease.granted_at
                worker.recent.append((result.accepted, held_s))
                valid = sum(n for reason, n in result.rejected.items() if reason not in UNTRUSTED)
                worker.generated.append((result.accepted + valid, held_s))
            worker.rollouts += result.accepted
            self._judge(batch.worker_id, bad=result.invalid > 0)
            return result

    def _unservable(self, worker: _Worker, lease: _Lease | None, prompt_ids: list[int]) -> None:
        """Prompts the worker's engine could not take (too long for it): queued again for another worker, and
        this worker's context lowered below them so it is not given them again."""
        back = sorted({i for i in prompt_ids if lease is not None and i in lease.outstanding})
        for prompt_id in back:
            lease.outstanding.discard(prompt_id)  # type: ignore[union-attr]
            longest = len(self.prompt_ids[prompt_id]) + self.max_new_tokens - 1
            worker.max_model_len = min(worker.max_model_len or longest, longest)
        self.pending.extendleft(reversed(back))  # oldest first
        self.ledger["returned"] += len(back)
        self.counters["unservable_prompts"] += len(back)

    def _lease_of(self, batch: RolloutBatch) -> tuple[_Lease | None, bool, bool]:
        """The batch's live lease (None if it is not this worker's), whether its version fits, whether stale."""
        lease = self.leases.get(batch.lease_id)
        if lease is not None and lease.worker_id != batch.worker_id:
            lease = None  # another worker's lease: nothing in it can be returned by this one
        version_ok = batch.version <= self.version and (lease is None or lease.version == batch.version)
        return lease, version_ok, self.version - batch.version > self.S

    def _judge(self, worker_id: str, bad: bool) -> None:
        """Cut off a worker after `max_bad_batches` batches in a row with invalid data."""
        w = self.workers[worker_id]
        w.bad_streak = w.bad_streak + 1 if bad else 0
        if w.bad_streak >= self.max_bad_batches and not w.cut_off:
            w.cut_off = True
            self.leave(worker_id)

    def accounting(self) -> dict[str, int]:
        """Every leased prompt is admitted, rejected (and leased again), expired, returned or outstanding:
            leased = admitted + rejected + expired + returned + outstanding
        and every admitted one is trained (or in training), waiting, or dropped as stale and leased again:
            admitted = trained + waiting + dropped_stale"""
        with self.lock:
            ledger = {k: self.ledger[k] for k in LEDGER_KEYS}
            ledger["outstanding"] = sum(len(ls.outstanding) for ls in self.leases.values())
            ledger["waiting"] = len(self.ready)
            return ledger

    def audit(self) -> dict[str, int | list[int]]:
        """The ledger per prompt rather than in counts: every prompt drawn is trained, in training, waiting,
        leased out or queued again (`lost` lists any that is none of these), and none is trained twice."""
        with self.lock:
            outstanding = {i for ls in self.leases.values() for i in ls.outstanding}
            held = self.trained_ids | set(self.training_ids) | {g.prompt_id for g in self.ready} | outstanding
            held |= set(self.pending) | self.skipped
            return {
                "prompts": len(self.problems),
                "trained": len(self.trained_ids),
                "trained_twice": self.counters["trained_twice"],
                "lost": [i for i in range(len(self.problems)) if i not in held],
            }

    def _accept(self, prompt_id: int, batch: RolloutBatch, samples: list[Sample], scores: list[Score]) -> None:
        samples = sorted(samples, key=lambda s: s.sample_idx)
        self.ready.append(
            Group(
                prompt_id,
                batch.version,
                self.prompt_ids[prompt_id],
                samples,
                [s.reward for s in scores],
                batch.worker_id,
                [dict(s.components) for s in scores],
            )
        )
        self.done.add(prompt_id)
        self.counters["reward_errors"] += sum(1 for s in scores if s.components.get("error"))
        self.counters["reward_timeouts"] += sum(1 for s in scores if s.components.get("timeout"))

    # -- checkpoints ---------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """JSON-able state for a checkpoint taken between steps (nothing in training)."""
        with self.lock:
            assert self.training == 0, "checkpoint between steps only"
            return {
                "version": self.version,
                "problems_drawn": len(self.problems),
                "pending": list(self.pending),
                "leased_out": sorted(i for ls in self.leases.values() for i in ls.outstanding),
                "done": sorted(self.done),
                "trained": sorted(self.trained_ids),
                "ready": [
                    {
                        "prompt_id": g.prompt_id,
                        "version": g.version,
                        "worker_id": g.worker_id,
                        "rewards": g.rewards,
                        "components": g.components,
                        "samples": [s.model_dump() for s in g.samples],
                    }
                    for g in self.ready
                ],
                "ledger": dict(self.ledger),
                "counters": dict(self.counters),
            }

    def load_state(self, state: dict) -> None:
        """Continue where `state_dict` left off. The task's prompt stream is replayed to the same position
        (a task yields the same prompts for the same seed), so prompt ids mean the same problems."""
        with self.lock:
            self.version = int(state["version"])
            for _ in range(int(state["problems_drawn"])):
                self._draw()
            leased_out = [int(i) for i in state["leased_out"]]
            self.pending = deque(leased_out + [int(i) for i in state["pending"]])  # oldest first
            self.done = {int(i) for i in state["done"]}
            self.trained_ids = {int(i) for i in state["trained"]}
            self.ready = deque(
                Group(
                    g["prompt_id"],
                    g["version"],
                    self.prompt_ids[g["prompt_id"]],
                    [Sample.model_validate(s) for s in g["samples"]],
                    g["rewards"],
                    g["worker_id"],
                    g.get("components", []),
                )
                for g in state["ready"]
            )
            self.ledger = Counter(state["ledger"])
            self.ledger["returned"] += len(leased_out)  # their workers join again; the prompts are leased again
            self.counters = Counter(state["counters"])

    # -- the training loop's side --------------------------------------------------------------------

    def take_batch(self) -> list[Group] | None:
        """B admissible groups for step t = self.version, oldest first; None if not enough yet."""
        with self.lock:
            self.expire_leases()
            t = self.version
            for group in [g for g in self.ready if t - g.version > self.S]:
                self.ready.remove(group)
                self.done.discard(group.prompt_id)
                self.pending.appendleft(group.prompt_id)
                self.counters["stale_samples"] += len(group.samples)
                self.ledger["dropped_stale"] += 1
            if len(self.ready) < self.B:
                return None
            self.training = self.B
            self.ledger["trained"] += self.B
            batch = [self.ready.popleft() for _ in range(self.B)]
            self.training_ids = [g.prompt_id for g in batch]
            self.counters["trained_twice"] += sum(i in self.trained_ids for i in self.training_ids)
            self.trained_ids.update(self.training_ids)
            return batch

    def advance(self, version: int) -> None:
        with self.lock:
            self.version = version
            self.training = 0
            self.training_ids = []
            self.step_began = self.clock()

    def publish(self, policy: PolicyInfo) -> None:
        with self.lock:
            self.policies[policy.version] = policy

    def latest_policy(self, worker_id: str | None = None) -> PolicyInfo:
        """The newest version; for a worker, with its fetch slot among the active workers (join order).
        A worker that asks is about to fetch it: until its heartbeat says otherwise, it is downloading it."""
        with self.lock:
            policy = self.policies[max(self.policies)]
            active = self.active_workers()
            w = self.workers.get(worker_id or "")
            if w is not None and not w.left and policy.version > w.version_loaded:
                w.downloading_version = policy.version
        if worker_id in active:
            policy = policy.model_copy(update={"slot": active.index(worker_id), "slots": len(active)})
        return policy

    def finish(self) -> None:
        with self.lock:
            self.finished = True

    def versions_in_download(self) -> set[int]:
        """Versions that live workers are fetching: the publisher keeps seeding them, however old, or a worker
        on a slow link would wait forever for a version nobody seeds any more."""
        with self.lock:
            return {v for w in self.active_workers() if (v := self.workers[w].downloading_version) is not None}

    def update_bcast(self) -> list[int]:
        """Per version v, once every worker of v's fleet generates with v or newer:
        T_bcast(v) = publish -> the last of them generating with it (`bcast_s`), and
        T_ready(v) = publish -> the last of them holding it downloaded, plus the slowest one's swap work
        (`ready_s`): T_bcast without the wait for a lease in progress to end — the capacity model's T_bcast,
        since the model accounts for whole leases itself. Returns the versions newly measured.
        v's fleet: the active workers that were already generating when v was published (all active workers
        if none was), so a late joiner still fetching its first version does not hold every measurement up."""
        with self.lock:
            live = [self.workers[w] for w in self.active_workers()]
            newly = []
            for v, policy in self.policies.items():
                active = [
                    w for w in live if w.first_seen_with and min(w.first_seen_with.values()) <= policy.published_at
                ] or live
                if v in self.bcast_s or not active:
                    continue
                firsts = [min((t for x, t in w.first_seen_with.items() if x >= v), default=None) for w in active]
                if all(t is not None for t in firsts):
                    self.bcast_s[v] = max(0.0, max(firsts) - policy.published_at)
                    ready = [
                        min([t for x, t in w.first_ready_with.items() if x >= v] + [first])
                        for w, first in zip(active, firsts, strict=True)
                    ]
                    swap = max(w.swap_s for w in active)
                    self.ready_s[v] = min(self.bcast_s[v], max(0.0, max(ready) - policy.published_at) + swap)
                    newly.append(v)
            return newly

    def set_standby(self, standby: set[str]) -> None:
        with self.lock:
            for wid, w in self.workers.items():
                w.standby = wid in standby

    def measured(self) -> list[dict]:
        """Each joined worker's price, measured mu_i (None before its first lease returns) and lease size."""
        with self.lock:
            active = set(self.active_workers())
            return [
                {
                    "worker_id": wid,
                    "name": w.name,
                    "usd_per_hour": w.usd_per_hour,
                    "active": wid in active,
                    "standby": w.standby,
                    "leases": w.leases,
                    "rollouts": w.rollouts,
                    "rollouts_per_s": _rate(w.recent),
                    "lease_rollouts": sum(n for n, _ in w.recent) / len(w.recent) if w.recent else None,
                }
                for wid, w in self.workers.items()
            ]

    def worker_views(self) -> list[WorkerView]:
        with self.lock:
            active = set(self.active_workers())
            return [
                WorkerView(
                    worker_id=wid,
                    name=w.name,
                    version_loaded=w.version_loaded,
                    downloading_version=w.downloading_version,
                    download_progress=w.download_progress,
                    tokens_per_s=w.tokens_per_s,
                    rollouts=w.rollouts,
                    active=wid in active,
                    standby=w.standby,
                    leased_prompts=sum(len(ls.outstanding) for ls in self.leases.values() if ls.worker_id == wid),
                )
                for wid, w in self.workers.items()
            ]
