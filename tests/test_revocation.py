"""Open connections end with their access: terminal and exec websockets (real ``websockets``
clients against the real daphne server, or the real ASGI app in this process), and followed
output streams, when a token is revoked or expires, a member is removed or lowered. SSH
sessions are in tests/test_ssh_gateway.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from datetime import timedelta

import httpx
import pytest
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from django.utils import timezone
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from dashboard.asgi import application
from runtime.models import ApiToken, Membership, Team
from runtime.services.auth import token_create
from tests.api.test_sandboxes_api import create
from tests.support import requires_runsc, wait_until

pytestmark = [requires_runsc, pytest.mark.timeout(180)]

PROMPT = "READY$ "


@pytest.fixture(autouse=True)
def fresh_channel_layer():
    """A Channels layer per test for the sockets served in this process (see test_consumers)."""
    from channels.layers import channel_layers

    channel_layers.backends.clear()
    yield
    channel_layers.backends.clear()


@pytest.fixture
def sandbox(api) -> str:
    return create(api)["id"]


@pytest.fixture
def terminal(api, sandbox) -> dict:
    r = api.post(f"/sandboxes/{sandbox}/terminals", json={"env": {"PS1": PROMPT}})
    assert r.status_code == 201, r.text
    return r.json()


def dial(server: str, path: str, token: str) -> ClientConnection:
    return connect(server.replace("http://", "ws://") + path, additional_headers={"Authorization": f"Bearer {token}"},
                   open_timeout=20)  # fmt: skip


def read_until(ws: ClientConnection, pattern: bytes, timeout: float = 15) -> bytes:
    buf = bytearray()
    deadline = time.monotonic() + timeout
    while pattern not in buf:
        msg = ws.recv(timeout=max(0.01, deadline - time.monotonic()))
        buf += msg if isinstance(msg, bytes) else msg.encode()
    return bytes(buf)


def closed_with(ws: ClientConnection, timeout: float = 10) -> tuple[int | None, list]:
    """The close code the server ends the socket with (and what came before it)."""
    seen = []
    deadline = time.monotonic() + timeout
    while True:
        try:
            seen.append(ws.recv(timeout=max(0.01, deadline - time.monotonic())))
        except ConnectionClosed as exc:
            return (exc.rcvd.code if exc.rcvd else None), seen
        except TimeoutError:
            raise AssertionError(f"the socket stayed open; it sent {seen[-5:]}") from None


def next_text(ws: ClientConnection, timeout: float = 10) -> dict:
    """The next JSON text frame (terminal bytes before it are skipped)."""
    deadline = time.monotonic() + timeout
    while isinstance(msg := ws.recv(timeout=max(0.01, deadline - time.monotonic())), bytes):
        pass
    return json.loads(msg)


def send_quietly(ws: ClientConnection, data: str | bytes) -> None:
    with contextlib.suppress(ConnectionClosed):
        ws.send(data)


def ls_tmp(api: httpx.Client, sandbox: str) -> str:
    return api.post(f"/sandboxes/{sandbox}/exec", json={"cmd": "ls /tmp"}).json()["stdout"]


def new_token(api: httpx.Client, **body) -> tuple[str, int]:
    r = api.post("/tokens", json={"name": "sockets", **body})
    assert r.status_code == 201, r.text
    return r.json()["token"], r.json()["id"]


def test_revoking_a_token_ends_its_open_terminal_and_exec_sockets_at_once(api, server, sandbox, terminal):
    raw, token_id = new_token(api)
    term = dial(server, terminal["websocket"], raw)
    read_until(term, PROMPT.encode())
    term.send(b"echo $((6*7))\n")
    read_until(term, b"42")
    ex = dial(server, f"/ws/v1/sandboxes/{sandbox}/exec", raw)
    ex.send(json.dumps({"cmd": "sh", "stdin_open": True}))  # a shell that runs what comes on stdin
    assert json.loads(ex.recv(timeout=15))["type"] == "start"
    ex.send(json.dumps({"type": "stdin", "data": "echo alive-$((1+1))\n"}))
    read_until(ex, b"alive-2")

    assert api.delete(f"/tokens/{token_id}").status_code == 204
    # Both sockets close at once (a keystroke racing the revocation by the moment the message
    # takes to arrive is as good as one typed before it); nothing typed after runs.
    code, seen = closed_with(term, timeout=5)
    assert code == 4401 and any("access ended" in m for m in seen if isinstance(m, str)), seen
    assert closed_with(ex, timeout=5)[0] == 4401
    send_quietly(term, b"touch /tmp/typed-after-revocation\n")
    send_quietly(ex, json.dumps({"type": "stdin", "data": "touch /tmp/stdin-after-revocation\n"}))
    time.sleep(1)  # what was typed would have run by now
    listing = ls_tmp(api, sandbox)
    assert "typed-after-revocation" not in listing and "stdin-after-revocation" not in listing, listing
    # The command the exec socket started ended with it; the terminal's shell lives on for others.
    wait_until(lambda: all(p["status"] != "running" for p in api.get(f"/sandboxes/{sandbox}/processes").json()
                           if p["argv"][-1] == "sh"), 15, what="the exec socket's command to end")  # fmt: skip
    again = dial(server, terminal["websocket"], raw)  # the revoked token: accepted, then refused
    assert closed_with(again, timeout=10)[0] == 4401


def test_a_member_lowered_to_viewer_only_watches_and_one_removed_is_cut_off(
    api, server, sandbox, terminal, team_token
):
    team = Team.objects.get(name="alpha")
    bob = get_user_model().objects.create_user(username="bob", password="pw")
    Membership.objects.create(user=bob, team=team, role=Membership.Role.MEMBER)
    bobs = token_create(user=bob, team=team).raw
    ws = dial(server, terminal["websocket"], bobs)
    read_until(ws, PROMPT.encode())
    ws.send(b"echo typed-by-$((1+1))-member\n")
    read_until(ws, b"typed-by-2-member\r\n" + PROMPT.encode())

    r = api.patch(f"/teams/{team.id}/members/bob", json={"role": "viewer"})
    assert r.status_code == 200, r.text
    assert "role changed" in next_text(ws)["message"]
    ws.send(b"touch /tmp/typed-by-a-viewer\n")
    assert "viewers" in next_text(ws)["message"]
    # Still watching: what the owner does shows.
    owner = dial(server, terminal["websocket"], team_token)
    owner.send(b"echo owner-$((2+3))\n")
    read_until(ws, b"owner-5")

    assert api.delete(f"/teams/{team.id}/members/bob").status_code == 204
    assert closed_with(ws, timeout=5)[0] == 4401
    owner.close()
    assert "typed-by-a-viewer" not in ls_tmp(api, sandbox)


def test_a_signed_in_session_removed_from_the_team_is_closed_with_4403(api, terminal, client):
    team = Team.objects.get(name="alpha")
    bob = get_user_model().objects.create_user(username="bob", password="pw")
    Membership.objects.create(user=bob, team=team, role=Membership.Role.MEMBER)
    client.force_login(bob)
    headers = [(b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()),
               (b"origin", b"http://testserver"), (b"host", b"testserver")]  # fmt: skip

    async def main() -> None:
        comm = WebsocketCommunicator(application, terminal["websocket"], headers=headers)
        assert (await comm.connect())[0]
        # The removal is made by the server (another process): its message reaches this socket.
        r = await asyncio.to_thread(api.delete, f"/teams/{team.id}/members/bob")
        assert r.status_code == 204
        while True:
            msg = await comm.receive_output(10)
            if msg["type"] == "websocket.close":
                assert msg["code"] == 4403
                return

    asyncio.run(main())


def test_a_lost_message_is_made_up_for_by_the_periodic_check_and_expiry_ends_a_socket(
    api, terminal, team_token, settings
):
    settings.HANGAR_AUTH_RECHECK_S = 0.5
    alice = get_user_model().objects.get(username="alice")
    team = Team.objects.get(name="alpha")

    async def closes(raw: str, change) -> tuple[int, float]:
        comm = WebsocketCommunicator(application, terminal["websocket"], headers=[(b"authorization", f"Bearer {raw}".encode())])  # fmt: skip
        assert (await comm.connect())[0]
        await asyncio.to_thread(change)
        t0 = time.monotonic()
        while True:
            msg = await comm.receive_output(10)
            if msg["type"] == "websocket.close":
                return msg["code"], time.monotonic() - t0

    quiet = token_create(user=alice, team=team)
    short = token_create(user=alice, team=team, expires_in_s=3)

    def revoke_without_a_word() -> None:  # as if the message were lost
        ApiToken.objects.filter(id=quiet.token.id).update(revoked_at=timezone.now())

    async def main() -> None:
        code, took = await closes(quiet.raw, revoke_without_a_word)
        assert code == 4401 and took < 3, took
        code, _ = await closes(short.raw, lambda: None)
        assert code == 4401 and timezone.now() < short.token.expires_at + timedelta(seconds=1.5)

    asyncio.run(main())


def test_a_followed_output_stream_ends_when_its_token_is_revoked(api, server, sandbox):
    raw, token_id = new_token(api)
    proc = api.post(f"/sandboxes/{sandbox}/exec", json={"cmd": "while true; do echo tick; sleep 0.2; done",
                                                       "background": True}).json()  # fmt: skip
    headers = {"Authorization": f"Bearer {raw}"}
    with httpx.Client(base_url=f"{server}/api/v1", headers=headers, timeout=30) as mine:
        # A streamed exec of this token, and a follow of the background process's output.
        with (
            mine.stream("POST", f"/sandboxes/{sandbox}/exec",
                        json={"cmd": "while true; do echo streamed; sleep 0.2; done", "stream": True}) as streamed,
            mine.stream("GET", f"/sandboxes/{sandbox}/processes/{proc['id']}/output") as followed,
        ):  # fmt: skip
            lines = [streamed.iter_lines(), followed.iter_lines()]
            for it, word in zip(lines, ("streamed", "tick"), strict=True):
                assert any(word in next(it) for _ in range(5))
            assert api.delete(f"/tokens/{token_id}").status_code == 204
            t0 = time.monotonic()
            for it in lines:
                rest = [json.loads(x) for x in it if x]  # ends instead of following on
                assert rest[-1]["type"] == "error" and "access ended" in rest[-1]["message"], rest[-3:]
            assert time.monotonic() - t0 < 5
    # The streamed exec belonged to its request: it was killed with it.
    wait_until(lambda: all(p["status"] != "running" for p in api.get(f"/sandboxes/{sandbox}/processes").json()
                           if "streamed" in " ".join(p["argv"])), 15, what="the streamed exec to end")  # fmt: skip


def test_deactivating_a_user_closes_their_sockets(terminal):
    team = Team.objects.get(name="alpha")
    carol = get_user_model().objects.create_user(username="carol", password="pw")
    Membership.objects.create(user=carol, team=team, role=Membership.Role.MEMBER)
    raw = token_create(user=carol, team=team).raw

    def deactivate() -> None:
        carol.is_active = False
        carol.save()

    async def main() -> None:
        comm = WebsocketCommunicator(application, terminal["websocket"], headers=[(b"authorization", f"Bearer {raw}".encode())])  # fmt: skip
        assert (await comm.connect())[0]
        await asyncio.to_thread(deactivate)
        while (msg := await comm.receive_output(10))["type"] != "websocket.close":
            pass
        assert msg["code"] == 4401

    asyncio.run(main())
