#!/usr/bin/env bash
# Lint and type-check, then the whole test suite. Exits non-zero on any failure, and when no test ran at all.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
$VENV/bin/ruff check dashboard runtime tests bench sdk || exit 1
# Types: runtime/ and dashboard/ with the Django stubs ([tool.mypy] in pyproject.toml).
$VENV/bin/mypy || exit 1
HANGAR_DATA_DIR=$(mktemp -d) DATABASE_URL= REDIS_URL= $VENV/bin/python manage.py makemigrations --check --dry-run >/dev/null || { echo "missing migrations" >&2; exit 1; }
# The suite across HANGAR_TEST_WORKERS processes (pytest-xdist; 2 by default, one per core of
# the development machine, whose single run leaves a core idle most of the time): each worker is
# a node of its own on this machine, modules go to workers whole, the longest first, and a test
# marked `alone` runs with no other beside it (tests/parallel.py). 1 runs it in one process.
WORKERS=${HANGAR_TEST_WORKERS:-2}
PARALLEL=()
if [ "$WORKERS" -gt 1 ]; then PARALLEL=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder); fi
# Each test has its own limit (pyproject's timeout); this one bounds the run as a whole, under
# CI's 90 minutes with the install before it (docs/reliability.md has the run's times).
HANGAR_TEST_BASE_IMAGE=${HANGAR_TEST_BASE_IMAGE-1} timeout --kill-after=60 "${HANGAR_TEST_RUN_LIMIT_S:-4800}" \
    $VENV/bin/python -m pytest "${PARALLEL[@]}" "$@"
rc=$?
if [ $rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "the test run went past its limit: failing" >&2; exit 1; fi
exit $rc
