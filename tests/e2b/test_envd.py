"""E2B's in-sandbox API (envd) at /e2b/envd, driven by the real ``e2b`` SDK from PyPI (sync and
async) against the real server, worker, bridge and runsc sandboxes: commands, background
processes, files and PTYs, and who may reach them."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import statistics
import struct
import threading
import time

import httpx
import pytest
from e2b import (
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    FilesystemEventType,
    FileType,
    NotFoundException,
    Sandbox,
)
from e2b.sandbox.commands.command_handle import PtySize

from tests.support import requires_runsc, wait_until


@pytest.fixture
def e2b(server, celery_worker, bridge, local_node, team_token, monkeypatch) -> str:
    """The SDK pointed at this Hangar by the environment, as a user does (docs/e2b.md)."""
    monkeypatch.setenv("E2B_API_URL", f"{server}/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", f"{server}/e2b/envd")
    monkeypatch.setenv("E2B_API_KEY", team_token)
    monkeypatch.delenv("E2B_DOMAIN", raising=False)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    return f"{server}/e2b/envd"


def _envelope(message: dict) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(data)) + data


def _start_over_http(envd: str, sid: str, token: str | None) -> httpx.Response:
    headers = {"E2b-Sandbox-Id": sid, "Content-Type": "application/connect+json"}
    if token is not None:
        headers["X-Access-Token"] = token
    body = _envelope({"process": {"cmd": "/bin/sh", "args": ["-c", "echo hi"]}})
    return httpx.post(f"{envd}/process.Process/Start", content=body, headers=headers, timeout=30)


def _stream_error(r: httpx.Response) -> dict:
    """The error of a Connect stream's end message."""
    assert r.status_code == 200 and r.headers["content-type"] == "application/connect+json", r.text
    flags, size = struct.unpack(">BI", r.content[:5])
    assert flags == 0x02, r.content  # nothing else was sent: refused before it started
    return json.loads(r.content[5 : 5 + size])["error"]


# -- the sync SDK ------------------------------------------------------------------------------


@requires_runsc
def test_commands_run_stream_fail_and_run_in_the_background(e2b):
    sbx = Sandbox.create("busybox", timeout=120, allow_internet_access=False)
    try:
        assert sbx.is_running() is True
        r = sbx.commands.run('echo out; echo err >&2; printf %s "$FOO"', envs={"FOO": "bar baz"})
        assert r.exit_code == 0 and r.stdout == "out\nbar baz" and r.stderr == "err\n"
        assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
        # As the image's user (root), or another one it has; one it lacks is told so.
        assert sbx.commands.run("id -u").stdout == sbx.commands.run("id -u", user="root").stdout == "0\n"
        assert sbx.commands.run("id -u", user="nobody").stdout == "65534\n"
        with pytest.raises(CommandExitException, match="user ghost does not exist"):
            sbx.commands.run("true", user="ghost")
        with pytest.raises(CommandExitException) as failed:
            sbx.commands.run("echo nope >&2; exit 3")
        assert failed.value.exit_code == 3 and failed.value.stderr == "nope\n"

        # on_stdout hears each line as it is written, not at the end.
        heard: list[tuple[float, str]] = []
        started = time.monotonic()
        sbx.commands.run("echo one; sleep 1; echo two",
                         on_stdout=lambda line: heard.append((time.monotonic() - started, line)))  # fmt: skip
        assert [line for _, line in heard] == ["one\n", "two\n"] and heard[1][0] - heard[0][0] > 0.5

        # A background command outlives the call that started it; found by pid, fed, followed.
        proc = sbx.commands.run("read line; echo got $line; sleep 600", background=True, stdin=True)
        listed = {p.pid: p for p in sbx.commands.list()}
        assert proc.pid in listed and listed[proc.pid].cmd == "/bin/sh"  # busybox: bash's stand-in
        assert listed[proc.pid].args[-1].startswith("read line")
        follower = sbx.commands.connect(proc.pid)
        sbx.commands.send_stdin(proc.pid, "hello\n")
        out = []
        for stdout, _, _ in follower:
            if stdout:
                out.append(stdout)
            if "got hello" in "".join(out):
                break
        assert "".join(out) == "got hello\n"
        assert sbx.commands.kill(proc.pid) is True
        wait_until(lambda: proc.pid not in {p.pid for p in sbx.commands.list()}, 10, what="killed")
        assert sbx.commands.kill(proc.pid) is False  # gone: the SDK's answer for not_found
        with pytest.raises(NotFoundException):
            sbx.commands.connect(proc.pid)

        # Input streamed in chunks (StreamInput, a client stream), then stdin closed: cat sees it all.
        cat = sbx.commands.run("cat > /tmp/streamed; echo done", background=True, stdin=True)
        sbx.commands.stream_input(cat.pid, (f"chunk {i}\n" for i in range(50)))
        sbx.commands.close_stdin(cat.pid)
        assert cat.wait().stdout == "done\n"
        assert sbx.files.read("/tmp/streamed") == "".join(f"chunk {i}\n" for i in range(50))

        # Median of a trivial command on a running sandbox, through the SDK (the target: 25 ms).
        times = []
        for _ in range(20):
            t = time.perf_counter()
            sbx.commands.run("true")
            times.append((time.perf_counter() - t) * 1000)
        print(f"\ncommands.run('true'): median {statistics.median(times):.1f} ms over 20")
    finally:
        sbx.kill()


