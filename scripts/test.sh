#!/usr/bin/env bash
# The test command: set up .venv (idempotent), lint (ruff), format check (ruff format), types (mypy),
# then every test, quick and integration, in two pytest-xdist processes: one runs the integration tests one after
# another (they share an engine and models), the other the unit modules beside them (tests/conftest.py,
# xdist_scope). At the end pytest prints each module's time against its budget (tests/budgets.toml,
# tests/budget_report.py) and names the modules over budget; nothing fails on time. `-n 0` runs in one process.
#   bash scripts/test.sh                          # everything per push (CI runs this; docs/results.md has its time)
#   bash scripts/test.sh -m "not integration"     # lint, types and the unit tests only
#   bash scripts/test.sh --extended               # also the long variants: the 6-kill churn, the 11,000-request
#                                                 # fuzz, the late joiner on a 30 Mbit/s link, the network cut
# Run --extended before resolving work on the worker, the learner's API or the broadcast plane.
# Randomized runs print their seed and take it from the environment: ECHO2_CHURN_SEED, ECHO2_FUZZ_SEED.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
.venv/bin/python -m ruff check echo2cli tests scripts examples
.venv/bin/python -m ruff format --check echo2cli tests scripts examples
.venv/bin/python -m mypy
exec .venv/bin/python -m pytest -n 2 tests "$@"
