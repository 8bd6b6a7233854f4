"""Expected failures print one line and exit 2; --help explains."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
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
        capture_output=True,
        text=True,
        timeout=180,
        env={**env_free, "ECHO2_UNREACHABLE_S": "1"},
    )
    assert proc.returncode == 2
    assert "unreachable" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_bad_config_value_is_one_line_naming_the_field():
    proc = run_cli("learner", "--staleness", "2", "--kappa", "5")
    assert proc.returncode == 2 and "kappa=5" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_model_directory_is_one_line(tmp_path):
    proc = run_cli("learner", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "out"))
    assert "no such directory, and not a Hugging Face Hub id" in one_line_error(proc)
    (tmp_path / "empty").mkdir()
    proc = run_cli("learner", "--model", str(tmp_path / "empty"), "--out", str(tmp_path / "out"))
    assert "no config.json" in one_line_error(proc)


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("echo2: error:")]
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


def test_a_model_whose_weights_do_not_load_is_one_line(tmp_path):
    from echo2cli.models import prepare_default_model

    bad = tmp_path / "bad-model"
    bad.mkdir()
    base = prepare_default_model()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (bad / name).write_bytes((base / name).read_bytes())
    (bad / "model.safetensors").write_bytes(b"\x00" * 64)  # truncated: not a safetensors file
    line = one_line_error(run_cli("learner", "--model", str(bad), "--out", str(tmp_path / "out"), "--port", "0"))
    assert "does not load" in line


def test_an_unwritable_run_directory_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    line = one_line_error(run_cli("learner", "--out", str(blocker / "run"), "--port", "0"))
    assert "cannot write to --out" in line


def test_resume_without_a_checkpoint_is_one_line(tmp_path):
    line = one_line_error(run_cli("learner", "--resume", str(tmp_path), "--port", "0"))
    assert "no checkpoint" in line


def test_tls_with_a_missing_key_file_is_one_line(tmp_path):
    (tmp_path / "cert.pem").write_text("x")
    line = one_line_error(
        run_cli("learner", "--tls-cert", str(tmp_path / "cert.pem"), "--out", str(tmp_path / "o"), "--port", "0")
    )
    assert "tls_cert and tls_key" in line


def test_eval_of_a_version_the_run_no_longer_keeps_is_one_line(tmp_path):
    import json

    from echo2cli.learner.checkpoint import STATE_FILE

    ckpt = tmp_path / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / STATE_FILE).write_text(json.dumps({"step": 2, "config": {"task": "arithmetic"}, "coordinator": {}}))
    (tmp_path / "versions" / "v000002").mkdir(parents=True)
    (tmp_path / "versions" / "v000002" / "model.safetensors").write_bytes(b"x")
    proc = run_cli("eval", "--run", str(tmp_path), "--version", "1")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        f"echo2: error: version 1 is not in {tmp_path / 'versions'} (kept: [2]; the learner keeps the newest S+1, "
        "and every N-th with --keep-versions-every N): evaluate a checkpoint with --run alone"
    ]
    assert "needs --run" in run_cli("eval", "--version", "1").stderr
    several = run_cli("eval", "--run", str(tmp_path), "--version", "2,1")  # each is checked before vLLM starts
    assert several.returncode != 0 and "version 1 is not in" in several.stderr
    bad = run_cli("eval", "--run", str(tmp_path), "--version", "2,x")
    assert bad.stderr.strip().splitlines() == [
        "echo2: error: --version takes comma-separated version numbers (>= 0), got '2,x'"
    ]


CONFIGS = [
    (["learner"], "LearnerConfig"),
    (["worker"], "WorkerConfig"),
    (["demo"], "DemoConfig"),
    (["eval"], "EvalConfig"),
    (["plan"], "PlanConfig"),
    (["bench", "broadcast"], "BenchBroadcastConfig"),
]


@pytest.mark.parametrize("command, config", CONFIGS)
def test_help_has_an_option_with_its_default_for_every_config_field(command, config):
    from echo2cli import config as configs

    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    help_text = " ".join(result.output.split())
    for name, field in getattr(configs, config).model_fields.items():
        if name == "task_options":
            continue  # a table: TOML only
        assert field.description and " ".join(field.description.split()) in help_text, name
        default = field.default
        if isinstance(default, int | float | str | Path) and not isinstance(default, bool):
            assert f"[default: {default}]" in help_text, name


def test_flags_win_over_the_config_file_which_wins_over_defaults(tmp_path):
    toml = tmp_path / "plan.toml"
    toml.write_text('[plan]\nbatch = 64\nt_train_s = 10\nt_bcast_s = 1\nstaleness = 2\nmu = "4,4,2"\n')
    result = runner.invoke(app, ["plan", "--config", str(toml), "--t-train", "20", "--json"])
    assert result.exit_code == 0, result.output
    inputs = json.loads(result.stdout)["inputs"]
    assert inputs["t_train_s"] == 20 and inputs["batch"] == 64 and inputs["kappa"] == 1


def test_the_demo_learner_gets_the_cores_left_after_one_per_worker():
    from echo2cli.demo import learner_threads

    assert learner_threads(2, 2) == 1  # the CI box: never more threads than free cores
    assert learner_threads(8, 2) == 6
    assert learner_threads(1, 4) == 1


def test_the_vllm_plugin_shortens_the_engine_busy_wait_only_when_echo2_asks(monkeypatch):
    from vllm.distributed.device_communicators import shm_broadcast

    from echo2cli.worker import vllm_plugin

    init = shm_broadcast.SpinCondition.__init__
    # vLLM's own default (an engine started earlier in this process may have run the plugin); restored after
    monkeypatch.setattr(init, "__defaults__", (1,))
    monkeypatch.delenv(vllm_plugin.BUSY_LOOP_ENV, raising=False)
    vllm_plugin.register()
    assert init.__defaults__ == (1,)  # untouched for anyone else
    monkeypatch.setenv(vllm_plugin.BUSY_LOOP_ENV, "0.05")
    vllm_plugin.register()
    assert init.__defaults__ == (0.05,)


def test_the_demo_seeds_its_learner_and_workers_and_says_so(tmp_path, monkeypatch):
    """`echo2 demo --seed N`: the learner gets N, worker i N + i, and the summary shows N."""
    from rich.console import Console

    from echo2cli import demo
    from echo2cli.config import DemoConfig, load_config

    spawned: list[list[str]] = []
    monkeypatch.setattr(demo, "spawn", lambda args, log, env=None: spawned.append(args))
    monkeypatch.setattr(demo, "wait_for_learner", lambda proc, out, log: {"url": "http://127.0.0.1:1"})
    cfg = load_config(DemoConfig, None, {"seed": 7, "workers": 2}, "demo")
    demo._start(cfg, tmp_path, [], Console(quiet=True), ())
    seeds = [args[args.index("--seed") + 1] for args in spawned]
    assert seeds == ["7", "7", "8"]  # learner, w0, w1
    metrics = tmp_path / "metrics.jsonl"
    row = {"rollout/reward_mean": 0.5, "learner/t_train_s": 1.0, "learner/bubble_ratio": 0.0}
    metrics.write_text(json.dumps({**row, "rollout/staleness_max": 0, "rollout/stale_dropped_total": 0}) + "\n")
    summary = demo.summarize(tmp_path, 10.0, cfg.seed)
    assert summary["seed"] == 7
    text = Console(record=True, width=200)
    text.print(demo.summary_table(summary))
    assert "seed" in text.export_text()


def test_eval_says_when_the_split_is_smaller_than_the_limit(monkeypatch):
    """A finite eval split evaluated whole is said so, not passed off as --limit problems."""
    import echo2cli.evaluate

    result = {"task": "arithmetic", "problems": 340, "model": "m", "greedy_accuracy": 0.5}
    monkeypatch.setattr(echo2cli.evaluate, "eval_command", lambda cfg: (result, None))
    out = runner.invoke(app, ["eval", "--limit", "500"])
    assert out.exit_code == 0
    assert "eval split has 340 distinct problems, fewer than --limit 500" in " ".join(out.output.split())
    out = runner.invoke(app, ["eval", "--limit", "300"])
    assert "distinct problems" not in out.output