@requires_runsc
def test_commands_run_as_the_image_s_own_user_unless_another_is_named(e2b):
    """An image whose config names a USER (as E2B's templates do) runs commands and PTYs as
    that user; root, or any user it has, when the request names one."""
    import dataclasses

    from runtime.models import Image
    from runtime.node.local import image_store
    from runtime.services.images import image_register

    info_of_busybox = image_store().get(Image.objects.get(name="busybox").digest)
    image_register(info=dataclasses.replace(info_of_busybox, config={**info_of_busybox.config, "user": "nobody:nogroup"}),
                   name="busybox-as-nobody")  # fmt: skip
    sbx = Sandbox.create("busybox-as-nobody", timeout=120, allow_internet_access=False)
    try:
        assert sbx.commands.run("id -un").stdout == "nobody\n"
        assert sbx.commands.run("id -u", user="root").stdout == "0\n"
        background = sbx.commands.run("id -u > /tmp/who; sleep 30", background=True)
        wait_until(lambda: sbx.commands.run("cat /tmp/who 2>/dev/null || true", user="root").stdout == "65534\n", 20,
                   what="the background command's user")  # fmt: skip
        background.kill()
        seen = bytearray()
        term = sbx.pty.create(PtySize(rows=24, cols=80), timeout=60)
        reader = threading.Thread(target=lambda: [seen.extend(pty) for _, _, pty in term if pty], daemon=True)
        reader.start()
        sbx.pty.send_stdin(term.pid, b"echo uid-$(id -u)\n")
        deadline = time.monotonic() + 15
        while b"uid-65534" not in seen and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b"uid-65534" in seen, bytes(seen)
        assert sbx.pty.kill(term.pid) is True
        reader.join(10)
        # Files written through envd are the image user's, and a relative path is under its home.
        info = sbx.files.write("notes/mine.txt", "mine\n")
        assert info.path == "/nonexistent/notes/mine.txt"
        assert sbx.commands.run("stat -c %u /nonexistent/notes/mine.txt").stdout == "65534\n"
        sbx.commands.run("echo more >> notes/mine.txt", cwd="/nonexistent")  # as nobody, who may
        assert sbx.files.read("notes/mine.txt") == "mine\nmore\n"
        assert sbx.files.make_dir("built") is True
        assert sbx.commands.run("stat -c %u /nonexistent/built").stdout == "65534\n"
    finally:
        sbx.kill()
    # A bare uid is found by number; one the image has no entry for runs as root, as before.
    for user, expected in (("65534", "nobody\n"), ("4242", "root\n")):
        image_register(info=dataclasses.replace(info_of_busybox, config={**info_of_busybox.config, "user": user}),
                       name=f"busybox-as-{user}")  # fmt: skip
        box = Sandbox.create(f"busybox-as-{user}", timeout=60, allow_internet_access=False)
        try:
            assert box.commands.run("id -un").stdout == expected, user
        finally:
            box.kill()


