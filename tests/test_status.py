"""`echo2 status`: the live view of one /v1/status answer, and a run directory's summary and plot."""

from __future__ import annotations

import json
import subprocess
import sys

from rich.console import Console
from typer.testing import CliRunner

from echo2cli.cli import app
from echo2cli.protocol import Status, WorkerView
from echo2cli.status import render, sparkline

runner = CliRunner()


def test_sparkline_scales_to_its_own_range_and_marks_gaps():
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert sparkline([2.0, None, 2.0]) == "▁·▁"
    assert sparkline([None]) == "" and len(sparkline([float(i) for i in range(100)], width=40)) == 40


def test_the_view_shows_progress_trend_timings_rejections_and_each_worker():
    worker = dict(downloading_version=None, download_progress=0.0, tokens_per_s=310.0, rollouts=24, active=True)
    status = Status(
        run_id="r",
        step=2,
        target_steps=5,
        version=2,
        finished=False,
        workers=[
            WorkerView(worker_id="a", name="gpu-a", version_loaded=2, **worker),
            WorkerView(worker_id="b", name="gpu-b", version_loaded=1, standby=True, **worker),
        ],
        last_metrics={
            "rollout/reward_mean": 0.5,
            "learner/t_train_s": 3.2,
            "bcast/t_s": 1.5,
            "cost/usd_per_step": 0.01,
        },
        history=[{"step": 0, "rollout/reward_mean": 0.1}, {"step": 1, "rollout/reward_mean": 0.5}],
        rejected={"stale": 3, "bad_logprobs": 1},
    )
    console = Console(record=True, width=160)
    console.print(render(status, "live"))
    text = console.export_text()
    assert "step 2/5" in text and "reward 0.500 ▁█" in text and "T_train 3.2 s" in text and "T_bcast 1.5 s" in text
    assert "rejected samples: bad_logprobs 1, stale 3" in text and "$/step 0.0100" in text
    assert "gpu-a" in text and "standby" in text and "310" in text


def write_run(run_dir, steps=6):
    with open(run_dir / "metrics.jsonl", "w") as f:
        for t in range(steps):
            row = {
                "step": t,
                "version": t + 1,
                "time_s": 10.0 * (t + 1),
                "rollout/reward_mean": t / steps,
                "learner/t_train_s": 2.0,
                "bcast/t_s": 1.0 if t else None,
                "learner/bubble_ratio": 0.1,
                "learner/bubble_ratio_step": 0.1,
                "cost/usd_per_step": 0.5,
                "rollout/staleness_max": 1,
                "rollout/stale_dropped_total": 4,
            }
            f.write(json.dumps(row) + "\n")


def test_a_run_directory_gives_a_summary_table_json_and_a_plot(tmp_path):
    write_run(tmp_path)
    result = runner.invoke(app, ["status", str(tmp_path), "--json", "--plot", str(tmp_path / "run.png")])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["steps"] == 6 and summary["version"] == 6 and summary["usd_total"] == 3.0
    assert summary["t_bcast_s_median"] == 1.0 and summary["rejected"] == {"stale_dropped": 4}
    assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"
    table = runner.invoke(app, ["status", str(tmp_path)])
    assert table.exit_code == 0 and "stale_dropped 4" in table.output and "$ 3.0000" in table.output


def test_no_run_and_no_learner_are_one_line_errors(tmp_path):
    for target in (str(tmp_path), "http://127.0.0.1:9"):
        proc = subprocess.run(
            [sys.executable, "-m", "echo2cli", "status", target], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "Traceback" not in proc.stderr
