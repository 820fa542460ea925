"""Hangar's server (:mod:`dashboard.server`, daphne with back-pressure) on its own. What each
kind of answer costs the server while a client reads slowly is measured in the test module of
its area: downloads and exec in tests/api/test_sandboxes_api.py, previews (HTTP and websockets)
in tests/api/test_previews_api.py."""

from __future__ import annotations

import contextlib
import socket
import time

import httpx

from tests.api.test_sandboxes_api import BIG, big_file, create
from tests.conftest import _stop, start_server
from tests.support import MiB, RssWatch, SlowReader, requires_runsc, unix_sockets, wait_until


@requires_runsc
def test_a_client_that_takes_nothing_is_dropped_after_the_stall_limit(api, service_env):
    sid = create(api)["id"]
    big_file(api, sid)
    proc = start_server({**service_env, "HANGAR_SEND_STALL_S": "2"})
    try:
        auth = {"Authorization": api.headers["Authorization"]}
        target = f"/api/v1/sandboxes/{sid}/files?path=/tmp/big"
        assert SlowReader(proc.url, f"/api/v1/sandboxes/{sid}/files?path=/etc/passwd", auth).read_rest() > 0
        before = unix_sockets(proc.pid)
        reader = SlowReader(proc.url, target, auth)
        assert reader.status == 200
        time.sleep(1)
        assert unix_sockets(proc.pid) > before  # held back, its agent connection open
        # The client takes nothing more: past the limit it is dropped, and the download ends.
        wait_until(lambda: unix_sockets(proc.pid) <= before, 15, what="the stalled download to be dropped")
        assert reader.read_rest() < BIG
        assert b"took nothing for 2 s" in proc.log_path.read_bytes()  # type: ignore[attr-defined]
    finally:
        _stop(proc)


def test_a_large_form_post_costs_the_server_little_memory(server_process):
    """Anybody may send a body to any URL: a 200 MB form post is kept on disk until the app
    reads it, a piece at a time (Twisted parsed form posts into memory whole, and daphne queued
    every body for the app at once)."""
    size = 200 * MiB
    head = b'--x\r\nContent-Disposition: form-data; name="f"; filename="a.bin"\r\n\r\n'
    tail = b"\r\n--x--\r\n"
    block = b"\1" * MiB

    def body():
        yield head
        for _ in range(size // MiB):
            yield block
        yield tail

    headers = {
        "Content-Type": "multipart/form-data; boundary=x",
        "Content-Length": str(len(head) + size + len(tail)),
    }
    with RssWatch(server_process.pid) as rss:
        # (Not under /api/, whose routes refuse a body over their limit before it is stored.)
        r = httpx.post(f"{server_process.url}/no-such-page/", content=body(), headers=headers, timeout=120)
    print(f"form post of 200 MiB: server RSS +{rss.growth / MiB:.1f} MiB")
    assert r.status_code in (403, 404)  # the CSRF check or the missing page: the body never parsed
    assert rss.growth < 32 * MiB, f"the server grew by {rss.growth / MiB:.0f} MiB"


def test_a_body_larger_than_the_largest_file_is_refused_before_it_is_stored(service_env):
    proc = start_server({**service_env, "HANGAR_FILE_MAX_BYTES": str(MiB)})
    try:
        port = int(proc.url.rsplit(":", 1)[1])
        # Announced: refused at once, before a byte of it is sent.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(
                b"PUT /api/v1/sandboxes/sbx/files?path=/a HTTP/1.1\r\nHost: x\r\nContent-Length: 3145728\r\n\r\n"
            )
            answer = s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 413 ") and b"HANGAR_FILE_MAX_BYTES" in answer, answer
        # Chunked: refused once it has sent more than that.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /api/v1/health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            answer = b""
            with contextlib.suppress(OSError):
                for _ in range(3):
                    s.sendall(b"100000\r\n" + b"\0" * MiB + b"\r\n")
            while data := s.recv(4096):
                answer += data
        assert answer.startswith(b"HTTP/1.1 413 "), answer
        # What fits is taken as ever.
        assert httpx.post(f"{proc.url}/api/v1/health", content=b"x" * 1000).status_code == 405
    finally:
        _stop(proc)


def test_an_api_body_over_its_routes_limit_is_refused_before_a_byte_of_it_is_stored(server_process):
    """The request line is known with the headers: a JSON control call that announces more than
    HANGAR_JSON_MAX_BYTES is answered 413 without its body being read (nothing is sent here)."""
    host, port = server_process.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /api/v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 52428800\r\n\r\n")  # fmt: skip
        answer = b""
        while data := s.recv(4096):
            answer += data
    assert answer.startswith(b"HTTP/1.1 413 ") and b"HANGAR_JSON_MAX_BYTES" in answer, answer
    # A file upload's route is held to the file limit instead: the same size is no 413 there.
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"PUT /api/v1/sandboxes/sbnone/files?path=/x HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n"
                  b"0123456789")  # fmt: skip
        assert not s.recv(4096).startswith(b"HTTP/1.1 413")
