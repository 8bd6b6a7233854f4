"""Checkpoints: the coordinator's state survives a round trip through JSON, the trainer's weights,
optimizer and RNG come back bit for bit, and a failed write never harms the previous checkpoint."""

from __future__ import annotations

import contextlib
import errno
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import batch_for, make_coord
from test_trainer import make_trainer, tiny_model_dir  # noqa: F401  (fixture)

from echo2cli.errors import ConfigError, DiskFullError
from echo2cli.learner.checkpoint import (
    STATE_FILE,
    complete_checkpoints,
    find_checkpoint,
    resume_check,
    write_checkpoint,
)
from echo2cli.learner.types import Group
from echo2cli.protocol import Sample


def busy_coordinator(clock):
    """Two steps trained, one group waiting, one lease out, one prompt queued again."""
    coord = make_coord(clock, B=2, S=1)
    wid = coord.join("w", 0.0)
    for _ in range(3):
        lease = coord.lease(wid, coord.version, 2).lease
        coord.submit(batch_for(coord, wid, lease))
        if (batch := coord.take_batch()) is not None:
            coord.advance(coord.version + 1)
            assert len(batch) == 2
    lease = coord.lease(wid, coord.version, 1).lease
    coord.submit(batch_for(coord, wid, lease))  # waits: one group is not a batch
    held = coord.lease(wid, coord.version, 1).lease  # out when the checkpoint is taken
    bad = coord.lease(wid, coord.version, 1).lease
    coord.submit(batch_for(coord, wid, bad, version=coord.version + 5))  # rejected: queued again
    return coord, held


def test_coordinator_state_round_trips_and_returns_leases_of_the_old_session(clock):
    coord, held = busy_coordinator(clock)
    state = json.loads(json.dumps(coord.state_dict()))
    again = make_coord(clock, B=2, S=1)
    again.load_state(state)
    assert again.version == coord.version == 3
    assert [g.prompt_id for g in again.admission.ready] == [g.prompt_id for g in coord.admission.ready]
    assert (
        again.admission.ready[0].samples == coord.admission.ready[0].samples
        and again.admission.ready[0].rewards == coord.admission.ready[0].rewards
    )
    assert again.admission.done == coord.admission.done and again.admission.trained == coord.admission.trained
    before, after = coord.accounting(), again.accounting()
    assert after["returned"] == before["returned"] + before["outstanding"] and after["outstanding"] == 0
    assert after["leased"] == after["admitted"] + after["rejected"] + after["expired"] + after["returned"]
    assert again.audit()["lost"] == [] and again.audit()["trained_twice"] == 0
    assert [again.prompts.problems[i] for i in range(len(coord.prompts.problems))] == list(
        coord.prompts.problems.values()
    )
    wid = again.join("w2", 0.0)
    assert again.lease(wid, again.version, 1).lease.prompts[0].prompt_id == held.prompts[0].prompt_id
    fresh_a, fresh_b = coord.prompts.draw(), again.prompts.draw()  # new prompts continue the same stream
    assert fresh_a == fresh_b and coord.prompts.problems[fresh_a] == again.prompts.problems[fresh_b]


def test_audit_finds_a_prompt_that_vanished(clock):
    coord, _ = busy_coordinator(clock)
    coord.prompts.pending.clear()  # mutate: drop queued prompts on the floor
    assert coord.audit()["lost"]


def test_trainer_checkpoint_restores_weights_optimizer_and_rng(tiny_model_dir, tmp_path):  # noqa: F811
    groups = [
        Group(
            0,
            0,
            [5, 6],
            [
                Sample(prompt_id=0, sample_idx=i, completion_token_ids=[20 + i, 21], logprobs=[-3.0, -3.0])
                for i in range(4)
            ],
            [1.0, 0.0, 1.0, 0.0],
            "w",
        )
    ]
    a = make_trainer(tiny_model_dir)
    a.step(groups)
    a.save_checkpoint(tmp_path)
    b = make_trainer(tiny_model_dir)
    b.load_checkpoint(tmp_path)
    draw_b = torch.rand(3)
    torch.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True)["torch"])
    assert torch.equal(torch.rand(3), draw_b)
    a.step(groups)  # the second step uses AdamW moments: equal only if the optimizer came back too
    b.step(groups)
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb), name


