from conftest import batch_for, make_coord

from echo2cli.protocol import Sample


def join_and_lease(coord, n=2, version=0):
    wid = coord.join("w", 0.0)
    resp = coord.lease(wid, version, n)
    assert resp.status == "ok"
    return wid, resp.lease


def test_rewards_are_computed_by_the_learner_not_taken_from_the_worker(clock):
    coord = make_coord(clock)
    wid, lease = join_and_lease(coord)
    coord.submit(batch_for(coord, wid, lease, right=False))
    groups = coord.take_batch()
    assert groups is not None and all(r == 0.0 for g in groups for r in g.rewards)


def test_each_prompt_is_trained_at_most_once(clock):
    coord = make_coord(clock)
    wid, lease = join_and_lease(coord)
    batch = batch_for(coord, wid, lease)
    assert coord.submit(batch).accepted == 4
    again = coord.submit(batch)
    assert again.accepted == 0 and again.duplicate == 4


def test_expired_lease_is_leased_again_and_a_late_copy_is_rejected(clock):
    coord = make_coord(clock, lease_timeout_s=10)
    wid, lease = join_and_lease(coord)
    clock(11)
    other = coord.join("other", 0.0)
    second = coord.lease(other, 0, 2).lease
    assert sorted(p.prompt_id for p in second.prompts) == sorted(p.prompt_id for p in lease.prompts)
    late = coord.submit(batch_for(coord, wid, lease))  # the slow worker finished after its deadline
    assert late.accepted == 0 and late.rejected == {"late": 4}
    assert coord.submit(batch_for(coord, other, second)).accepted == 4
    assert coord.accounting()["expired"] == 2 and coord.accounting()["admitted"] == 2


def test_worker_that_leaves_returns_its_prompts(clock):
    coord = make_coord(clock)
    wid, lease = join_and_lease(coord)
    assert coord.leave(wid) == 2
    other = coord.join("other", 0.0)
    assert {p.prompt_id for p in coord.lease(other, 0, 2).lease.prompts} == {p.prompt_id for p in lease.prompts}


def test_rollouts_older_than_S_are_dropped_counted_and_their_prompts_requeued(clock):
    coord = make_coord(clock, S=1, B=2)
    wid, lease = join_and_lease(coord, n=2, version=0)
    coord.advance(2)  # the learner moved on: version 0 rollouts are 2 > S behind
    result = coord.submit(batch_for(coord, wid, lease))
    assert result.stale == 4 and result.accepted == 0
    assert coord.counters["stale_samples"] == 4
    resp = coord.lease(wid, 2, 2)
    assert {p.prompt_id for p in resp.lease.prompts} == {p.prompt_id for p in lease.prompts}


def test_buffered_group_that_becomes_stale_is_not_trained(clock):
    coord = make_coord(clock, S=1, B=4)
    wid, lease = join_and_lease(coord, n=2, version=0)
    coord.submit(batch_for(coord, wid, lease))
    coord.advance(2)
    assert coord.take_batch() is None
    assert coord.counters["stale_samples"] == 4 and not coord.admission.ready


def test_admissible_batch_respects_staleness_bound(clock):
    coord = make_coord(clock, S=1, B=2)
    wid, lease = join_and_lease(coord, n=2, version=0)
    coord.advance(1)
    coord.submit(batch_for(coord, wid, lease))
    groups = coord.take_batch()
    assert groups is not None and all(1 - g.version <= 1 for g in groups)


def test_worker_too_far_behind_is_told_to_update(clock):
    coord = make_coord(clock, S=1)
    wid = coord.join("w", 0.0)
    coord.advance(2)
    assert coord.lease(wid, 0, 2).status == "update"


def test_leases_are_capped_at_B_times_S_plus_one_in_flight(clock):
    coord = make_coord(clock, S=0, B=2)
    wid = coord.join("w", 0.0)
    assert len(coord.lease(wid, 0, 8).lease.prompts) == 2
    assert coord.lease(wid, 0, 8).status == "wait"


