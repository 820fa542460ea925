"""Bad input, against the real stack (daphne, a Celery worker, the stream bridge, runsc
sandboxes), as a non-staff owner of a team of their own:

- schemathesis, run exactly as docs/api.md gives it, finds nothing;
- a sweep generated from the OpenAPI schema sends every operation, for each of its parameters
  and body fields in turn, the values that break servers (path traversal, NUL and control
  characters, a megabyte string, numbers past every bound, the wrong type, an unknown field (a
  422 naming it)):
  each answer is a 4xx with a message or a success, never a 5xx, never slower than 30 s, and a
  refused change leaves no row behind (nothing half-done);
- slow and oversized requests: a request trickled a byte at a time, huge headers."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.sweep import Probe, probes
from tests.support import requires_runsc

pytestmark = [requires_runsc, pytest.mark.slow]

ST = [sys.executable, str(Path(__file__).with_name("st_threadsafe.py"))]  # `st`, thread-safe: see there
FUZZ_QUOTAS = {
    "sandboxes": 4,
    "vcpu": 4,
    "memory_mb": 4096,
    "storage_mb": 20480,
    "disk_mb": 40960,
    "harnesses": 1,
}


def fuzz_owner() -> str:
    """A token of the non-staff owner of a team of their own, whose quotas (and ceilings,
    which its owner cannot raise) are below the test node's room: a create past them is a 429,
    never the 503 of a full node (a correct answer when an install is full, which the checks
    count as a server error); they also bound the load."""
    from django.contrib.auth import get_user_model

    from runtime.models import Membership, Team
    from runtime.services import quotas
    from runtime.services.auth import token_create

    user = get_user_model().objects.create_user(username="fuzzer", password="pw")
    team = Team.objects.create(name="fuzz")
    Membership.objects.create(user=user, team=team, role=Membership.Role.OWNER)
    quotas.ceilings_set(team=team, values=FUZZ_QUOTAS)
    quotas.limits_set(team=team, values=FUZZ_QUOTAS, role="owner", staff=True)
    return token_create(user=user, team=team).raw


@pytest.mark.timeout(900)
@pytest.mark.beside_alone  # its 400 s hold up no `alone` test (tests/parallel.py)
def test_schemathesis_finds_nothing(service_env, celery_worker, bridge, local_node, tmp_path, report):
    from tests.conftest import _stop, start_server

    # A server of its own whose quiet streams send their keep-alive line every 45 s, not 15: a
    # request that lasts past 30 s is then the read timeout schemathesis reports by name, where
    # lines every 15 s would keep it waiting (past --max-time) for as long as the stream lasts.
    server_process = start_server({**service_env, "HANGAR_STREAM_KEEPALIVE_S": "45"})
    try:
        _schemathesis(server_process, tmp_path, report)
    finally:
        _stop(server_process)
        server_process.log.close()


def _schemathesis(server_process, tmp_path, report) -> None:
    server = server_process.url
    token = fuzz_owner()

    argv = [
        *ST, "run", f"{server}/api/v1/openapi.json", "-H", f"Authorization: Bearer {token}",
        "--checks", "all", "--exclude-checks", "use_after_free,positive_data_acceptance",
        "-n", "10", "-w", "2", "--max-time", "400", "--request-timeout", "30",
        "--exclude-path-regex", r"tokens/\{|members/\{",
    ]  # fmt: skip
    # The command exactly, `st` run through st_threadsafe.py: on CPython 3.11.7 (the one
    # here) ast.parse is not thread-safe (gh-106905), and hypothesis parses its filters' source
    # from each of schemathesis's worker threads ("SystemError: AST constructor recursion depth
    # mismatch", a crash of the tool itself with -w 2): the wrapper serialises the parse.
    # (The test node's worker keeps its heartbeat fresh: runtime/node/heartbeat.py.)
    # Its output goes to a file as it runs: a run that overstays shows where it stood.
    out_path = tmp_path / "st.out"
    with out_path.open("w") as out:
        proc = subprocess.Popen(argv, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, text=True)
        try:
            returncode = proc.wait(timeout=800)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            returncode = None
    stdout = out_path.read_text(errors="replace")
    print(stdout[-60000:])
    if returncode is None:
        # The server's last answers: the request that held the run is the one after them.
        lines = Path(server_process.log_path).read_text(errors="replace").splitlines()
        print("\n".join(line[:300] for line in lines[-40:]))
    assert returncode is not None, (
        "schemathesis ran past 800 s: where it stood, and the server's log, are above"
    )
    assert returncode == 0, "schemathesis found something: its report is above"
    summary = re.findall(r"(\d+) generated", stdout)
    report.held(
        "schemathesis",
        "st run --checks all (less use_after_free, positive_data_acceptance) found nothing",
        operations=_st_count(stdout, "operations"),
        generated=summary[-1] if summary else "?",
    )


def _st_count(out: str, what: str) -> str:
    m = re.search(rf"(\d+) {what}", out) or re.search(rf"{what}[^\d]*(\d+)", out, re.IGNORECASE)
    return m.group(1) if m else "?"


# -- the schema-driven sweep --------------------------------------------------------------------

# Operations that end what the rest of the sweep needs (the sandbox it works in, the token it
# sends) run last or not at all; the token's own are left out as schemathesis leaves them.
LAST = ("/pause", "/stop", "/resume")


def _order(probe: Probe) -> int:
    return 1 if probe.method == "DELETE" or probe.path.endswith(LAST) else 0


@pytest.mark.timeout(900)
def test_every_input_of_every_operation_gets_a_4xx_or_a_success_never_a_5xx(
    server, celery_worker, bridge, local_node, report
):  # fmt: skip
    import httpx

    from dashboard.api import api as ninja_api

    token = fuzz_owner()
    headers = {"Authorization": f"Bearer {token}"}
    failures: list[str] = []
    statuses: dict[int, int] = {}
    slowest = (0.0, "")
    with httpx.Client(base_url=f"{server}/api/v1", headers=headers, timeout=35) as http:
        sandbox = http.post("/sandboxes", json={"image": "busybox", "memory_mb": 256, "timeout_s": 900})
        assert sandbox.status_code == 201, sandbox.text
        sid = sandbox.json()["id"]
        # An ended process: its output stream, with nothing more to follow, ends at once.
        proc = http.post(f"/sandboxes/{sid}/exec", json={"cmd": "echo done", "background": True})
        time.sleep(1)
        term = http.post(f"/sandboxes/{sid}/terminals", json={})
        team_id = http.get("/tokens/current").json()["team_id"]
        fill = {"sandbox_id": sid, "process_id": str(proc.json()["id"]), "terminal_id": term.json()["id"],
                "team_id": str(team_id)}  # fmt: skip
        spec = ninja_api.get_openapi_schema(path_prefix="")
        all_probes = sorted(probes(spec, fill), key=_order)
        for probe in all_probes:
            if re.search(r"tokens/\{|members/\{", probe.label):
                continue
            before = _footprint(team_id, probe.path) if probe.method != "GET" else None
            started = time.monotonic()
            try:
                r = http.request(probe.method, probe.path, params=probe.params or None,
                                 json=probe.body if probe.body is not None else None)  # fmt: skip
            except (httpx.TimeoutException, httpx.TransportError) as exc:
                failures.append(f"{probe.label}: no answer ({type(exc).__name__})")
                continue
            except (ValueError, TypeError):
                continue  # a value httpx itself will not encode (inf): nothing reached the server
            took = time.monotonic() - started
            slowest = max(slowest, (took, probe.label))
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code >= 500:
                failures.append(f"{probe.label}: {r.status_code} {r.text[:200]}")
            elif r.status_code >= 400 and not _has_message(r):
                failures.append(f"{probe.label}: {r.status_code} without a message: {r.text[:200]}")
            elif (
                probe.refused
                and r.status_code not in (401, 403)
                and (  # (refused before the body is read)
                    r.status_code != 422 or probe.refused not in r.json()["detail"]
                )
            ):
                failures.append(
                    f"{probe.label}: {r.status_code}, not a 422 naming {probe.refused}: {r.text[:200]}"
                )
            elif took > 30:
                failures.append(f"{probe.label}: {took:.1f} s")
            if (
                before is not None
                and r.status_code >= 400
                and (after := _footprint(team_id, probe.path)) != before
            ):
                failures.append(
                    f"{probe.label}: refused ({r.status_code}) but left rows behind: {before} -> {after}"
                )
    assert not failures, f"{len(failures)} bad answers:\n" + "\n".join(failures[:80])
    report.held("bad input", "every operation × input × breaking value: a 4xx with a message or a success",
                requests=sum(statuses.values()), statuses=dict(sorted(statuses.items())),
                slowest_s=round(slowest[0], 2), slowest=slowest[1])  # fmt: skip


def _footprint(team_id: int, path: str) -> dict[str, int]:
    """How many of the things ``path`` makes the team has (deleted ones too): a refused request
    adds none. Sandboxes that pools and harnesses start on their own (later, on the worker) are
    not counted, nor their commands."""
    from runtime.models import ApiToken, Exec, Harness, Pool, Run, Sandbox, Secret, Terminal, Volume

    mine = Sandbox.objects.filter(team_id=team_id, pool__isnull=True).exclude(
        id__in=Harness.objects.exclude(sandbox=None).values("sandbox_id")
    )
    counts = {
        "/exec": lambda: Exec.objects.filter(sandbox__in=mine).count(),
        "/terminals": lambda: Terminal.objects.filter(sandbox__in=mine).count(),
        "/sandboxes": lambda: mine.count(),
        "/volumes": lambda: Volume.objects.filter(team_id=team_id).count(),
        "/secrets": lambda: Secret.objects.filter(team_id=team_id).count(),
        "/pools": lambda: Pool.objects.filter(team_id=team_id).count(),
        "/harnesses": lambda: Harness.objects.filter(team_id=team_id).count(),
        "/runs": lambda: Run.objects.filter(harness__team_id=team_id).count(),
        "/tokens": lambda: ApiToken.objects.filter(team_id=team_id).count(),
    }
    return {what: count() for what, count in counts.items() if what in path}


def _has_message(r: Any) -> bool:
    try:
        body = r.json()
    except ValueError:
        return False
    return isinstance(body, dict) and bool(body.get("detail") or body.get("message"))


# -- slow and oversized requests ------------------------------------------------------------------


def _raw(server: str, payload: bytes, delay: float = 0.0, timeout: float = 40.0) -> bytes:
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        if delay:
            for i in range(len(payload)):
                s.sendall(payload[i : i + 1])
                time.sleep(delay)
        else:
            s.sendall(payload)
        out = b""
        while b"\r\n\r\n" not in out:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
        return out


@pytest.mark.timeout(120)
def test_a_trickled_request_is_served_and_holds_nobody_up(server, local_node, team_token, report):
    import httpx

    request = (f"GET /api/v1/sandboxes HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {team_token}\r\n"
               "Connection: close\r\n\r\n").encode()  # fmt: skip
    answers: list[bytes] = []
    t = threading.Thread(target=lambda: answers.append(_raw(server, request, delay=0.02)))
    t.start()
    time.sleep(0.5)
    started = time.monotonic()
    quick = httpx.get(
        f"{server}/api/v1/sandboxes", headers={"Authorization": f"Bearer {team_token}"}, timeout=10
    )
    others_wait = time.monotonic() - started
    t.join(timeout=60)
    assert quick.status_code == 200 and others_wait < 2, others_wait
    assert answers and answers[0].startswith(b"HTTP/1.1 200"), answers
    report.held("slow client", f"a request trickled a byte every 20 ms ({len(request)} bytes) is served",
                another_request_s=round(others_wait, 3))  # fmt: skip


@pytest.mark.timeout(60)
def test_huge_headers_and_request_lines_are_refused_cleanly(server, local_node, team_token, report):
    import httpx

    huge_header = (f"GET /api/v1/sandboxes HTTP/1.1\r\nHost: localhost\r\nX-Big: {'a' * 200_000}\r\n"
                   "Connection: close\r\n\r\n").encode()  # fmt: skip
    huge_line = f"GET /api/v1/sandboxes?{'q=1&' * 50_000} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode()
    many = ("GET /api/v1/sandboxes HTTP/1.1\r\nHost: localhost\r\n" + "X-A: b\r\n" * 10_000 + "\r\n").encode()
    for name, payload in (("a 200 kB header", huge_header), ("a 250 kB request line", huge_line),
                          ("10,000 headers", many), ("a 17 kB URL", f"GET /?{'q' * 17_000} HTTP/1.1\r\n\r\n".encode())):  # fmt: skip
        answer = _raw(server, payload, timeout=20)
        status = answer.split(b" ", 2)[1] if answer.startswith(b"HTTP/") else b"no answer"
        assert status in (b"414", b"431"), (name, answer[:300])
        report.held("oversized request", name, answer=status.decode())
    ok = httpx.get(
        f"{server}/api/v1/sandboxes", headers={"Authorization": f"Bearer {team_token}"}, timeout=10
    )
    assert ok.status_code == 200


# -- malformed websocket frames -------------------------------------------------------------------


def _frame(first: int, payload: bytes, *, masked: bool = True, length: int | None = None) -> bytes:
    """A websocket frame as a client writes it, or as it must not: ``first`` is the FIN, RSV
    and opcode byte; ``length`` announces a length other than the payload's."""
    import os
    import struct

    n = len(payload) if length is None else length
    mask_bit = 0x80 if masked else 0
    if n < 126:
        head = bytes([first, mask_bit | n])
    elif n < 2**16:
        head = bytes([first, mask_bit | 126]) + struct.pack("!H", n)
    else:
        head = bytes([first, mask_bit | 127]) + struct.pack("!Q", n)
    if not masked:
        return head + payload
    key = os.urandom(4)
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