@requires_runsc
def test_files_and_pty(e2b):
    t = time.perf_counter()
    sbx = Sandbox.create("busybox", timeout=120, allow_internet_access=False)
    sbx.commands.run("true")
    print(f"\ncreate + first command: {(time.perf_counter() - t) * 1000:.0f} ms")
    try:
        info = sbx.files.write("/work/dir/hello.txt", "héllo\n")
        assert info.path == "/work/dir/hello.txt" and info.name == "hello.txt"
        assert sbx.files.read("/work/dir/hello.txt") == "héllo\n"
        blob = bytes(range(256)) * 8192  # 2 MiB: over the API's JSON limit, held to the file limit
        sbx.files.write("/work/dir/blob.bin", blob)
        assert bytes(sbx.files.read("/work/dir/blob.bin", format="bytes")) == blob
        sbx.files.write_files([{"path": "/work/a.txt", "data": "a"}, {"path": "/work/b.txt", "data": b"b"}])
        assert sbx.files.read("/work/b.txt") == "b"
        # A file-like object goes as application/octet-stream, gzip=True gzipped (envd 0.5.7's).
        sbx.files.write("/work/dir/streamed.bin", io.BytesIO(blob))
        sbx.files.write("/work/dir/zipped.bin", blob, gzip=True)
        for name in ("streamed.bin", "zipped.bin"):
            assert bytes(sbx.files.read(f"/work/dir/{name}", format="bytes")) == blob, name
        assert sbx.commands.run("cat /work/a.txt").stdout == "a"  # where commands see them

        entries = {e.name: e for e in sbx.files.list("/work")}
        assert set(entries) == {"a.txt", "b.txt", "dir"} and entries["dir"].type == FileType.DIR
        assert entries["a.txt"].type == FileType.FILE and entries["a.txt"].size == 1
        watcher = sbx.files.watch_dir("/work")  # polled: the sandbox's agent has no inotify
        deep = {e.path for e in sbx.files.list("/work", depth=2)}
        assert "/work/dir/blob.bin" in deep
        assert sbx.files.get_info("/work/dir/blob.bin").size == len(blob)
        sbx.files.write("/work/c.txt", "c")
        events = {(e.name, e.type) for e in watcher.get_new_events()}
        assert events == {("c.txt", FilesystemEventType.CREATE)}
        watcher.stop()

        assert sbx.files.exists("/work/a.txt") and not sbx.files.exists("/work/none")
        assert sbx.files.make_dir("/work/new/deeper") is True
        assert sbx.files.make_dir("/work/new/deeper") is False  # already there
        moved = sbx.files.rename("/work/a.txt", "/work/new/a.txt")
        assert moved.path == "/work/new/a.txt" and not sbx.files.exists("/work/a.txt")
        sbx.files.remove("/work/new")
        assert not sbx.files.exists("/work/new/a.txt")
        with pytest.raises(NotFoundException):
            sbx.files.read("/work/missing.txt")
        with pytest.raises(NotFoundException):
            sbx.files.rename("/work/missing.txt", "/work/x")

        # A PTY: input typed in, its size changed, killed.
        seen = bytearray()
        term = sbx.pty.create(PtySize(rows=24, cols=80), timeout=60)
        reader = threading.Thread(target=lambda: [seen.extend(pty) for _, _, pty in term if pty], daemon=True)
        reader.start()
        sbx.pty.send_stdin(term.pid, b"stty size; echo mark-$((6*7))\n")
        wait_until(lambda: b"mark-42" in seen, 15, what="the PTY's answer")
        assert b"24 80" in seen
        sbx.pty.resize(term.pid, PtySize(rows=30, cols=100))
        sbx.pty.send_stdin(term.pid, b"stty size\n")
        wait_until(lambda: b"30 100" in seen, 15, what="the new size")
        assert sbx.pty.kill(term.pid) is True
        reader.join(10)
        assert not reader.is_alive()  # the stream ended with the PTY
    finally:
        sbx.kill()
    assert sbx.is_running() is False


# -- who may reach a sandbox's envd -----------------------------------------------------------


@requires_runsc
def test_access_token_is_required_and_bound_to_a_live_token_of_the_team(e2b, server, team_token,
                                                                        other_team_token):  # fmt: skip
    from runtime.models import ApiToken
    from runtime.services.auth import token_revoke_row

    sbx = Sandbox.create("busybox", timeout=120, allow_internet_access=False)
    sid, token = sbx.sandbox_id, sbx._envd_access_token
    try:
        assert _start_over_http(e2b, sid, None).status_code == 200
        assert _stream_error(_start_over_http(e2b, sid, None))["code"] == "unauthenticated"
        assert _stream_error(_start_over_http(e2b, sid, token + "0"))["code"] == "unauthenticated"
        health = httpx.get(f"{e2b}/health", headers={"E2b-Sandbox-Id": sid}, timeout=10)
        assert health.status_code == 401
        files = httpx.get(f"{e2b}/files", params={"path": "/etc/hostname"}, headers={"E2b-Sandbox-Id": sid})
        assert files.status_code == 401

        # Another team's key finds nothing, and its own access tokens open nothing here.
        other = Sandbox.create("busybox", timeout=60, allow_internet_access=False, api_key=other_team_token)
        try:
            assert (
                _stream_error(_start_over_http(e2b, sid, other._envd_access_token))["code"]
                == "unauthenticated"
            )
        finally:
            other.kill()
        with pytest.raises(NotFoundException):
            Sandbox.connect(sid, api_key=other_team_token)

        # A long stream sees the revocation; a new call is refused.
        follow = sbx.commands.run("sleep 600", background=True)
        token_revoke_row(ApiToken.objects.get(id=int(token.split(".")[0])))
        with pytest.raises(AuthenticationException):
            sbx.commands.run("true")
        with pytest.raises(AuthenticationException):
            sbx.files.read("/etc/hostname")
        with pytest.raises(AuthenticationException, match="access ended"):
            follow.wait()
    finally:
        Sandbox.kill(sid, api_key=_fresh_token())


