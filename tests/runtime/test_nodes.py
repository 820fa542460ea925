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
import pytest

from runtime.models import Node, Sandbox, Team
from runtime.services import sandbox_io as io_svc
from runtime.services import sandboxes as svc
from tests.support import die_with_parent, free_port, requires_runsc, wait_until

ROOT = Path(__file__).resolve().parent.parent.parent


@requires_runsc
def test_second_node_joins_and_runs_sandboxes(service_env, celery_worker, local_node, server):
    log_path = Path(tempfile.mkdtemp()) / "node-b.log"
    tunnel_port = free_port()
    env = {**service_env, "HANGAR_NODE_NAME": "node-b", "HANGAR_TUNNEL_PORT": str(tunnel_port)}
    # Its worker's output goes to its data dir's logs (this test's, which node-b shares): what
    # is added from now on.
    worker_log = Path(service_env["HANGAR_DATA_DIR"]) / "logs" / "worker.log"
    start = worker_log.stat().st_size if worker_log.exists() else 0
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dashboard.cli", "node", "--concurrency", "4", "--log-level", "INFO"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent,
        )  # fmt: skip
    try:

        def ready() -> bool:
            return (
                worker_log.exists() and b"ready." in worker_log.read_bytes()[start:]
            ) or proc.poll() is not None

        wait_until(ready, 60, what="node-b")
        assert proc.poll() is None, log_path.read_text()
        assert "logs in" in log_path.read_text()  # its console says where they are
        node_b = Node.objects.get(name="node-b")
        # It advertises the runtimes it runs, with what their sandboxes can have (as this node does).
        assert node_b.state == Node.State.READY and node_b.launchers == local_node.launchers
        assert node_b.launchers["gvisor"]["network"] and node_b.launchers["gvisor"]["checkpoint"]
        assert node_b.images.filter(name="busybox").exists()  # it registered the images it holds

        # Only node-b takes new sandboxes now.
        Node.objects.filter(name=local_node.name).update(state=Node.State.DRAINING)
        team = Team.objects.create(name="multi")
        sandbox = svc.sandbox_create(
            team=team, user=None, request=svc.SandboxRequest(image="busybox", memory_mb=256)
        )
        sandbox = svc.sandbox_wait(sandbox=sandbox, timeout=60)
        assert sandbox.status == Sandbox.Status.RUNNING, sandbox.status_reason
        assert sandbox.node.name == "node-b"

        # This process is not node-b: exec and files travel through node-b's queue.
        out = io_svc.sandbox_exec(sandbox=sandbox, cmd="echo $HANGAR_SANDBOX_ID")
        assert out.result.stdout.decode().strip() == sandbox.id
        # A viewer's file calls keep out of /proc there too (node-b says it kept them out).
        from runtime.errors import Forbidden

        with pytest.raises(Forbidden, match="viewers cannot read /proc or /sys"):
            io_svc.sandbox_file_read(sandbox=sandbox, path="/proc/1/environ", no_pseudo_fs=True)
        with pytest.raises(Forbidden):
            io_svc.sandbox_file_list(sandbox=sandbox, path="/proc", no_pseudo_fs=True)
        assert "etc" in {
            e.name for e in io_svc.sandbox_file_list(sandbox=sandbox, path="/", no_pseudo_fs=True)
        }
        entry, chunks = io_svc.sandbox_file_read(sandbox=sandbox, path="/etc/hostname", no_pseudo_fs=True)
        assert b"".join(chunks)

        # A preview URL served by a server that is not node-b: through node-b's tunnel.
        assert node_b.tunnel_address == f"127.0.0.1:{tunnel_port}"
        from runtime.services.previews import port_expose

        port_expose(sandbox=sandbox, port=8000, public=True)
        io_svc.sandbox_file_write(sandbox=sandbox, path="/www/index.html", data=b"served by node-b\n")
        from asgiref.sync import async_to_sync

        from runtime.services.processes import process_start

        async_to_sync(process_start)(
            sandbox=sandbox, cmd="httpd -f -p 127.0.0.1:8000 -h /www", kind="background"
        )
        wait_until(lambda: httpx.get(f"{server}/", headers={"Host": f"8000-{sandbox.id}.localhost"}).status_code
                   == 200, 20, what="the preview through node-b")  # fmt: skip
        r = httpx.get(f"{server}/", headers={"Host": f"8000-{sandbox.id}.localhost"})
        assert r.text == "served by node-b\n"
        # A streamed write travels in parts (never whole in one message) and lands atomically.
        import hashlib

        from runtime.services import uploads

        block = os.urandom(1 << 20)
        size = 2 * uploads.REMOTE_PART + 12345
        chunks = (block[: min(1 << 20, size - i)] for i in range(0, size, 1 << 20))
        assert io_svc.sandbox_file_write(sandbox=sandbox, path="/www/big.bin", data=chunks) == size
        out = io_svc.sandbox_exec(
            sandbox=sandbox, cmd="wc -c < /www/big.bin; head -c 1048576 /www/big.bin | md5sum"
        )
        assert out.result.stdout.decode().split() == [str(size), hashlib.md5(block).hexdigest(), "-"]
        assert io_svc.sandbox_file_write(sandbox=sandbox, path="/www/empty", data=iter([])) == 0
        assert not list(
            (Path(service_env["HANGAR_DATA_DIR"]) / "uploads").iterdir()
        )  # node-b's parts are gone
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


@requires_runsc
def test_the_nodes_worker_heartbeats_from_a_thread_of_its_own(celery_worker, local_node):
    """No beat runs here, and no heartbeat task is sent: the node's worker keeps its row's
    heartbeat fresh itself (runtime.node.heartbeat), whatever its pool is doing, and a lost
    node whose worker answers is back."""
    from datetime import timedelta

    from django.utils import timezone

    stale = timezone.now() - timedelta(hours=1)
    Node.objects.filter(id=local_node.id).update(heartbeat_at=stale, state=Node.State.LOST)
    wait_until(
        lambda: Node.objects.get(id=local_node.id).heartbeat_at > timezone.now() - timedelta(seconds=30),
        30, what="a heartbeat from the node's worker",
    )  # fmt: skip
    wait_until(lambda: Node.objects.get(id=local_node.id).state == Node.State.READY, 10, what="the node back")