def test_malformed_samples_are_rejected_and_the_prompt_requeued(clock):
    coord = make_coord(clock)
    wid, lease = join_and_lease(coord, n=1)
    pid = lease.prompts[0].prompt_id
    bad = [
        Sample(prompt_id=pid, sample_idx=0, completion_token_ids=[1, 2], logprobs=[-0.1]),  # length mismatch
        Sample(prompt_id=pid, sample_idx=1, completion_token_ids=[1], logprobs=[0.5]),  # positive log-prob
    ]
    from echo2cli.protocol import RolloutBatch

    result = coord.submit(RolloutBatch(worker_id=wid, lease_id=lease.lease_id, version=0, samples=bad))
    assert result.invalid == 2 and result.accepted == 0
    assert coord.lease(wid, 0, 1).lease.prompts[0].prompt_id == pid


def test_nan_logprobs_and_out_of_vocab_tokens_are_invalid(clock):
    coord = make_coord(clock)
    for sample in (
        Sample(prompt_id=0, sample_idx=0, completion_token_ids=[1], logprobs=[float("nan")]),
        Sample(prompt_id=0, sample_idx=0, completion_token_ids=[5000], logprobs=[-1.0]),
    ):
        other = sample.model_copy(update={"sample_idx": 1})
        assert coord.admission.invalid_reason([sample, other])


def test_bcast_time_is_publish_to_last_active_worker_on_that_version(clock):
    from echo2cli.protocol import Heartbeat, PolicyInfo

    coord = make_coord(clock)
    a, b = coord.join("a", 0.0), coord.join("b", 0.0)
    t_pub = clock()
    coord.publish(
        PolicyInfo(version=1, info_hash="ab" * 20, torrent_b64="", digest="cd" * 32, size_bytes=1, published_at=t_pub)
    )
    clock(1)
    coord.heartbeat(Heartbeat(worker_id=a, version_loaded=1))
    assert coord.update_bcast() == []
    clock(2)
    coord.heartbeat(Heartbeat(worker_id=b, version_loaded=1))
    assert coord.update_bcast() == [1] and coord.published.bcast_s[1] == 3.0


def test_ready_time_leaves_out_the_wait_for_a_lease_in_progress(clock):
    from echo2cli.protocol import Heartbeat, PolicyInfo

    coord = make_coord(clock)
    a, b = coord.join("a", 0.0), coord.join("b", 0.0)
    coord.publish(
        PolicyInfo(version=1, info_hash="ab" * 20, torrent_b64="", digest="cd" * 32, size_bytes=1, published_at=clock())
    )
    clock(1)
    coord.heartbeat(Heartbeat(worker_id=a, version_loaded=1, swap_s=0.5))  # idle: loaded it at once
    clock(1)
    coord.heartbeat(Heartbeat(worker_id=b, version_loaded=0, ready_version=1))  # downloaded, mid-lease
    clock(10)
    coord.heartbeat(Heartbeat(worker_id=b, version_loaded=1, swap_s=0.8))  # the lease ended
    assert coord.update_bcast() == [1]
    assert coord.published.bcast_s[1] == 12.0  # publish -> the last worker generating with it
    assert coord.published.ready_s[1] == 2.0 + 0.8  # publish -> the last worker holding it, plus the slowest swap


