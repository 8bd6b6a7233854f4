"""`echo2 status`: the live view of one /v1/status answer, and a run directory's summary and plot."""

from __future__ import annotations

import io
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


HOSTILE_NAMES = ["x[/]", "[bold]loud", "\x1b[31mred\x1b[0m", "\x1b]0;title\x07", "two\nlines", "\u202eevil", "n" * 128]


def hostile_status(**metrics: object) -> Status:
    """A learner's answer in which workers named themselves (and the learner named its reasons) to break the view."""
    worker = dict(downloading_version=None, download_progress=0.0, tokens_per_s=1.0, rollouts=1, active=True)
    return Status(
        run_id="r",
        step=1,
        target_steps=2,
        version=1,
        finished=False,
        workers=[
            WorkerView(worker_id=str(i), name=name, version_loaded=1, **worker) for i, name in enumerate(HOSTILE_NAMES)
        ],
        last_metrics={"rollout/reward_mean": 0.5, **metrics},
        rejected={"[/]\x1b[2J": 1},
    )


def printed(status: Status) -> str:
    out = io.StringIO()
    Console(file=out, width=200).print(render(status, "live"))
    return out.getvalue()


def test_hostile_worker_names_and_reasons_render_as_literal_text_in_the_view():
    text = printed(hostile_status())
    for seen in ("x[/]", "[bold]loud", "\\x1b[31mred\\x1b[0m", "\\x1b]0;title\\x07", "two\\nlines", "\\u202eevil"):
        assert seen in text
    assert "n" * 128 in text  # the longest name a worker may give shows whole
    assert "rejected samples: [/]\\x1b[2J 1" in text
    assert "\x1b" not in text and "\u202e" not in text and max(map(len, text.splitlines())) <= 200


def test_a_metric_of_another_type_than_the_view_expects_is_shown_as_text():
    text = printed(hostile_status(**{"rollout/reward_mean": "[/]", "rollout/staleness_max": 2.0}))
    assert "reward [/]" in text and "max staleness 2.0" in text


def test_echo2_status_of_a_learner_with_hostile_worker_names_prints_them_not_a_traceback(monkeypatch):
    class Learner:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def status(self) -> Status:
            return hostile_status()

    monkeypatch.setattr("echo2cli.worker.client.LearnerClient", Learner)
    result = runner.invoke(app, ["status", "http://127.0.0.1:9"])
    assert result.exit_code == 0, result.output
    assert "x[/]" in result.output and "\\x1b[31mred" in result.output and "\x1b" not in result.output
