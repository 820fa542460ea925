"""A second node joins with `hangar node`: it registers, consumes its own queue, runs the
sandboxes scheduled on it, and answers exec/file calls sent through that queue."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from runtime.models import Node, Sandbox, Team
from runtime.services import sandboxes as svc
from tests.support import die_with_parent, requires_runsc, wait_until

ROOT = Path(__file__).resolve().parent.parent.parent


@requires_runsc
def test_second_node_joins_and_runs_sandboxes(service_env, celery_worker, local_node):
    log_path = Path(tempfile.mkdtemp()) / "node-b.log"
    env = {**service_env, "HANGAR_NODE_NAME": "node-b"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dashboard.cli", "node", "--concurrency", "4", "--log-level", "INFO"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent,
        )  # fmt: skip
    try:
        wait_until(lambda: b"ready." in log_path.read_bytes() or proc.poll() is not None, 60, what="node-b")
        assert proc.poll() is None, log_path.read_text()
        node_b = Node.objects.get(name="node-b")
        assert node_b.status == Node.Status.ONLINE and node_b.runtimes == ["gvisor"]
        assert node_b.images.filter(name="busybox").exists()  # it registered the images it holds

        # Only node-b takes new sandboxes now.
        Node.objects.filter(name=local_node.name).update(status=Node.Status.DRAINING)
        team = Team.objects.create(name="multi")
        sandbox = svc.sandbox_create(team=team, user=None, image="busybox", memory_mb=256)
        sandbox = svc.sandbox_wait(sandbox=sandbox, timeout=60)
        assert sandbox.status == Sandbox.Status.RUNNING, sandbox.status_reason
        assert sandbox.node.name == "node-b"

        # This process is not node-b: exec and files travel through node-b's queue.
        out = svc.sandbox_exec(sandbox=sandbox, cmd="echo $HANGAR_SANDBOX_ID")
        assert out.result.stdout.decode().strip() == sandbox.id
        svc.sandbox_delete(sandbox=sandbox)
        wait_until(
            lambda: Sandbox.objects.get(id=sandbox.id).status == Sandbox.Status.DELETED, 30, what="deleted"
        )
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
