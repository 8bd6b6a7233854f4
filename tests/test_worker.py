"""The worker's swap, rejoin and late-join logic, with fakes of the learner, the torrent session and the engine
(tests/worker_fakes.py): real version files, torrents, SHA-256 checks and deltas; no sockets, no vLLM."""

from __future__ import annotations

import json
import threading
import time

import pytest
from worker_fakes import FakeEngine, FakeLearner, FakeNode, Published, lora_adapter, lora_base

from echo2cli.config import WorkerConfig
from echo2cli.errors import BroadcastError, ProtocolError
from echo2cli.layout import VersionKey
from echo2cli.protocol import Lease, LeaseResponse, LoraSpec, PromptItem
from echo2cli.worker import versions
from echo2cli.worker.engine import Completion
from echo2cli.worker.loop import Stats, Worker, rollout_batch


@pytest.fixture
def learner(tmp_path):
    published = Published(tmp_path / "learner")
    published.publish(0)
    return FakeLearner(published)


def joined_worker(tmp_path, learner: FakeLearner, node: FakeNode, prepare_thread: bool = False, **cfg) -> Worker:
    """A worker that joined: its torrent session and version store are open, nothing fetched yet. Without
    `prepare_thread` downloads are verified between leases, so each `_work_once` does a known part of the work.
    `cfg`: more WorkerConfig fields."""
    worker = Worker(
        WorkerConfig(join="http://learner", work_dir=tmp_path / "w", verify_between_leases=not prepare_thread, **cfg),
        client=learner,
        make_node=lambda key: node,
        make_engine=FakeEngine,
    )
    worker._open(worker._join())
    return worker


def started_worker(tmp_path, learner: FakeLearner, prepare_thread: bool = False, **cfg) -> Worker:
    """A worker that joined and started its engine on the learner's latest version."""
    worker = joined_worker(tmp_path, learner, FakeNode(learner.published.root), prepare_thread, **cfg)
    worker._start(worker.join_info)
    return worker


def publish(learner: FakeLearner, version: int, **kw) -> None:
    learner.published.publish(version, **kw)
    learner.latest = version


def loads(worker: Worker) -> list[dict]:
    return [json.loads(line) for line in (worker.work_dir / "events.jsonl").read_text().splitlines()]


def test_a_verified_download_is_swapped_in_between_leases_and_versions_past_s_plus_one_pruned(tmp_path, learner):
    worker = started_worker(tmp_path, learner)
    assert worker.engine.started_with == worker.store.weights(0)
    for v in (1, 2, 3):
        publish(learner, v, delta=False)
        worker._work_once(Stats())  # the lease reply announces v: its fetch starts
        worker._work_once(Stats())  # between leases: v is verified and swapped in
        assert worker.store.loaded == v and worker.engine.reloads[-1] == VersionKey(v).dir(worker.store.root)
        assert (worker.work_dir / "engine" / "model.safetensors").resolve() == worker.store.weights(v)
    assert [e["version"] for e in loads(worker)] == [0, 1, 2, 3] and all(e["digest_verified"] for e in loads(worker))
    assert not VersionKey(0).dir(worker.store.root).exists()  # S = 1: older than v3 - 2 is gone
    assert VersionKey(1).dir(worker.store.root).exists()


def test_a_delta_against_the_loaded_version_is_fetched_and_rebuilt_to_the_announced_digest(tmp_path, learner):
    worker = started_worker(tmp_path, learner)
    publish(learner, 1)
    worker._work_once(Stats())
    worker._work_once(Stats())
    event = loads(worker)[-1]
    assert event["version"] == 1 and event["via"] == "delta"
    assert worker.store.weights(1).read_bytes() == VersionKey(1).path(learner.published.root).read_bytes()
    assert VersionKey(1) in worker.node.transfers  # the rebuilt version is seeded too


def work_until_loaded(worker: Worker, version: int) -> None:
    for _ in range(20):
        if worker.store.loaded == version:
            return
        worker._work_once(Stats())
    raise AssertionError(f"version {version} never loaded; loaded {worker.store.loaded}")


def test_a_worker_several_versions_behind_applies_the_chain_of_deltas_to_the_published_digest(tmp_path):
    published = Published(tmp_path / "learner")
    published.publish(0)
    learner = FakeLearner(published, staleness=2)  # the learner keeps deltas S + 1 = 3 versions back
    worker = started_worker(tmp_path, learner)
    for v in (1, 2, 3):
        publish(learner, v)  # the worker hears of none of them until v3 is out
    work_until_loaded(worker, 3)
    assert [(e["version"], e["via"]) for e in loads(worker)] == [(0, "full"), (1, "delta"), (2, "delta"), (3, "delta")]
    assert learner.policy_asks.count(1) == 1 and learner.policy_asks.count(2) == 1  # one link at a time
    for v in (1, 2, 3):  # each link rebuilt and checked against its published SHA-256
        assert worker.store.weights(v).read_bytes() == VersionKey(v).path(published.root).read_bytes()


