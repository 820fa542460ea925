"""The OpenAPI schema describes the API: schemathesis, run exactly as docs/api.md gives it,
against the real stack (daphne, a Celery worker, the stream bridge, runsc sandboxes), as a
non-staff owner of a team of their own, finds nothing."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.support import requires_runsc

pytestmark = [requires_runsc, pytest.mark.slow]

ST = str(Path(sys.executable).with_name("st"))
FUZZ_QUOTAS = {
    "sandboxes": 4,
    "vcpu": 4,
    "memory_mb": 4096,
    "storage_mb": 20480,
    "disk_mb": 40960,
    "harnesses": 1,
}


@pytest.mark.timeout(900)
def test_schemathesis_finds_nothing(server, celery_worker, bridge, local_node, tmp_path):
    from django.contrib.auth import get_user_model

    from runtime.models import Membership, Team
    from runtime.services import quotas
    from runtime.services.auth import token_create

    user = get_user_model().objects.create_user(username="fuzzer", password="pw")
    team = Team.objects.create(name="fuzz")
    Membership.objects.create(user=user, team=team, role=Membership.Role.OWNER)
    token = token_create(user=user, team=team).raw
    # The team's quotas (and ceilings, which its owner cannot raise) are below the test node's
    # room: a create past them is a 429, never the 503 of a full node (a correct answer when an
    # install is full, which schemathesis counts as a server error); they also bound the load.
    quotas.ceilings_set(team=team, values=FUZZ_QUOTAS)
    quotas.limits_set(team=team, values=FUZZ_QUOTAS, role="owner", staff=True)

    argv = [
        ST, "run", f"{server}/api/v1/openapi.json", "-H", f"Authorization: Bearer {token}",
        "--checks", "all", "--exclude-checks", "use_after_free,positive_data_acceptance",
        "-n", "10", "-w", "1", "--max-time", "400", "--request-timeout", "30",
        "--exclude-path-regex", r"tokens/\{|members/\{",
    ]  # fmt: skip
    # One worker: on CPython 3.11.7 (the one here) ast.parse is not thread-safe (gh-106905), and
    # hypothesis parses its filters' source from each of schemathesis's worker threads
    # ("SystemError: AST constructor recursion depth mismatch", a crash of the tool itself).
    # The test stack runs no beat: the node's heartbeat is kept here, or after a minute it would
    # count as offline and every create would be a 503.
    done = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(local_node.name, done), daemon=True)
    beat.start()
    try:
        proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=800)
    finally:
        done.set()
        beat.join()
    print(proc.stdout[-60000:], proc.stderr[-5000:])
    assert proc.returncode == 0, "schemathesis found something: its report is above"


def _heartbeat(node_name: str, done: threading.Event) -> None:
    from django.db import connection

    from runtime.services.nodes import node_heartbeat

    try:
        while not done.wait(5):
            node_heartbeat(name=node_name)
    finally:
        connection.close()
