"""How the ranks of a sharded learner end (FSDP2 under torchrun, gloo on CPU, tests/dist/sharded_fault.py on a tiny
Llama): when one fails inside a step, or dies of SIGABRT there (printing its Python stack first), all of them end
within a minute; an idle rank 0 keeps the others past the process-group timeout. Five torchrun jobs of 2 ranks:
about 3 minutes on 2 busy cores.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import procs
import pytest
from test_trainer import tiny_model_dir  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parent.parent / "dist" / "sharded_fault.py"
RANKS = 2
EXIT_DEADLINE_S = 60.0  # every rank gone this long after any rank failed (the requirement)
START_TIMEOUT_S = 300.0  # 2 ranks importing torch and transformers on 2 busy cores
# The process-group timeout for the idle runs: short, but longer than the ranks' start is skewed (both load the model
# before their first collective); the idle wait is 2.5 times it.
DIST_TIMEOUT_S = 10.0
IDLE_S = 2.5 * DIST_TIMEOUT_S


def start(model: Path, out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}"]
    cmd += [str(SCRIPT), str(model), str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with open(out / "log.txt", "w") as log:  # torchrun writes to its own copy
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def kill(proc: subprocess.Popen) -> None:
    """torchrun with SIGKILL, if it is still running; its ranks die with it (`die_with_parent`)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def finish(proc: subprocess.Popen, out: Path, timeout_s: float) -> int:
    """torchrun's exit status; killed if it has not exited in `timeout_s`."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill(proc)
        raise AssertionError(f"still running after {timeout_s:.0f} s:\n{log_tail(out)}") from None


def log_tail(out: Path) -> str:
    return procs.log_tail(out / "log.txt", 4000)


def running(pid: int) -> bool:
    """Not exited (a zombie waiting for torchrun to reap it has exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def exit_times(pids: dict[int, int], since: float, deadline_s: float) -> dict[int, float]:
    """Seconds after `since` (a time.time()) at which each rank's process had exited, polled every 0.1 s up to
    `deadline_s`; ranks still running then are missing."""
    exited: dict[int, float] = {}
    while len(exited) < len(pids) and time.time() < since + deadline_s:
        for rank, pid in pids.items():
            if rank not in exited and not running(pid):
                exited[rank] = time.time() - since
        time.sleep(0.1)
    return exited


@pytest.mark.parametrize(("rank", "where"), [(0, "forward"), (1, "clip"), (1, "abort")])
def test_when_a_rank_fails_inside_a_step_every_rank_exits_within_a_minute(tiny_model_dir, tmp_path, rank, where):  # noqa: F811
    out = tmp_path / "run"
    proc = start(tiny_model_dir, out, f"--fail-rank={rank}", f"--fail-in={where}")
    try:
        deadline = time.time() + START_TIMEOUT_S
        while not (out / "failed_at").exists():
            assert proc.poll() is None, f"ended before the injected failure:\n{log_tail(out)}"
            assert time.time() < deadline, f"no failure after {START_TIMEOUT_S:.0f} s:\n{log_tail(out)}"
            time.sleep(0.1)
        time.sleep(0.1)  # failed_at exists a moment before its text does
        pids = {r: int((out / f"rank{r}.pid").read_text()) for r in range(RANKS)}
        exited = exit_times(pids, float((out / "failed_at").read_text()), EXIT_DEADLINE_S)
        late = sorted(set(pids) - set(exited))
        assert not late, f"rank {rank} failed; {EXIT_DEADLINE_S:.0f} s later ranks {late} still ran:\n{log_tail(out)}"
    finally:
        kill(proc)
    assert proc.returncode != 0
    if where == "abort":  # no exception to write: the rank's stack is in the log (`init_process_group`)
        log = (out / "log.txt").read_text()
        assert "Fatal Python error: Aborted" in log and " in fail\n" in log, log_tail(out)
        assert procs.log_tail(out / "log.txt", 100).startswith(procs.FATAL)  # a short tail still shows the stacks
    else:
        assert "injected failure" in (out / f"rank{rank}.error").read_text()
    print(f"rank {rank} failed in the {where}: ranks exited after {exited} s")


def test_an_idle_rank_0_keeps_the_others_past_the_process_group_timeout_and_steps_again(tiny_model_dir, tmp_path):  # noqa: F811
    env = {"ECHO2_DIST_TIMEOUT_S": str(DIST_TIMEOUT_S)}
    idle = start(tiny_model_dir, tmp_path / "idle", f"--idle-s={IDLE_S}", env=env)
    assert finish(idle, tmp_path / "idle", START_TIMEOUT_S + IDLE_S) == 0, log_tail(tmp_path / "idle")
    losses = json.loads((tmp_path / "idle" / "metrics.json").read_text())
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)

    # the same wait without keepalive calls: rank 1's wait for the next call times out, so the knob is in force
    silent = start(tiny_model_dir, tmp_path / "silent", f"--idle-s={IDLE_S}", "--no-keepalive", env=env)
    assert finish(silent, tmp_path / "silent", START_TIMEOUT_S + IDLE_S) != 0
    assert "Timed out" in (tmp_path / "silent" / "rank1.error").read_text()
    assert not (tmp_path / "silent" / "metrics.json").exists()