class _RunsCode:
    """Unpickling this runs `Path.touch` on a marker: what a crafted checkpoint file could do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_checkpoint_whose_pickles_would_run_code_is_refused(tiny_model_dir, tmp_path):  # noqa: F811
    trainer = make_trainer(tiny_model_dir)
    trainer.save_checkpoint(tmp_path / "ckpt")
    marker = tmp_path / "ran"
    torch.save({"torch": torch.get_rng_state(), "python": _RunsCode(marker)}, tmp_path / "ckpt" / "rng.pt")
    with pytest.raises(ValueError, match="not plain tensors"):
        make_trainer(tiny_model_dir).load_checkpoint(tmp_path / "ckpt")
    assert not marker.exists()


def test_a_failed_export_leaves_no_partial_file(tiny_model_dir, tmp_path, monkeypatch):  # noqa: F811
    import safetensors.torch

    def full_disk(tensors, path, metadata=None):
        Path(path).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(OSError):
        make_trainer(tiny_model_dir).export_weights(tmp_path / "v000001" / "model.safetensors")
    assert list((tmp_path / "v000001").iterdir()) == []


def fake_writer(payload: bytes = b"w"):
    return lambda tmp: (tmp / "model.safetensors").write_bytes(payload)


def test_checkpoints_are_atomic_and_the_two_newest_are_kept(tmp_path):
    for step in (1, 2, 3):
        write_checkpoint(tmp_path / "checkpoints" / f"step_{step:06d}", fake_writer(), {"step": step})
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000002", "step_000003"]
    (tmp_path / "checkpoints" / "step_000009.tmp").mkdir()
    (tmp_path / "checkpoints" / "step_000009.tmp" / STATE_FILE).write_text("{}")  # crashed before the rename
    assert find_checkpoint(tmp_path).name == "step_000003"


def test_a_full_disk_leaves_the_previous_checkpoint_intact(tmp_path):
    write_checkpoint(tmp_path / "checkpoints" / "step_000001", fake_writer(b"good"), {"step": 1})

    def full(tmp):
        (tmp / "model.safetensors").write_bytes(b"part")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskFullError, match="previous checkpoint is intact"):
        write_checkpoint(tmp_path / "checkpoints" / "step_000002", full, {"step": 2})
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000001"]
    assert (find_checkpoint(tmp_path) / "model.safetensors").read_bytes() == b"good"


def test_resume_refuses_changes_that_change_what_the_state_means(tmp_path):
    saved = {
        "model": "default",
        "task": "arithmetic",
        "seed": 0,
        "group_size": 8,
        "prompts_per_step": 8,
        "max_new_tokens": 16,
    }
    cfg = SimpleNamespace(**{**saved, "steps": 20, "token": "s", "insecure_no_token": False})
    resume_check(saved, 10, cfg)
    with pytest.raises(ConfigError, match="cannot change group_size"):
        resume_check(saved, 10, SimpleNamespace(**{**vars(cfg), "group_size": 4}))
    pinned = {**saved, "model": "Qwen/Qwen3-4B", "revision": "abc123"}
    with pytest.raises(ConfigError, match="cannot change revision"):  # another commit is another model
        resume_check(pinned, 10, SimpleNamespace(**{**vars(cfg), **pinned, "revision": "main"}))
    with pytest.raises(ConfigError, match="--steps"):
        resume_check(saved, 20, cfg)
    with pytest.raises(ConfigError, match="no checkpoint"):
        find_checkpoint(tmp_path)


@contextlib.contextmanager
def small_disk(where: Path, size: str):
    """A tmpfs of `size` mounted at `where` (skips the test where mounting needs root we lack)."""
    where.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True)


def test_a_really_full_disk_is_a_one_line_error_and_spoils_nothing(tiny_model_dir, tmp_path):  # noqa: F811
    with small_disk(tmp_path / "small", "96k") as mount:
        trainer = make_trainer(tiny_model_dir)
        write_checkpoint(mount / "checkpoints" / "step_000001", fake_writer(b"good"), {"step": 1})
        with pytest.raises(DiskFullError, match="disk full writing checkpoint"):
            write_checkpoint(mount / "checkpoints" / "step_000002", trainer.save_checkpoint, {"step": 2})
        assert [p.name for p in (mount / "checkpoints").iterdir()] == ["step_000001"]
        assert (find_checkpoint(mount) / "model.safetensors").read_bytes() == b"good"


def test_a_full_disk_while_publishing_a_version_is_a_disk_full_error(tiny_model_dir, tmp_path):  # noqa: F811
    from echo2cli.learner.publisher import Publisher

    with small_disk(tmp_path / "small", "16k") as mount:
        publisher = Publisher(make_trainer(tiny_model_dir), None, None, mount / "versions", "http://t", keep=2)
        publisher.publish(0)  # the copy of the weights; the file is written in the background
        with pytest.raises(DiskFullError, match="disk full writing version 0"):
            publisher.wait()
        with pytest.raises(DiskFullError):  # a failure is raised once, then the next version is tried
            publisher.publish(1)
            publisher.wait()
        publisher.close()


def test_a_full_disk_while_encoding_a_delta_is_a_disk_full_error(tiny_model_dir, tmp_path, monkeypatch):  # noqa: F811
    from echo2cli.learner import publisher as pub_module
    from echo2cli.learner.publisher import Publisher

    seeded = []
    node = SimpleNamespace(seed=lambda key, data, root: seeded.append(key), remove=lambda *a, **k: None)
    coord = SimpleNamespace(publish=lambda info: None, versions_in_download=set)
    publisher = Publisher(make_trainer(tiny_model_dir), node, coord, tmp_path / "versions", "http://t/announce", keep=2)
    publisher.publish(0)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pub_module, "encode_delta", full)
    publisher.publish(1)  # waits for version 0, which was fine
    with pytest.raises(DiskFullError, match="disk full writing the delta of version 1"):
        publisher.publish(2)  # the next version raises what went wrong with the one in flight
    publisher.close()


def test_versions_are_announced_in_order_one_in_flight_and_the_copy_is_taken_at_publish(tiny_model_dir, tmp_path):  # noqa: F811
    from safetensors.torch import load_file

    from echo2cli.learner.publisher import Publisher

    announced = []
    node = SimpleNamespace(seed=lambda key, data, root: None, remove=lambda *a, **k: None)
    coord = SimpleNamespace(publish=lambda info: announced.append(info.version), versions_in_download=set)
    trainer = make_trainer(tiny_model_dir)
    publisher = Publisher(trainer, node, coord, tmp_path / "versions", "http://t/announce", keep=5)
    publisher.publish(0)
    before = {k: v.clone() for k, v in trainer.published_weights().items()}
    with torch.no_grad():  # training goes on while version 0 is written: the file must not see it
        for p in trainer.model.parameters():
            p.add_(1.0)
    publisher.publish(1)
    publisher.wait()
    assert announced == [0, 1]
    written = load_file(str(publisher.weights_path(0)))
    assert all(torch.equal(written[k], v) for k, v in before.items())
    assert publisher.announce_s is not None and 1 in publisher.delta_stats
    publisher.close()


def test_a_sharded_checkpoint_given_to_a_one_process_learner_says_to_use_ranks(tiny_model_dir, tmp_path):  # noqa: F811
    trainer = make_trainer(tiny_model_dir)
    trainer.save_checkpoint(tmp_path)
    (tmp_path / "optimizer.pt").unlink()  # what a sharded learner writes instead: dcp/
    (tmp_path / "dcp").mkdir()
    with pytest.raises(ValueError, match="written by a sharded learner: resume it with --nproc-per-node"):
        make_trainer(tiny_model_dir).load_checkpoint(tmp_path)


def test_publish_returns_the_time_it_waited_for_the_version_still_in_flight(tiny_model_dir, tmp_path, monkeypatch):  # noqa: F811
    """`learner/t_publish_wait_s`: the training path's time lost to a publisher slower than a step. The publisher's
    clock is the test's: version 0's seed returns only once publish(1) waits for it, and moves the clock 5 s on
    first, so the wait is 5 s however busy the machine is."""
    import threading
    import time

    from echo2cli.learner import publisher as publishing

    clock = [0.0]
    monkeypatch.setattr(publishing, "time", SimpleNamespace(perf_counter=lambda: clock[0], time=time.time))
    released = threading.Event()
    node = SimpleNamespace(seed=lambda key, data, root: released.wait(), remove=lambda *a, **k: None)
    announced: list[int] = []
    coord = SimpleNamespace(publish=lambda info: announced.append(info.version), versions_in_download=set)
    trainer = make_trainer(tiny_model_dir)
    publisher = publishing.Publisher(trainer, node, coord, tmp_path / "versions", "http://t/announce", keep=5)
    first = publisher.publish(0)  # nothing in flight: no wait
    wait = publisher.wait

    def release_then_wait() -> None:  # publish(1) has read its start time: 5 s pass, then version 0 is seeded
        clock[0] += 5.0
        released.set()
        wait()

    publisher.wait = release_then_wait
    second = publisher.publish(1)
    assert (first, second) == (0.0, 5.0)
    assert announced[:1] == [0]  # publish(1) returned only once version 0 was announced
    publisher.close()
