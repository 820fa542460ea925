"""Faults, injected into a Hangar of the suite's own (tests/reliability/stack.py: the real
`hangar up` on its own Postgres, Redis and data disk): every Hangar process SIGKILLed and
started again, a sandbox's runtime killed from outside, the bridge killed during a streamed
command, Redis and Postgres restarted, the data disk filled, the worker killed during a
provision, a pause, a resume and a destroy (`hangar up` starts a dead child again). After each, the
state converges (no sandbox left in a transitional state, no runtime left without its row) and
clients get an answer (an error or the result), never a hang."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.reliability.stack import Stack, host_resources
from tests.support import requires_runsc

pytestmark = [requires_runsc, pytest.mark.slow, pytest.mark.timeout(600)]

TRANSITIONAL = ("pending", "starting", "pausing", "resuming", "stopping")


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("faults"))
    try:
        s.mount_data_disk()
        s.start_postgres()
        s.start_redis()
        s.bootstrap()
        s.start()
        with s.api() as api:
            r = api.post("/volumes", json={"name": WITNESS, "size_mb": 16})
            assert r.status_code == 201, r.text
        yield s
    finally:
        s.close()


WITNESS = "witness"  # a volume in use through every fault: what was written to it is kept
WRITTEN: list[str] = []  # the lines written to it so far, one before each fault


@pytest.fixture(autouse=True)
def _clean(stack, request) -> Iterator[None]:
    """Each fault starts on an empty node but for a sandbox that has just written a line to
    the witness volume and keeps it mounted through the fault; after it, every sandbox is
    deleted and a new one reads the volume back: no line written before a fault is lost."""
    line = f"before {request.node.name}"
    with stack.api() as api:
        holder = create(api, volumes=[{"volume": WITNESS, "mount_path": "/w"}])
        r = exec_(api, holder["id"], f"echo '{line}' >> /w/log && sync")
        assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
        WRITTEN.append(line)
    yield
    with stack.api() as api:
        try:
            for sb in api.get("/sandboxes", params={"limit": 1000}).json():
                api.delete(f"/sandboxes/{sb['id']}")
            eventually(lambda: not api.get("/sandboxes", params={"limit": 1000}).json(), 60, "all deleted")
        except (httpx.HTTPError, AssertionError):
            pass  # a fault left the stack unable to answer: the next test says so
        reader = eventually(lambda: create(api, volumes=[{"volume": WITNESS, "mount_path": "/w"}]), 60,
                            "a sandbox with the witness volume after the fault")  # fmt: skip
        r = exec_(api, reader["id"], "cat /w/log")
        assert r.status_code == 200, r.text
        kept, written = r.json()["stdout"].splitlines(), list(WRITTEN)
        WRITTEN[:] = kept  # one loss fails its own test, not every one after it
        assert kept == written, f"the witness volume after {line}: {r.text}"
        assert api.delete(f"/sandboxes/{reader['id']}").status_code in (202, 204)
        eventually(lambda: not api.get("/sandboxes", params={"limit": 1000}).json(), 60, "the reader deleted")


def create(api: httpx.Client, **extra) -> dict:
    r = api.post("/sandboxes", json={"image": "busybox", "memory_mb": 128, "timeout_s": 900, **extra})
    assert r.status_code == 201, r.text
    return r.json()


def exec_(api: httpx.Client, sandbox_id: str, cmd: str, timeout: float = 60) -> httpx.Response:
    return api.post(f"/sandboxes/{sandbox_id}/exec", json={"cmd": cmd}, timeout=timeout)


def converged(api: httpx.Client, within: float = 60) -> float:
    """Seconds until no sandbox is in a transitional state (fails past ``within``)."""
    started = time.monotonic()
    while True:
        try:
            rows = api.get("/sandboxes", params={"limit": 1000}).json()
            stuck = [f"{r['id']} {r['status']}" for r in rows if r["status"] in TRANSITIONAL]
        except (httpx.HTTPError, ValueError) as exc:
            stuck = [f"no answer: {exc}"]
        if not stuck:
            return time.monotonic() - started
        assert time.monotonic() - started < within, f"still transitional after {within} s: {stuck}"
        time.sleep(0.5)


def eventually(fn, within: float, what: str):
    deadline = time.monotonic() + within
    last: object = None
    while time.monotonic() < deadline:
        try:
            out = fn()
            if out:
                return out
            last = out
        except (httpx.HTTPError, AssertionError) as exc:
            last = exc
        time.sleep(0.5)
    raise AssertionError(f"{what} not within {within} s: {last!r}")


def _stream(api: httpx.Client, sandbox_id: str, cmd: str, got: list[str], ended: threading.Event) -> None:
    try:
        with api.stream("POST", f"/sandboxes/{sandbox_id}/exec", json={"cmd": cmd, "stream": True},
                        timeout=httpx.Timeout(120, read=60)) as r:  # fmt: skip
            for line in r.iter_lines():
                got.append(line)
    except httpx.HTTPError as exc:
        got.append(f"client error: {type(exc).__name__}")
    finally:
        ended.set()


def test_every_process_sigkilled_then_started_again(stack, report):
    with stack.api() as api:
        r = api.post("/volumes", json={"name": f"v-{stack.tag}", "size_mb": 32})
        assert r.status_code == 201, r.text
        sb = create(api, volumes=[{"volume": f"v-{stack.tag}", "mount_path": "/vol"}],
                    network={"egress": "all"})  # fmt: skip
        api.put(f"/sandboxes/{sb['id']}/files", params={"path": "/data.txt"}, content=b"kept")
        api.put(f"/sandboxes/{sb['id']}/files", params={"path": "/vol/data.txt"}, content=b"on the volume")
        got: list[str] = []
        ended = threading.Event()
        threading.Thread(
            target=_stream, args=(api, sb["id"], "sleep 60; echo late", got, ended), daemon=True
        ).start()
        time.sleep(1.5)
        killed_at = time.monotonic()
        stack.kill_everything()
        assert ended.wait(15), "the streaming client was left hanging"
        client_answered_s = time.monotonic() - killed_at
        stack.start()
        back = eventually(
            lambda: api.get(f"/sandboxes/{sb['id']}").json()["status"] == "running", 60, "running"
        )
        assert back
        r = eventually(lambda: exec_(api, sb["id"], "cat /data.txt"), 60, "an exec after the restart")
        assert r.status_code == 200 and r.json()["stdout"] == "kept", r.text
        assert exec_(api, sb["id"], "cat /vol/data.txt").json()["stdout"] == "on the volume"
        assert api.delete(f"/sandboxes/{sb['id']}").status_code in (202, 204)
        eventually(lambda: api.get(f"/sandboxes/{sb['id']}").json()["status"] == "deleted", 60, "deleted")
        # The volume's data outlives its sandbox, the kill and the restart.
        again = create(api, volumes=[{"volume": f"v-{stack.tag}", "mount_path": "/again"}])
        assert exec_(api, again["id"], "cat /again/data.txt").json()["stdout"] == "on the volume"
        took = converged(api)
    report.held("fault", "SIGKILL of server, worker, beat and bridge, then a start", client_answered_s=round(
        client_answered_s, 1), sandbox="still running with its files", converged_s=round(took, 1))  # fmt: skip


def _runtime_pids(sandbox_id: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", sandbox_id], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def test_a_sandbox_whose_runtime_is_killed_from_outside_fails_with_a_reason(stack, report):
    with stack.api() as api:
        sb = create(api)
        pids = _runtime_pids(sb["id"])
        assert pids, "no runtime process carries the sandbox's id"
        started = time.monotonic()
        subprocess.run(["kill", "-9", *map(str, pids)], check=False)
        row = eventually(lambda: (r := api.get(f"/sandboxes/{sb['id']}").json())["status"] == "failed" and r,
                         60, "the sandbox marked failed")  # fmt: skip
        failed_s = time.monotonic() - started
        assert row["status_reason"], row
        refused = exec_(api, sb["id"], "true")
        assert refused.status_code == 409, refused.text
        assert api.delete(f"/sandboxes/{sb['id']}").status_code in (202, 204)
        eventually(lambda: api.get(f"/sandboxes/{sb['id']}").json()["status"] == "deleted", 60, "deleted")
        eventually(lambda: not _runtime_pids(sb["id"]), 30, "no process left")
        assert sb["id"] not in Path("/proc/self/mountinfo").read_text()
    report.held("fault", "a sandbox's runtime SIGKILLed from outside", marked_failed_s=round(failed_s, 1),
                reason=row["status_reason"][:60])  # fmt: skip


def test_the_bridge_killed_during_a_streamed_command(stack, report):
    with stack.api() as api:
        sb = create(api)
        got: list[str] = []
        ended = threading.Event()
        script = "i=0; while [ $i -lt 200 ]; do echo line-$i; i=$((i+1)); sleep 0.1; done"
        threading.Thread(target=_stream, args=(api, sb["id"], script, got, ended), daemon=True).start()
        eventually(lambda: any("line-5" in g for g in got), 30, "output flowing")
        killed_at = time.monotonic()
        old = stack.child("bridge")
        stack.kill("bridge")
        assert ended.wait(15), "the streaming client was left hanging after the bridge died"
        answered_s = time.monotonic() - killed_at
        last = got[-1]
        stack.restarted("bridge", old)  # by hangar up
        r = eventually(lambda: exec_(api, sb["id"], "echo after"), 60, "an exec once the bridge is back")
        assert r.status_code == 200 and r.json()["stdout"] == "after\n"
        again: list[str] = []
        done = threading.Event()
        _stream(api, sb["id"], "echo streamed-again", again, done)
        assert any("streamed-again" in line for line in again), again
        took = converged(api)
    report.held("fault", "the bridge SIGKILLed during a streamed command", client_answered_s=round(answered_s, 1),
                last_event=last[:60], converged_s=round(took, 1))  # fmt: skip


def _terminal_echo(stack: Stack, api: httpx.Client, sandbox_id: str, name: str):
    """A terminal of the sandbox, attached over its websocket, that has echoed a command."""
    from websockets.sync.client import connect

    r = api.post(f"/sandboxes/{sandbox_id}/terminals", json={"name": name})
    assert r.status_code in (200, 201), r.text
    ws = connect(stack.url.replace("http://", "ws://") + r.json()["websocket"],
                 additional_headers={"Authorization": f"Bearer {stack.token}"}, open_timeout=30)  # fmt: skip
    ws.send(b"echo ready-$((6 * 7))\n")
    seen = b""
    deadline = time.monotonic() + 30
    while b"ready-42" not in seen:
        msg = ws.recv(timeout=max(0.01, deadline - time.monotonic()))
        seen += msg if isinstance(msg, bytes) else msg.encode()
    return ws


def test_the_bridge_killed_under_a_terminal(stack, report):
    from websockets.exceptions import ConnectionClosed

    with stack.api() as api:
        sb = create(api)
        ws = _terminal_echo(stack, api, sb["id"], "before")
        old = stack.child("bridge")
        stack.kill("bridge")
        killed_at = time.monotonic()
        last = ""
        try:  # the terminal's end is said (an exit frame) and the socket closes; nothing hangs
            while time.monotonic() - killed_at < 15:
                msg = ws.recv(timeout=max(0.01, killed_at + 15 - time.monotonic()))
                if isinstance(msg, str):
                    last = msg
        except ConnectionClosed:
            pass
        except TimeoutError:
            pytest.fail("the terminal's socket was left open and silent after its bridge died")
        answered_s = time.monotonic() - killed_at
        assert answered_s < 15 and '"exit"' in last, (answered_s, last)
        ws.close()
        stack.restarted("bridge", old)
        eventually(
            lambda: _terminal_echo(stack, api, sb["id"], "after").close() or True, 60, "a new terminal"
        )
        took = converged(api)
    report.held("fault", "the bridge SIGKILLed under a terminal", client_answered_s=round(answered_s, 1),
                last_frame=last[:60], converged_s=round(took, 1))  # fmt: skip


def service_name(service: str) -> str:
    return {"redis": "Redis", "postgres": "the database"}[service]


@pytest.mark.parametrize("service", ["redis", "postgres"])
def test_a_restart_of_the_services_underneath(stack, service, report):
    with stack.api() as api:
        sb = create(api)
        stack.kill(service)
        started = time.monotonic()
        answers = []
        for method, path, body in (("GET", "/sandboxes", None), ("POST", f"/sandboxes/{sb['id']}/exec",
                                   {"cmd": "true"}), ("POST", "/sandboxes", {"image": "busybox"})):  # fmt: skip
            r = api.request(method, path, json=body, timeout=60)
            # An answer: what was asked, or a 503 naming the service away and when to try again.
            assert r.status_code < 500 or (r.status_code == 503 and r.headers.get("Retry-After")), r.text
            assert r.status_code != 503 or service_name(service) in r.json()["detail"], r.text
            answers.append(f"{method} {path.split('/')[-1]}: {r.status_code}")
        answered_s = time.monotonic() - started
        assert answered_s < 60, "requests hung while the service was down"
        stack.restart(service)
        back_at = time.monotonic()
        r = eventually(lambda: (r := exec_(api, sb["id"], "echo back")).status_code == 200 and r, 60,
                       f"an exec after {service} came back")  # fmt: skip
        assert r.json()["stdout"] == "back\n", r.text
        recovered_s = time.monotonic() - back_at
        got: list[str] = []
        _stream(api, sb["id"], "echo streamed", got, threading.Event())
        assert any("streamed" in line for line in got), got
        assert create(api)["status"] == "running"
        took = converged(api)
        assert stack.procs["up"].poll() is None, "hangar up stopped:\n" + stack.log("up")
    report.held("fault", f"{service} restarted", answers_while_down=", ".join(answers), answered_s=round(answered_s, 1),
                recovered_s=round(recovered_s, 1), converged_s=round(took, 1))  # fmt: skip


def test_a_full_data_disk(stack, report):
    with stack.api() as api:
        sb = create(api)
        filler = stack.data / "filler"
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M", "count=100000"], capture_output=True)
        try:
            started = time.monotonic()
            r = api.post("/sandboxes", json={"image": "busybox", "memory_mb": 128}, timeout=120)
            answered_s = time.monotonic() - started
            if r.status_code == 201:  # placed before the node reported its disk: an outcome, with its reason
                row = r.json()
                outcome = row["status"]
                assert outcome == "running" or (outcome == "failed" and row["status_reason"]), row
            else:  # refused up front, saying why
                outcome = r.status_code
                assert r.status_code in (503, 507) and "disk" in r.json()["detail"], r.text
            running = exec_(api, sb["id"], "echo still")
            assert running.status_code == 200 and running.json()["stdout"] == "still\n"
        finally:
            filler.unlink(missing_ok=True)
        # The node reports its free space every tick; a create fits again once it has.
        freed_at = time.monotonic()
        again = eventually(lambda: (r := api.post("/sandboxes", json={"image": "busybox", "memory_mb": 128}))
                           .status_code == 201 and r.json(), 30, "a create once the disk has room")  # fmt: skip
        assert again["status"] == "running", again
        room_again_s = time.monotonic() - freed_at
        took = converged(api)
    report.held("fault", "the data disk filled", create_answer=outcome, answered_s=round(answered_s, 1),
                room_again_s=round(room_again_s, 1), converged_s=round(took, 1))  # fmt: skip


# The worker is killed just after the request that gives it the work, then started again;
# (operation, the request, the state it must reach, the exec that proves it).
WORKER_FAULTS = {
    "provision": ("running", "echo up"),
    "pause": ("paused", None),
    "resume": ("running", "cat /kept.txt"),
    "destroy": ("deleted", None),
}


@pytest.mark.parametrize("operation", list(WORKER_FAULTS))
def test_the_worker_killed_during_an_operation(stack, operation, report):
    settled, proof = WORKER_FAULTS[operation]
    with stack.api() as api:
        worker = stack.child("worker")
        assert worker is not None
        if operation == "provision":
            r = api.post("/sandboxes", json={"image": "busybox", "memory_mb": 128, "wait": False})
            assert r.status_code in (201, 202), r.text
            sid = r.json()["id"]
        else:
            sid = create(api)["id"]
            api.put(f"/sandboxes/{sid}/files", params={"path": "/kept.txt"}, content=b"kept")
            if operation == "resume":
                r = api.post(f"/sandboxes/{sid}/pause", json={"mode": "stop"})
                assert r.status_code == 200 and r.json()["status"] == "paused", r.text
                r = api.post(f"/sandboxes/{sid}/resume", json={"wait": False})
            elif operation == "pause":
                r = api.post(f"/sandboxes/{sid}/pause", json={"mode": "stop", "wait": False})
            else:
                r = api.delete(f"/sandboxes/{sid}")
            assert r.status_code < 300, r.text
        # Stopped the moment the request has its answer, so the operation is still in the
        # worker's hands (queued, taken or half done), then killed: never a fault after the fact.
        os.killpg(worker, signal.SIGSTOP)
        killed_in = api.get(f"/sandboxes/{sid}").json()["status"]
        os.killpg(worker, signal.SIGKILL)
        assert killed_in in TRANSITIONAL, f"{operation} was over ({killed_in}) before the worker was killed"
        stack.restarted("worker", worker)  # by hangar up
        started = time.monotonic()
        final = eventually(
            lambda: (s := api.get(f"/sandboxes/{sid}").json()["status"]) not in TRANSITIONAL and s,
            90, f"the sandbox out of its transitional state after the worker died during {operation}",
        )  # fmt: skip
        took = time.monotonic() - started
        assert final == settled, f"{operation}: ended {final}, not {settled}"
        if proof:
            r = exec_(api, sid, proof)
            assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
    report.held("fault", f"the worker SIGKILLed during {operation}", killed_in=killed_in, final_status=final,
                converged_s=round(took, 1))  # fmt: skip


def _shows(sandbox_id: str, kind: str, text: str) -> bool:
    digest = hashlib.sha1(sandbox_id.encode()).hexdigest()[:8]
    return sandbox_id in text or (kind in ("interfaces", "nftables") and digest in text)


def test_nothing_is_left_without_its_row_and_no_row_without_its_resources(stack):
    """After every fault above: no process, mount, loop device, network namespace, veth,
    nftables rule or cgroup of a sandbox whose row is not live; each running row has every one
    of them (which also shows that the search for leftovers looks where sandboxes leave things);
    a paused one has no process and no runtime; each live row's sandbox is in runsc's list."""
    with stack.api() as api:
        r = api.post("/volumes", json={"name": "live-check", "size_mb": 16})
        assert r.status_code == 201, r.text
        live = create(api, volumes=[{"volume": "live-check", "mount_path": "/v"}], network={"egress": "all"})
        paused = create(api)
        r = api.post(f"/sandboxes/{paused['id']}/pause", json={"mode": "stop"})
        assert r.status_code == 200 and r.json()["status"] == "paused", r.text
        rows = {r["id"]: r["status"] for r in api.get("/sandboxes", params={"limit": 1000}).json()}
        gone = [r["id"] for r in api.get("/sandboxes", params={"status": "deleted", "limit": 1000}).json()]
    assert len(gone) >= 10, f"the faults above left only {len(gone)} deleted sandboxes to check"
    host = host_resources()
    leftovers = [f"{i} in {kind}" for i in gone for kind, text in host.items() if _shows(i, kind, text)]
    assert not leftovers, leftovers
    absent = [kind for kind, text in host.items() if not _shows(live["id"], kind, text)]
    assert not absent, f"the running sandbox {live['id']} has no {', '.join(absent)} on the host"
    kept = [kind for kind in ("processes", "cgroups", "network namespaces", "interfaces", "nftables")
            if _shows(paused["id"], kind, host[kind])]  # fmt: skip
    assert not kept, f"the paused (stopped) sandbox {paused['id']} still has its {', '.join(kept)}"
    roots = [p for p in stack.data.glob("*/runsc-root")] + [p for p in stack.data.glob("*/*/runsc-root")]
    assert roots, f"no runsc state under {stack.data}"
    listed: set[str] = set()
    for root in roots:
        out = subprocess.run(
            ["runsc", "--root", str(root), "list", "--format=json"], capture_output=True, text=True
        )
        listed |= {c["id"] for c in ((json.loads(out.stdout or "[]") or []) if out.returncode == 0 else [])}
    orphans = [i for i in listed if rows.get(i) not in ("running", "paused")]
    assert not orphans, orphans
    missing = [i for i, status in rows.items() if status == "running" and i not in listed]
    assert not missing, missing
