"""The SSH gateway end to end: the real OpenSSH client (ssh, scp, sftp) against ``hangar
ssh-gateway`` run as its own process on a free loopback port, into harnesses running in gVisor."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import ROOT, _stop
from .support import die_with_parent, free_port, requires_runsc, wait_until

pytestmark = [requires_runsc, pytest.mark.timeout(300)]

HARNESS = {"agent": "custom", "command": "cat", "image": "minimal", "disk_mb": 256, "memory_mb": 512,
           "network": {"egress": "none"}}  # fmt: skip
CLIENT_OPTS = ["-F", "/dev/null", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
               "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", "-o", "ConnectTimeout=20"]  # fmt: skip
QUIET = ["-o", "LogLevel=ERROR"]  # no "Permanently added …" on stderr (nor auth banners)


def start_gateway(service_env: dict[str, str], host_key: Path | None = None) -> tuple[subprocess.Popen, dict]:
    """``hangar ssh-gateway`` on a free loopback port, with the test settings."""
    port = free_port()
    tmp = Path(tempfile.mkdtemp())
    log_path = tmp / "ssh-gateway.log"
    host_key = host_key or tmp / "keys" / "host_ed25519"
    env = {**service_env, "HANGAR_SSH_HOST_KEY": str(host_key), "HANGAR_LOG_LEVEL": "INFO"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dashboard.cli", "ssh-gateway", "--port", str(port), "--bind", "127.0.0.1"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=die_with_parent,
        )  # fmt: skip
    wait_until(
        lambda: b"listening on" in log_path.read_bytes() or proc.poll() is not None, 60, what="ssh gateway"
    )
    assert proc.poll() is None, log_path.read_text()
    return proc, {"port": port, "log": log_path}


@pytest.fixture(scope="session")
def gateway(service_env) -> Iterator[dict]:
    proc, info = start_gateway(service_env)
    yield info
    _stop(proc)


@pytest.fixture(scope="session")
def keys(tmp_path_factory) -> dict[str, Path]:
    """Client key pairs: alice's (registered), mallory's (another team's), and a stranger's."""
    root = tmp_path_factory.mktemp("ssh-keys")
    out = {}
    for who in ("alice", "mallory", "stranger"):
        path = root / who
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{who}@test", "-f", str(path)],
                       check=True, capture_output=True)  # fmt: skip
        out[who] = path
    return out


def register(api: httpx.Client, key: Path) -> None:
    r = api.post("/ssh-keys", json={"name": key.name, "public_key": key.with_suffix(".pub").read_text()})
    assert r.status_code == 201, r.text


def wait_status(api: httpx.Client, hid: str, want: str, timeout: float = 120) -> dict:
    seen: dict = {}

    def check() -> bool:
        seen.update(api.get(f"/harnesses/{hid}").json())
        assert seen["status"] != "failed", seen
        return seen["status"] == want

    wait_until(check, timeout, interval=0.2, what=f"harness {hid} {want} (last: {seen.get('status')})")
    return seen


@pytest.fixture
def box(api, minimal_image, gateway, keys) -> dict:
    """A running harness ``box`` of alice's team, and alice's key registered."""
    register(api, keys["alice"])
    r = api.post("/harnesses", json={"name": "box", **HARNESS})
    assert r.status_code == 201, r.text
    return wait_status(api, r.json()["id"], "running")


def ssh(gateway: dict, key: Path, *command: str, user: str = "box", tty: bool = False, quiet: bool = True,
        stdin: bytes | None = None, term: str = "xterm", timeout: float = 90) -> subprocess.CompletedProcess[bytes]:  # fmt: skip
    argv = ["ssh", *CLIENT_OPTS, *(QUIET if quiet else []), "-i", str(key), "-p", str(gateway["port"]),
            *(["-tt"] if tty else ["-T"]), f"{user}@127.0.0.1", *command]  # fmt: skip
    return subprocess.run(argv, input=stdin if stdin is not None else b"", capture_output=True, timeout=timeout,
                          env={**os.environ, "TERM": term})  # fmt: skip


def scp_argv(gateway: dict, key: Path, *args: str) -> list[str]:
    return ["scp", *CLIENT_OPTS, *QUIET, "-i", str(key), "-P", str(gateway["port"]), *args]


def ok(result: subprocess.CompletedProcess[bytes]) -> str:
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr)
    return result.stdout.decode()


# -- shells and commands ----------------------------------------------------------------------------


def test_a_registered_key_gets_a_shell_and_commands_in_the_workspace(api, box, gateway, keys):
    key = keys["alice"]
    # A command on a PTY: the terminal path, in /workspace.
    r = ssh(gateway, key, "pwd; tty", tty=True)
    assert r.returncode == 0, r
    lines = r.stdout.decode().split("\r\n")
    assert lines[0] == "/workspace" and lines[1].startswith("/dev/pts/"), r.stdout

    # An interactive login shell on a PTY, typed into through stdin.
    r = ssh(gateway, key, tty=True, stdin=b"echo in-$(pwd)-$((6*7)) TERM=$TERM\nexit 3\n", term="vt100")
    out = r.stdout.decode()
    assert "in-/workspace-42 TERM=vt100" in out, out
    assert r.returncode == 3, (r.returncode, out)

    # Without a PTY: stdout and stderr apart, the exit status back.
    r = ssh(gateway, key, "echo out; echo err >&2; exit 7")
    assert (r.returncode, r.stdout, r.stderr) == (7, b"out\n", b"err\n")
    assert ok(ssh(gateway, key, "pwd; test -t 0 || echo no-tty")) == "/workspace\nno-tty\n"

    # stdin goes through, EOF included; binary data arrives intact.
    assert ok(ssh(gateway, key, "cat > f && wc -c < f", stdin=b"data")).strip() == "4"
    assert ok(ssh(gateway, key, "cat /workspace/f")) == "data"
    blob = os.urandom(200_000)
    r = ssh(gateway, key, "sha256sum | cut -d' ' -f1", stdin=blob)
    assert ok(r).strip() == hashlib.sha256(blob).hexdigest()

    # Output much larger than the flow-control marks arrives whole and in order.
    expected = "".join(f"{i}\n" for i in range(1, 200_001))
    assert ok(ssh(gateway, key, "seq 1 200000")) == expected

    # A command killed by a signal is reported as one (OpenSSH's ssh exits 255 for that; the
    # signal's name is checked with asyncssh's client below).
    r = ssh(gateway, key, "kill -TERM $$; sleep 5")
    assert r.returncode == 255, r

    # Connections and who made them are in the team's audit log.
    events = api.get("/audit", params={"action": "ssh."}).json()
    assert events and all(e["action"] == "ssh.connect" for e in events), events
    assert events[0]["actor"] == "alice" and events[0]["via"] == "ssh" and "box" in events[0]["target"]


def test_a_command_is_killed_when_the_client_goes_away(api, box, gateway, keys):
    proc = subprocess.Popen(
        ["ssh", *CLIENT_OPTS, *QUIET, "-i", str(keys["alice"]), "-p", str(gateway["port"]), "-T",
         "box@127.0.0.1", "sleep 600"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    sandbox = box["sandbox"]

    def running() -> list[dict]:
        return [p for p in api.get(f"/sandboxes/{sandbox}/processes").json()
                if p["status"] == "running" and "sleep 600" in " ".join(p["argv"])]  # fmt: skip

    found = wait_until(running, 60, interval=0.2, what="the ssh command to run")
    proc.kill()
    proc.wait()
    pid = found[0]["id"]
    wait_until(lambda: api.get(f"/sandboxes/{sandbox}/processes/{pid}").json()["status"] != "running", 30,
               interval=0.2, what="the command to be killed")  # fmt: skip
    assert api.get(f"/sandboxes/{sandbox}/processes/{pid}").json()["signal"] == 9


def test_stopping_the_gateway_ends_the_processes_of_its_sessions(api, box, service_env, keys):
    proc, gw = start_gateway(service_env)
    try:
        client = subprocess.Popen(
            ["ssh", *CLIENT_OPTS, *QUIET, "-i", str(keys["alice"]), "-p", str(gw["port"]), "-tt",
             "box@127.0.0.1", "sleep 600"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        sandbox = box["sandbox"]

        def running() -> list[dict]:
            return [t for t in api.get(f"/sandboxes/{sandbox}/terminals").json() if t["status"] == "running"]

        found = wait_until(running, 60, interval=0.2, what="the ssh terminal to run")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, gw["log"].read_text()
        wait_until(lambda: not running(), 30, interval=0.2, what=f"terminal {found[0]['id']} to end")
        assert client.wait(15) == 255  # the connection went with the gateway
    finally:
        _stop(proc)


# -- files ------------------------------------------------------------------------------------------


def test_scp_and_sftp_move_files_both_ways_byte_for_byte(box, gateway, keys, tmp_path):
    key = keys["alice"]
    blob = os.urandom(150_000) + bytes(range(256)) + b"\r\n\x00\x1b[0m"
    src = tmp_path / "up.bin"
    src.write_bytes(blob)

    # Modern scp speaks SFTP (the sftp subsystem); paths are relative to /workspace.
    ok(subprocess.run(scp_argv(gateway, key, str(src), "box@127.0.0.1:up.bin"), capture_output=True,
                      timeout=90))  # fmt: skip
    assert ok(ssh(gateway, key, "sha256sum /workspace/up.bin")).split()[0] == hashlib.sha256(blob).hexdigest()
    back = tmp_path / "back.bin"
    ok(subprocess.run(scp_argv(gateway, key, "box@127.0.0.1:/workspace/up.bin", str(back)), capture_output=True,
                      timeout=90))  # fmt: skip
    assert back.read_bytes() == blob

    # Legacy scp runs `scp -t` / `scp -f` as plain commands.
    ok(subprocess.run(scp_argv(gateway, key, "-O", str(src), "box@127.0.0.1:legacy.bin"), capture_output=True,
                      timeout=90))  # fmt: skip
    legacy = tmp_path / "legacy.bin"
    ok(subprocess.run(scp_argv(gateway, key, "-O", "box@127.0.0.1:legacy.bin", str(legacy)), capture_output=True,
                      timeout=90))  # fmt: skip
    assert legacy.read_bytes() == blob

    # sftp in batch mode: put, ls, get.
    batch = tmp_path / "batch"
    got = tmp_path / "got.bin"
    batch.write_text(f"put {src} sftp.bin\nls -l\nget sftp.bin {got}\n")
    r = subprocess.run(["sftp", *CLIENT_OPTS, *QUIET, "-i", str(key), "-P", str(gateway["port"]), "-b", str(batch),
                        "box@127.0.0.1"], capture_output=True, timeout=90)  # fmt: skip
    listing = ok(r)
    assert "sftp.bin" in listing and "legacy.bin" in listing and str(len(blob)) in listing, listing
    assert got.read_bytes() == blob


def test_file_transfers_leave_their_processes_ended(api, box, gateway, keys, tmp_path):
    src = tmp_path / "nul.bin"
    src.write_bytes(b"\x00" * 1000)
    ok(subprocess.run(scp_argv(gateway, keys["alice"], str(src), "box@127.0.0.1:nul.bin"), capture_output=True,
                      timeout=90))  # fmt: skip
    ok(subprocess.run(scp_argv(gateway, keys["alice"], "box@127.0.0.1:nul.bin", str(tmp_path / "back")),
                      capture_output=True, timeout=90))  # fmt: skip

    def ended() -> bool:
        return all(p["status"] != "running" for p in api.get(f"/sandboxes/{box['sandbox']}/processes").json())

    wait_until(ended, 5, interval=0.2, what="the transfers' processes to be recorded as ended")


def test_an_upload_faster_than_the_command_reads_is_held_back_not_buffered(box, gateway, keys, bridge):
    """SSH's flow control reaches the command: while it does not read (sleep), the client is
    held back, and the node's stream bridge does not take the upload into its memory."""

    def rss_mb() -> float:
        status = Path(f"/proc/{bridge.pid}/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) / 1024

    size = 48 * 1024 * 1024
    src = Path(tempfile.mkdtemp()) / "big.bin"
    src.write_bytes(os.urandom(1024 * 1024) * 48)
    before = rss_mb()
    argv = ["ssh", *CLIENT_OPTS, *QUIET, "-i", str(keys["alice"]), "-p", str(gateway["port"]), "-T",
            "box@127.0.0.1", "sleep 6; wc -c"]  # fmt: skip
    with open(src, "rb") as stdin:
        proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        peak = before
        while proc.poll() is None:
            peak = max(peak, rss_mb())
            time.sleep(0.1)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, (out, err)
    assert int(out.split()[0]) == size  # every byte, once the command read
    assert peak - before < 16, f"the bridge grew by {peak - before:.1f} MB while the command did not read"


# -- who may connect ----------------------------------------------------------------------------------


def test_unregistered_keys_and_other_teams_users_are_refused(api, other_api, box, gateway, keys):
    # A key nobody registered: authentication fails, with a banner saying why; nothing runs.
    r = ssh(gateway, keys["stranger"], "touch /workspace/intruder", quiet=False)
    assert r.returncode == 255, r
    err = r.stderr.decode()
    assert "is not registered with Hangar" in err and "Permission denied" in err, err

    # A registered key of a user outside the harness's team: as if there were no such harness.
    register(other_api, keys["mallory"])
    for target in ("box", box["id"]):
        r = ssh(gateway, keys["mallory"], "touch /workspace/intruder", user=target, quiet=False)
        assert r.returncode == 255, r
        assert f"no harness '{target}' in your teams" in r.stderr.decode(), r.stderr
        assert "alpha" not in r.stderr.decode()

    # A name that is no harness of alice's teams is refused the same way.
    r = ssh(gateway, keys["alice"], "true", user="nothere", quiet=False)
    assert r.returncode == 255 and "no harness 'nothere' in your teams" in r.stderr.decode(), r

    assert ok(ssh(gateway, keys["alice"], "test -e /workspace/intruder && echo yes || echo no")) == "no\n"
    from runtime.models import AuditEvent

    wait_until(lambda: AuditEvent.objects.filter(action="ssh.refused", actor="mallory").exists(), 10,
               what="the refusal in the audit log")  # fmt: skip
    assert not AuditEvent.objects.filter(action="ssh.connect", actor="mallory").exists()


# -- paused harnesses ----------------------------------------------------------------------------------


def test_a_paused_harness_resumes_when_someone_connects(api, box, gateway, keys):
    key = keys["alice"]
    ok(ssh(gateway, key, "echo kept > /workspace/note"))
    r = api.post(f"/harnesses/{box['id']}/pause", json={})
    assert r.status_code == 200, r.text
    wait_status(api, box["id"], "paused")

    r = ssh(gateway, key, "cat /workspace/note", timeout=150)
    assert r.returncode == 0, r
    assert r.stdout == b"kept\n"
    assert "resuming harness box" in r.stderr.decode(), r.stderr
    assert api.get(f"/harnesses/{box['id']}").json()["status"] == "running"


# -- terminal size and signals -------------------------------------------------------------------------------------


def test_window_changes_resize_the_terminal_and_signals_are_reported(box, gateway, keys):
    import asyncssh

    async def session() -> list[str]:
        async with asyncssh.connect(
            "127.0.0.1", gateway["port"], username="box", client_keys=[str(keys["alice"])], known_hosts=None,
            agent_path=None, config=None,
        ) as conn:  # fmt: skip
            proc = await conn.create_process(term_type="xterm", term_size=(80, 24), encoding="utf-8")
            seen = []

            async def expect(marker: str) -> None:
                buf = ""
                while marker not in buf:
                    chunk = await asyncio.wait_for(proc.stdout.read(4096), 30)
                    assert chunk, f"the session ended before {marker!r}: {buf!r}"
                    buf += chunk
                seen.append(marker)

            proc.stdin.write("echo SIZE=$(stty size)\n")
            await expect("SIZE=24 80")
            proc.change_terminal_size(132, 43)
            proc.stdin.write("echo SIZE=$(stty size)\n")
            await expect("SIZE=43 132")
            proc.stdin.write("exit\n")
            result = await asyncio.wait_for(proc.wait(), 30)
            assert result.exit_status == 0, result
            killed = await asyncio.wait_for(conn.run("kill -TERM $$; sleep 5"), 30)
            assert killed.exit_signal is not None and killed.exit_signal[0] == "TERM", killed
            return seen

    assert asyncio.run(session()) == ["SIZE=24 80", "SIZE=43 132"]


def test_the_host_key_is_made_once_kept_private_and_reused(service_env, tmp_path):
    path = tmp_path / "data" / "ssh_host_ed25519_key"

    def served_key() -> str:
        proc, gw = start_gateway(service_env, host_key=path)
        try:
            r = subprocess.run(["ssh-keyscan", "-p", str(gw["port"]), "-t", "ed25519", "127.0.0.1"],
                               capture_output=True, text=True, timeout=30)  # fmt: skip
            return r.stdout.split()[-1]
        finally:
            _stop(proc)

    first = served_key()
    assert (path.stat().st_mode & 0o777) == 0o600
    made = path.read_bytes()
    assert served_key() == first and path.read_bytes() == made
    public = subprocess.run(["ssh-keygen", "-y", "-f", str(path)], capture_output=True, text=True, check=True)
    assert public.stdout.split()[1] == first


def test_port_forwarding_is_refused(box, gateway, keys):
    base = ["ssh", *CLIENT_OPTS, *QUIET, "-i", str(keys["alice"]), "-p", str(gateway["port"])]
    # A forward to a port from the gateway's side (-W: stdio forwarding, like -L).
    r = subprocess.run([*base, "-W", "127.0.0.1:22", "box@127.0.0.1"], capture_output=True, timeout=60)
    assert r.returncode == 255 and b"forwarding failed" in r.stderr, r
    # A listening forward on the gateway's side (-R).
    r = subprocess.run([*base, "-N", "-o", "ExitOnForwardFailure=yes", "-R", "0:127.0.0.1:22", "box@127.0.0.1"],
                       capture_output=True, timeout=60)  # fmt: skip
    assert r.returncode == 255 and b"forwarding failed" in r.stderr, r


# -- access ending while connected ---------------------------------------------------------------------


def test_a_session_ends_when_its_user_is_lowered_removed_or_their_key_deleted(
    api, server, box, gateway, keys
):
    """An open SSH session lasts as long as its access: lowered below member (a shell is a
    member's right), the key deleted, or removed from the team, it ends at once, and what is
    typed after runs nothing."""
    import asyncssh
    from django.contrib.auth import get_user_model

    from runtime.models import Membership, Team
    from runtime.services.auth import token_create

    team = Team.objects.get(name="alpha")
    bob = get_user_model().objects.create_user(username="bob", password="pw")
    Membership.objects.create(user=bob, team=team, role=Membership.Role.MEMBER)
    bobs = httpx.Client(base_url=f"{server}/api/v1", timeout=60,
                        headers={"Authorization": f"Bearer {token_create(user=bob, team=team).raw}"})  # fmt: skip
    register(bobs, keys["stranger"])

    async def typing_after(change, marker: str) -> tuple[int | None, str]:
        async with asyncssh.connect(
            "127.0.0.1", gateway["port"], username="box", client_keys=[str(keys["stranger"])], known_hosts=None,
            agent_path=None, config=None,
        ) as conn:  # fmt: skip
            proc = await conn.create_process(term_type="xterm", term_size=(80, 24), encoding="utf-8")
            buf = ""
            proc.stdin.write("echo in-$((6*7))\n")
            while "in-42" not in buf:
                chunk = await asyncio.wait_for(proc.stdout.read(4096), 30)
                assert chunk, buf
                buf += chunk
            await asyncio.to_thread(change)
            # It ends at once (a keystroke racing the change by the moment the message takes
            # to arrive is as good as one typed before it); nothing typed after runs.
            err = await asyncio.wait_for(proc.stderr.read(), 5)
            result = await asyncio.wait_for(proc.wait(), 5)
            with contextlib.suppress(Exception):
                proc.stdin.write(f"touch /workspace/{marker}\n")
            return result.exit_status, err

    def role(name: str) -> None:
        assert api.patch(f"/teams/{team.id}/members/bob", json={"role": name}).status_code == 200

    code, err = asyncio.run(typing_after(lambda: role("viewer"), "typed-as-viewer"))
    assert code == 255 and "access ended" in err and "a shell needs member" in err, (code, err)
    role("member")
    key_id = bobs.get("/ssh-keys").json()[0]["id"]
    code, err = asyncio.run(typing_after(lambda: bobs.delete(f"/ssh-keys/{key_id}"), "typed-without-a-key"))
    assert code == 255 and "key of this connection was removed" in err, (code, err)
    register(bobs, keys["stranger"])
    code, err = asyncio.run(
        typing_after(lambda: api.delete(f"/teams/{team.id}/members/bob"), "typed-when-out")
    )
    assert code == 255 and "no harness 'box' in your teams" in err, (code, err)
    time.sleep(1)  # what was typed would have run by now
    listing = ok(ssh(gateway, keys["alice"], "ls /workspace"))
    assert "typed-" not in listing, listing
    # And a new connection is refused outright.
    r = ssh(gateway, keys["stranger"], "true", quiet=False)
    assert r.returncode == 255 and "Permission denied" in r.stderr.decode(), r
