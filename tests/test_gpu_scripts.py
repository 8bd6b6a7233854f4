"""The GPU check's trainer benchmark runs on CPU at a tiny shape: a lent GPU session gets one try at
scripts/gpu_check.sh, so an API drift must fail here first, not there."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "scripts" / "bench_learner_gpu.py"


def test_the_trainer_benchmark_runs_a_tiny_shape_and_reports_every_figure(tmp_path):
    out = tmp_path / "results.jsonl"
    args = ["--shape", "tiny", "--groups", "2", "--group-size", "4", "--prompt-tokens", "16",
            "--completion-tokens", "32", "--micro-batch-tokens", "128", "--steps", "2", "--variable",
            "--logp-error", "--export", "--checkpoint", str(tmp_path / "ck"), "--json", str(out)]  # fmt: skip
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["shape"] == "tiny" and result["tokens_per_s"] > 0 and result["step_s"] > 0
    assert result["attention"] == "sdpa, padded rows" and result["logp_err_max"] >= 0.0
    assert result["export_s"] >= 0 and result["checkpoint_gib"] > 0
    assert not (tmp_path / "ck" / "ckpt-tiny").exists()  # the timed checkpoint is removed
