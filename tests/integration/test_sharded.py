"""The sharded learner (FSDP2 under torchrun, gloo on CPU) against the one-process trainer, on a tiny Llama.

Run in fp32 so the only difference is the order of floating-point sums: on two ranks each rank sums its own
micro-batches and the reduce-scatter adds the two sums, where one process adds every micro-batch in turn. At
fp32 (24-bit mantissa) that moves losses, norms and weights by a few 1e-7 relative per step (measured: at most
7.7e-7 in a weight after two lr 1e-2 steps); the tolerances below are ten times that.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_trainer import tiny_model_dir  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parent.parent / "dist" / "sharded_step.py"
RTOL = ATOL = 1e-5
RUNS: dict[tuple[str, tuple[str, ...], int], Path] = {}  # (model, arguments, ranks) -> the run's directory
STORE: list[Path] = []


def run(model: Path, out: Path, *args: str, ranks: int = 0) -> list[dict]:
    """`ranks` = 0: the one-process trainer; else torchrun with that many ranks. `out` links to the run's directory,
    which lives as long as the module: a run with the same arguments as one made already is not made again."""
    key = (str(model), args, ranks)
    if key not in RUNS:
        made = STORE[0] / f"run{len(RUNS)}"
        made.mkdir()
        if ranks:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        else:
            cmd = [sys.executable]
        cmd += [str(SCRIPT), str(model), str(made), "--fp32", *args] + ([] if ranks else ["--plain"])
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, timeout=300, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-4000:]
        RUNS[key] = made
    out.parent.mkdir(parents=True, exist_ok=True)
    out.symlink_to(RUNS[key], target_is_directory=True)
    return json.loads((out / "metrics.json").read_text())


@pytest.fixture(scope="module", autouse=True)
def store(tmp_path_factory):
    """Where this module's runs live (removed with the module's directories when it ends)."""
    STORE[:] = [tmp_path_factory.mktemp("sharded-runs")]
    yield
    RUNS.clear()


def assert_close(a: list[dict], b: list[dict], tol: float = RTOL) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k] == pytest.approx(y[k], rel=tol, abs=tol), k


def assert_same_weights(a: Path, b: Path, tol: float = RTOL) -> None:
    x, y = load_file(str(a)), load_file(str(b))
    assert x.keys() == y.keys()
    for k in x:
        torch.testing.assert_close(x[k], y[k], rtol=tol, atol=tol, msg=k)


# The one-process run most tests compare with: three steps, its weights after two (what two steps give) kept too
PLAIN = ("--steps=3", "--snapshot-after=2")


def test_two_ranks_step_like_one_process_and_resume_on_two_and_on_one(tiny_model_dir, tmp_path):  # noqa: F811
    plain = run(tiny_model_dir, tmp_path / "plain", *PLAIN)
    two = run(tiny_model_dir, tmp_path / "two", ranks=2)
    one = run(tiny_model_dir, tmp_path / "one", ranks=1)
    assert 0 < plain[1]["train/trained_frac"] < 1 and plain[2]["train/trained_frac"] == 0  # flat groups (batch())
    assert plain[2]["train/loss"] == 0 and "train/clipfrac" not in plain[2]
    assert_close(two, plain[:2])
    assert_close(one, plain[:2])
    resume = ["--steps=1", "--first=2", f"--resume={tmp_path / 'two' / 'checkpoint'}"]
    assert_close(run(tiny_model_dir, tmp_path / "r2", *resume, ranks=2), plain[2:])
    assert_close(run(tiny_model_dir, tmp_path / "r1", *resume, ranks=1), plain[2:])  # DCP reshards 2 ranks onto 1
    weights = "checkpoint/model.safetensors"
    for after_two, after_three in (("two", "r2"), ("one", "r1")):
        assert_same_weights(tmp_path / "plain" / "after-2" / weights, tmp_path / after_two / weights)
        assert_same_weights(tmp_path / "plain" / weights, tmp_path / after_three / weights)


def test_three_ranks_with_uneven_shards_and_a_kl_reference_step_like_one_process(tiny_model_dir, tmp_path):  # noqa: F811
    """Each rank loads only its rows of each tensor (`shard_load.py`); 3 ranks split the 64-row embedding 22/22/20
    and the 16-row k_proj 6/6/4. The KL reference is loaded the same way; its term moves the second step."""
    plain = run(tiny_model_dir, tmp_path / "plain", "--kl-coef=0.5")
    three = run(tiny_model_dir, tmp_path / "three", "--kl-coef=0.5", ranks=3)
    assert plain[1]["train/kl_ref"] > 0
    assert_close(three, plain)
    assert_same_weights(
        tmp_path / "plain" / "checkpoint/model.safetensors", tmp_path / "three" / "checkpoint/model.safetensors"
    )


def test_two_ranks_step_like_one_process_in_mini_batches_against_the_batchs_start(tiny_model_dir, tmp_path):  # noqa: F811
    """Two optimizer steps a batch, decoupled's ratio against the policy before the first: every rank scores
    pi_prox for its rows of the second mini-batch before that step, and the clip acts in it (lr 1e-2). Four
    optimizer steps in all: fp32 weights 1e-7 apart that round to neighbouring bf16 values for the passes
    (`rounding.py`) put the last step's metrics up to 2e-5 apart (measured), hence 1e-4; a wrong proximal
    policy or mini-batch split moves them by ~1e-2 (lr)."""
    args = ["--minibatches=2", "--off-policy=decoupled"]
    plain = run(tiny_model_dir, tmp_path / "plain", *args)
    two = run(tiny_model_dir, tmp_path / "two", *args, ranks=2)
    assert all(m["train/clipfrac"] > 0 for m in plain)
    assert_close(two, plain, tol=1e-4)
    weights = "checkpoint/model.safetensors"
    assert_same_weights(tmp_path / "plain" / weights, tmp_path / "two" / weights, tol=1e-4)


def test_two_ranks_gather_the_same_version_file_byte_for_byte(tiny_model_dir, tmp_path):  # noqa: F811
    """Version 0: the weights each run exported before its first step."""
    run(tiny_model_dir, tmp_path / "plain", *PLAIN)
    run(tiny_model_dir, tmp_path / "two", ranks=2)
    assert (tmp_path / "plain" / "start.safetensors").read_bytes() == (
        tmp_path / "two" / "start.safetensors"
    ).read_bytes()


def test_after_a_step_the_bf16_version_of_two_ranks_is_within_one_bf16_step_of_one_process(tiny_model_dir, tmp_path):  # noqa: F811
    """After two steps: the one-process run's snapshot, the two ranks' run's end."""
    run(tiny_model_dir, tmp_path / "plain", *PLAIN)
    run(tiny_model_dir, tmp_path / "two", ranks=2)
    x = load_file(str(tmp_path / "plain" / "after-2" / "model.safetensors"))
    y = load_file(str(tmp_path / "two" / "model.safetensors"))
    assert x.keys() == y.keys() and "lm_head.weight" not in x
    off = total = 0
    for k in x:
        assert x[k].dtype == y[k].dtype == torch.bfloat16
        # fp32 weights 1e-7 apart can round to neighbouring bf16 values: one bf16 step (2^-8 relative). Where a
        # weight rounded apart before the second step, whose passes run on the rounded weights (`rounding.py`),
        # that step's gradients differ a little everywhere, and a weight near 0 can end a few bf16 steps apart
        # (measured: 1 of the 2048 of one tensor, 7.6e-6 apart). Diverged training would be ~lr = 1e-2 apart.
        a, b = x[k].float(), y[k].float()
        off += int(((a - b).abs() > b.abs() * 2**-7 + 1e-6).sum())
        total += a.numel()
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-4, msg=k)
    assert off <= total * 1e-3


def test_the_scale_benchmark_runs_a_tiny_shape_on_one_and_two_ranks():
    script = Path(__file__).parent.parent.parent / "scripts" / "bench_learner_scale.py"
    args = ["--hidden", "64", "--layers", "2", "--intermediate", "128", "--heads", "4", "--kv-heads", "2",
            "--vocab", "256", "--steps", "1", "--kl-coef", "0.05", "--prompt-tokens", "8",
            "--completion-tokens", "8"]  # fmt: skip
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1] in ("1", "2")]
    assert [row[0] for row in table] == ["1", "2"] and "start-up/rank" in proc.stdout
