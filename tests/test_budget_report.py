"""The per-module time report of the test command (`budget_report.py`) and its budgets (`budgets.toml`)."""

import ast
from pathlib import Path

from budget_report import BUDGETS, budget_of, load_budgets, rows

TESTS = Path(__file__).parent


def test_every_budgeted_module_exists_and_every_budget_is_positive():
    budgets, unit_s, integration_s = load_budgets()
    assert unit_s > 0 and integration_s > 0
    for module, seconds in budgets.items():
        assert (TESTS.parent / module).is_file(), f"{BUDGETS.name} names {module}, which does not exist"
        assert seconds > 0


def test_a_module_without_a_budget_of_its_own_gets_its_kinds_default():
    budgets = {"tests/test_a.py": 3.0}
    assert budget_of("tests/test_a.py", budgets, 10, 60) == 3.0
    assert budget_of("tests/test_b.py", budgets, 10, 60) == 10
    assert budget_of("tests/integration/test_c.py", budgets, 10, 60) == 60


def test_rows_are_slowest_first_and_name_the_modules_over_budget():
    seconds = {"tests/test_a.py": 4.0, "tests/test_b.py": 12.0, "tests/integration/test_c.py": 50.0}
    tests = {"tests/test_a.py": 2, "tests/test_b.py": 1, "tests/integration/test_c.py": 3}
    table = rows(seconds, tests, {"tests/test_a.py": 3.0}, 10, 60)
    assert [r["module"] for r in table] == ["tests/integration/test_c.py", "tests/test_b.py", "tests/test_a.py"]
    assert [r["over"] for r in table] == [False, True, True]
    assert table[0]["tests"] == 3 and table[0]["budget_s"] == 60


def test_the_integration_tests_share_one_process_but_those_run_beside_the_rest():
    from conftest import BESIDE, xdist_scope

    assert xdist_scope("tests/test_grpo.py::test_x") == "tests/test_grpo.py"
    assert xdist_scope("tests/integration/test_e2e.py::test_x[a]") == "integration"
    assert xdist_scope("tests/integration/test_faults.py::test_y") == "integration"
    for name in BESIDE:
        module = TESTS / "integration" / name
        assert xdist_scope(f"tests/integration/{name}::test_x") == f"tests/integration/{name}"
        # the session's shared engine and models (integration_fixtures.py) would be made again in the other process
        functions = [n for n in ast.walk(ast.parse(module.read_text())) if isinstance(n, ast.FunctionDef)]
        asked = {a.arg for f in functions for a in f.args.args}
        assert not asked & {"engine", "plumbing_model", "hf_home"}, name