# Each sent alone, first on a connection the server accepted: (what, the frames, the close codes
# that are a right answer). 1002: protocol error; 1007: invalid data; 1009: too big.
BAD_FRAMES = [
    ("an unmasked frame from a client", _frame(0x81, b"hello", masked=False), {1002}),
    ("a reserved opcode (0x3)", _frame(0x83, b"x"), {1002}),
    ("a reserved control opcode (0xB)", _frame(0x8B, b""), {1002}),
    ("RSV1 set with no extension agreed", _frame(0xC1, b"hi"), {1002}),
    ("a continuation with no message begun", _frame(0x80, b"x"), {1002}),
    ("a text frame that is not UTF-8", _frame(0x81, b"\xff\xfe\xfd"), {1007}),
    ("a ping of 200 bytes (control frames hold at most 125)", _frame(0x89, b"p" * 200), {1002}),
    ("a fragmented ping", _frame(0x09, b"p"), {1002}),
    ("a frame announcing 2**62 bytes", _frame(0x82, b"", length=2**62), {1009}),
    ("a message of 1.5 MiB in fragments", _frame(0x02, b"a" * 2**20) + _frame(0x80, b"a" * 2**19), {1009}),
    ("a close frame with one byte of code", _frame(0x88, b"\x03"), {1002}),
    ("a close frame with code 999", _frame(0x88, b"\x03\xe7"), {1002}),
]


