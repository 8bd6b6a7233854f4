"""Each test module's time against its budget, printed at the end of every run of the test command.

A module's time is the sum of its tests' setup, call and teardown phases, so a module-scoped fixture (a learner,
an engine) counts where it starts and where it stops. A session fixture counts in the first module that asks for it.
The budgets live in `tests/budgets.toml`; a module with none is held to its section's `default_s`. Nothing fails on
time (a shared 2-core box's speed varies 2-3x between days): the report names the modules over budget, so a CI log
shows where a slow run's time went, and the run also writes the table as JSON (`ECHO2_BUDGET_JSON`, if set).

    pytest tests -p no:echo2_budget      # without the report
"""

from __future__ import annotations

import json
import os
import time
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

BUDGETS = Path(__file__).parent / "budgets.toml"


def load_budgets(path: Path = BUDGETS) -> tuple[dict[str, float], float, float]:
    """(budget per module path, the unit default, the integration default), in seconds."""
    raw = tomllib.loads(path.read_text())
    modules = {
        name: float(s) for section in ("unit", "integration") for name, s in raw[section].get("modules", {}).items()
    }
    return modules, float(raw["unit"]["default_s"]), float(raw["integration"]["default_s"])


def budget_of(module: str, budgets: dict[str, float], unit_s: float, integration_s: float) -> float:
    if module in budgets:
        return budgets[module]
    return integration_s if "/integration/" in module else unit_s


def rows(
    seconds: dict[str, float], tests: dict[str, int], budgets: dict[str, float], unit_s: float, integration_s: float
) -> list[dict]:
    """One row per module that ran, slowest first."""
    out = [
        {
            "module": m,
            "tests": tests[m],
            "seconds": round(s, 1),
            "budget_s": budget_of(m, budgets, unit_s, integration_s),
        }
        for m, s in seconds.items()
    ]
    for r in out:
        r["over"] = r["seconds"] > r["budget_s"]
    return sorted(out, key=lambda r: -r["seconds"])


class BudgetReport:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.tests: dict[str, int] = defaultdict(int)
        self.started = time.monotonic()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        module = report.nodeid.split("::")[0]
        self.seconds[module] += report.duration
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            self.tests[module] += 1

    @pytest.hookimpl(trylast=True)  # after the slowest durations: the last table before the closing line
    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.seconds:
            return
        budgets, unit_s, integration_s = load_budgets()
        table = rows(self.seconds, self.tests, budgets, unit_s, integration_s)
        tr = terminalreporter
        tr.section("time per module against tests/budgets.toml")
        width = max(len(r["module"]) for r in table)
        tr.write_line(f"{'module':<{width}}  tests  seconds  budget")
        for r in table:
            mark = "  OVER" if r["over"] else ""
            tr.write_line(f"{r['module']:<{width}}  {r['tests']:>5}  {r['seconds']:>7.1f}  {r['budget_s']:>6.0f}{mark}")
        total = sum(r["seconds"] for r in table)
        tr.write_line(f"{'all modules':<{width}}  {sum(self.tests.values()):>5}  {total:>7.1f}")
        tr.write_line(f"pytest's wall time: {time.monotonic() - self.started:.1f} s")
        over = [r["module"] for r in table if r["over"]]
        tr.write_line(f"over budget: {', '.join(over)}" if over else "over budget: none")
        if path := os.environ.get("ECHO2_BUDGET_JSON"):
            Path(path).write_text(json.dumps({"modules": table, "total_s": round(total, 1)}, indent=1))


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(BudgetReport(), "echo2_budget")
