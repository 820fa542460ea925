"""A second node joins with `hangar node`: it registers, consumes its own queue, runs the
sandboxes scheduled on it, and answers exec/file calls sent through that queue."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from runtime.models import Node, Sandbox, Team
from runtime.services import sandboxes as svc
from tests.support import die_with_parent, free_port, requires_runsc, wait_until

ROOT = Path(__file__).resolve().parent.parent.parent


@requires_runsc
def test_second_node_joins_and_runs_sandboxes(service_env, celery_worker, local_node, server):
    log_path = Path(tempfile.mkdtemp()) / "node-b.log"
    tunnel_port = free_port()
    env = {**service_env, "HANGAR_NODE_NAME": "node-b", "HANGAR_TUNNEL_PORT": str(tunnel_port)}
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

        # A preview URL served by a server that is not node-b: through node-b's tunnel.
        assert node_b.tunnel_address == f"127.0.0.1:{tunnel_port}"
        from runtime.services.previews import port_expose

        port_expose(sandbox=sandbox, port=8000, public=True)
        svc.sandbox_file_write(sandbox=sandbox, path="/www/index.html", data=b"served by node-b\n")
        from asgiref.sync import async_to_sync

        from runtime.services.processes import process_start

        async_to_sync(process_start)(
            sandbox=sandbox, cmd="httpd -f -p 127.0.0.1:8000 -h /www", kind="background"
        )
        wait_until(lambda: httpx.get(f"{server}/", headers={"Host": f"8000-{sandbox.id}.localhost"}).status_code
                   == 200, 20, what="the preview through node-b")  # fmt: skip
        r = httpx.get(f"{server}/", headers={"Host": f"8000-{sandbox.id}.localhost"})
        assert r.text == "served by node-b\n"
        # A tunnel request without the shared key's signature is refused by the node.
        import json
        import socket

        with socket.create_connection(("127.0.0.1", tunnel_port)) as raw:
            raw.sendall(
                json.dumps({"sandbox": sandbox.id, "port": 8000, "expires": 2**31, "sig": "x"}).encode()
                + b"\n"
            )
            assert raw.recv(100).startswith(b"ERR")
        svc.sandbox_delete(sandbox=sandbox)
        wait_until(
            lambda: Sandbox.objects.get(id=sandbox.id).status == Sandbox.Status.DELETED, 30, what="deleted"
        )
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
