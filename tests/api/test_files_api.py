"""The file API over HTTP (a real daphne server and worker, real runsc sandboxes): what a
viewer may read, and downloads whose framing neither /proc nor a sandbox can corrupt."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.test_sandboxes_api import create
from tests.support import requires_runsc

pytestmark = [requires_runsc]

SECRET = "viewer-test-secret-" + os.urandom(6).hex()
FAST = 15.0  # a client that waits longer than this on an answer has met a hang


@pytest.fixture
def viewer(server, api, team_token) -> Iterator[httpx.Client]:
    """A viewer of the team that `api` belongs to."""
    from django.contrib.auth import get_user_model

    from runtime.models import Membership, Team
    from runtime.services.auth import token_create

    team = Team.objects.get(name="alpha")
    user = get_user_model().objects.create_user(username="vic", password="pw")
    Membership.objects.create(user=user, team=team, role=Membership.Role.VIEWER)
    raw = token_create(user=user, team=team).raw
    with httpx.Client(
        base_url=f"{server}/api/v1", headers={"Authorization": f"Bearer {raw}"}, timeout=FAST
    ) as client:
        yield client


def sh(api: httpx.Client, sandbox: str, cmd: str, **kw) -> dict:
    r = api.post(f"/sandboxes/{sandbox}/exec", json={"cmd": cmd, **kw})
    assert r.status_code in (200, 202), r.text
    return r.json()


def test_a_viewer_cannot_read_proc_or_sys_by_any_path_and_reads_other_files(api, viewer):
    assert api.post("/secrets", json={"name": "VIEWER_TEST_SECRET", "value": SECRET}).status_code == 201
    sid = create(api, secrets=["VIEWER_TEST_SECRET"])["id"]
    pid = sh(api, sid, "sleep 600", background=True)["pid"]
    # A command holding a deleted file open: only /proc/<pid>/fd/3 reaches its bytes.
    holder = sh(api, sid, f"echo {SECRET} > /tmp/gone; exec 3</tmp/gone; rm /tmp/gone; sleep 600",
                background=True)["pid"]  # fmt: skip
    sh(api, sid, f"ln -s /proc/1/environ /tmp/env; ln -s /proc /tmp/p; ln -s /proc/{holder}/fd/3 /tmp/fd; "
                 "mkdir -p /work && echo hello > /work/note.txt && ln -s /work/note.txt /tmp/note")  # fmt: skip
    time.sleep(0.5)  # the holder has removed its file

    refused = [
        f"/proc/{pid}/environ", "/proc/self/environ", "/proc/thread-self/environ", "/proc/1/environ",
        f"/proc/{pid}/task/{pid}/environ", "/tmp/env", "/tmp/p/1/environ", "/tmp/fd", f"/proc/{holder}/fd/3",
        "/proc/self/mem", "/sys/kernel/uevent_seqnum",
    ]  # fmt: skip
    for path in refused:
        r = viewer.get(f"/sandboxes/{sid}/files", params={"path": path})
        assert r.status_code == 403, (path, r.status_code, r.text)
        assert "viewers cannot read /proc or /sys" in r.json()["detail"] and SECRET not in r.text, path
    for path in ("/proc", "/proc/1", "/proc/1/fd", "/tmp/p", "/sys", "/sys/kernel"):
        r = viewer.get(f"/sandboxes/{sid}/files/list", params={"path": path})
        assert r.status_code == 403 and "viewers cannot read /proc or /sys" in r.json()["detail"], path

    # Everything else is theirs to read, through symlinks too; a listing shows links, unfollowed.
    for path in ("/work/note.txt", "/tmp/note"):
        r = viewer.get(f"/sandboxes/{sid}/files", params={"path": path})
        assert r.status_code == 200 and r.content == b"hello\n", path
    listed = {
        e["name"]: e["type"]
        for e in viewer.get(f"/sandboxes/{sid}/files/list", params={"path": "/tmp"}).json()
    }
    assert listed["env"] == "symlink" and listed["p"] == "symlink"
    assert viewer.get(f"/sandboxes/{sid}/files/list", params={"path": "/"}).status_code == 200
    # A member could `cat` it anyway: the file API serves them /proc.
    r = api.get(f"/sandboxes/{sid}/files", params={"path": f"/proc/{pid}/environ"})
    assert r.status_code == 200 and f"VIEWER_TEST_SECRET={SECRET}".encode() in r.content


def test_a_proc_file_comes_whole_and_cannot_pose_as_the_next_answer(api, server, team_token):
    sid = create(api)["id"]
    # A sandbox decides what its processes' environments hold: here, a whole HTTP answer.
    injected = 'HTTP/1.1 200 OK\\r\\nContent-Type: application/json\\r\\nContent-Length: 22\\r\\n\\r\\n{"status": "injected"}'
    pid = sh(api, sid, f"env -i \"$(printf '{injected}')=x\" sleep 600", background=True)["pid"]
    time.sleep(0.5)
    with httpx.Client(
        base_url=f"{server}/api/v1", headers={"Authorization": f"Bearer {team_token}"}, timeout=FAST,
        limits=httpx.Limits(max_connections=1),
    ) as one:  # fmt: skip
        r = one.get(f"/sandboxes/{sid}/files", params={"path": f"/proc/{pid}/environ"})
        assert (
            r.status_code == 200
            and r.content.startswith(b"HTTP/1.1 200 OK\r\n")
            and r.content.endswith(b"=x\0")
        )
        assert r.headers["content-length"] == str(len(r.content))  # /proc says 0; the bytes say more
        health = one.get("/health")  # on the same connection
        assert health.status_code == 200 and health.json()["status"] != "injected", health.text
        r = one.get(f"/sandboxes/{sid}/files", params={"path": "/proc/self/mem"})
        assert r.status_code == 409 and "/proc/self/mem" in r.json()["detail"]


# -- a sandbox answering for its own agent ------------------------------------------------------


@contextlib.contextmanager
def impostor_agent(sandbox_id: str, reply) -> Iterator[None]:
    """Put a listener of the test's at the sandbox's agent socket, as a process inside the
    sandbox can (the socket's directory is the sandbox's; runsc creates its sockets on the
    host): ``reply(conn)`` answers each request as it likes. The real socket comes back after."""
    from runtime.node.local import launcher_for

    path = Path(launcher_for("gvisor").handle_for(sandbox_id)["socket"])
    real = path.with_name("agent.sock.real")
    os.rename(path, real)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                kind, length = struct.unpack(">cI", conn.recv(5, socket.MSG_WAITALL))
                conn.recv(length, socket.MSG_WAITALL)
                with contextlib.suppress(OSError):
                    reply(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        listener.close()
        thread.join(5)
        path.unlink()
        os.rename(real, path)


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    return struct.pack(">cI", kind, len(payload)) + payload


def stat_reply(size: int) -> bytes:
    return frame(b"T", b"size=%d\0mode=644\0mtime=1.0\0type=file\0" % size)


CHUNK = 200_000


def test_a_download_the_sandbox_cuts_short_ends_its_connection(api, server, team_token):
    sid = create(api)["id"]

    def short(conn: socket.socket) -> None:  # announces 1 MB, sends 600 kB and hangs up
        conn.sendall(stat_reply(1_000_000) + frame(b"D", b"x" * CHUNK) * 3)

    with impostor_agent(sid, short), httpx.Client(
        base_url=f"{server}/api/v1", headers={"Authorization": f"Bearer {team_token}"}, timeout=FAST
    ) as client:  # fmt: skip
        start = time.monotonic()
        with pytest.raises(httpx.RemoteProtocolError), client.stream(
            "GET", f"/sandboxes/{sid}/files", params={"path": "/big"}
        ) as r:  # fmt: skip
            assert r.status_code == 200 and r.headers["content-length"] == "1000000"
            r.read()
        assert time.monotonic() - start < FAST
    # The sandbox is not failed for it, and the next answers come as they should.
    assert api.get(f"/sandboxes/{sid}").json()["status"] == "running"
    assert sh(api, sid, "echo ok")["stdout"] == "ok\n"


def test_a_download_is_never_longer_than_announced(api, server, team_token):
    sid = create(api)["id"]

    def long(conn: socket.socket) -> None:  # announces 500 kB, sends 800 kB
        conn.sendall(stat_reply(500_000) + frame(b"D", b"y" * CHUNK) * 4 + frame(b"K"))

    host, port = server.removeprefix("http://").split(":")
    request = (f"GET /api/v1/sandboxes/{sid}/files?path=/big HTTP/1.1\r\nHost: {host}\r\n"
               f"Authorization: Bearer {team_token}\r\nConnection: close\r\n\r\n")  # fmt: skip
    with impostor_agent(sid, long), socket.create_connection((host, int(port)), timeout=FAST) as raw:
        raw.sendall(request.encode())
        answer = b""
        while data := raw.recv(1 << 16):  # everything the server sends, to its close
            answer += data
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"\r\ncontent-length: 500000" in head.lower(), head
    assert body == b"y" * 500_000  # not a byte more: a keep-alive client would take them for its next answer
