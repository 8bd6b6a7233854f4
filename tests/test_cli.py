"""Expected failures print one line and exit 2; --help explains."""

import subprocess
import sys

from typer.testing import CliRunner

from echo2cli.cli import app

runner = CliRunner()


def test_help_lists_the_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("learner", "worker", "demo", "model"):
        assert command in result.output


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "echo2cli", *args], capture_output=True, text=True, timeout=120)


def test_unreachable_learner_is_one_line_not_a_traceback():
    # port 9 on loopback: nothing listens there, the connection is refused at once
    import os

    env_free = {k: v for k, v in os.environ.items() if not k.startswith("ECHO2_")}
    proc = subprocess.run(
        [sys.executable, "-m", "echo2cli", "worker", "--join", "http://127.0.0.1:9", "--quiet"],
        capture_output=True, text=True, timeout=180, env={**env_free, "ECHO2_UNREACHABLE_S": "1"},
    )
    assert proc.returncode == 2
    assert "unreachable" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_bad_config_value_is_one_line_naming_the_field():
    proc = run_cli("learner", "--staleness", "2", "--kappa", "5")
    assert proc.returncode == 2 and "kappa=5" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_model_directory_is_one_line(tmp_path):
    proc = run_cli("learner", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "config.json" in proc.stderr and "Traceback" not in proc.stderr