def _close_code(sock: socket.socket, timeout: float) -> int | str | None:
    """The code of the close frame the server answers with (None: it only hung up; "nothing":
    neither, within ``timeout``)."""
    sock.settimeout(timeout)
    data = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        data += chunk
        while len(data) >= 2:  # the server's frames: unmasked, short ones here
            opcode, n = data[0] & 0x0F, data[1] & 0x7F
            if n >= 126 or len(data) < 2 + n:
                break
            if opcode == 0x8:
                return int.from_bytes(data[2:4], "big") if n >= 2 else None
            data = data[2 + n :]
    return "nothing" if time.monotonic() >= deadline else None


@pytest.mark.timeout(240)
def test_malformed_websocket_frames_are_closed_with_the_right_code_and_hurt_nobody(
    api, server, team_token, report
):
    import base64
    import os

    from tests.api.test_sandboxes_api import create

    sandbox = create(api)["id"]
    host, port = server.removeprefix("http://").split(":")
    handshake = (
        f"GET /ws/v1/sandboxes/{sandbox}/exec HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\n"
        f"Authorization: Bearer {team_token}\r\n\r\n"
    ).encode()
    wrong: list[str] = []
    for what, frames, right in BAD_FRAMES:
        with socket.create_connection((host, int(port)), timeout=20) as sock:
            sock.sendall(handshake)
            head = b""
            while b"\r\n\r\n" not in head:
                head += sock.recv(4096)
            assert head.startswith(b"HTTP/1.1 101"), (what, head[:200])
            try:
                sock.sendall(frames)
            except (BrokenPipeError, ConnectionResetError):
                pass  # closed before it read the rest: answered already
            code = _close_code(sock, 15)
        # A close frame with the code, or the connection dropped at once: autobahn, under daphne,
        # fails a connection that breaks the protocol by dropping it, which RFC 6455 allows.
        if code not in right and code is not None:
            wrong.append(f"{what}: closed with {code}, not {sorted(right)}")
            continue
        report.held("malformed websocket frame", what, answer=f"close {code}" if code else "dropped")
    assert not wrong, "\n".join(wrong)
    # The server, and this sandbox's sockets, serve a well-behaved client as before.
    from websockets.sync.client import connect

    with connect(f"ws://{host}:{port}/ws/v1/sandboxes/{sandbox}/exec",
                 additional_headers={"Authorization": f"Bearer {team_token}"}, open_timeout=20) as ws:  # fmt: skip
        ws.send(json.dumps({"cmd": ["echo", "still-here"]}))
        seen = ""
        while "still-here" not in seen:
            seen += str(ws.recv(timeout=20))
    assert api.get("/health").status_code == 200
