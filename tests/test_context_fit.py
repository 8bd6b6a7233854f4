"""Prompts and workers' contexts: a prompt is leased only to a worker whose engine can take it (prompt +
max_new_tokens <= its max_model_len), a worker hands back what its engine could not take, and a prompt too
long for the learner itself is skipped and counted. Fake clock, no sockets."""

from __future__ import annotations

from itertools import cycle

from conftest import batch_for

from echo2cli.learner.coordinator import Coordinator
from echo2cli.protocol import RolloutBatch
from echo2cli.tasks.arithmetic import ArithmeticTask


def coord_with_lengths(clock, lengths, *, B=2, max_seq_len=None) -> Coordinator:
    """Prompt i is `lengths[i % len(lengths)]` tokens long; max_new_tokens = 8, G = 2."""
    sizes = cycle(lengths)
    return Coordinator(
        ArithmeticTask(),
        encode_prompt=lambda messages: [1] * next(sizes),
        decode=str,
        group_size=2,
        staleness=1,
        prompts_per_step=B,
        max_new_tokens=8,
        vocab_size=1000,
        lease_timeout_s=60,
        heartbeat_s=2,
        seed=0,
        clock=clock,
        max_seq_len=max_seq_len,
    )


def leased_lengths(coord, worker_id, n=2) -> list[int]:
    resp = coord.lease(worker_id, 0, n)
    return [len(p.prompt_token_ids) for p in resp.lease.prompts] if resp.lease else []


def test_a_prompt_too_long_for_a_workers_context_is_leased_to_one_it_fits(clock):
    coord = coord_with_lengths(clock, [100, 10, 10, 10])
    short, long_ = coord.join("short", 0.0, max_model_len=64), coord.join("long", 0.0, max_model_len=4096)
    assert leased_lengths(coord, short) == [10, 10]  # prompt 0 (100 + 8 > 64) stays queued
    assert leased_lengths(coord, long_) == [100, 10]  # the oldest queued prompt first
    audit = coord.audit()
    assert audit["lost"] == []


def test_a_prompt_the_engine_could_not_take_is_handed_back_and_not_leased_to_it_again(clock):
    coord = coord_with_lengths(clock, [40])
    w = coord.join("w", 0.0, max_model_len=1024)  # it says 1024, its engine takes less
    lease = coord.lease(w, 0, 2).lease
    back = RolloutBatch(
        worker_id=w, lease_id=lease.lease_id, version=0, samples=[], unservable=[p.prompt_id for p in lease.prompts]
    )
    assert coord.submit(back).accepted == 0
    assert coord.lease(w, 0, 2).status == "wait"  # every prompt is 40 tokens: none fits it any more
    other = coord.join("other", 0.0, max_model_len=1024)
    again = coord.lease(other, 0, 2).lease
    assert [p.prompt_id for p in again.prompts] == [p.prompt_id for p in lease.prompts]
    acc = coord.accounting()
    assert acc["leased"] == acc["admitted"] + acc["rejected"] + acc["expired"] + acc["returned"] + acc["outstanding"]
    assert acc["returned"] == 2


def test_a_prompt_too_long_for_the_learner_is_skipped_and_counted(clock):
    coord = coord_with_lengths(clock, [10, 500], max_seq_len=256)
    w = coord.join("w", 0.0)
    assert leased_lengths(coord, w) == [10, 10]
    assert coord.counters["prompts_too_long"] == 1 and coord.audit()["lost"] == []


def test_an_honest_worker_still_returns_full_batches(clock):
    coord = coord_with_lengths(clock, [10])
    w = coord.join("w", 0.0, max_model_len=1024)
    lease = coord.lease(w, 0, 2).lease
    assert coord.submit(batch_for(coord, w, lease, right=False)).accepted == 4