def test_ready_time_is_measured_while_a_worker_is_still_partway_through_a_lease(clock):
    from echo2cli.protocol import Heartbeat, PolicyInfo

    coord = make_coord(clock)
    a, b = coord.join("a", 0.0), coord.join("b", 0.0)
    for w in (a, b):
        coord.heartbeat(Heartbeat(worker_id=w, version_loaded=0, swap_s=0.5))
    coord.publish(
        PolicyInfo(version=1, info_hash="ab" * 20, torrent_b64="", digest="cd" * 32, size_bytes=1, published_at=clock())
    )
    clock(1)
    coord.heartbeat(Heartbeat(worker_id=a, version_loaded=1, swap_s=0.5))
    coord.heartbeat(Heartbeat(worker_id=b, version_loaded=0, ready_version=0))
    assert coord.update_bcast() == [] and coord.bcast_times() == ({}, {})  # b does not hold v1 yet
    clock(2)
    coord.heartbeat(Heartbeat(worker_id=b, version_loaded=0, ready_version=1))  # verified, a long lease goes on
    assert coord.update_bcast() == [] and coord.bcast_times() == ({}, {1: 3.0 + 0.5})
    clock(30)
    coord.heartbeat(Heartbeat(worker_id=b, version_loaded=1, swap_s=0.5))
    assert coord.update_bcast() == [1] and coord.bcast_times() == ({1: 33.0}, {1: 3.5})


def test_a_lagging_worker_gets_only_work_that_will_still_be_admissible(clock):
    coord = make_coord(clock, S=2, B=2)
    fresh, behind, behind2 = coord.join("fresh", 0.0), coord.join("behind", 0.0), coord.join("behind2", 0.0)
    coord.advance(1)
    # lag 1: B * S = 4 prompts in flight, in leases of at most B = 2 (and at most B held per worker)
    assert [len(coord.lease(w, 0, 8).lease.prompts) for w in (behind, behind2)] == [2, 2]
    assert coord.lease(behind, 0, 8).status == "wait"
    assert len(coord.lease(fresh, 1, 8).lease.prompts) == 2  # lag 0: up to B * (S + 1) in flight


def test_the_batch_being_trained_counts_against_the_lease_cap(clock):
    coord = make_coord(clock, S=1, B=2)
    wid, lease = join_and_lease(coord, n=2, version=0)
    coord.submit(batch_for(coord, wid, lease))
    assert coord.take_batch() is not None
    # while step 0 trains, only B more prompts fit: they will be trained at step 1 with staleness 1 <= S
    assert len(coord.lease(wid, 0, 8).lease.prompts) == 2
    assert coord.lease(wid, 0, 8).status == "wait"


def test_policy_for_a_worker_carries_its_fetch_slot_among_active_workers(clock):
    from echo2cli.protocol import PolicyInfo

    coord = make_coord(clock)
    a, b = coord.join("a", 0.0), coord.join("b", 0.0)
    coord.publish(
        PolicyInfo(version=0, info_hash="0" * 40, torrent_b64="", digest="0" * 64, size_bytes=1, published_at=0.0)
    )
    assert (coord.latest_policy(a).slot, coord.latest_policy(a).slots) == (0, 2)
    assert (coord.latest_policy(b).slot, coord.latest_policy(b).slots) == (1, 2)
    assert coord.latest_policy().slots == 1  # no worker: no slot
    coord.leave(a)
    assert (coord.latest_policy(b).slot, coord.latest_policy(b).slots) == (0, 1)


def test_fetch_slots_are_sized_by_each_workers_measured_uplink(clock):
    from echo2cli.protocol import Heartbeat, PolicyInfo

    coord = make_coord(clock)
    a, b = coord.join("a", 0.0), coord.join("b", 0.0)
    coord.publish(
        PolicyInfo(version=0, info_hash="0" * 40, torrent_b64="", digest="0" * 64, size_bytes=1, published_at=0.0)
    )
    for w in (a, b):
        coord.heartbeat(Heartbeat(worker_id=w, version_loaded=0, upload_bytes=0))
    clock(2.0)
    coord.heartbeat(Heartbeat(worker_id=a, version_loaded=0, upload_bytes=10_000_000))  # 5 MB/s
    coord.heartbeat(Heartbeat(worker_id=b, version_loaded=0, upload_bytes=30_000_000))  # 15 MB/s
    pa, pb = coord.latest_policy(a), coord.latest_policy(b)
    # b's 3x counts as 2x: of two workers, the median is the lower one
    assert (pa.slot, pa.slots, pa.slot_width) == (0, 63, 21) and (pb.slot, pb.slots, pb.slot_width) == (21, 63, 42)
    clock(2.0)
    coord.heartbeat(Heartbeat(worker_id=b, version_loaded=0, upload_bytes=31_000_000))  # slower now: the peak stays
    assert coord.latest_policy(b).slot_width == 42