@requires_runsc
def test_a_quiet_stream_sends_keepalive_events_as_often_as_the_client_asks(e2b):
    """Start's stream for a command that prints nothing for a while: keepalive events every
    ``Keepalive-Ping-Interval`` seconds (the SDK sends the header), then its end."""
    sbx = Sandbox.create("busybox", timeout=120, allow_internet_access=False)
    try:
        headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token,
                   "Content-Type": "application/connect+json", "Keepalive-Ping-Interval": "1"}  # fmt: skip
        body = _envelope({"process": {"cmd": "/bin/sh", "args": ["-c", "sleep 3.5; echo late"]}})
        r = httpx.post(f"{e2b}/process.Process/Start", content=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        events, at = [], 0
        while at < len(r.content):
            flags, size = struct.unpack(">BI", r.content[at : at + 5])
            message = json.loads(r.content[at + 5 : at + 5 + size])
            events.append("end-of-stream" if flags & 0x02 else next(iter(message["event"])))
            at += 5 + size
        assert events[0] == "start" and events[-2:] == ["end", "end-of-stream"], events
        assert events.count("keepalive") >= 2, events  # 3.5 s of quiet, one every second
        assert "data" in events[events.index("keepalive") :], events
    finally:
        sbx.kill()


@requires_runsc
def test_an_image_with_bash_runs_commands_under_bash(e2b, minimal_image):
    sbx = Sandbox.create(minimal_image, timeout=120, allow_internet_access=False)
    try:
        r = sbx.commands.run('echo "bash $BASH_VERSION"; shopt -q login_shell && echo login')
        assert r.stdout.startswith("bash 5") and r.stdout.endswith("login\n"), r.stdout
    finally:
        sbx.kill()


@requires_runsc
def test_a_gzipped_upload_is_unpacked_and_a_bad_one_refused(e2b):
    import gzip

    sbx = Sandbox.create("busybox", timeout=120, allow_internet_access=False)
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token,
               "Content-Type": "application/octet-stream"}  # fmt: skip
    try:

        def post(body: bytes, encoding: str) -> httpx.Response:
            return httpx.post(f"{e2b}/files", params={"path": "/work/up.bin"}, content=body, timeout=60,
                              headers={**headers, "Content-Encoding": encoding})  # fmt: skip

        assert post(gzip.compress(b"packed\n"), "gzip").status_code == 200
        assert sbx.files.read("/work/up.bin") == "packed\n"
        r = post(gzip.compress(b"x" * 1000)[:-12], "gzip")
        assert r.status_code == 400 and "cut short" in r.text, r.text
        r = post(b"plain", "br")
        assert r.status_code == 400 and "Content-Encoding 'br'" in r.text, r.text
        assert sbx.files.read("/work/up.bin") == "packed\n"  # none of those wrote anything
    finally:
        sbx.kill()


