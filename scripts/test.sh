#!/usr/bin/env bash
# The test command: set up .venv (idempotent), lint (ruff), format check (ruff format), types (mypy),
# then every test, quick and integration.
#   bash scripts/test.sh                 # everything (33-45 min on 2 cores after setup; CI runs this)
#   bash scripts/test.sh -m "not slow"   # without the fault-injection runs
#   bash scripts/test.sh -m "not integration"   # lint, types and the unit tests only (~5 min)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
.venv/bin/python -m ruff check echo2cli tests scripts examples
.venv/bin/python -m ruff format --check echo2cli tests scripts examples
.venv/bin/python -m mypy
exec .venv/bin/python -m pytest tests "$@"
