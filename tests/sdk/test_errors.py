"""Each of the SDK's exceptions, raised from a real answer of the real server."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from hangar_sdk import (
    AuthError,
    ConflictError,
    HangarError,
    NetworkError,
    NotFoundError,
    QuotaError,
    Sandbox,
    ValidationError,
)
from tests.support import free_port, requires_runsc

pytestmark = [requires_runsc]


def test_a_wrong_token_is_an_auth_error(hangar):
    with pytest.raises(AuthError) as e:
        Sandbox.list(token="hgr_not-a-token")
    assert e.value.status_code == 401 and "token" in e.value.message
    assert isinstance(e.value, HangarError)


def _alice_token(**kw) -> str:
    """Another token of the test's user (alice, owner of team alpha), narrower than hers."""
    from django.contrib.auth import get_user_model

    from runtime.models import Team
    from runtime.services.auth import token_create

    user = get_user_model().objects.get(username="alice")
    return token_create(user=user, team=Team.objects.get(name="alpha"), **kw).raw


def test_a_token_without_the_scope_or_the_role_is_a_403_auth_error(hangar):
    with Sandbox.create(image="busybox", timeout_s=120) as sb:
        read_only = _alice_token(name="reader", scopes=["sandboxes:read"])
        assert Sandbox.get(sb.id, token=read_only).status == "running"  # it may read
        with pytest.raises(AuthError) as e:
            Sandbox.create(image="busybox", token=read_only)
        assert e.value.status_code == 403 and "sandboxes:write" in e.value.message, e.value.message
        viewer = _alice_token(name="viewer", role="viewer")
        with pytest.raises(AuthError) as e:
            Sandbox.get(sb.id, token=viewer).delete()
        assert e.value.status_code == 403 and e.value.message
        assert sb.refresh().status == "running"  # refused: nothing was done


def test_a_terminal_whose_connection_was_cut_says_so_as_a_network_error(hangar, team_token):
    from tests.cli.gate import WebsocketGate

    gate = WebsocketGate(hangar)
    try:
        with Sandbox.create(image="busybox", timeout_s=120) as sb:
            term = Sandbox.get(sb.id, url=gate.url, token=team_token).terminal()
            term.send("echo up-$((3*3))\n")
            term.read_until("up-9")
            gate.cut()
            with pytest.raises(NetworkError, match="closed"):
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:  # the first sends may still find a buffer
                    term.send("echo into-the-void\n")
                    time.sleep(0.1)
            for _ in range(100):  # what had come before the cut, then the end: no exception
                if term.recv(timeout=5) == b"":
                    break
            else:
                raise AssertionError("the terminal's output never ended")
            term.close()
    finally:
        gate.close()
    refused = WebsocketGate(hangar, refuse_websockets=403)
    try:
        with Sandbox.create(image="busybox", timeout_s=120) as sb:
            with pytest.raises(AuthError, match="refused with HTTP 403") as e:
                Sandbox.get(sb.id, url=refused.url, token=team_token).terminal()
            assert e.value.status_code == 403
    finally:
        refused.close()


def test_an_unknown_sandbox_is_not_found(hangar):
    with pytest.raises(NotFoundError) as e:
        Sandbox.get("sbnosuchthing")
    assert e.value.status_code == 404 and e.value.message


def test_bad_input_is_a_validation_error_with_the_servers_message(hangar):
    with pytest.raises(ValidationError) as e:
        Sandbox.create(image="no-such-image")
    assert e.value.status_code == 400 and "busybox" in e.value.message  # it names the images there are
    with pytest.raises(ValidationError) as e:
        Sandbox.create(image="busybox", memory_mb=1)
    assert e.value.status_code == 422 and "memory_mb" in e.value.message and e.value.errors


def test_a_command_in_a_paused_or_stopped_sandbox_is_a_conflict_naming_its_status(hangar):
    with Sandbox.create(image="busybox", timeout_s=120) as sb:
        sb.pause()
        with pytest.raises(ConflictError) as e:
            sb.exec("true")
        assert e.value.status_code == 409 and e.value.status == "paused" and "paused" in e.value.message
        with pytest.raises(ConflictError) as e:
            sb.files.write("/x", b"x")
        assert e.value.status == "paused"
        sb.resume()
        sb.stop()
        with pytest.raises(ConflictError) as e:
            sb.exec("true")
        assert e.value.status in ("stopping", "stopped")


def test_a_create_over_the_teams_quota_is_a_quota_error(hangar, team_token):
    from runtime.models import Team

    team = Team.objects.get(name="alpha")
    r = httpx.put(f"{hangar}/api/v1/teams/{team.id}/quotas", json={"sandboxes": 1},
                  headers={"Authorization": f"Bearer {team_token}"})  # fmt: skip
    assert r.status_code == 200, r.text
    with Sandbox.create(image="busybox", timeout_s=60):
        with pytest.raises(QuotaError) as e:
            Sandbox.create(image="busybox", timeout_s=60)
    assert e.value.status_code == 429
    assert (e.value.quota, e.value.used, e.value.limit, e.value.requested) == ("sandboxes", 1, 1, 1)
    assert "quota" in e.value.message


def test_a_server_that_cannot_be_reached_is_a_network_error_after_retries(monkeypatch):
    monkeypatch.setenv("HANGAR_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("HANGAR_TOKEN", "hgr_x")
    with pytest.raises(NetworkError) as e:
        Sandbox.get("sbx")
    assert e.value.status_code is None and "ConnectError" in str(e.value)


def test_a_command_refused_with_retry_after_is_sent_again_and_runs(hangar):
    """A team's 9th blocking command at once is a 429 with Retry-After (nothing ran): the SDK
    waits as told and sends it again, and it runs once a slot is free."""
    with Sandbox.create(image="busybox", timeout_s=120) as sb:
        statuses: list[int] = []
        sb._t.client.event_hooks["response"].append(lambda r: statuses.append(r.status_code))
        with ThreadPoolExecutor(8) as pool:
            busy = [pool.submit(Sandbox.get(sb.id).exec, "sleep 3") for _ in range(8)]
            time.sleep(1)  # all eight are in flight
            r = sb.exec("echo through")
            assert [f.result().exit_code for f in busy] == [0] * 8
        assert r.stdout == "through\n" and 429 in statuses and statuses[-1] == 200, statuses
