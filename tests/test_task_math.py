import itertools
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from echo2cli.errors import ConfigError
from echo2cli.tasks import Problem, chat, load_task
from echo2cli.tasks.math import SAMPLE_PATH, SYSTEM_PROMPT, MathTask, last_boxed, tame


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def problem(answer: str) -> Problem:
    return Problem(id="t", messages=chat("q"), answer=answer)


def reward(answer: str, completion: str) -> float:
    return MathTask().score(problem(answer), completion).reward


def test_the_three_file_shapes_give_their_gold_answers(tmp_path):
    path = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {"question": "GSM8K?", "answer": "3 + 4 = 7 #### 1 #### 42", "split": "train"},
            {"problem": "MATH?", "solution": "So $\\boxed{1}$, no: $\\boxed{\\frac{1}{\\sqrt{2}}}$.", "split": "train"},
            {"problem": "AIME?", "answer": 7, "split": "train", "id": "aime-1"},
            {"question": "Plain?", "answer": "\\frac{3}{4}", "split": "eval"},
        ],
    )
    task = MathTask(str(path))
    got = {p.prompt: (p.answer, p.meta["shape"]) for p in task.train + task.eval}
    assert got == {
        "GSM8K?": ("42", "gsm8k"),
        "MATH?": ("\\frac{1}{\\sqrt{2}}", "math"),
        "AIME?": ("7", "plain"),
        "Plain?": ("\\frac{3}{4}", "plain"),
    }
    assert [p.id for p in task.train][2] == "aime-1"
    assert len(task.train[0].id) == 12 and task.train[0].id != task.train[1].id


def test_prompts_ask_for_a_boxed_answer_after_a_system_message():
    p = next(MathTask().prompts(0))
    assert p.messages[0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert "\\boxed{}" in SYSTEM_PROMPT and p.messages[1]["role"] == "user"


@pytest.mark.parametrize(
    ("gold", "answer"),
    [
        ("0.5", "\\frac{1}{2}"),
        ("\\frac{1}{2}", "1/2"),
        ("1/2", "0.5"),
        ("3", "3.0"),
        ("\\sqrt{8}", "2\\sqrt{2}"),
        ("-7", "\u22127"),  # unicode minus
        ("1,550", "1550"),
        ("x^2 - 9", "-9 + x^2"),
        ("7", "7."),
    ],
)
def test_equivalent_forms_score_correct(gold, answer):
    score = MathTask().score(problem(gold), f"Some work. The answer is $\\boxed{{{answer}}}$.")
    assert score.components == {"correct": 1.0, "format": 1.0}
    assert score.reward == 1.0


@pytest.mark.parametrize(("gold", "answer"), [("0.5", "0.51"), ("42", "43"), ("1/3", "0.33"), ("-7", "7"), ("2x", "2")])
def test_close_but_wrong_answers_score_only_format(gold, answer):
    score = MathTask().score(problem(gold), f"\\boxed{{{answer}}}")
    assert score.components == {"correct": 0.0, "format": 1.0}
    assert score.reward == pytest.approx(0.2)


def test_the_last_boxed_answer_counts_and_nested_braces_balance():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{\\sqrt{9}}{4}} and {") == "\\frac{\\sqrt{9}}{4}"
    assert last_boxed("\\boxed{2} and an unclosed \\boxed{\\frac{1}{2}") == "2"
    assert reward("\\frac{3}{4}", "first \\boxed{1}, on reflection \\boxed{\\frac{\\sqrt{9}}{4}}") == 1.0
    assert reward("1", "first \\boxed{1}, on reflection \\boxed{\\frac{\\sqrt{9}}{4}}") == pytest.approx(0.2)


def test_without_a_box_the_last_number_can_be_correct_but_format_is_zero():
    score = MathTask().score(problem("1200"), "We get 3 * 400 = 1,200")
    assert score.components == {"correct": 1.0, "format": 0.0}
    assert score.reward == pytest.approx(0.8)
    assert MathTask().score(problem("42"), "no idea").components == {"correct": 0.0, "format": 0.0}


@pytest.mark.parametrize(
    "completion",
    [
        "\\boxed{" + "9" * 100_000 + "}",
        "9" * 100_000,
        "\\boxed{" + "\\frac{1}{" * 500 + "2" + "}" * 500 + "}",
        "\\boxed{" + "\\frac{1}{" * 16 + "2" + "}" * 16 + "}",
        "\\boxed{9^{9^{9^{9}}}}",
        "\\boxed{9^(9^9)}",
        "\\boxed{(((9^{99})^{99})^{99})^{99}}",
        "\\boxed{(x+1)^{100000}}",
        "\\boxed{10^{400}!}",
        "\\boxed{\\Gamma(10^{9})}",
        "\\boxed{" + "".join(f"\\sin({i})" for i in range(1, 21)) + "}",
        "the answer " * 10_000 + "\\boxed{41",
        "\\boxed{" * 20_000,
        "{" * 50_000 + "}" * 50_000,
        "",
        "\x00\ud800 \\boxed{\\}",
    ],
)
def test_adversarial_completions_return_a_score_in_range(completion):
    score = MathTask().score(problem("42"), completion)
    assert 0.0 <= score.reward <= 1.0
    assert score.components["correct"] == 0.0


def test_answers_that_could_stall_sympy_are_refused_and_ordinary_ones_are_not():
    assert not tame("9^{9^{9}}")
    assert not tame("\\frac{1}{" * 8 + "2" + "}" * 8)
    assert not tame("1" * 51)
    assert not tame("(10)!")
    assert not tame("\\sum_{i=1}^{10} i")
    assert all(map(tame, ["2^{10}", "\\frac{\\sqrt{3}}{2}", "x^2 - 9", "\\left(\\frac{1}{2}, 3\\right)", "5\\%"]))


def test_splits_are_disjoint_and_cover_the_file():
    task = MathTask()
    lines = SAMPLE_PATH.read_text().splitlines()
    train = {p.id for p in itertools.islice(task.prompts(0, "train"), len(task.train))}
    held_out = [p.id for p in task.prompts(0, "eval")]
    assert len(held_out) == len(set(held_out)) >= 15
    assert not train & set(held_out)
    assert len(train) + len(held_out) == len(lines)


def test_each_training_epoch_is_a_shuffle_of_the_train_split():
    task = MathTask()
    n = len(task.train)
    stream = [p.id for p in itertools.islice(task.prompts(3), 2 * n)]
    assert set(stream[:n]) == set(stream[n:]) == {p.id for p in task.train}
    assert stream[:n] != stream[n:]


def test_order_is_reproducible_from_the_seed_and_differs_between_seeds():
    def order(seed):
        return [p.id for p in itertools.islice(MathTask().prompts(seed), 100)]

    assert order(1) == order(1)
    assert order(1) != order(2)
    assert [p.id for p in MathTask().prompts(1, "eval")] == [p.id for p in MathTask().prompts(2, "eval")]


def test_explicit_split_fields_override_the_hash(tmp_path):
    held_out = [{"question": f"q{i}", "answer": str(i), "split": "eval"} for i in range(3)]
    path = write_jsonl(tmp_path / "m.jsonl", [*held_out, {"question": "last", "answer": "1", "split": "train"}])
    task = MathTask(str(path))
    assert [p.answer for p in task.eval] == ["0", "1", "2"]
    assert [p.prompt for p in task.train] == ["last"]


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{not json", "line 2"),
        ('{"question": "q"}', "no 'answer' or 'solution'"),
        ('{"answer": "3"}', "no 'question' or 'problem'"),
        ('{"problem": "q", "solution": "no box"}', "boxed"),
        ('{"question": "q", "answer": "1", "split": "test"}', "split"),
        ('["q", "1"]', "not a JSON object"),
    ],
)
def test_a_bad_line_is_a_value_error_naming_file_and_line(tmp_path, line, reason):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "ok", "answer": "1", "split": "train"}\n' + line + "\n")
    with pytest.raises(ValueError, match=reason) as err:
        MathTask(str(path))
    assert f"{path} line 2" in str(err.value)