@requires_runsc
def test_files_post_takes_each_part_s_filename_as_its_whole_path_or_octet_stream_to_path(e2b):
    """envd's plain ``POST /files`` as E2B's SDKs send it, over HTTP with the access token."""
    sbx = Sandbox.create("busybox", timeout=120, allow_internet_access=False)
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token}
    try:
        with httpx.Client(base_url=e2b, headers=headers, timeout=60) as http:
            # Multipart: a part's filename is its whole destination (never cut to its last name).
            parts = [("file", ("/work/up/one.txt", b"one\n", "application/octet-stream")),
                     ("file", ("/work/deep/er/two.bin", b"\x00\xfftwo", "application/octet-stream"))]  # fmt: skip
            r = http.post("/files", files=parts)
            assert r.status_code == 200, r.text
            assert r.json() == [{"name": "one.txt", "type": "file", "path": "/work/up/one.txt"},
                                {"name": "two.bin", "type": "file", "path": "/work/deep/er/two.bin"}]  # fmt: skip
            assert sbx.commands.run("cat /work/up/one.txt; ls /work").stdout == "one\ndeep\nup\n"
            got = http.get("/files", params={"path": "/work/deep/er/two.bin"})
            assert got.status_code == 200 and got.content == b"\x00\xfftwo"
            # One part with ?path=: the query names where it goes.
            r = http.post(
                "/files", params={"path": "/work/named.txt"}, files=[("file", ("ignored", b"named"))]
            )
            assert r.status_code == 200 and r.json()[0]["path"] == "/work/named.txt", r.text
            # application/octet-stream: the body is the file, ?path= its destination.
            r = http.post("/files", params={"path": "/work/raw.bin"}, content=bytes(range(256)),
                          headers={"Content-Type": "application/octet-stream"})  # fmt: skip
            assert r.status_code == 200 and r.json() == [
                {"name": "raw.bin", "type": "file", "path": "/work/raw.bin"}
            ]
        assert bytes(sbx.files.read("/work/raw.bin", format="bytes")) == bytes(range(256))
        assert sbx.files.read("/work/named.txt") == "named"
        refused = httpx.post(f"{e2b}/files", params={"path": "/work/x"}, content=b"x", timeout=30,
                             headers={"E2b-Sandbox-Id": sbx.sandbox_id, "Content-Type": "application/octet-stream"})  # fmt: skip
        assert refused.status_code == 401  # no access token: nothing written
        assert not sbx.files.exists("/work/x")
    finally:
        sbx.kill()


def test_the_create_response_s_domain_has_the_preview_port_unless_it_is_the_scheme_s_own(settings):
    from types import SimpleNamespace

    from dashboard.e2b.schemas import created_out

    sandbox = SimpleNamespace(image="busybox", id="sbx-one", node=None, open_ports="public")
    caller = SimpleNamespace(pk=7, scopes=[], effective_role="member")
    settings.HANGAR_PREVIEW_DOMAIN = "preview.example.com"
    for scheme, port, expected in [
        ("http", 8000, "preview.example.com:8000"), ("http", 80, "preview.example.com"),
        ("https", 443, "preview.example.com"), ("https", 8443, "preview.example.com:8443"),
        ("http", 443, "preview.example.com:443"), ("http", 0, "preview.example.com"),
    ]:  # fmt: skip
        settings.HANGAR_PREVIEW_SCHEME, settings.HANGAR_PREVIEW_PORT = scheme, port
        assert created_out(sandbox, caller)["domain"] == expected, (scheme, port)


def _fresh_token() -> str:
    from django.contrib.auth import get_user_model

    from runtime.models import Team
    from runtime.services.auth import token_create

    return token_create(
        user=get_user_model().objects.get(username="alice"), team=Team.objects.get(name="alpha")
    ).raw


@requires_runsc
def test_pause_then_connect_keeps_files_and_runs_commands(e2b):
    sbx = Sandbox.create("busybox", timeout=120, allow_internet_access=False)
    try:
        sbx.files.write("/work/kept.txt", "kept")
        assert sbx.pause() is True
        assert sbx.is_running() is False
        with pytest.raises(Exception, match="was not found"):
            sbx.commands.run("true")
        again = Sandbox.connect(sbx.sandbox_id, timeout=120)
        assert again.is_running() is True
        assert again.files.read("/work/kept.txt") == "kept"
        assert again.commands.run("cat /work/kept.txt").stdout == "kept"
    finally:
        sbx.kill()


# -- the async SDK -----------------------------------------------------------------------------


