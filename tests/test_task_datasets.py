"""The math task reads any local dataset `datasets` reads: the shipped GSM8K-shaped parquet repository (train and
test splits), a single parquet file, CSV with AIME-style column names, an Arrow directory, MATH's `solution`."""

from __future__ import annotations

from pathlib import Path

import pytest

from echo2cli.errors import ConfigError
from echo2cli.tasks import load_task
from echo2cli.tasks.math import MathTask, gold_from_text

TINY = Path(__file__).parent / "data" / "gsm8k_tiny"


def test_a_parquet_repository_trains_on_train_and_holds_out_test():
    task = MathTask(path=str(TINY), eval_split="test")
    assert (len(task.train), len(task.eval)) == (12, 4)
    assert task.eval[0].prompt.startswith("A farmer has 7 cows") and task.eval[0].answer == "13"
    assert {p.meta["shape"] for p in task.train} == {"gsm8k"}
    assert task.score(task.eval[0], "7 + 6 = 13, so \\boxed{13}").reward == 1.0


def test_without_eval_split_the_train_split_is_held_out_by_hash_and_test_is_unused():
    task = MathTask(path=str(TINY), eval_every=3)
    assert len(task.train) + len(task.eval) == 12 and task.eval


def test_a_single_parquet_file():
    task = MathTask(path=str(TINY / "main" / "train-00000-of-00001.parquet"), eval_every=4)
    assert len(task.train) + len(task.eval) == 12


def test_csv_with_named_columns(tmp_path):
    csv = tmp_path / "aime.csv"
    csv.write_text('ID,Problem,Answer\n1,"Find x if 2x = 10.",5\n2,"What is 7 squared?",49\n3,"Half of 30?",15\n')
    task = MathTask(path=str(csv), question_column="Problem", answer_column="Answer", eval_every=2)
    problems = {p.prompt: p.answer for p in task.train + task.eval}
    assert problems == {"Find x if 2x = 10.": "5", "What is 7 squared?": "49", "Half of 30?": "15"}


def test_an_arrow_directory_with_math_solutions(tmp_path):
    import datasets

    rows = {
        "problem": ["Compute 1/2 + 1/2.", "Simplify 6/8.", "What is 3 + 4?"],
        "solution": ["It is $\\boxed{1}$.", "Divide by 2: $\\boxed{\\frac{3}{4}}$.", "$3+4=\\boxed{7}$"],
    }
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "arrow"))
    task = MathTask(path=str(tmp_path / "arrow"), answer_column="solution", eval_every=2)
    assert sorted(p.answer for p in task.train + task.eval) == ["1", "7", "\\frac{3}{4}"]


def test_answer_text_shapes():
    assert gold_from_text("work\n#### 1,200") == ("1,200", "gsm8k")
    assert gold_from_text("so $\\boxed{\\sqrt{2}}$") == ("\\sqrt{2}", "math")
    assert gold_from_text(42) == ("42", "plain")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"question_column": "prompt"}, "no column 'prompt'"),
        ({"eval_split": "validation"}, "no split 'validation'"),
        ({"split": "dev"}, "no split 'dev'"),
    ],
)
def test_dataset_problems_are_one_line_config_errors(options, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_task("math", {"path": str(TINY), **options})
    assert "\n" not in str(info.value)


def test_unknown_file_types_and_jsonl_splits_are_refused(tmp_path):
    odd = tmp_path / "data.xlsx"
    odd.write_bytes(b"x")
    with pytest.raises(ConfigError, match="unknown data file type '.xlsx'"):
        load_task("math", {"path": str(odd)})
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"question": "1+1?", "answer": "2"}\n')
    with pytest.raises(ConfigError, match="a JSONL file marks them per line"):
        load_task("math", {"path": str(jsonl), "eval_split": "test"})
