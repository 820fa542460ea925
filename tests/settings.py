"""Test settings: real Postgres and Redis on 127.0.0.1, a private data dir."""

import os

# The database, Redis and data dir (under `pytest -n`, each worker's own).
from tests import worker_env  # noqa: F401

os.environ.setdefault("HANGAR_NODE_NAME", "test-node")
# Tests register nodes and place sandboxes on them from several processes at once: every
# placement reads the fleet afresh (tests/runtime/test_fleet_view.py tests the view's age).
os.environ.setdefault("HANGAR_PLACEMENT_VIEW_S", "0")
os.environ.setdefault("HANGAR_ACTIVITY_REPORT_S", "1")  # bridges report terminal activity at once
# Flow control's marks, small: a gVisor pty under ptrace may move only ~10 KB/s on a busy host,
# and the flow tests must reach the high mark whatever the host's load.
os.environ.setdefault("HANGAR_FLOW_HIGH_BYTES", str(16 * 1024))
os.environ.setdefault("HANGAR_FLOW_LOW_BYTES", str(4 * 1024))

# A second registration of the gVisor launcher with network and checkpoints off: the seam a
# second runtime plugs into, exercised by the conformance suite and the API and page tests.
os.environ.setdefault(
    "HANGAR_LAUNCHER_CLASSES", "gvisor-reduced=tests.launchers.reduced:ReducedGVisorLauncher"
)

# hangar.internal's port, one per test session (several sessions may share a machine) and per
# worker of a `pytest -n` run (tests/worker_env.py drops the one its controller picked).
if "HANGAR_SANDBOX_GATEWAY_PORT" not in os.environ:
    import socket

    with socket.socket() as _s:
        _s.bind(("127.0.0.1", 0))
        os.environ["HANGAR_SANDBOX_GATEWAY_PORT"] = str(_s.getsockname()[1])
        os.environ["HANGAR_TEST_PICKED_GATEWAY_PORT"] = os.environ["HANGAR_SANDBOX_GATEWAY_PORT"]

from dashboard.settings import *  # noqa: E402,F403

HANGAR_LAUNCHER_CONFIG.setdefault("gvisor-reduced", HANGAR_LAUNCHER_CONFIG["gvisor"])  # noqa: F405