def test_a_chain_longer_than_the_learner_keeps_or_missing_a_link_takes_the_full_version(tmp_path, learner):
    worker = started_worker(tmp_path, learner)  # S = 1: the learner keeps 2 versions back
    for v in (1, 2, 3):
        publish(learner, v)
    work_until_loaded(worker, 3)
    assert [(e["version"], e["via"]) for e in loads(worker)] == [(0, "full"), (3, "full")]

    publish(learner, 4)
    publish(learner, 5)
    learner.published.policies.pop(4)  # the learner cannot hand out the next link any more
    work_until_loaded(worker, 5)
    assert 4 in learner.policy_asks and (loads(worker)[-1]["version"], loads(worker)[-1]["via"]) == (5, "full")


def test_a_delta_that_does_not_rebuild_the_version_falls_back_to_the_full_file(tmp_path, learner):
    worker = started_worker(tmp_path, learner)
    publish(learner, 1)
    VersionKey(1, delta=True).path(learner.published.root).write_bytes(b"not a delta")
    worker._work_once(Stats())
    worker._work_once(Stats())  # the delta arrives and fails: the full version is fetched
    worker._work_once(Stats())
    assert worker.store.loaded == 1 and loads(worker)[-1]["via"] == "full"


def test_a_file_that_fails_its_digest_is_rechecked_once_then_refused(tmp_path, learner):
    worker = started_worker(tmp_path, learner)
    publish(learner, 1, delta=False)
    VersionKey(1).path(learner.published.root).write_bytes(b"\0" * 16)  # the swarm serves another file
    worker._work_once(Stats())
    worker._work_once(Stats())  # hash mismatch: recheck
    with pytest.raises(BroadcastError, match="digest"):
        worker._work_once(Stats())
    assert worker.store.loaded == 0


