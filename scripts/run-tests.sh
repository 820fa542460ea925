#!/usr/bin/env bash
# Lint and type-check, then the whole test suite. Exits non-zero on any failure, and when no test ran at all.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
$VENV/bin/ruff check dashboard runtime tests bench sdk || exit 1
# Types: runtime/ and dashboard/ with the Django stubs ([tool.mypy] in pyproject.toml).
$VENV/bin/mypy || exit 1
HANGAR_DATA_DIR=$(mktemp -d) DATABASE_URL= REDIS_URL= $VENV/bin/python manage.py makemigrations --check --dry-run >/dev/null || { echo "missing migrations" >&2; exit 1; }
# Each test has its own limit (pyproject's timeout); this one bounds the run as a whole, under
# CI's 90 minutes with the install before it. (The run took 49 min on 2026-12-06 and went past
# 60 on 2026-12-07, a slower day for this machine: trimming it is docs/reliability.md's next step.)
HANGAR_TEST_BASE_IMAGE=${HANGAR_TEST_BASE_IMAGE-1} timeout --kill-after=60 "${HANGAR_TEST_RUN_LIMIT_S:-4800}" \
    $VENV/bin/python -m pytest "$@"
rc=$?
if [ $rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "the test run went past its limit: failing" >&2; exit 1; fi
exit $rc
