"""`hangar up` on the embedded default (SQLite + an embedded Redis), as a user runs it."""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from runtime.launchers.gvisor.runsc import default_runsc
from tests.support import free_port, requires_runsc, wait_until

ROOT = Path(__file__).resolve().parent.parent


def _clean_env(data_dir: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")
    }
    env.update(HANGAR_DATA_DIR=str(data_dir), HANGAR_NODE_NAME="uptest", PYTHONUNBUFFERED="1",
               HANGAR_SSH_PORT=str(free_port()), **extra)  # fmt: skip
    return env


class Up:
    def __init__(self, data_dir: Path, **extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.output: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dashboard.cli", "up", "--port", str(self.port), "--concurrency", "4"],
            cwd=ROOT, env=_clean_env(data_dir, **extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1,
        )  # fmt: skip
        self.read_until("Press Ctrl-C", 120)
        wait_until(self._healthy, 60, what="hangar up to answer")

    def read_until(self, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                if not line and self.proc.poll() is not None:
                    break
                self.output.append(line)
                if needle in line:
                    return
        raise AssertionError(f"{needle!r} not seen; output:\n{''.join(self.output)}")

    def read_for(self, seconds: float) -> None:
        """Take what it prints for ``seconds``."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if select.select([self.proc.stdout], [], [], left)[0]:
                line = self.proc.stdout.readline()
                if not line:
                    break
                self.output.append(line)

    def _healthy(self) -> bool:
        try:
            r = httpx.get(f"{self.url}/api/v1/health", timeout=2)
            return r.status_code == 200 and any(n["name"] == "uptest" for n in r.json()["nodes"])
        except httpx.HTTPError:
            return False

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(60)


def _zombies_of(parent: int) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == parent:
            found.append(int(pid))
    return found


def _hangar_processes(data_dir: Path) -> list[str]:
    """Processes started by that Hangar (they carry its data dir in their environment), except
    the sandboxes, which are meant to outlive it."""
    marker = f"HANGAR_DATA_DIR={data_dir}".encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if (marker in environ.split(b"\0") or str(data_dir) in cmdline) and "runsc" not in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


def _e2b_lines(up: Up) -> list[str]:
    """The E2B lines `hangar up` printed, run through a shell as a user pastes them: a comment
    and three exports, nothing else (no redirect, no stray word)."""
    start = next(i for i, line in enumerate(up.output) if "# the e2b SDK" in line)
    block = "".join(up.output[start : start + 4])
    shown = subprocess.run(["bash", "-euc", block + 'printf "%s\n" "$E2B_API_URL" "$E2B_SANDBOX_URL" "$E2B_API_KEY"'],
                           capture_output=True, text=True, check=True, cwd="/")  # fmt: skip
    assert shown.stderr == "", shown.stderr
    lines = [line.strip() for line in up.output[start + 1 : start + 4]]
    assert [
        f"export {name}={value}"
        for name, value in zip(
            ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"), shown.stdout.splitlines(), strict=True
        )
    ] == lines
    return lines


@requires_runsc
def test_hangar_up_runs_stops_cleanly_and_sandboxes_survive_a_restart(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o755)
    data_dir.chmod(0o755)
    up = Up(data_dir, HANGAR_NODE_TICK_S="1")
    worker_log = data_dir / "logs" / "worker.log"
    wait_until(lambda: "[queues]" in worker_log.read_text(), 60, what="the worker's banner in its log")
    up.read_for(2)  # what the children print once up
    text = "".join(up.output)
    assert "admin: admin / " in text
    # The console is Hangar's: no Celery banner or superuser warning; those are in the logs.
    for noise in ("celery@", "[config]", "[queues]", "superuser privileges", "-------------- "):
        assert noise not in text, (noise, text)
    assert f"logs:  {data_dir}/logs/" in text
    token = next(line.split(": ", 1)[1].strip() for line in up.output if "API token" in line)
    # The e2b SDK's three variables, each a line a shell takes as pasted, the new token the key.
    assert _e2b_lines(up) == [f"export E2B_API_URL={up.url}/e2b", f"export E2B_SANDBOX_URL={up.url}/e2b/envd",
                              f"export E2B_API_KEY={token}"]  # fmt: skip
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700 and "now 700" in text  # root's alone
    # The SSH gateway into harnesses is one of the processes it starts.
    ssh_port = int(re.search(r"ssh: +port (\d+)", text).group(1))
    with socket.create_connection(("127.0.0.1", ssh_port), timeout=10) as conn:
        assert conn.recv(64).startswith(b"SSH-2.0-")
    api = httpx.Client(base_url=f"{up.url}/api/v1", headers={"Authorization": f"Bearer {token}"}, timeout=60)
    sb = api.post("/sandboxes", json={"image": "busybox", "memory_mb": 256, "timeout_s": 600}).json()
    assert sb.get("status") == "running", sb
    sid = sb["id"]
    assert (
        api.post(f"/sandboxes/{sid}/exec", json={"cmd": "echo first > /tmp/f; cat /tmp/f"}).json()["stdout"]
        == "first\n"
    )
    assert (data_dir / "hangar.sqlite3").exists()
    # Hangar's own spans reach its traces on SQLite too: the server's and the node's of one
    # create in one trace, whose summary each batch grows (one upsert per batch).
    listed = lambda: api.get("/traces", params={"sandbox": sid, "limit": 50}).json()  # noqa: E731
    trace = wait_until(lambda: next((t for t in listed() if t["span_count"] >= 3), None), 30, 0.5,
                       what="the create's trace with the node's spans in it")  # fmt: skip
    spans = api.get(f"/traces/{trace['trace_id']}").json()["spans"]
    assert len(spans) == trace["span_count"] and {"sandbox.create", "sandbox.start"} <= {
        s["name"] for s in spans
    }
    # A volume's data and a paused sandbox's files must outlive Hangar's processes too.
    assert api.post("/volumes", json={"name": "keep", "size_mb": 32}).status_code == 201
    vb = api.post("/sandboxes", json={"image": "busybox", "memory_mb": 256,
                                      "volumes": [{"volume": "keep", "mount_path": "/keep"}]}).json()  # fmt: skip
    api.post(
        f"/sandboxes/{vb['id']}/exec", json={"cmd": "echo on-volume > /keep/f; echo in-root > /root/f; sync"}
    )
    assert api.post(f"/sandboxes/{vb['id']}/pause", json={}).json()["status"] == "paused"

    assert up.stop() == 0
    wait_until(lambda: not _hangar_processes(data_dir), 20, what="every hangar process to exit")
    runsc_root = data_dir / "runtime" / "gvisor" / "runsc-root"
    listed = subprocess.run(
        [default_runsc(), "--root", str(runsc_root), "list"], capture_output=True, text=True
    ).stdout
    assert re.search(rf"^{sid}\s+\d+\s+running", listed, re.M), (
        "the sandbox must outlive Hangar's processes",
        listed,
    )

    # `hangar token create` prints the token alone on its last line.
    out = subprocess.run(
        [sys.executable, "-m", "dashboard.cli", "token", "create", "--user", "admin"],
        cwd=ROOT, env=_clean_env(data_dir), capture_output=True, text=True, check=True,
    )  # fmt: skip
    token2 = out.stdout.strip().splitlines()[-1]
    assert token2.startswith("hgr_") and token2 != token

    up = Up(data_dir, HANGAR_NODE_TICK_S="1")
    assert "API token" not in "".join(up.output)  # only the first start prints one
    assert _e2b_lines(up)[2] == "export E2B_API_KEY=hgr_YOUR_TOKEN"  # a placeholder, said so above it
    assert "hangar token create --user admin` for hgr_YOUR_TOKEN" in "".join(up.output)
    api = httpx.Client(base_url=f"{up.url}/api/v1", headers={"Authorization": f"Bearer {token2}"}, timeout=60)
    time.sleep(3)  # several reconciliation ticks
    after = api.get(f"/sandboxes/{sid}").json()
    assert after["status"] == "running", (after, (data_dir / "logs" / "worker.log").read_text()[-3000:])
    assert api.post(f"/sandboxes/{sid}/exec", json={"cmd": "cat /tmp/f"}).json()["stdout"] == "first\n"
    assert api.get(f"/sandboxes/{vb['id']}").json()["status"] == "paused"  # reconciliation left it be
    assert api.post(f"/sandboxes/{vb['id']}/resume", json={}).json()["status"] == "running"
    out = api.post(f"/sandboxes/{vb['id']}/exec", json={"cmd": "cat /keep/f /root/f"}).json()
    assert out["stdout"] == "on-volume\nin-root\n", out
    assert api.delete(f"/sandboxes/{vb['id']}").status_code == 204
    wait_until(lambda: api.get(f"/sandboxes/{vb['id']}").json()["status"] == "deleted", 30, what="deleted")
    # The sandboxes that exited (one paused, then this one) were orphans of `hangar up`, which
    # reaps them: no zombie is left with it.
    wait_until(lambda: not _zombies_of(up.proc.pid), 5, what="hangar up to reap its exited sandboxes")
    assert api.delete("/volumes/keep").status_code == 204  # unmounts it: nothing left on the host
    assert api.delete(f"/sandboxes/{sid}").status_code == 204
    wait_until(lambda: api.get(f"/sandboxes/{sid}").json()["status"] == "deleted", 30, what="deleted")
    assert up.stop() == 0
    wait_until(lambda: not _hangar_processes(data_dir), 20, what="every hangar process to exit")
    from tests.reliability.stack import destroy_leftovers

    destroy_leftovers(data_dir)  # its node's nftables tables (its sandboxes are gone already)


def test_token_create_for_unknown_user_fails_clearly(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "dashboard.cli", "token", "create", "--user", "ghost"],
        cwd=ROOT, env=_clean_env(tmp_path), capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 2
    assert "no user named 'ghost'" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("argv", [["--help"], ["image", "--help"], ["token", "create", "--help"]])
def test_cli_help(argv):
    out = subprocess.run(
        [sys.executable, "-m", "dashboard.cli", *argv], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0 and "usage: hangar" in out.stdout