def until(condition, what: str, timeout_s: float = 30.0) -> None:
    """Wait for the prepare thread: a bound on a hang, not a measure of speed."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def test_a_delta_is_rebuilt_on_the_prepare_thread_while_leases_go_on_and_the_swap_is_only_the_reload(
    tmp_path, learner, monkeypatch
):
    entered, gate, threads = threading.Event(), threading.Event(), []

    def held_rebuild(*args, **kwargs):
        threads.append(threading.current_thread().name)
        entered.set()
        gate.wait()
        return versions_apply_delta(*args, **kwargs)

    versions_apply_delta = versions.apply_delta
    monkeypatch.setattr(versions, "apply_delta", held_rebuild)
    worker = started_worker(tmp_path, learner, prepare_thread=True)
    try:
        publish(learner, 1)
        worker._work_once(Stats())  # the lease reply announces v1: its delta is fetched
        until(entered.is_set, "the rebuild started")
        item = PromptItem(prompt_id=7, prompt_token_ids=[1, 2, 3])
        lease = Lease(lease_id="l1", version=0, prompts=[item], deadline_s=60)
        learner.lease_answers.append(LeaseResponse(status="ok", latest_version=1, lease=lease))
        stats = Stats()
        worker._work_once(stats)  # mid-rebuild: the lease is generated with v0, nothing waits for the rebuild
        assert stats.leases == 1 and worker.store.loaded == 0 and worker.engine.reloads == []
        gate.set()
        until(worker.store.ready, "v1 verified")
        worker._work_once(Stats())
        assert worker.store.loaded == 1 and worker.engine.reloads == [VersionKey(1).dir(worker.store.root)]
        assert threads == ["prepare"] and loads(worker)[-1]["via"] == "delta"
        assert worker.store.weights(1).read_bytes() == VersionKey(1).path(learner.published.root).read_bytes()
    finally:
        gate.set()
        worker.stop.set()


def test_a_file_that_fails_its_digest_on_the_prepare_thread_is_refused_in_the_main_loop(tmp_path, learner):
    worker = started_worker(tmp_path, learner, prepare_thread=True)
    try:
        publish(learner, 1, delta=False)
        VersionKey(1).path(learner.published.root).write_bytes(b"\0" * 16)
        with pytest.raises(BroadcastError, match="digest"):
            until(lambda: worker._work_once(Stats()) and False, "the mismatch reported")
        assert worker.store.loaded == 0
    finally:
        worker.stop.set()


def test_a_version_dropped_while_it_is_rebuilt_is_not_marked_verified(tmp_path, learner, monkeypatch):
    # A learner resumed behind us while the prepare thread rebuilt v1: the outcome belongs to a version gone.
    worker = started_worker(tmp_path, learner)
    publish(learner, 1)
    worker._work_once(Stats())
    pending = worker.store.pending

    def resumed_meanwhile(*args, **kwargs):
        worker.store.go_back(learner.published.policies[0])
        return 0.5

    monkeypatch.setattr(worker.store, "_verify", resumed_meanwhile)
    worker.store.prepare()
    assert worker.store.pending is not pending and not worker.store.ready() and worker.store._verified == -1


def test_a_late_joiner_starts_on_the_newest_version_once_its_first_download_stalls(tmp_path, learner, monkeypatch):
    monkeypatch.setattr(versions, "FETCH_STALL_S", 0.0)
    node = FakeNode(learner.published.root)
    node.held.add(0)  # version 0 never arrives: a slow link
    worker = joined_worker(tmp_path, learner, node)
    worker.store.start(learner.policy())
    publish(learner, 1)
    worker._follow(1)  # a heartbeat announces version 1 while version 0 has not moved
    assert node.fetched == [0, 1] and 0 in node.removed  # the delta needs v0: the full v1 is fetched
    worker._wait_download()
    first = worker.store.take()
    assert first.policy.version == 1


def test_a_late_joiner_keeps_a_first_download_that_makes_progress(tmp_path, learner):
    node = FakeNode(learner.published.root)
    node.held.add(0)
    worker = joined_worker(tmp_path, learner, node)
    worker.store.start(learner.policy())
    publish(learner, 1)
    node.bytes = 1000
    worker._follow(1)
    assert worker.store.pending.policy.version == 0 and node.fetched == [0]


def test_a_worker_rejoins_a_learner_resumed_behind_it_and_goes_back_to_the_learners_version(tmp_path, learner):
    worker = started_worker(tmp_path, learner)
    for v in (1, 2):
        publish(learner, v)
        worker._work_once(Stats())
        worker._work_once(Stats())
    assert worker.store.loaded == 2
    learner.restart(at_version=1)  # it crashed after its checkpoint at step 1: version 2 no longer exists
    stats = Stats()
    worker._work_once(stats)
    assert stats.rejoins == 1 and worker.worker_id == "w2" and worker.node.tracker_key == "key2"
    assert worker.store.loaded == 1 and worker.engine.reloads[-1] == VersionKey(1).dir(worker.store.root)
    assert not VersionKey(2).dir(worker.store.root).exists()


def test_a_rejoin_at_the_same_version_keeps_the_engine_and_the_versions(tmp_path, learner):
    worker = started_worker(tmp_path, learner)
    publish(learner, 1)
    worker._work_once(Stats())
    worker._work_once(Stats())
    reloads, fetched = list(worker.engine.reloads), list(worker.node.fetched)
    learner.restart(at_version=1)
    worker._work_once(Stats())
    assert worker.worker_id == "w2" and worker.store.loaded == 1
    assert worker.engine.reloads == reloads and worker.node.fetched == fetched


def test_a_learner_that_now_runs_another_run_is_refused(tmp_path, learner):
    worker = started_worker(tmp_path, learner)
    learner.restart(at_version=0, run_id="run2")
    with pytest.raises(ProtocolError, match="another run"):
        worker._work_once(Stats())


def test_a_lease_is_generated_and_submitted_and_unservable_prompts_handed_back(tmp_path, learner):
    worker = started_worker(tmp_path, learner)
    items = [PromptItem(prompt_id=7, prompt_token_ids=[1, 2, 3])]
    learner.lease_answers.append(
        LeaseResponse(
            status="ok", latest_version=0, lease=Lease(lease_id="l1", version=0, prompts=items, deadline_s=60)
        )
    )
    stats = Stats()
    worker._work_once(stats)
    assert stats.leases == 1 and stats.rollouts == 2 == stats.accepted
    lease = Lease(
        lease_id="l2", version=0, prompts=[*items, PromptItem(prompt_id=8, prompt_token_ids=[4])], deadline_s=1
    )
    batch = rollout_batch("w1", lease, [[Completion([5], [-0.5], "stop")] * 2, []])
    assert [s.prompt_id for s in batch.samples] == [7, 7] and batch.unservable == [8]


@pytest.fixture
def lora_learner(tmp_path):
    published = Published(tmp_path / "learner")
    published.publish(0, content=lora_base())
    learner = FakeLearner(published)
    learner.lora = LoraSpec(rank=4, alpha=8, targets=["q_proj", "v_proj"])
    return learner


def test_a_lora_worker_runs_the_base_and_loads_each_version_as_adapters_keeping_the_base(tmp_path, lora_learner):
    learner = lora_learner
    publish(learner, 1, delta=False, adapter=True, content=lora_adapter(4))
    worker = started_worker(tmp_path, learner, lora_load="adapter")
    assert learner.policy_asks[0] == 0  # the newest version is adapters: the base, version 0, comes first
    assert worker.engine.started_with == worker.store.weights(0) and worker.engine.lora == learner.lora
    for v in (1, 2, 3, 4):
        if v > 1:
            publish(learner, v, delta=False, adapter=True, content=lora_adapter(4))
            worker._work_once(Stats())  # the lease reply announces v: its fetch starts
        worker._work_once(Stats())  # between leases: v is verified and its adapters loaded
        version, adapters = worker.engine.adapters[-1]
        assert version == v == worker.store.loaded and adapters == VersionKey(v).dir(worker.store.root)
        assert json.loads((adapters / "adapter_config.json").read_text())["r"] == 4
        assert (adapters / "adapter_model.safetensors").resolve() == worker.store.weights(v)
    assert worker.engine.reloads == []  # no version replaced the base's weights
    assert (worker.work_dir / "engine" / "model.safetensors").resolve() == worker.store.weights(0)
    assert VersionKey(0).dir(worker.store.root).exists()  # kept: S = 1 prunes v1, not the base
    assert not VersionKey(1).dir(worker.store.root).exists()
    assert [e["version"] for e in loads(worker)] == [0, 1, 2, 3, 4]


def test_a_lora_worker_that_merges_reloads_each_version_folded_into_the_base(tmp_path, lora_learner):
    from safetensors.torch import load, load_file

    from echo2cli.lora import merge

    worker = started_worker(tmp_path, lora_learner, lora_load="merge")
    assert worker.engine.lora is None  # no vLLM LoRA: the engine runs full weights
    for v in (1, 2):
        publish(lora_learner, v, delta=False, adapter=True, content=lora_adapter(4))
        worker._work_once(Stats())
        worker._work_once(Stats())
        assert worker.store.loaded == v and worker.engine.reloads[-1] == worker.store.merged(v)
        base, adapters = load_file(str(worker.store.weights(0))), load_file(str(worker.store.weights(v)))
        got = load(worker.engine.reloaded[-1])
        want = merge(base, adapters, lora_learner.lora)
        assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in got)
        assert not worker.store.merged(v).exists()  # the engine has it: not kept on disk
    assert worker.engine.adapters == [] and [e["version"] for e in loads(worker)] == [0, 1, 2]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (lora_adapter(8), r"is \[8, 8\], not \[4, 8\]"),  # another rank than the spec's
        (lora_adapter(4, a_shape=(4, 7)), r"is \[4, 7\], not \[4, 8\]"),  # vLLM would load this one
        (b"not safetensors", "not a safetensors file"),
    ],
)
def test_adapters_that_do_not_fit_the_base_are_refused_before_vllm_loads_them(tmp_path, lora_learner, content, message):
    publish(lora_learner, 1, delta=False, adapter=True, content=content)
    worker = started_worker(tmp_path, lora_learner, lora_load="merge")  # on the base; fetching version 1
    with pytest.raises(BroadcastError, match="the adapters of version 1 do not fit the base model: .*" + message):
        worker._work_once(Stats())
    assert worker.engine.adapters == []


def test_adapters_without_a_lora_spec_are_refused(tmp_path, learner):
    publish(learner, 1, delta=False, adapter=True)  # and the join answer says nothing of LoRA
    worker = joined_worker(tmp_path, learner, FakeNode(learner.published.root))
    with pytest.raises(BroadcastError, match="LoRA versions without a full base"):
        worker._start(worker.join_info)


def test_a_learners_words_in_the_workers_log_are_text_not_markup_or_terminal_control(tmp_path, learner):
    import io

    from rich.console import Console

    out = io.StringIO()
    worker = Worker(
        WorkerConfig(join="http://learner", work_dir=tmp_path / "w", verify_between_leases=True),
        client=learner,
        make_node=lambda key: FakeNode(learner.published.root),
        make_engine=FakeEngine,
        console=Console(file=out, width=300),
    )
    worker._open(worker._join())
    worker._start(worker.join_info)
    learner.lease_answers.append(LeaseResponse(status="standby", latest_version=0, detail="x[/] \x1b[2J[bold]"))
    worker._work_once(Stats())  # a MarkupError here once
    assert "standby: x[/] \\x1b[2J[bold]" in out.getvalue()