def test_share_widths_follow_uplinks_but_one_claimed_uplink_counts_for_at_most_2x_the_median():
    from echo2cli.learner.fleet import share_widths

    assert share_widths([5.0, 0.0, 7.0]) == [1, 1, 1]  # one unmeasured: equal shares
    assert share_widths([1.0, 1000.0, 1000.0]) == [1, 32, 32]  # every worker keeps a share
    assert share_widths([100.0] * 7 + [1e12]) == [7] * 7 + [14]  # the claim counts as 200
    assert share_widths([100.0, 200.0, 400.0, 800.0]) == [5, 10, 20, 30]  # 800 counts as 600: 2x the median
    assert share_widths([1e12, 1e6]) == [42, 21]  # of two, the median is the lower: the cap binds at N = 2


def test_a_worker_asking_again_and_again_holds_no_more_than_its_cap(clock):
    coord = make_coord(clock, S=4, B=2)  # room for B * (S + 1) = 10 prompts in flight
    greedy, other = coord.join("greedy", 0.0), coord.join("other", 0.0)
    got = [coord.lease(greedy, 0, 8) for _ in range(5)]
    assert [len(r.lease.prompts) if r.lease else 0 for r in got] == [2, 0, 0, 0, 0]
    assert len(coord.lease(other, 0, 8).lease.prompts) == 2  # the rest of the fleet still gets work


def test_a_claimed_version_the_learner_never_published_gets_no_lease(clock):
    coord = make_coord(clock, S=1, B=2)
    w = coord.join("w", 0.0)
    resp = coord.lease(w, 7, 8)
    assert resp.status == "update" and resp.lease is None and "never published" in resp.detail
    assert coord.accounting()["leased"] == 0 and coord.fleet.workers[w].version_loaded == -1


def test_rejected_samples_do_not_count_as_a_workers_throughput(clock):
    coord = make_coord(clock, S=1, B=2)
    junk = coord.join("junk", 0.0)
    for _ in range(3):
        lease = coord.lease(junk, 0, 2).lease
        clock(1.0)
        coord.submit(batch_for(coord, junk, lease, version=0, right=True).model_copy(update={"version": 1}))
    assert [m["rollouts_per_s"] for m in coord.measured()] == [0.0]


def test_a_slow_worker_gets_leases_it_can_return_while_they_are_admissible(clock):
    coord = make_coord(clock, S=1, B=8)  # G = 2
    slow = coord.join("slow", 0.0)
    for _ in range(3):  # 2 prompts x 2 samples in 8 s: 0.5 rollouts/s
        lease = coord.lease(slow, 0, 2).lease
        clock(8.0)
        coord.submit(batch_for(coord, slow, lease))
    coord.take_batch()
    coord.advance(1)
    for _ in range(5):
        coord.set_step_time(4.0)
    # a group made now is admissible for S - lag + 1 = 2 steps of 4 s: 0.5 * 8 / G = 2 prompts, not B = 8
    assert len(coord.lease(slow, 1, 8).lease.prompts) == 2


def slow_worker_after_leases(coord, clock, seconds_per_lease, leases=3):
    """A worker that took `seconds_per_lease` for each of its leases of 2 prompts (G = 2: 4 rollouts)."""
    w = coord.join("slow", 0.0)
    for _ in range(leases):
        lease = coord.lease(w, coord.version, 2).lease
        clock(seconds_per_lease)
        coord.submit(batch_for(coord, w, lease))
    return w


