"""`echo2 plan`: pool files, finished runs, JSON and one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from echo2cli.cli import app
from echo2cli.errors import ConfigError
from echo2cli.plan.io import from_run, load_pool

runner = CliRunner()
EXAMPLE_POOL = Path(__file__).parent.parent / "examples" / "pool-8.toml"
FLAGS = ["--batch", "512", "--t-train", "20", "--t-bcast", "8", "--staleness", "2", "--lease-rollouts", "16"]


def plan_json(*args: str) -> dict:
    result = runner.invoke(app, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_json_carries_both_thresholds_and_the_activation():
    out = plan_json("--mu", "4,4,2", "--batch", "64", "--t-train", "10", "--t-bcast", "1", "-S", "2")
    assert out["mu_min"] == pytest.approx(64 / 9)  # paper: kappa*B/(kappa*T - T_b)
    assert out["mu_min_echo2"] >= out["mu_rate_bound"] == pytest.approx(6.4)
    assert set(out["recommended"]["active"]) | set(out["standby"]) == {"w0", "w1", "w2"}


def test_numbers_alone_give_the_thresholds_without_activation():
    # the paper's example run: B = 512, S = 4, kappa = 3 and no pool
    out = plan_json("--batch", "512", "--t-train", "1649", "--t-bcast", "300", "-S", "4", "--kappa", "3")
    assert out["mu_min"] == pytest.approx(3 * 512 / (3 * 1649 - 300))
    assert out["mu_rate_bound"] == pytest.approx(512 / 1649)
    assert out["mu_min_echo2"] == pytest.approx(max(512 / 1649, 512 / (2 * 1649 - 300)))
    assert out["paper_feasible"] and out["recommended"] is None and out["meets_target"] is None
    table = runner.invoke(app, ["plan", "--batch", "64", "--t-train", "10", "--t-bcast", "10", "-S", "2"])
    assert table.exit_code == 0 and "mu_min (paper's rule) infeasible" in table.output
    assert "mu_min_echo2 6.40" in table.output and "no pool given" in table.output


def test_group_size_decides_who_is_too_slow_to_lease_to():
    # 0.15 rollouts/s returns 8 rollouts in 53 s, past the 30 s (S+1 steps) a group stays admissible: no lease
    flags = ["--mu", "2,2,2,2,0.15", "--batch", "64", "--t-train", "10", "--t-bcast", "1", "-S", "2"]
    assert plan_json(*flags)["baselines"]["all_active"]["mu_pool"] == pytest.approx(8.0)
    assert plan_json(*flags, "--group-size", "1")["baselines"]["all_active"]["mu_pool"] == pytest.approx(8.15)


def test_example_pool_cost_aware_beats_random_activation_by_10_percent_at_equal_utilisation():
    out = plan_json("--workers", str(EXAMPLE_POOL), *FLAGS)
    assert len(load_pool(EXAMPLE_POOL)[0]) >= 8
    ours, rand = out["recommended"], out["baselines"]["random_activation"]
    assert ours["bubble_ratio"] == rand["bubble_ratio"] == 0.0  # both keep the learner busy
    assert ours["usd_per_step"] <= 0.9 * rand["usd_per_step"]
    assert ours["usd_per_step"] < out["baselines"]["all_active"]["usd_per_step"]
    assert "centralized" in out["baselines"]


def test_table_output_and_plot(tmp_path):
    png = tmp_path / "plan.png"
    result = runner.invoke(app, ["plan", "--workers", str(EXAMPLE_POOL), *FLAGS, "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert "mu_min_echo2" in result.output and "standby" in result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mu", "0,3", "--batch", "64", "--t-train", "10", "--t-bcast", "1", "-S", "2"], "throughput"),
        (["--mu", "3", "--batch", "64", "--t-train", "10", "--t-bcast", "30", "-S", "2"], "need S >= 4"),
        (
            ["--mu", "3", "--batch", "64", "--t-train", "10", "--t-bcast", "10", "-S", "2", "--rule", "paper"],
            "kappa*T_train",
        ),
        (["--mu", "3", "--batch", "64"], "missing --t-train"),
        (["--batch", "64", "--t-train", "10", "--t-bcast", "1", "-S", "2", "--plot", "p.png"], "--plot needs a pool"),
        (["--mu", "a,b", "--batch", "64", "--t-train", "10", "--t-bcast", "1", "-S", "2"], "comma-separated"),
    ],
)
def test_impossible_inputs_are_one_line_errors(args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "echo2cli", "plan", *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_pool_file_rejects_typos_and_negative_prices(tmp_path):
    bad = tmp_path / "pool.toml"
    bad.write_text('[[workers]]\nname = "a"\nusd_per_hour = 1.0\nrollouts_per_sec = 3.0\n')
    with pytest.raises(ConfigError, match="rollouts_per_sec"):
        load_pool(bad)
    bad.write_text('[[workers]]\nname = "a"\nusd_per_hour = -1.0\nrollouts_per_s = 3.0\n')
    result = runner.invoke(app, ["plan", "--workers", str(bad), *FLAGS])
    assert result.exit_code != 0 and "price" in str(result.exception)


def test_pool_file_count_expands_identical_workers(tmp_path):
    pool = tmp_path / "pool.toml"
    pool.write_text('[[workers]]\nname = "g"\nusd_per_hour = 0.5\nrollouts_per_s = 2.0\ncount = 3\n')
    workers, learner = load_pool(pool)
    assert [w.name for w in workers] == ["g-1", "g-2", "g-3"] and learner == {}


def fake_run(tmp_path: Path, announce_s: float = 2.0) -> Path:
    """A run directory as `echo2 learner` writes it: config.json, metrics.jsonl, summary.json."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(
        json.dumps({"prompts_per_step": 4, "group_size": 8, "staleness": 2, "kappa": 1, "gamma": 1.1})
    )
    rows = [
        {
            "step": t,
            "learner/t_busy_s": busy,
            "learner/t_train_s": busy - 1,
            "learner/bubble_ratio": 0.2,
            "bcast/t_s": 3.0 + t,
            "bcast/t_announce_s": announce_s,
            "bcast/version": t,
        }
        for t, busy in enumerate([30.0, 10.0, 12.0, 11.0])
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text(
        json.dumps(
            {
                "bcast_s": {"0": 40.0, "1": 4.0, "2": 5.0, "3": 6.0},
                "workers": [
                    {
                        "worker_id": "ab12",
                        "name": "w0",
                        "usd_per_hour": 0.5,
                        "rollouts_per_s": 2.0,
                        "lease_rollouts": 32.0,
                    },
                    {
                        "worker_id": "cd34",
                        "name": "w1",
                        "usd_per_hour": 0.0,
                        "rollouts_per_s": None,
                        "lease_rollouts": None,
                    },
                ],
            }
        )
    )
    return tmp_path


def test_from_run_reads_the_measured_inputs(tmp_path):
    got = from_run(fake_run(tmp_path))
    assert got["batch"] == 32 and got["staleness"] == 2
    assert got["t_train_s"] == 11.0  # median busy time without step 0 (engine start-up)
    assert got["t_bcast_s"] == 5.0  # median over v1..v3; v0 waited for the engines
    assert [w.name for w in got["pool"]] == ["w0"] and got["measured_bubble"] == 0.2


def test_plan_from_run_compares_measured_and_predicted_bubble(tmp_path):
    out = plan_json("--from-run", str(fake_run(tmp_path)))
    # one worker of 2 rollouts/s, B=32, T=11: rate bound says P >= 16 s -> predicted bubble 1 - 11/16
    assert out["run"]["predicted_bubble"] == pytest.approx(1 - 11 / 16)
    assert out["run"]["measured_bubble"] == 0.2
    flagged = plan_json("--from-run", str(tmp_path), "--t-train", "20")  # flags override the run's numbers
    assert flagged["inputs"]["t_train_s"] == 20


def test_plan_warns_when_publishing_a_version_takes_longer_than_a_step(tmp_path):
    quick = plan_json("--from-run", str(fake_run(tmp_path / "quick")))
    assert not [n for n in quick["notes"] if "publisher" in n]
    slow = plan_json("--from-run", str(fake_run(tmp_path / "slow", announce_s=25.0)))
    (note,) = [n for n in slow["notes"] if "publisher" in n]
    assert "takes 25.0 s, more than the 11.0 s between versions" in note


def test_from_run_on_a_directory_that_is_not_a_run_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="not a learner run directory"):
        from_run(tmp_path)
