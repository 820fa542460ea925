"""Under `pytest -n N` (scripts/run-tests.sh) each worker is a node of its own on this machine,
as `hangar node` would make it: its own data dir (so its own host names, address pool, nftables
table and runsc root: runtime/host/hostnames.py), its own Redis database (so its own Celery
queues and channel layer) and, from pytest-django, its own test database (``test_hangar_gw0``, …).

Imported for its effect on ``os.environ``, by the settings and by ``tests.support`` (whichever
pytest imports first), once per process."""

from __future__ import annotations

import os
import tempfile
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/hangar")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/7")
os.environ.setdefault("HANGAR_DATA_DIR", os.path.join(tempfile.gettempdir(), "hangar-test-data"))

WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", …; "" without -n
INDEX = int(WORKER.removeprefix("gw")) if WORKER else 0


def _redis_for_worker(url: str, index: int) -> str:
    """The next databases after the configured one: ``/7`` → ``/8`` for gw0, ``/9`` for gw1
    (``?db=`` for a unix socket's URL)."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    if parts.scheme == "unix" or "db" in query:
        number = int(query.get("db", ["0"])[0] or 0)
        query["db"] = [str((number + 1 + index) % 16)]
        return urlunsplit(parts._replace(query=urlencode(query, doseq=True)))
    db = parts.path.strip("/")
    number = int(db) if db.isdigit() else 0
    return urlunsplit(parts._replace(path=f"/{(number + 1 + index) % 16}"))


if WORKER and os.environ.get("HANGAR_TEST_WORKER_ENV") != WORKER:
    os.environ["HANGAR_TEST_WORKER_ENV"] = WORKER
    os.environ["HANGAR_DATA_DIR"] += f"-{WORKER}"
    os.environ["REDIS_URL"] = _redis_for_worker(os.environ["REDIS_URL"], INDEX)
    # hangar.internal's port: the controller's pick (tests/settings.py) is not this worker's,
    # whose bridge listens on a port of its own (a port set by whoever ran pytest is kept).
    picked = os.environ.pop("HANGAR_TEST_PICKED_GATEWAY_PORT", None)
    if picked and os.environ.get("HANGAR_SANDBOX_GATEWAY_PORT") == picked:
        del os.environ["HANGAR_SANDBOX_GATEWAY_PORT"]
