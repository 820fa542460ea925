"""A trace page's socket (``/ws/ui/traces/{id}``) against the real ASGI app, Redis and Postgres:
spans stored after it opens arrive as rows, those stored between the page and the socket are
caught up, another team's user and API tokens are refused, and a member removed from the team
is cut off while watching."""

from __future__ import annotations

import asyncio
import json
import secrets
import time

import pytest
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from django.test import Client

from dashboard.asgi import application
from runtime.models import Membership, Team, TraceSpan
from runtime.services import otlp, traces

from .support import refused_with


@pytest.fixture(autouse=True)
def fresh_channel_layer():
    # Each test runs its own event loop; the Channels layer keeps state bound to the loop that used it.
    from channels.layers import channel_layers

    channel_layers.backends.clear()
    yield
    channel_layers.backends.clear()


def _span(trace_id: str, name: str, parent: str = "", at_ms: int = 0) -> tuple[str, dict]:
    span_id = secrets.token_hex(8)
    start = time.time_ns() + at_ms * 1_000_000
    return span_id, {"traceId": trace_id, "spanId": span_id, "parentSpanId": parent, "name": name,
                     "startTimeUnixNano": str(start), "endTimeUnixNano": str(start + 2_000_000)}  # fmt: skip


def _store(team: Team, *spans: dict) -> None:
    body = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "agent"}}]},
                               "scopeSpans": [{"spans": list(spans)}]}]}  # fmt: skip
    decoded = otlp.span_rows(otlp.parse("traces", json.dumps(body).encode(), "application/json"))
    traces.spans_store(team=team, decoded=decoded)


def _session(client, username: str, team: Team, role: str = "viewer") -> tuple[list, object]:
    """The websocket headers of ``username``'s browser session (signed in on ``client``; one
    client a user: signing another in on it would end the first one's session)."""
    user = get_user_model().objects.create_user(username, password="pw")
    Membership.objects.create(user=user, team=team, role=role)
    client.force_login(user)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()
    return [(b"cookie", cookie), (b"origin", b"http://testserver"), (b"host", b"testserver")], user


async def _spans_frame(comm: WebsocketCommunicator, timeout: float = 10) -> dict:
    frame = json.loads(await comm.receive_from(timeout))
    assert frame["type"] == "spans", frame
    return frame


@pytest.mark.django_db(transaction=True)
def test_spans_stored_after_the_socket_opens_arrive_as_rows(client):
    team = Team.objects.create(name="crew")
    headers, _ = _session(client, "vera", team)
    trace_id = secrets.token_hex(16)
    root_id, root = _span(trace_id, "invoke_agent")
    _store(team, root)
    page = client.get(f"/traces/{trace_id}/").content.decode()
    after = TraceSpan.objects.get(span_id=root_id).id
    assert f'data-live="/ws/ui/traces/{trace_id}" data-after="{after}"' in page

    async def main() -> tuple[dict, dict, bool]:
        comm = WebsocketCommunicator(application, f"/ws/ui/traces/{trace_id}?after={after}", headers=headers)
        assert (await comm.connect())[0]
        assert await comm.receive_nothing(0.5)  # nothing new yet
        child_id, child = _span(trace_id, "execute_tool bash", parent=root_id, at_ms=1)
        await asyncio.to_thread(_store, team, child)
        first = await _spans_frame(comm)
        _, late = _span(trace_id, "chat claude", parent=child_id, at_ms=2)
        await asyncio.to_thread(_store, team, late)
        second = await _spans_frame(comm)
        quiet = await comm.receive_nothing(0.5)
        await comm.disconnect()
        return first, second, quiet

    first, second, quiet = asyncio.run(main())
    (row,) = first["rows"]
    assert row["parent_span_id"] == root_id and 'class="wf-label">execute_tool bash<' in row["html"]
    assert 'data-parent="' + root_id + '"' in row["html"] and "wf-bar tool" in row["html"]
    assert first["trace"]["span_count"] == 2 and first["trace"]["root_name"] == "invoke_agent"
    assert [r["html"].count("chat claude") for r in second["rows"]] == [1]
    assert second["trace"]["span_count"] == 3 and quiet  # each row once


@pytest.mark.django_db(transaction=True)
def test_spans_stored_between_the_page_and_its_socket_are_caught_up(client):
    team = Team.objects.create(name="crew")
    headers, _ = _session(client, "vera", team)
    trace_id = secrets.token_hex(16)
    root_id, root = _span(trace_id, "invoke_agent")
    _store(team, root)
    after = TraceSpan.objects.get(span_id=root_id).id
    _store(team, _span(trace_id, "meanwhile", parent=root_id)[1])

    async def main() -> dict:
        comm = WebsocketCommunicator(application, f"/ws/ui/traces/{trace_id}?after={after}", headers=headers)
        assert (await comm.connect())[0]
        frame = await _spans_frame(comm)
        await comm.disconnect()
        return frame

    assert [r["html"].count("meanwhile") for r in asyncio.run(main())["rows"]] == [1]


@pytest.mark.django_db(transaction=True)
def test_another_teams_user_a_token_and_a_bad_query_are_refused(client):
    from runtime.services.auth import token_create

    crew, others = Team.objects.create(name="crew"), Team.objects.create(name="others")
    trace_id = secrets.token_hex(16)
    _store(crew, _span(trace_id, "invoke_agent")[1])
    headers, _ = _session(client, "otto", others, role="owner")
    owner, _ = _session(Client(), "olga", crew, role="owner")
    token = token_create(user=get_user_model().objects.get(username="olga"), team=crew).raw
    path = f"/ws/ui/traces/{trace_id}"

    async def main() -> list[int]:
        return [
            await refused_with(WebsocketCommunicator(application, path, headers=headers)),
            await refused_with(WebsocketCommunicator(application, f"/ws/ui/traces/{'0' * 32}", headers=owner)),
            await refused_with(WebsocketCommunicator(
                application, path, headers=[(b"authorization", f"Bearer {token}".encode())])),
            await refused_with(WebsocketCommunicator(application, path, headers=[*owner[:1], (b"origin", b"http://evil.example"),
                                                                                 (b"host", b"testserver")])),
        ]  # fmt: skip

    async def bad_query() -> tuple[dict, dict]:
        comm = WebsocketCommunicator(application, f"{path}?after=-1", headers=owner)
        assert (await comm.connect())[0]
        return json.loads(await comm.receive_from(5)), await comm.receive_output(5)

    assert asyncio.run(main()) == [4404, 4404, 4401, 4401]
    said, closed = asyncio.run(bad_query())
    assert "after" in said["message"] and closed["code"] == 4400


@pytest.mark.django_db(transaction=True)
def test_a_member_removed_from_the_team_is_cut_off_while_watching(client):
    from runtime.notify import auth_changed

    team = Team.objects.create(name="crew")
    headers, user = _session(client, "vera", team)
    trace_id = secrets.token_hex(16)
    _store(team, _span(trace_id, "invoke_agent")[1])

    def remove() -> None:
        Membership.objects.filter(user=user, team=team).delete()
        auth_changed([user.pk])

    async def main() -> dict:
        comm = WebsocketCommunicator(application, f"/ws/ui/traces/{trace_id}", headers=headers)
        assert (await comm.connect())[0]
        await comm.receive_from(10)  # the catch-up: the root
        await asyncio.to_thread(remove)
        return await comm.receive_output(10)

    closed = asyncio.run(main())
    assert closed["type"] == "websocket.close" and closed["code"] == 4403