@requires_runsc
def test_async_sdk_runs_commands_files_and_a_pty(e2b):
    async def scenario() -> None:
        sbx = await AsyncSandbox.create("busybox", timeout=120, allow_internet_access=False)
        try:
            assert await sbx.is_running() is True
            lines: list[str] = []
            r = await sbx.commands.run("echo a; echo b >&2; echo c", on_stdout=lines.append)
            assert r.stdout == "a\nc\n" and r.stderr == "b\n" and "".join(lines) == "a\nc\n"
            with pytest.raises(CommandExitException):
                await sbx.commands.run("exit 7")
            proc = await sbx.commands.run("cat", background=True, stdin=True)
            assert proc.pid in [p.pid for p in await sbx.commands.list()]
            await sbx.commands.send_stdin(proc.pid, "piped\n")
            await sbx.commands.close_stdin(proc.pid)
            done = await proc.wait()
            assert done.stdout == "piped\n" and done.exit_code == 0

            await sbx.files.write("/work/x.bin", b"\x00\xff")
            assert bytes(await sbx.files.read("/work/x.bin", format="bytes")) == b"\x00\xff"
            assert [e.name for e in await sbx.files.list("/work")] == ["x.bin"]
            seen_events: list = []
            watch = await sbx.files.watch_dir("/work", on_event=seen_events.append)
            await sbx.files.remove("/work/x.bin")
            for _ in range(50):
                if seen_events:
                    break
                await asyncio.sleep(0.1)
            await watch.stop()
            assert [(e.name, e.type) for e in seen_events] == [("x.bin", FilesystemEventType.REMOVE)]
            with pytest.raises(NotFoundException):
                await sbx.files.read("/work/nope")

            seen = bytearray()
            term = await sbx.pty.create(PtySize(rows=24, cols=80), on_data=seen.extend)
            await sbx.pty.send_stdin(term.pid, b"echo hi-$((1+1))\n")
            for _ in range(150):
                if b"hi-2" in seen:
                    break
                await asyncio.sleep(0.1)
            assert b"hi-2" in seen
            await sbx.pty.resize(term.pid, PtySize(rows=10, cols=40))
            assert await sbx.pty.kill(term.pid) is True
        finally:
            await sbx.kill()

    asyncio.run(scenario())


def test_envelopes_and_base64_round_trip():
    from dashboard.e2b.envd.protocol import RpcError, end_envelope, envelope, unb64, unwrap

    body = envelope({"a": 1}) + envelope({"b": "x"}) + end_envelope()
    assert unwrap(body) == [{"a": 1}, {"b": "x"}]
    assert unb64(base64.b64encode(b"\xff\xfe").decode().rstrip("="), "x") == b"\xff\xfe"
    assert unb64(base64.urlsafe_b64encode(b"\xff\xfe").decode(), "x") == b"\xff\xfe"
    with pytest.raises(RpcError):
        unwrap(body[:-1])


def test_a_gzipped_upload_unpacking_past_the_file_limit_is_a_413(settings):
    import gzip

    from django.test import RequestFactory

    from dashboard.e2b.envd.files import _decoded
    from dashboard.e2b.envd.protocol import RpcError
    from runtime.errors import TooLarge

    settings.HANGAR_FILE_MAX_BYTES = 4096

    def request(body: bytes):
        return RequestFactory().post("/e2b/envd/files", data=body, content_type="application/octet-stream",
                                     HTTP_CONTENT_ENCODING="gzip")  # fmt: skip

    assert _decoded(request(gzip.compress(b"a" * 4096))) == b"a" * 4096  # up to the limit, whole
    with pytest.raises(TooLarge, match="HANGAR_FILE_MAX_BYTES"):
        _decoded(request(gzip.compress(b"\0" * (10 * 1024 * 1024))))  # 10 MiB of zeros in ~10 KB
    # A file of several members (`gzip -c a b`, pigz) is every member's bytes, within the limit too.
    assert _decoded(request(gzip.compress(b"first ") + gzip.compress(b"second"))) == b"first second"
    with pytest.raises(TooLarge):
        _decoded(request(gzip.compress(b"a" * 3000) + gzip.compress(b"b" * 3000)))
    # While two are being unpacked, a third is told to come back.
    from dashboard.e2b.envd import files

    assert files._UNPACKING.acquire(blocking=False) and files._UNPACKING.acquire(blocking=False)
    try:
        with pytest.raises(RpcError, match="too many compressed uploads"):
            _decoded(request(gzip.compress(b"x")))
    finally:
        files._UNPACKING.release()
        files._UNPACKING.release()


def test_envd_uploads_and_input_have_their_data_limits(settings):
    from dashboard.limits import body_limit

    assert body_limit("POST", "/e2b/envd/files")[0] == settings.HANGAR_FILE_MAX_BYTES
    stdin = body_limit("POST", "/api/v1/sandboxes/sbx/processes/7/stdin")
    assert body_limit("POST", "/e2b/envd/process.Process/SendInput") == stdin
    assert body_limit("POST", "/e2b/envd/process.Process/StreamInput") == stdin
    assert body_limit("POST", "/e2b/envd/process.Process/Start") == (
        settings.HANGAR_JSON_MAX_BYTES,
        "HANGAR_JSON_MAX_BYTES",
    )
