"""Nothing lost, nothing trained twice: the coordinator's prompt ledger under random churn (pure logic,
fake clock). Workers lease (or claim a version never published), submit good, bad, late and stale groups,
hand back prompts their engine cannot take, die (leases expire) or leave, while the learner trains and
advances versions."""

from conftest import batch_for, make_clock, make_coord
from hypothesis import given, settings
from hypothesis import strategies as st

from echo2cli.protocol import RolloutBatch, Sample

OPS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "lease",
                "lease_future",
                "submit",
                "submit_bad",
                "submit_other",
                "unservable",
                "tick",
                "leave",
                "join",
                "train",
                "guard",
            ]
        ),
        st.integers(0, 3),
    ),
    min_size=1,
    max_size=120,
)


def check(coord, trained_ids):
    a = coord.accounting()
    assert a["leased"] == a["admitted"] + a["rejected"] + a["expired"] + a["returned"] + a["outstanding"], a
    assert a["admitted"] == a["trained"] + a["waiting"] + a["dropped_stale"], a
    assert len(trained_ids) == len(set(trained_ids)), "a prompt was trained twice"
    # every prompt handed out is admitted, waiting to be leased again, or out on a lease: none is lost
    out = {p for lease in coord.leases.leases.values() for p in lease.outstanding}
    assert not set(coord.prompts.problems) - coord.admission.done - set(coord.prompts.pending) - out
    assert coord.audit()["lost"] == []


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_ledger_balances_and_no_prompt_is_trained_twice(ops):
    clock = make_clock()  # hypothesis runs many examples per test: a fresh clock for each
    coord = make_coord(clock, G=2, S=1, B=2, lease_timeout_s=30)
    workers = [coord.join(f"w{i}", 0.0) for i in range(2)]
    held: dict[str, list] = {}  # worker -> leases it holds
    trained: list[int] = []
    for op, k in ops:
        wid = workers[k % len(workers)]
        if coord.cut_off(wid) or not coord.known(wid):
            continue
        if op == "lease":
            resp = coord.lease(wid, coord.version, 1 + k)
            if resp.lease is not None:
                held.setdefault(wid, []).append(resp.lease)
        elif op == "lease_future":  # a version the learner never published: no lease, nothing leased
            assert coord.lease(wid, coord.version + 1 + k, 4).lease is None
        elif op == "unservable" and held.get(wid):  # its engine could take none of them: handed back
            lease = held[wid].pop(0)
            coord.submit(
                RolloutBatch(
                    worker_id=wid,
                    lease_id=lease.lease_id,
                    version=lease.version,
                    samples=[],
                    unservable=[p.prompt_id for p in lease.prompts],
                )
            )
        elif op in ("submit", "submit_bad", "submit_other") and held.get(wid):
            lease = held[wid].pop(0)
            if op == "submit_other":  # try to return another worker's lease
                other = workers[(k + 1) % len(workers)]
                coord.submit(batch_for(coord, other, lease)) if coord.known(other) else None
            elif op == "submit_bad":
                samples = [
                    Sample(prompt_id=p.prompt_id, sample_idx=i, completion_token_ids=[1, 2], logprobs=[0.5])
                    for p in lease.prompts
                    for i in range(2)
                ]
                coord.submit(
                    RolloutBatch(worker_id=wid, lease_id=lease.lease_id, version=lease.version, samples=samples)
                )
            else:
                coord.submit(batch_for(coord, wid, lease))
        elif op == "tick":
            clock(10.0 * k)  # leases of a silent worker expire after 30 s
            coord.expire_leases()
        elif op == "leave":
            coord.leave(wid)
            held.pop(wid, None)
        elif op == "join":
            workers.append(coord.join(f"w{len(workers)}", 0.0))
        elif op == "train":
            groups = coord.take_batch()
            if groups is not None:
                trained += [g.prompt_id for g in groups]
                coord.advance(coord.version + 1)
        elif op == "guard":  # the divergence guard lowers S to 0 or raises it back to 1
            coord.set_effective_staleness(k % 2)
        check(coord, trained)


def test_a_worker_that_keeps_sending_invalid_data_is_cut_off(clock):
    coord = make_coord(clock, G=2, S=1, B=2)
    wid = coord.join("bad", 0.0)
    for _ in range(coord.max_bad_batches):
        lease = coord.lease(wid, 0, 1).lease
        samples = [
            Sample(prompt_id=p.prompt_id, sample_idx=i, completion_token_ids=[5000], logprobs=[-1.0])
            for p in lease.prompts
            for i in range(2)
        ]
        result = coord.submit(RolloutBatch(worker_id=wid, lease_id=lease.lease_id, version=0, samples=samples))
        assert result.rejected == {"invalid_samples": 2} and "vocabulary" in result.detail
    assert coord.cut_off(wid) and not coord.known(wid)
    assert coord.fleet.workers[wid].rejected["invalid_samples"] == 2 * coord.max_bad_batches
    a = coord.accounting()
    assert a["leased"] == a["rejected"] + a["outstanding"] + a["returned"]  # every prompt leased again


def test_stale_and_honest_duplicates_do_not_count_against_a_worker(clock):
    coord = make_coord(clock, G=2, S=0, B=2)
    wid = coord.join("honest", 0.0)
    for _ in range(coord.max_bad_batches + 1):
        lease = coord.lease(wid, coord.version, 2).lease
        coord.advance(coord.version + 1)  # the learner moved on: the group is more than S=0 behind
        assert coord.submit(batch_for(coord, wid, lease)).rejected == {"stale": 4}
    assert not coord.cut_off(wid)


def test_a_copy_of_a_batch_whose_lease_was_revoked_for_invalid_data_is_told_revoked(clock):
    coord = make_coord(clock)
    w = coord.join("w", 0.0)
    lease = coord.lease(w, 0, 2).lease
    bad = batch_for(coord, w, lease)
    for s in bad.samples:
        s.logprobs = [1.5]  # positive log-probs: invalid
    assert coord.submit(bad).rejected == {"invalid_samples": 4}
    again = coord.submit(batch_for(coord, w, lease))  # the same lease, now with valid samples
    assert again.rejected == {"revoked": 4} and "revoked" in again.detail
    acc = coord.accounting()
    assert acc["leased"] == acc["admitted"] + acc["rejected"] + acc["expired"] + acc["returned"] + acc["outstanding"]
