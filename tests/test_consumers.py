"""Websocket consumers against the real ASGI app (``channels.testing.WebsocketCommunicator``),
with the real stream bridge process and real runsc sandboxes behind them."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest
from channels.testing import WebsocketCommunicator

from dashboard.asgi import application
from tests.api.test_sandboxes_api import create
from tests.support import refused_with, requires_runsc

pytestmark = [requires_runsc]

PROMPT = b"READY$ "


@pytest.fixture(autouse=True)
def fresh_channel_layer():
    """Each test runs its own event loop (asyncio.run); a server has one for its life. The
    Channels layer keeps state bound to the loop that used it (a receive still waiting when a
    test's loop closed holds its lock), so each test gets a layer of its own."""
    from channels.layers import channel_layers

    channel_layers.backends.clear()
    yield
    channel_layers.backends.clear()


def communicator(path: str, token: str | None = None, **kw) -> WebsocketCommunicator:
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    headers += kw.pop("headers", [])
    return WebsocketCommunicator(application, path, headers=headers, **kw)


async def read_until(
    comm: WebsocketCommunicator, pattern: bytes, timeout: float = 15.0, acks: bool = False
) -> bytes:
    """Collect binary frames until ``pattern`` shows up (acknowledging them when ``acks``)."""
    buf = bytearray()
    deadline = time.monotonic() + timeout
    while pattern not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{pattern!r} did not arrive; last output: {bytes(buf[-300:])!r}")
        msg = await comm.receive_output(timeout=left)
        if msg["type"] == "websocket.close":
            raise AssertionError(f"closed before {pattern!r}: {msg}; output: {bytes(buf[-300:])!r}")
        if msg.get("bytes") is not None:
            buf += msg["bytes"]
            if acks:
                await comm.send_to(text_data=json.dumps({"type": "ack", "bytes": len(msg["bytes"])}))
    return bytes(buf)


@pytest.fixture
def sandbox(api):
    return create(api)["id"]


@pytest.fixture
def terminal(api, sandbox):
    r = api.post(f"/sandboxes/{sandbox}/terminals", json={"env": {"PS1": PROMPT.decode()}})
    assert r.status_code == 201, r.text
    return r.json()


def test_terminal_runs_commands_and_replays_the_screen_on_reconnect(terminal, team_token):
    async def main() -> None:
        comm = communicator(terminal["websocket"], team_token)
        connected, _ = await comm.connect()
        assert connected
        await comm.send_to(bytes_data=b"echo $((6*7))\n")
        out = await read_until(comm, b"\r\n42\r\n")
        assert b"echo $((6*7))" in out  # the shell echoed what was typed
        await comm.disconnect()

        # The shell lived on without a viewer; a new one gets the earlier screen replayed.
        comm = communicator(terminal["websocket"], team_token)
        assert (await comm.connect())[0]
        replay = await read_until(comm, b"\r\n42\r\n")
        assert b"echo $((6*7))" in replay
        await comm.send_to(text_data=json.dumps({"type": "ping"}))
        while True:
            msg = await comm.receive_output(5)
            if msg.get("text"):
                assert json.loads(msg["text"]) == {"type": "pong"}
                break
        await comm.disconnect()

    asyncio.run(main())


def test_several_viewers_share_one_terminal(terminal, team_token):
    async def main() -> None:
        a = communicator(terminal["websocket"], team_token)
        b = communicator(terminal["websocket"], team_token)
        assert (await a.connect())[0] and (await b.connect())[0]
        await read_until(a, PROMPT)
        await read_until(b, PROMPT)
        await a.send_to(bytes_data=b"echo from-a-$((1+1))\n")
        await read_until(b, b"from-a-2")  # b sees what a typed and what it printed
        await b.send_to(bytes_data=b"echo from-b-$((2+2))\n")
        await read_until(a, b"from-b-4")
        await a.disconnect()
        await b.disconnect()

    asyncio.run(main())


def test_terminal_resize_reaches_the_pty(terminal, team_token):
    async def main() -> None:
        comm = communicator(terminal["websocket"], team_token)
        assert (await comm.connect())[0]
        await read_until(comm, PROMPT)
        await comm.send_to(text_data=json.dumps({"type": "resize", "rows": 33, "cols": 111}))
        await asyncio.sleep(0.3)
        await comm.send_to(bytes_data=b"stty size\n")
        await read_until(comm, b"33 111")
        await comm.disconnect()

    asyncio.run(main())


def test_yes_flat_out_then_ctrl_c_gives_the_prompt_back(terminal, team_token):
    """Flow control: the client acknowledges what it consumed (as xterm.js's write callback
    does); `yes` is held back to that pace, and Ctrl-C still gets through at once."""

    async def main() -> None:
        comm = communicator(terminal["websocket"] + "?flow=1", team_token)
        assert (await comm.connect())[0]
        await read_until(comm, PROMPT, acks=True)
        await comm.send_to(bytes_data=b"yes\n")
        flood = await read_until(comm, b"y\r\ny\r\ny\r\n" * 1000, acks=True)
        # Let it run flat out for a while (at least 2 s and 20 KB: a gVisor pty gives busybox
        # yes anything from ~10 to 100 KB/s here, with the host's load), reading and
        # acknowledging like a browser.
        start = time.monotonic()
        received = len(flood)
        while time.monotonic() < start + 2.0 or (received <= 20_000 and time.monotonic() < start + 30):
            msg = await comm.receive_output(15)
            if msg.get("bytes"):
                received += len(msg["bytes"])
                await comm.send_to(text_data=json.dumps({"type": "ack", "bytes": len(msg["bytes"])}))
        assert received > len(flood)  # it went on while acknowledged (past the high mark, mostly)
        sent_at = time.monotonic()
        await comm.send_to(bytes_data=b"\x03")
        tail = await read_until(comm, b"^C", timeout=10, acks=True)
        if PROMPT not in tail.rpartition(b"^C")[2]:  # the prompt may come in the same frame
            tail += await read_until(comm, PROMPT, timeout=10, acks=True)
        answered = time.monotonic() - sent_at
        # Recorded, not asserted as a target: bench/ measures it; here it only must not hang.
        print(f"prompt back {answered:.2f} s after Ctrl-C, {received} bytes of yes before it")
        await comm.send_to(bytes_data=b"echo still-$((40+2))\n")
        await read_until(comm, b"still-42", acks=True)
        await comm.disconnect()

    asyncio.run(main())


def test_unacknowledged_output_holds_the_command_back(terminal, team_token):
    """A flow-controlled viewer that stops acknowledging stops the command producing output
    (it blocks in write) instead of the node buffering without bound."""

    async def main() -> None:
        comm = communicator(terminal["websocket"] + "?flow=1", team_token)
        assert (await comm.connect())[0]
        await read_until(comm, PROMPT, acks=True)
        await comm.send_to(bytes_data=b"yes\n")
        received = 0
        # Long enough to reach the high mark (HANGAR_FLOW_HIGH_BYTES) even on a slow pty.
        deadline = time.monotonic() + 60
        stalled = False
        while time.monotonic() < deadline:
            # (receive_output's timeout would cancel the consumer: peek instead)
            if await comm.receive_nothing(timeout=1.5):
                stalled = True
                break
            msg = await comm.receive_output()
            received += len(msg.get("bytes") or b"")
        # Nothing acknowledged: the bridge stopped reading after its high watermark; what
        # arrived is bounded by that plus what was already in flight.
        assert stalled, f"output kept coming without acknowledgements: {received} bytes"
        assert 0 < received < 2 * 1024 * 1024, received
        # The viewer catches up (acknowledges all it has), then interrupts the command.
        await comm.send_to(text_data=json.dumps({"type": "ack", "bytes": received}))
        await comm.send_to(bytes_data=b"\x03")
        await read_until(comm, PROMPT, timeout=15, acks=True)
        await comm.disconnect()

    asyncio.run(main())


def test_terminal_exit_is_reported_and_closes(terminal, team_token, api, sandbox):
    async def main() -> None:
        comm = communicator(terminal["websocket"], team_token)
        assert (await comm.connect())[0]
        await read_until(comm, PROMPT)
        await comm.send_to(bytes_data=b"exit 5\n")
        while True:
            msg = await comm.receive_output(10)
            if msg["type"] == "websocket.close":
                break
            if msg.get("text"):
                assert json.loads(msg["text"])["exit_code"] == 5
        await comm.wait()

    asyncio.run(main())
    rows = api.get(f"/sandboxes/{sandbox}/terminals").json()
    assert rows[0]["status"] == "exited" and rows[0]["exit_code"] == 5


def test_terminal_socket_checks_token_and_team(terminal, team_token, other_team_token):
    async def main() -> None:
        assert await refused_with(communicator(terminal["websocket"])) == 4401
        assert await refused_with(communicator(terminal["websocket"], "hgr_not-a-token")) == 4401
        assert await refused_with(communicator(terminal["websocket"], other_team_token)) == 4404
        assert await refused_with(communicator("/ws/v1/terminals/tmnosuchterm", team_token)) == 4404
        # ?token= works for clients that cannot set headers.
        comm = communicator(terminal["websocket"] + f"?token={team_token}")
        assert (await comm.connect())[0]
        await comm.disconnect()

    asyncio.run(main())


def test_viewers_watch_terminals_and_commands_but_cannot_type(terminal, sandbox, team_token):
    from django.contrib.auth import get_user_model

    from runtime.models import Membership, Team
    from runtime.services.auth import token_create

    team = Team.objects.get(name="alpha")
    viewer = get_user_model().objects.create_user(username="victor", password="pw")
    Membership.objects.create(user=viewer, team=team, role=Membership.Role.VIEWER)
    viewer_token = token_create(user=viewer, team=team).raw

    async def main() -> None:
        owner = communicator(terminal["websocket"], team_token)
        watcher = communicator(terminal["websocket"], viewer_token)
        assert (await owner.connect())[0] and (await watcher.connect())[0]
        await read_until(watcher, PROMPT)
        await watcher.send_to(bytes_data=b"echo typed-by-$((0+0))-viewer\n")
        msg = await watcher.receive_output(5)
        assert "viewers" in json.loads(msg["text"])["message"]
        await owner.send_to(bytes_data=b"echo typed-by-$((1+1))-owner\n")
        seen = await read_until(watcher, b"typed-by-2-owner")  # the viewer sees the owner's work
        assert b"typed-by-0-viewer" not in seen
        await owner.disconnect()
        await watcher.disconnect()

        # Nor can a viewer start a command on the exec socket.
        comm = communicator(f"/ws/v1/sandboxes/{sandbox}/exec", viewer_token)
        assert (await comm.connect())[0]
        await comm.send_to(text_data=json.dumps({"cmd": "echo nope"}))
        assert "viewers" in json.loads((await comm.receive_output(5))["text"])["message"]
        assert (await comm.receive_output(5))["code"] == 4403

    asyncio.run(main())


def test_terminal_activity_keeps_its_sandbox_from_expiring(api, terminal, sandbox, team_token):
    """Typing into (or just watching) a terminal is activity: the node's bridge pushes the
    sandbox's expiry out to its timeout from now (every HANGAR_ACTIVITY_REPORT_S, 1 s here)."""
    before = api.get(f"/sandboxes/{sandbox}").json()["expires_at"]

    async def main() -> None:
        comm = communicator(terminal["websocket"], team_token)
        assert (await comm.connect())[0]
        await read_until(comm, PROMPT)
        await asyncio.sleep(1.5)
        await comm.send_to(bytes_data=b"echo busy\n")
        await read_until(comm, b"busy\r\n")
        await asyncio.sleep(2.5)
        await comm.disconnect()

    asyncio.run(main())
    after = api.get(f"/sandboxes/{sandbox}").json()["expires_at"]
    assert after > before, (before, after)


def test_session_socket_needs_same_origin(terminal, client, django_user_model):
    """A browser session is accepted only from this site's own pages (no cross-site use of
    the cookie)."""
    from runtime.models import Membership, Team

    user = django_user_model.objects.get(username="alice")
    assert Membership.objects.filter(user=user, team=Team.objects.get(name="alpha")).exists()
    client.force_login(user)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()

    async def main() -> None:
        evil = communicator(terminal["websocket"], headers=[(b"cookie", cookie), (b"origin", b"http://evil.example"),
                                                           (b"host", b"testserver")])  # fmt: skip
        assert await refused_with(evil) == 4401
        good = communicator(terminal["websocket"], headers=[(b"cookie", cookie), (b"origin", b"http://testserver"),
                                                           (b"host", b"testserver")])  # fmt: skip
        assert (await good.connect())[0]
        await good.send_to(bytes_data=b"echo ok-$((3*3))\n")
        await read_until(good, b"ok-9")
        await good.disconnect()

    asyncio.run(main())


def test_exec_socket_streams_output_and_takes_stdin(sandbox, team_token):
    async def main() -> None:
        comm = communicator(f"/ws/v1/sandboxes/{sandbox}/exec", team_token)
        assert (await comm.connect())[0]
        await comm.send_json_to({"cmd": "read a; echo got:$a; echo warn >&2; read b; echo got:$b; exit 2"})
        start = await comm.receive_json_from(10)
        assert start["type"] == "start" and start["pid"] > 0
        await comm.send_json_to({"type": "stdin", "data": "first\n"})
        events = []
        while not any(e.get("data") == "got:first\n" for e in events):
            events.append(await comm.receive_json_from(10))
        await comm.send_json_to({"type": "stdin", "data": "second\n"})
        await comm.send_json_to({"type": "eof"})
        while events[-1]["type"] != "exit":
            events.append(await comm.receive_json_from(10))
        assert {"type": "stderr", "data": "warn\n"} in events
        assert "".join(e["data"] for e in events if e["type"] == "stdout") == "got:first\ngot:second\n"
        assert events[-1]["exit_code"] == 2
        await comm.wait()

    asyncio.run(main())


def test_exec_socket_input_the_command_leaves_unread_is_refused_past_the_bound_with_a_message(
    sandbox, team_token
):
    """A websocket cannot be held back, so its input past what the node keeps unread for a
    command (8 MiB) is refused, and the client is told so, not left to find bytes missing."""

    async def main() -> None:
        comm = communicator(f"/ws/v1/sandboxes/{sandbox}/exec", team_token)
        assert (await comm.connect())[0]
        await comm.send_json_to({"cmd": "sleep 60"})
        assert (await comm.receive_json_from(10))["type"] == "start"
        for _ in range(12):
            await comm.send_to(bytes_data=b"\0" * (1024 * 1024))
        error = await comm.receive_json_from(20)
        assert error["type"] == "error" and error["message"].startswith(
            "input refused: the process has not read the input it was sent"
        ), error
        await comm.disconnect()

    asyncio.run(main())


def test_exec_socket_attaches_to_a_background_process(api, sandbox, team_token):
    proc = api.post(f"/sandboxes/{sandbox}/exec", json={"cmd": "echo before; read x; echo after:$x", "background": True,
                                                        "stdin_open": True}).json()  # fmt: skip

    async def main() -> None:
        comm = communicator(f"/ws/v1/sandboxes/{sandbox}/exec?process={proc['id']}", team_token)
        assert (await comm.connect())[0]
        assert (await comm.receive_json_from(10))["attached"] is True
        assert await comm.receive_json_from(10) == {"type": "stdout", "data": "before\n"}
        await comm.send_json_to({"type": "stdin", "data": "typed\n"})
        assert await comm.receive_json_from(10) == {"type": "stdout", "data": "after:typed\n"}
        assert (await comm.receive_json_from(10))["type"] == "exit"

    asyncio.run(main())


def test_exec_socket_bad_requests_are_explained(sandbox, team_token, other_team_token):
    async def main() -> None:
        comm = communicator(f"/ws/v1/sandboxes/{sandbox}/exec", team_token)
        assert (await comm.connect())[0]
        await comm.send_json_to({"command": "oops"})
        err = await comm.receive_json_from(5)
        assert err["type"] == "error" and "cmd" in err["message"]
        comm = communicator(f"/ws/v1/sandboxes/{sandbox}/exec", team_token)
        assert (await comm.connect())[0]
        await comm.send_json_to({"cmd": ["/no/such/thing"]})
        err = await comm.receive_json_from(5)
        assert err["type"] == "error" and "/no/such/thing" in err["message"]
        other = communicator(f"/ws/v1/sandboxes/{sandbox}/exec", other_team_token)
        assert await refused_with(other) == 4404

    asyncio.run(main())


def test_live_sandboxes_page_pushes_status_changes(api, team_token, client, django_user_model):
    """The sandboxes page's socket pushes a row when a sandbox of the team changes."""
    user = django_user_model.objects.get(username="alice")
    client.force_login(user)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()
    headers = [(b"cookie", cookie), (b"origin", b"http://testserver"), (b"host", b"testserver")]

    async def main() -> str:
        comm = communicator("/ws/ui/sandboxes", headers=headers)
        assert (await comm.connect())[0]
        sid = await asyncio.to_thread(lambda: create(api)["id"])
        html = ""
        deadline = time.monotonic() + 20
        while not re.search(rf'id="sb-{sid}"[^>]*>.*running', html, re.S) and time.monotonic() < deadline:
            html += await comm.receive_from(20)
        await comm.disconnect()
        return html

    html = asyncio.run(main())
    assert "hx-swap-oob" in html and "running" in html


def test_live_pages_catch_up_on_what_changed_before_their_socket_opened(
    api, team_token, client, django_user_model
):
    """A page rendered before a change whose socket opens after it still gets the change."""
    user = django_user_model.objects.get(username="alice")
    client.force_login(user)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()
    headers = [(b"cookie", cookie), (b"origin", b"http://testserver"), (b"host", b"testserver")]
    rendered_at = time.time() - 1
    sid = create(api)["id"]  # comes up between the page and its socket

    async def main() -> tuple[str, str]:
        comm = communicator(f"/ws/ui/sandboxes?since={rendered_at:.3f}", headers=headers)
        assert (await comm.connect())[0]
        listing = await comm.receive_from(10)
        await comm.disconnect()
        comm = communicator(f"/ws/ui/sandboxes/{sid}?after=0", headers=headers)
        assert (await comm.connect())[0]
        detail = await comm.receive_from(10)
        await comm.disconnect()
        return listing, detail

    listing, detail = asyncio.run(main())
    assert re.search(rf'id="sb-{sid}"[^>]*data-status="running"', listing), listing[:500]
    assert 'id="sb-header"' in detail and 'data-status="running"' in detail


def test_malformed_terminal_frames_are_refused_and_the_socket_keeps_serving(terminal, team_token):
    async def main() -> None:
        comm = communicator(terminal["websocket"] + "?flow=1", team_token)
        assert (await comm.connect())[0]
        await read_until(comm, PROMPT, acks=True)
        bad = [
            ('{"type": "ack", "bytes": "abc"}', "bad ack message: bytes"),
            ('{"type": "resize", "rows": "x", "cols": 80}', "bad resize message: rows"),
            ('{"type": "resize", "rows": 0, "cols": 80}', "bad resize message: rows"),
            ('{"type": "input", "data": 5}', "bad input message: data"),
            ('{"type": "warp"}', "unknown message type 'warp'"),
            ("[1, 2]", "text frames must be JSON objects"),
        ]
        for frame, says in bad:
            await comm.send_to(text_data=frame)
            while (msg := await comm.receive_output(5)).get("text") is None:
                pass  # terminal bytes still coming
            error = json.loads(msg["text"])
            assert error["type"] == "error" and error["message"].startswith(says), error
        # Still serving: it answers pings, takes input and acknowledgements.
        await comm.send_to(text_data=json.dumps({"type": "ping"}))
        while (msg := await comm.receive_output(5)).get("text") is None:
            pass
        assert json.loads(msg["text"]) == {"type": "pong"}
        await comm.send_to(text_data=json.dumps({"type": "input", "data": "echo still-$((40+2))\n"}))
        await read_until(comm, b"still-42", acks=True)
        await comm.disconnect()

    asyncio.run(main())


def test_malformed_exec_frames_are_refused_and_the_command_keeps_running(sandbox, team_token):
    async def main() -> None:
        comm = communicator(f"/ws/v1/sandboxes/{sandbox}/exec", team_token)
        assert (await comm.connect())[0]
        await comm.send_json_to({"cmd": "read a; echo got:$a", "rows": "x"})
        error = await comm.receive_json_from(5)
        assert error["type"] == "error" and "rows" in error["message"]
        assert (await comm.receive_output(5))["code"] == 4400  # the request itself was bad

        comm = communicator(f"/ws/v1/sandboxes/{sandbox}/exec", team_token)
        assert (await comm.connect())[0]
        await comm.send_json_to({"cmd": "read a; echo got:$a"})
        assert (await comm.receive_json_from(10))["type"] == "start"
        for frame, says in [
            ({"type": "stdin_b64", "data": "!!"}, "bad stdin_b64 message: data"),
            ({"type": "resize", "rows": "x", "cols": 1}, "bad resize message: rows"),
            ({"type": "signal", "signal": 1000}, "bad signal message"),
            ({"type": "stdin", "data": ["a"]}, "bad stdin message: data"),
        ]:
            await comm.send_json_to(frame)
            error = await comm.receive_json_from(5)
            assert error["type"] == "error" and error["message"].startswith(says), error
        await comm.send_json_to({"type": "stdin", "data": "fine\n"})
        assert await comm.receive_json_from(10) == {"type": "stdout", "data": "got:fine\n"}
        assert (await comm.receive_json_from(10))["type"] == "exit"

    asyncio.run(main())


def test_a_bad_query_string_closes_the_socket_with_4400_and_the_reason(api, sandbox, team_token):
    proc = api.post(f"/sandboxes/{sandbox}/exec", json={"cmd": "sleep 5", "background": True}).json()

    async def main() -> None:
        for query, says in [
            (f"process={proc['id']}&offset=abc", "offset"),
            ("process=abc", "process"),
            ("encoding=latin-1", "encoding"),
        ]:
            comm = communicator(f"/ws/v1/sandboxes/{sandbox}/exec?{query}", team_token)
            assert (await comm.connect())[0]
            error = await comm.receive_json_from(5)
            assert error["type"] == "error" and error["message"].startswith("bad query string: ")
            assert says in error["message"]
            closed = await comm.receive_output(5)
            assert closed["type"] == "websocket.close" and closed["code"] == 4400
            assert closed["reason"] == error["message"]

    asyncio.run(main())


def test_refusals_reach_a_real_client_as_close_codes_not_http_403(
    server, terminal, sandbox, team_token, other_team_token
):
    """Through daphne, as browsers and SDKs meet it: a socket refused before its handshake was
    accepted would be an HTTP 403 with no close code."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    ws = server.replace("http://", "ws://")

    def close_of(path: str, token: str | None = None) -> tuple[int, list[str]]:
        """The close code, and the text frames that came before it."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        frames = []
        with connect(ws + path, additional_headers=headers, open_timeout=10) as conn:
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    frames.append(conn.recv(timeout=10))
        return closed.value.rcvd.code, frames

    assert close_of(terminal["websocket"])[0] == 4401
    assert close_of(terminal["websocket"], "hgr_not-a-token")[0] == 4401
    assert close_of(terminal["websocket"], other_team_token)[0] == 4404
    assert close_of(f"/ws/v1/sandboxes/{sandbox}/exec", other_team_token)[0] == 4404
    code, said = close_of(f"/ws/v1/sandboxes/{sandbox}/exec?process=1&offset=abc", team_token)
    assert code == 4400 and json.loads(said[0])["message"].startswith("bad query string: offset")
