"""`--report-to`: the same per-step record in TensorBoard (read back here), W&B and trackio; bad names and
missing packages are one-line errors, and a logger that fails mid-run never stops training."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from echo2cli.config import LearnerConfig
from echo2cli.errors import ConfigError
from echo2cli.loggers import Reporters, parse_report_to, scalars


def read_tensorboard(log_dir):
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_tensorboard_file_reads_back_the_step_records(tmp_path):
    reporters = Reporters(["jsonl", "tensorboard"], tmp_path, {"lr": 5e-5})
    for step in range(3):
        record = {"step": step, "rollout/reward_mean": 0.1 * step, "train/loss": 1.0 - step, "rollout/versions": [0]}
        reporters.log(record, {"rollout/rewards": [0.0, 1.0, 1.0], "rollout/staleness": [0.0, float(step)]})
    reporters.close()
    acc = read_tensorboard(tmp_path / "tensorboard")
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("rollout/reward_mean")] == [(0, 0.0), (1, 0.1), (2, 0.2)]
    assert [e.value for e in acc.Scalars("train/loss")] == [1.0, 0.0, -1.0]
    assert "rollout/versions" not in acc.Tags()["scalars"]  # lists are not scalars
    hist = acc.Histograms("rollout/staleness")
    assert [h.step for h in hist] == [0, 1, 2] and hist[2].histogram_value.max == 2.0
    assert acc.Histograms("rollout/rewards")[0].histogram_value.num == 3


def test_scalars_keep_finite_numbers_only():
    record = {"step": 4, "a": 1, "b": 2.5, "c": float("nan"), "d": True, "e": None, "f": [1], "g": {"0": 2}}
    assert scalars(record) == {"a": 1.0, "b": 2.5}


@pytest.mark.parametrize("text, message", [("jsonl,tensorbord", "unknown logger"), ("mlflow", "choose from")])
def test_unknown_logger_is_a_config_error(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_report_to(text)
    with pytest.raises(ValueError, match=message):
        LearnerConfig(report_to=text)


def test_jsonl_is_always_on_and_order_is_canonical():
    assert parse_report_to("trackio, tensorboard") == ["jsonl", "tensorboard", "trackio"]
    assert parse_report_to("") == ["jsonl"]


def test_a_logger_that_fails_mid_run_is_dropped_with_a_warning(tmp_path, capsys):
    reporters = Reporters(["tensorboard"], tmp_path, {})

    class Broken:
        def log(self, *args):
            raise OSError("disk full")

        def close(self):
            pass

    reporters.backends["broken"] = Broken()
    reporters.log({"step": 0, "x": 1.0}, {})
    reporters.log({"step": 1, "x": 2.0}, {})
    reporters.close()
    err = capsys.readouterr().err
    assert err.count("broken logging failed") == 1 and "disk full" in err
    assert [e.value for e in read_tensorboard(tmp_path / "tensorboard").Scalars("x")] == [1.0, 2.0]
