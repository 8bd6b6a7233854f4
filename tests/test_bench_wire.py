"""`scripts/bench_wire.py`: fp16 against bf16 runs read back from their OUT and paired by seed."""

import importlib.util
import json
from pathlib import Path

import pytest

PATH = Path(__file__).parent.parent / "scripts" / "bench_wire.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_wire", PATH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def write_run(out: Path, wire: str, seed: int, split: float, deltas: list[float], wall: float) -> None:
    """A run as `echo2 bench staleness` leaves it: its row, its final evaluation and its metrics."""
    name = f"S0-token_tis-seed{seed}"
    run = out / wire / name
    (run / "eval").mkdir(parents=True)
    levels = {"one": {"problems": 29, "greedy_accuracy": split + 0.1}}
    (run / "eval" / "arithmetic-step_000020.json").write_text(json.dumps({"by_level": levels}))
    metrics = [{"bcast/version": 0, "bcast/delta_ratio": 1.0}]  # version 0 is whole: not a delta
    metrics += [{"bcast/version": v + 1, "bcast/delta_ratio": d} for v, d in enumerate(deltas)]
    metrics += [{"offpolicy/by_staleness": {"0": {"kl_behaviour": 0.001}}}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    row = {"seed": seed, "name": name, "eval_greedy_accuracy": split, "wall_s": wall}
    with open(out / wire / "rows.jsonl", "a") as f:
        f.write(json.dumps(row | {"eval_greedy_accuracy_train_mix": split + 0.05}) + "\n")


def test_fp16_runs_pair_with_bf16_runs_of_the_same_seed_only(tmp_path, capsys):
    bench = load_script()
    for seed, (bf16, fp16) in enumerate([(0.60, 0.70), (0.50, 0.55), (0.40, 0.45)]):
        write_run(tmp_path, "bf16", seed, bf16, [0.01, 0.02], 200.0)
        write_run(tmp_path, "fp16", seed, fp16, [0.04, 0.08], 220.0)
    write_run(tmp_path, "bf16", 7, 0.9, [0.01], 100.0)  # no fp16 run of seed 7: left out of every pair
    result = bench.report(bench.collect(tmp_path))
    split = result["fp16_minus_bf16"]["split"]
    assert split["seeds"] == [0, 1, 2] and split["mean"] == pytest.approx(0.0667, abs=1e-4)
    assert result["fp16_minus_bf16"]["level one"]["mean"] == pytest.approx(0.0667, abs=1e-4)
    assert result["fp16_over_bf16"]["delta_ratio"]["mean"] == pytest.approx(4.0)  # 0.06 / 0.015, version 0 aside
    assert result["fp16_over_bf16"]["wall_s"]["mean"] == pytest.approx(1.1)
    bench.print_report(result)
    out = capsys.readouterr().out
    assert "fp16 - bf16, held-out split: +0.067 [" in out and "(n=3)" in out
    assert "bf16 seed 7: split 0.900" in out


def test_seeds_read_as_a_range_or_a_list():
    bench = load_script()
    assert bench.parse_seeds("0-3") == [0, 1, 2, 3] and bench.parse_seeds("2,5") == [2, 5]