def test_a_worker_too_slow_to_return_one_group_while_admissible_gets_no_lease(clock):
    coord = make_coord(clock, S=1, B=8)  # G = 2
    slow = slow_worker_after_leases(coord, clock, 100.0)  # 4 rollouts in 100 s: one group takes 50 s
    coord.advance(1)
    for _ in range(5):
        coord.set_step_time(4.0)  # a group stays admissible for (S + 1) * 4 = 8 s
    resp = coord.lease(slow, 1, 8)
    assert resp.status == "wait" and resp.lease is None and "too slow" in resp.detail
    for _ in range(5):
        coord.set_step_time(40.0)  # the learner slowed down: 80 s is time enough for one group
    assert len(coord.lease(slow, 1, 8).lease.prompts) == 1


def test_leases_resume_when_the_learner_has_waited_longer_than_one_group_takes(clock):
    coord = make_coord(clock, S=1, B=8)
    slow = slow_worker_after_leases(coord, clock, 100.0)  # one group takes it 50 s
    coord.advance(1)
    for _ in range(5):
        coord.set_step_time(4.0)
    assert coord.lease(slow, 1, 8).status == "wait"
    clock(25.0)  # no step for 25 s (every worker is that slow): a group made now is trained in time
    assert len(coord.lease(slow, 1, 8).lease.prompts) == 1


def test_a_worker_measured_only_on_its_cold_first_lease_still_gets_a_prompt(clock):
    coord = make_coord(clock, S=1, B=8)
    cold = slow_worker_after_leases(coord, clock, 100.0, leases=1)  # engine start-up inside the first lease
    coord.advance(1)
    coord.set_step_time(4.0)
    assert len(coord.lease(cold, 1, 8).lease.prompts) == 1


def test_stale_groups_count_toward_a_workers_speed_but_not_its_throughput(clock):
    coord = make_coord(clock, S=0, B=4)
    w = coord.join("w", 0.0)
    for _ in range(3):
        lease = coord.lease(w, coord.version, 2).lease
        clock(2.0)
        coord.advance(coord.version + 1)  # the learner moved on: the group is stale, yet it was generated
        assert coord.submit(batch_for(coord, w, lease)).rejected == {"stale": 4}
    coord.set_step_time(4.0)
    assert coord.measured()[0]["rollouts_per_s"] == 0.0  # mu_i: nothing admitted
    assert len(coord.lease(w, coord.version, 8).lease.prompts) == 4  # 2 rollouts/s x 4 s / G = 4 prompts


def test_leases_name_the_newest_announced_version_not_the_one_still_being_written(clock):
    # A worker told of a version that is not announced yet would fetch the one it holds, again and again.
    from echo2cli.protocol import PolicyInfo

    coord = make_coord(clock, S=1)
    coord.publish(
        PolicyInfo(version=0, info_hash="ab" * 20, torrent_b64="", digest="cd" * 32, size_bytes=1, published_at=0.0)
    )
    wid = coord.join("w", 0.0)
    coord.advance(1)  # step 0 trained; version 1 is written in the background
    resp = coord.lease(wid, 0, 2)
    assert resp.status == "ok" and resp.latest_version == 0  # lag 1 <= S: it may go on with version 0
    coord.advance(2)
    assert coord.lease(wid, 0, 2).status == "update" and coord.lease(wid, 0, 2).latest_version == 0


def test_a_lowered_effective_staleness_drops_admitted_groups_staler_than_it(clock):
    coord = make_coord(clock, G=2, S=2, B=1)
    for name in ("a", "b"):  # two groups of version 0
        wid = coord.join(name, 0.0)
        coord.submit(batch_for(coord, wid, coord.lease(wid, 0, 1).lease))
    assert coord.take_batch() is not None
    coord.advance(1)
    coord.set_effective_staleness(0)  # the guard: lag 1 is too stale now
    assert coord.take_batch() is None  # the version-0 group waiting is dropped, not trained at lag 1
    a = coord.accounting()
    assert a["dropped_stale"] == 1 and a["waiting"] == 0
    assert coord.audit()["lost"] == []  # its prompt is queued again
