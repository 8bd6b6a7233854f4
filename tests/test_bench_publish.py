"""The publish benchmark runs end to end at a tiny shape (its real shapes take GBs): every stage timed, the
delta rebuilt and verified, its files removed."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "scripts" / "bench_publish.py"


def test_the_publish_benchmark_times_every_stage_at_a_tiny_shape(tmp_path):
    out = tmp_path / "publish.json"
    cmd = [sys.executable, str(SCRIPT), "--shape", "tiny", "--cores", "1", "--repeats", "2", "--json", str(out)]
    cmd += ["--dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())["cores"]["1"]
    stages = ["first snapshot", "snapshot", "write (beside them)", "piece hashes", "digest", "delta encode"]
    stages += ["torrents + seed", "publish"]
    stages += ["rebuild", "verify", "bound: read + write", "bound: ... to the disk"]
    assert all(figures[s] > 0 for s in stages) and "x the bound's speed" in proc.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["publish.json"]  # the versions are gone
