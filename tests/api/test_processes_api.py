"""Streamed and background commands and terminals over HTTP: a real daphne server, the real
stream bridge process, real runsc sandboxes."""

from __future__ import annotations

import base64
import json
import time

import httpx
import pytest

from tests.api.test_sandboxes_api import create
from tests.support import requires_runsc, wait_until

pytestmark = [requires_runsc]


def ndjson(api, method: str, url: str, **kw) -> list[dict]:
    with api.stream(method, url, **kw) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("application/x-ndjson")
        return [json.loads(line) for line in r.iter_lines() if line]


@pytest.fixture
def sandbox(api):
    return create(api)["id"]


def test_streamed_exec_yields_output_as_it_is_produced(api, sandbox):
    seen: list[tuple[float, dict]] = []
    start = time.monotonic()
    body = {"cmd": "echo one; sleep 1; echo two; echo oops >&2; exit 3", "stream": True}
    with api.stream("POST", f"/sandboxes/{sandbox}/exec", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            seen.append((time.monotonic() - start, json.loads(line)))
    events = [e for _, e in seen]
    assert events[0]["type"] == "start" and events[0]["pid"] > 0
    assert {"type": "stdout", "data": "one\n"} in events and {"type": "stderr", "data": "oops\n"} in events
    end = events[-1]
    assert end.pop("duration_ms") >= 0
    assert end == {"type": "exit", "exit_code": 3, "signal": 0, "timed_out": False}
    # "one" arrived before the command slept, not with everything at the end.
    t_one = next(t for t, e in seen if e.get("data") == "one\n")
    t_exit = seen[-1][0]
    assert t_exit - t_one >= 0.8
    row = api.get(f"/sandboxes/{sandbox}/processes/{events[0]['id']}").json()
    assert row["kind"] == "stream" and row["status"] == "exited" and row["exit_code"] == 3


def test_streamed_exec_keeps_multibyte_characters_whole_and_can_send_base64(api, sandbox):
    # "é" is two bytes; printf them in separate writes so they arrive in separate chunks.
    cmd = r"printf '\303'; sleep 0.3; printf '\251\n'"
    events = ndjson(api, "POST", f"/sandboxes/{sandbox}/exec", json={"cmd": cmd, "stream": True})
    assert "".join(e["data"] for e in events if e["type"] == "stdout") == "é\n"
    events = ndjson(
        api,
        "POST",
        f"/sandboxes/{sandbox}/exec",
        json={"cmd": "printf '\\001\\377'", "stream": True, "encoding": "base64"},
    )
    assert [e["data"] for e in events if e["type"] == "stdout"] == ["Af8="]


def test_hanging_up_a_streamed_exec_kills_the_command(api, sandbox):
    body = {"cmd": "echo started; exec sleep 300", "stream": True}
    # Its own client: closing it drops the connection (a pooled one could outlive the stream).
    with httpx.Client(base_url=api.base_url, headers=api.headers) as client:
        with client.stream("POST", f"/sandboxes/{sandbox}/exec", json=body) as r:
            lines = r.iter_lines()
            start = json.loads(next(lines))
            assert json.loads(next(lines))["data"] == "started\n"
    wait_until(lambda: api.get(f"/sandboxes/{sandbox}/processes/{start['id']}").json()["status"] != "running",
               15, what="the streamed command to be killed")  # fmt: skip
    row = api.get(f"/sandboxes/{sandbox}/processes/{start['id']}").json()
    assert row["signal"] == 9
    ps = api.post(f"/sandboxes/{sandbox}/exec", json={"cmd": "ps -o comm | grep -c '^sleep' || true"}).json()
    assert ps["stdout"].strip() == "0"


def test_background_process_returns_at_once_and_can_be_followed(api, sandbox):
    t = time.monotonic()
    r = api.post(
        f"/sandboxes/{sandbox}/exec",
        json={"cmd": "for i in 1 2 3; do echo tick $i; sleep 0.5; done", "background": True},
    )
    assert r.status_code == 202 and time.monotonic() - t < 1.2
    proc = r.json()
    assert proc["status"] == "running" and proc["pid"] > 0
    assert proc["output"] == f"/api/v1/sandboxes/{sandbox}/processes/{proc['id']}/output"
    listed = api.get(f"/sandboxes/{sandbox}/processes", params={"status": "running"}).json()
    assert [p["id"] for p in listed] == [proc["id"]]

    # Reattach from the start while it runs: everything, then the exit.
    events = ndjson(api, "GET", f"/sandboxes/{sandbox}/processes/{proc['id']}/output")
    text = "".join(e["data"] for e in events if e["type"] == "stdout")
    assert text == "tick 1\ntick 2\ntick 3\n" and events[-1]["exit_code"] == 0
    # After the end the output is still there, from the start or from an offset.
    again = ndjson(api, "GET", f"/sandboxes/{sandbox}/processes/{proc['id']}/output", params={"offset": 7})
    assert "".join(e["data"] for e in again if e["type"] == "stdout") == "tick 2\ntick 3\n"
    got = api.get(f"/sandboxes/{sandbox}/processes/{proc['id']}").json()
    assert got["status"] == "exited" and got["exit_code"] == 0 and got["stdout_bytes"] == 21


def test_background_process_live_output_only_and_no_follow(api, sandbox):
    proc = api.post(
        f"/sandboxes/{sandbox}/exec", json={"cmd": "echo early; sleep 1; echo late", "background": True}
    ).json()
    time.sleep(0.4)
    snapshot = ndjson(
        api, "GET", f"/sandboxes/{sandbox}/processes/{proc['id']}/output", params={"follow": False}
    )
    assert [e["data"] for e in snapshot if e["type"] == "stdout"] == ["early\n"]
    assert not any(e["type"] == "exit" for e in snapshot)
    live = ndjson(api, "GET", f"/sandboxes/{sandbox}/processes/{proc['id']}/output", params={"live": True})
    assert "".join(e["data"] for e in live if e["type"] == "stdout") == "late\n"


def test_background_process_stdin_and_signals(api, sandbox):
    cat = api.post(
        f"/sandboxes/{sandbox}/exec", json={"cmd": ["cat"], "background": True, "stdin_open": True}
    ).json()
    url = f"/sandboxes/{sandbox}/processes/{cat['id']}"
    assert api.post(f"{url}/stdin", json={"data": "hello\n"}).status_code == 202
    assert api.post(f"{url}/stdin", json={"data_b64": "d29ybGQK", "close": True}).status_code == 202
    wait_until(lambda: api.get(url).json()["status"] == "exited", 15, what="cat to see EOF")
    out = ndjson(api, "GET", f"{url}/output")
    assert "".join(e["data"] for e in out if e["type"] == "stdout") == "hello\nworld\n"
    assert api.post(f"{url}/stdin", json={"data": "x"}).status_code == 409

    # Input a command does not read waits on its node up to a bound (8 MiB), then is refused
    # with what to do; a call over the bound is refused before anything is sent.
    deaf = api.post(f"/sandboxes/{sandbox}/exec", json={"cmd": "sleep 120", "background": True,
                                                        "stdin_open": True}).json()  # fmt: skip
    url = f"/sandboxes/{sandbox}/processes/{deaf['id']}"
    big = base64.b64encode(b"\0" * (8 * 1024 * 1024 + 1)).decode()
    r = api.post(f"{url}/stdin", json={"data_b64": big})
    assert r.status_code == 422 and "at most 8388608 bytes of input per call" in r.json()["detail"], r.text
    started = time.monotonic()
    r = api.post(f"{url}/stdin", json={"data_b64": base64.b64encode(b"\0" * (8 * 1024 * 1024)).decode()})
    assert r.status_code == 202 and time.monotonic() - started >= 4, r.text  # it waited to be read
    r = api.post(f"{url}/stdin", json={"data": "more"})
    assert r.status_code == 409 and "has not read the input it was sent" in r.json()["detail"], r.text
    api.post(f"{url}/signal", json={"signal": "KILL"})

    sleeper = api.post(f"/sandboxes/{sandbox}/exec", json={"cmd": "trap 'echo got TERM; exit 7' TERM; while :; do sleep 0.1; done", "background": True}).json()  # fmt: skip
    url = f"/sandboxes/{sandbox}/processes/{sleeper['id']}"
    time.sleep(0.3)
    assert api.post(f"{url}/signal", json={"signal": "NOSUCH"}).status_code == 422
    assert api.post(f"{url}/signal", json={"signal": "TERM"}).status_code == 202
    wait_until(lambda: api.get(url).json()["status"] == "exited", 15, what="the trap to run")
    assert api.get(url).json()["exit_code"] == 7


def test_background_timeout_is_the_commands_own_not_the_sandboxes(api, sandbox):
    timed = api.post(
        f"/sandboxes/{sandbox}/exec", json={"cmd": "sleep 30", "background": True, "timeout_s": 1}
    ).json()
    forever = api.post(f"/sandboxes/{sandbox}/exec", json={"cmd": "sleep 30", "background": True}).json()
    assert forever and api.get(f"/sandboxes/{sandbox}/processes/{forever['id']}").json()["timeout_s"] is None
    url = f"/sandboxes/{sandbox}/processes/{timed['id']}"
    wait_until(lambda: api.get(url).json()["status"] == "exited", 15, what="the timeout")
    assert api.get(url).json()["timed_out"] is True
    # The sandbox and the process without a timeout carry on.
    assert api.get(f"/sandboxes/{sandbox}").json()["status"] == "running"
    assert api.get(f"/sandboxes/{sandbox}/processes/{forever['id']}").json()["status"] == "running"


def test_live_processes_end_when_the_sandbox_is_deleted(api, sandbox):
    proc = api.post(f"/sandboxes/{sandbox}/exec", json={"cmd": "sleep 300", "background": True}).json()
    term = api.post(f"/sandboxes/{sandbox}/terminals", json={}).json()
    assert api.delete(f"/sandboxes/{sandbox}").status_code == 204
    wait_until(lambda: api.get(f"/sandboxes/{sandbox}/processes/{proc['id']}").json()["status"] != "running",
               30, what="the process to end with its sandbox")  # fmt: skip
    wait_until(lambda: api.get(f"/sandboxes/{sandbox}/terminals").json()[0]["status"] != "running",
               30, what="the terminal to end with its sandbox")  # fmt: skip
    assert term["id"]


def test_a_process_is_addressed_by_its_id_and_its_pid_is_refused_naming_the_id(api, sandbox, server):
    proc = api.post(f"/sandboxes/{sandbox}/exec", json={"cmd": "sleep 5", "background": True}).json()
    assert api.get(f"/sandboxes/{sandbox}/processes/{proc['id']}").json()["pid"] == proc["pid"]
    if proc["pid"] != proc["id"]:
        r = api.get(f"/sandboxes/{sandbox}/processes/{proc['pid']}")
        assert r.status_code == 404, r.text
        assert (
            f"{proc['pid']} is the pid of process {proc['id']}; paths take the process's id"
            in r.json()["detail"]
        )
    # The OpenAPI document says the same of the path's parameter.
    paths = httpx.get(f"{server}/api/v1/openapi.json").json()["paths"]
    params = paths["/api/v1/sandboxes/{sandbox_id}/processes/{process_id}"]["get"]["parameters"]
    described = {p["name"]: p.get("description", "") for p in params}
    assert "not its `pid`" in described["process_id"]


def test_process_errors_are_client_errors(api, sandbox, other_api):
    r = api.post(f"/sandboxes/{sandbox}/exec", json={"cmd": ["/no/such/binary"], "stream": True})
    assert r.status_code == 422 and "/no/such/binary" in r.json()["detail"]
    r = api.post(f"/sandboxes/{sandbox}/exec", json={"cmd": "true", "stream": True, "background": True})
    assert r.status_code == 422 and "one of" in r.json()["detail"]
    assert api.get(f"/sandboxes/{sandbox}/processes/999999").status_code == 404
    proc = api.post(f"/sandboxes/{sandbox}/exec", json={"cmd": "sleep 5", "background": True}).json()
    # Another team sees none of it.
    assert other_api.get(f"/sandboxes/{sandbox}/processes/{proc['id']}").status_code == 404
    assert other_api.post(f"/sandboxes/{sandbox}/processes/{proc['id']}/signal", json={}).status_code == 404
    assert other_api.get(f"/sandboxes/{sandbox}/processes/{proc['id']}/output").status_code == 404
    assert other_api.post(f"/sandboxes/{sandbox}/terminals", json={}).status_code == 404
    # A run-to-completion exec is history, not a live process.
    ran = api.post(f"/sandboxes/{sandbox}/exec", json={"cmd": "true"}).json()
    assert api.post(f"/sandboxes/{sandbox}/processes/{ran['id']}/signal", json={}).status_code == 409


def test_a_follow_that_cannot_be_served_is_refused_before_its_first_byte(api, sandbox, other_api):
    proc = api.post(f"/sandboxes/{sandbox}/exec", json={"cmd": "echo hi", "background": True}).json()
    url = f"/sandboxes/{sandbox}/processes/{proc['id']}/output"
    # A short timeout: a stream that hangs instead of answering fails here at once.
    with httpx.Client(base_url=api.base_url, headers=api.headers, timeout=10) as client:
        for offset in ("99999999999999999999", str(2**53), "-1", "x"):
            r = client.get(url, params={"offset": offset})
            assert r.status_code == 422 and "offset" in r.json()["detail"], (offset, r.text)
        r = client.get(f"/sandboxes/{sandbox}/processes/999999/output")
        assert r.status_code == 404 and "no process" in r.json()["detail"]
        assert other_api.get(url, timeout=10).status_code == 404
        # The largest offset there is: nothing to send, and the exit.
        events = ndjson(client, "GET", url, params={"offset": 2**53 - 1})
        assert [e["type"] for e in events] == ["exit"]


def test_terminals_api_create_list_close(api, sandbox, other_api):
    r = api.post(f"/sandboxes/{sandbox}/terminals", json={"name": "build", "rows": 30, "cols": 100})
    assert r.status_code == 201, r.text
    term = r.json()
    assert term["id"].startswith("tm") and term["status"] == "running" and term["pid"] > 0
    assert term["websocket"] == f"/ws/v1/terminals/{term['id']}" and term["name"] == "build"
    assert [t["id"] for t in api.get(f"/sandboxes/{sandbox}/terminals").json()] == [term["id"]]
    assert api.post(f"/sandboxes/{sandbox}/terminals", json={"rows": 0}).status_code == 422
    assert other_api.delete(f"/sandboxes/{sandbox}/terminals/{term['id']}").status_code == 404
    assert api.delete(f"/sandboxes/{sandbox}/terminals/{term['id']}").status_code == 204
    wait_until(lambda: api.get(f"/sandboxes/{sandbox}/terminals").json()[0]["status"] != "running",
               15, what="the terminal to close")  # fmt: skip


def test_stop_and_keepalive(api, sandbox):
    before = api.get(f"/sandboxes/{sandbox}").json()["expires_at"]
    r = api.post(f"/sandboxes/{sandbox}/keepalive", json={"timeout_s": 7200})
    assert r.status_code == 200 and r.json()["expires_at"] > before
    assert api.post(f"/sandboxes/{sandbox}/keepalive", json={"timeout_s": 0}).status_code == 422
    events = api.get(f"/sandboxes/{sandbox}/events").json()
    assert any(e["kind"] == "keepalive" for e in events)
    assert api.post(f"/sandboxes/{sandbox}/stop").status_code == 200
    wait_until(lambda: api.get(f"/sandboxes/{sandbox}").json()["status"] == "stopped", 30, what="stop")
    assert sandbox not in launcher_ids()
    r = api.post(f"/sandboxes/{sandbox}/exec", json={"cmd": "true"})
    assert r.status_code == 409 and "stopped" in r.json()["detail"]
    assert api.post(f"/sandboxes/{sandbox}/keepalive", json={"timeout_s": 60}).status_code == 409
    assert api.delete(f"/sandboxes/{sandbox}").status_code == 204
    wait_until(lambda: api.get(f"/sandboxes/{sandbox}").json()["status"] == "deleted", 30, what="delete")


def launcher_ids() -> list[str]:
    from runtime.node.local import launcher_for

    return list(launcher_for("gvisor").states())