def test_a_repeated_problem_is_skipped_but_a_clashing_id_is_an_error(tmp_path):
    same = {"question": "q", "answer": "1", "split": "train"}
    assert len(MathTask(str(write_jsonl(tmp_path / "a.jsonl", [same, same]))).train) == 1
    clash = write_jsonl(tmp_path / "b.jsonl", [{**same, "id": "x"}, {**same, "question": "other", "id": "x"}])
    with pytest.raises(ValueError, match="line 2: id 'x' is already used on line 1"):
        MathTask(str(clash))


def test_load_task_builds_math_from_the_sample_or_a_file(tmp_path):
    assert load_task("math").name == "math"
    path = write_jsonl(tmp_path / "m.jsonl", [{"question": "q", "answer": "5", "split": "train"}])
    assert next(load_task("math", {"path": str(path)}).prompts(0)).answer == "5"


def test_load_task_turns_data_problems_into_one_line_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="no math data file"):
        load_task("math", {"path": str(tmp_path / "missing.jsonl")})
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    with pytest.raises(ConfigError, match="bad.jsonl line 1"):
        load_task("math", {"path": str(tmp_path / "bad.jsonl")})
    with pytest.raises(ConfigError, match="eval_every"):
        load_task("math", {"eval_every": 1})


def test_scoring_works_off_the_main_thread():
    """math-verify's default timeouts use SIGALRM, which raises outside the main thread."""
    with ThreadPoolExecutor(1) as pool:
        score = pool.submit(MathTask().score, problem("\\frac{1}{2}"), "\\boxed{0.5}").result()
    assert score.components["correct"] == 1.0
