"""Long completions: the wire takes what any run may ask for (up to 65,536 tokens), the run's own cap decides
what is admitted, the learner counts truncated completions, and a worker sizes its engine from the run."""

from __future__ import annotations

import json

import pytest
from test_context_fit import coord_with_lengths
from worker_fakes import FakeEngine, FakeLearner, FakeNode, Published

from echo2cli.config import LearnerConfig, WorkerConfig
from echo2cli.learner.guard import rollout_body_limit
from echo2cli.learner.records import batch_metrics
from echo2cli.learner.types import Group
from echo2cli.protocol import MAX_COMPLETION_TOKENS, RolloutBatch, Sample
from echo2cli.worker.loop import DEFAULT_CONTEXT_LEN, Worker


def long_batch(coord, worker_id, n_tokens: int) -> RolloutBatch:
    lease = coord.lease(worker_id, 0, 1).lease
    assert lease is not None
    samples = [
        Sample(prompt_id=p.prompt_id, sample_idx=i, completion_token_ids=[5] * n_tokens, logprobs=[-0.5] * n_tokens)
        for p in lease.prompts
        for i in range(2)
    ]
    return RolloutBatch(worker_id=worker_id, lease_id=lease.lease_id, version=0, samples=samples)


def test_the_wire_takes_a_16k_completion_and_the_learners_config_allows_32k():
    batch = RolloutBatch.model_validate_json(
        json.dumps(
            {
                "worker_id": "w",
                "lease_id": "l",
                "version": 0,
                "samples": [
                    {"prompt_id": 0, "sample_idx": 0, "completion_token_ids": [7] * 16384, "logprobs": [-1.0] * 16384}
                ],
            }
        )
    )
    assert len(batch.samples[0].completion_token_ids) == 16384
    assert LearnerConfig(max_new_tokens=32768).max_new_tokens == 32768
    with pytest.raises(ValueError):
        Sample(prompt_id=0, sample_idx=0, completion_token_ids=[1] * (MAX_COMPLETION_TOKENS + 1), logprobs=[])


def test_a_completion_within_the_runs_cap_is_admitted_and_one_above_it_refused_with_its_reason(clock):
    coord = coord_with_lengths(clock, [10])
    coord.admission.max_new_tokens = 16384  # a run with a 16k cap
    w = coord.join("w", 0.0)
    assert coord.submit(long_batch(coord, w, 16384)).accepted == 2
    coord.admission.max_new_tokens = 1000
    result = coord.submit(long_batch(coord, w, 16384))
    assert result.accepted == 0
    assert result.invalid == 2 and "completion length 16384 not in 1..1000" in result.detail, result


def test_the_body_limit_of_a_16k_run_fits_a_full_batch_of_16k_completions():
    samples = [
        {"prompt_id": p, "sample_idx": i, "completion_token_ids": [49151] * 16384, "logprobs": [-12.345678] * 16384}
        for p in range(2)
        for i in range(4)
    ]
    body = json.dumps({"worker_id": "w" * 12, "lease_id": "l" * 16, "version": 3, "samples": samples})
    assert len(body) < rollout_body_limit(2, 4, 16384)


def test_completions_that_reach_the_cap_are_counted_as_truncated():
    samples = [
        Sample(prompt_id=0, sample_idx=i, completion_token_ids=[1] * n, logprobs=[-1.0] * n)
        for i, n in enumerate([3, 8, 8, 5])
    ]
    metrics = batch_metrics([Group(0, 0, [1], samples, [0.0] * 4, "w")], 0, max_new_tokens=8)
    assert metrics["rollout/truncated_frac"] == 0.5 and metrics["rollout/completion_len_max"] == 8


def worker(tmp_path, learner, **cfg) -> Worker:
    w = Worker(
        WorkerConfig(join="http://learner", work_dir=tmp_path / "w", verify_between_leases=True, **cfg),
        client=learner,
        make_node=lambda key: FakeNode(learner.published.root),
        make_engine=FakeEngine,
    )
    w._open(w._join())
    w._start(w.join_info)
    return w


@pytest.fixture
def learner(tmp_path):
    published = Published(tmp_path / "learner")
    published.publish(0)
    return FakeLearner(published)


def test_a_worker_sizes_its_engine_from_the_run_and_says_so_when_it_joins_again(tmp_path, learner):
    learner.context_len = 16896  # 512 prompt + 16384 completion tokens
    w = worker(tmp_path, learner)
    assert w.engine.context_len == w.context_len == 16896
    assert learner.join_requests[0].max_model_len is None  # before its engine runs, it takes the run's context
    w._join()
    assert learner.join_requests[1].max_model_len == 16896  # from then on, it is the engine's


def test_max_model_len_overrides_the_run_and_an_old_learner_gets_the_default(tmp_path, learner):
    learner.context_len = 16896
    assert worker(tmp_path / "a", learner, max_model_len=4096).engine.context_len == 4096
    assert learner.join_requests[-1].max_model_len == 4096
    learner.context_len = 0
    assert worker(tmp_path / "b", learner).engine.context_len == DEFAULT_CONTEXT_LEN


def test_the_lease_timeout_grows_with_the_completion_cap_unless_given():
    assert LearnerConfig().lease_timeout() == 120.0
    assert LearnerConfig(max_new_tokens=16384).lease_timeout() == 16384 / 20
    assert LearnerConfig(max_new_tokens=16384, lease_timeout_s=60).lease_timeout() == 60
