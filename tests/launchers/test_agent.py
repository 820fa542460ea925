"""The guest agent, run directly on the host (no gVisor) and driven through its Python client.

Run with: .venv/bin/python -m pytest tests/launchers/test_agent.py -p no:django -q
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import socket
import stat
import struct
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from runtime.launchers.agent import build
from runtime.launchers.agent import client as agent_client
from runtime.launchers.agent.build import AgentBuildError, agent_binary
from runtime.launchers.agent.client import AgentClient
from runtime.launchers.agent.protocol import (
    AgentError,
    AgentFileError,
    AgentUnavailable,
    ExitInfo,
    decode_fields,
    encode_fields,
    encode_frame,
)

BASE_ENV_VALUE = "from-the-agent-environment"


@dataclass
class RunningAgent:
    proc: subprocess.Popen[bytes]
    socket: Path
    log: Path
    client: AgentClient


def start_agent(binary: Path, run_dir: Path) -> RunningAgent:
    sock = run_dir / "agent.sock"
    log = run_dir / "agent.log"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "HANGAR_TEST_BASE": BASE_ENV_VALUE,
    }
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            [str(binary), "--socket", str(sock)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,
        )
    client = AgentClient(sock)
    try:
        client.wait_ready(10.0)
    except AgentUnavailable:
        proc.kill()
        raise
    return RunningAgent(proc, sock, log, client)


def stop_agent(agent: RunningAgent) -> None:
    if agent.proc.poll() is None:
        agent.proc.send_signal(signal.SIGTERM)
        try:
            agent.proc.wait(5)
        except subprocess.TimeoutExpired:
            agent.proc.kill()
            agent.proc.wait()


@pytest.fixture(scope="module")
def agent_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # HANGAR_TEST_AGENT_BIN runs the suite against another build, e.g. one with sanitizers.
    override = os.environ.get("HANGAR_TEST_AGENT_BIN")
    return Path(override) if override else agent_binary(tmp_path_factory.mktemp("agent-bin"))


@pytest.fixture(scope="module")
def agent(agent_bin: Path, tmp_path_factory: pytest.TempPathFactory):
    running = start_agent(agent_bin, tmp_path_factory.mktemp("agent-run"))
    yield running
    stop_agent(running)


@pytest.fixture
def client(agent: RunningAgent) -> AgentClient:
    return agent.client


def gone(pid: int, within: float = 3.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # A zombie still answers kill(pid, 0); it is gone for our purposes.
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z"):
                return True
        except OSError:
            return True
        time.sleep(0.02)
    return False


def raw_request(agent: RunningAgent, frame: bytes) -> tuple[bytes, dict[str, str]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(agent.socket))
        s.sendall(frame)
        header = s.recv(5, socket.MSG_WAITALL)
        kind, length = struct.unpack(">cI", header)
        payload = s.recv(length, socket.MSG_WAITALL) if length else b""
        return kind, decode_fields(payload)


# -- build ---------------------------------------------------------------------------------


def test_build_is_cached_by_source_hash(tmp_path: Path) -> None:
    binary = agent_binary(tmp_path)
    assert binary.name == f"hangar-agent-{build.agent_digest()}"
    before = binary.stat().st_mtime_ns
    assert agent_binary(tmp_path) == binary
    assert binary.stat().st_mtime_ns == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([binary.name, ".hangar-agent.lock"])


def test_concurrent_builds_share_one_binary(tmp_path: Path) -> None:
    with ThreadPoolExecutor(3) as pool:
        paths = set(pool.map(lambda _: agent_binary(tmp_path / "cache"), range(3)))
    assert len(paths) == 1
    assert subprocess.run([str(paths.pop()), "--help"], capture_output=True).returncode == 0


def test_build_without_gcc_explains_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(AgentBuildError, match="apt-get install gcc libc6-dev"):
        agent_binary(tmp_path / "cache")


def test_socket_is_private_and_agent_announced_ready(agent: RunningAgent) -> None:
    assert stat.S_IMODE(agent.socket.stat().st_mode) == 0o600
    assert b"hangar-agent ready" in agent.log.read_bytes()
    # Bound under a temporary name and renamed into place: the path existing means listening.
    assert not (agent.socket.parent / "agent.sock.new").exists()
    agent.client.wait_listening(1.0)


# -- ping ----------------------------------------------------------------------------------


def test_ping_reports_version_and_agent_pid(agent: RunningAgent) -> None:
    assert agent.client.ping() == {"version": "1", "pid": str(agent.proc.pid)}


def test_ping_works_many_times_in_a_row(client: AgentClient) -> None:
    for _ in range(200):
        assert client.ping()["version"] == "1"


def test_missing_socket_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(AgentUnavailable):
        AgentClient(tmp_path / "nothing.sock").ping()
    started = time.monotonic()
    with pytest.raises(AgentUnavailable):
        AgentClient(tmp_path / "nothing.sock").wait_ready(0.2)
    assert time.monotonic() - started < 2
    with pytest.raises(AgentUnavailable):
        AgentClient(tmp_path / "nothing.sock").wait_listening(0.05)


def test_a_symlink_at_the_socket_path_is_never_followed(tmp_path: Path) -> None:
    # The sandbox writes in the socket's directory: a symlink it leaves there must not lead
    # the host's client to one of the host's own sockets.
    host_path = tmp_path / "host.sock"
    host = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.closing(host):
        host.bind(str(host_path))
        host.listen(4)
        host.setblocking(False)
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        (run_dir / "agent.sock").symlink_to(host_path)
        client = AgentClient(run_dir / "agent.sock", connect_timeout=0.2)
        with pytest.raises(AgentUnavailable):
            client.ping()
        with pytest.raises(AgentUnavailable):
            client.wait_listening(0.05)
        with pytest.raises(BlockingIOError):
            host.accept()  # nothing ever connected to the host's socket

        # A real socket deeper than sun_path's 107 bytes is still reached.
        deep = tmp_path.joinpath(*["d" * 40] * 4)
        deep.mkdir(parents=True)
        os.link(host_path, deep / "agent.sock")
        assert len(os.fsencode(deep / "agent.sock")) > 107
        with contextlib.closing(AgentClient(deep / "agent.sock")._connect(1.0)):
            conn, _ = host.accept()
            conn.close()


# -- exec ----------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [0, 3])
def test_exit_code_is_reported(client: AgentClient, code: int) -> None:
    r = client.exec(["sh", "-c", f"exit {code}"])
    assert (r.exit_code, r.signal, r.timed_out) == (code, 0, False)
    assert r.pid > 0 and r.duration_ms > 0


def test_stdout_and_stderr_are_kept_apart(client: AgentClient) -> None:
    r = client.exec(["sh", "-c", "echo out; echo err >&2; echo out2"])
    assert r.stdout == b"out\nout2\n"
    assert r.stderr == b"err\n"


def test_stdin_round_trips_one_megabyte_through_cat(client: AgentClient) -> None:
    data = os.urandom(1 << 20)
    r = client.exec(["cat"], stdin=data)
    assert r.exit_code == 0
    assert r.stdout == data


def test_stdin_larger_than_a_frame_streams_without_deadlock(client: AgentClient) -> None:
    data = os.urandom(5 * (1 << 20) + 123)
    r = client.exec(["cat"], stdin=data, timeout=30)
    assert r.exit_code == 0
    assert hashlib.sha256(r.stdout).digest() == hashlib.sha256(data).digest()


def test_stdin_the_command_never_reads_does_not_hang(client: AgentClient) -> None:
    r = client.exec(["true"], stdin=os.urandom(5 * (1 << 20)), timeout=10)
    assert r.exit_code == 0


def test_without_stdin_the_command_reads_eof(client: AgentClient) -> None:
    r = client.exec(["cat"], timeout=5)
    assert (r.exit_code, r.stdout, r.timed_out) == (0, b"", False)


def test_env_overrides_and_agent_env_is_inherited(client: AgentClient) -> None:
    script = 'printf "%s|%s|%s" "$HANGAR_TEST_BASE" "$EXTRA" "$HOME"'
    r = client.exec(["sh", "-c", script])
    assert r.stdout.decode().split("|")[:2] == [BASE_ENV_VALUE, ""]
    r = client.exec(["sh", "-c", script], env={"HANGAR_TEST_BASE": "overridden", "EXTRA": "a=b c"})
    assert r.stdout.decode().split("|")[:2] == ["overridden", "a=b c"]


def test_command_is_looked_up_in_the_requests_path(client: AgentClient, tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "hangar-test-cmd").write_text('#!/bin/sh\necho found "$1"\n')
    (bindir / "hangar-test-cmd").chmod(0o755)
    (bindir / "no-shebang").write_text("echo plain script\n")
    (bindir / "no-shebang").chmod(0o755)
    env = {"PATH": f"{bindir}:/usr/bin:/bin"}
    assert client.exec(["hangar-test-cmd", "x"], env=env).stdout == b"found x\n"
    assert client.exec(["no-shebang"], env=env).stdout == b"plain script\n"
    with pytest.raises(AgentFileError) as exc:
        client.exec(["hangar-test-cmd"])
    assert exc.value.errno_name == "ENOENT"


def test_cwd_is_applied_and_defaults_to_root(client: AgentClient, tmp_path: Path) -> None:
    assert client.exec(["pwd"], cwd=str(tmp_path)).stdout.decode().strip() == str(tmp_path)
    assert client.exec(["pwd"]).stdout == b"/\n"


def test_missing_cwd_is_enoent(client: AgentClient, tmp_path: Path) -> None:
    with pytest.raises(AgentFileError) as exc:
        client.exec(["true"], cwd=str(tmp_path / "nope"))
    assert exc.value.errno_name == "ENOENT"
    assert "chdir" in exc.value.message


def test_missing_binary_is_enoent(client: AgentClient) -> None:
    with pytest.raises(AgentFileError) as exc:
        client.exec(["hangar-no-such-binary-xyz"])
    assert exc.value.errno_name == "ENOENT"
    with pytest.raises(AgentFileError) as exc:
        client.exec(["/nonexistent/bin/thing"])
    assert exc.value.errno_name == "ENOENT"


def test_non_executable_file_is_eacces(client: AgentClient, tmp_path: Path) -> None:
    (tmp_path / "data").write_text("x")
    with pytest.raises(AgentFileError) as exc:
        client.exec([str(tmp_path / "data")])
    assert exc.value.errno_name == "EACCES"


def test_timeout_kills_the_command(client: AgentClient) -> None:
    started = time.monotonic()
    r = client.exec(["sleep", "30"], timeout=0.5)
    elapsed = time.monotonic() - started
    assert (r.timed_out, r.exit_code, r.signal) == (True, -1, 9)
    assert 0.4 < elapsed < 3


def test_timeout_kills_the_whole_process_group(client: AgentClient) -> None:
    r = client.exec(["sh", "-c", "sleep 60 & echo $!; wait"], timeout=0.5)
    assert r.timed_out
    assert gone(int(r.stdout))


def test_daemonised_grandchild_does_not_hold_the_exec_open(client: AgentClient) -> None:
    started = time.monotonic()
    r = client.exec(["sh", "-c", "sleep 60 & echo hi"])
    assert time.monotonic() - started < 2
    assert (r.exit_code, r.stdout, r.timed_out) == (0, b"hi\n", False)
    r = client.exec(["sh", "-c", "sleep 60 & echo $!"])
    assert gone(int(r.stdout))


def test_killed_command_reports_128_plus_signal(client: AgentClient) -> None:
    r = client.exec(["sh", "-c", "kill -9 $$"])
    assert (r.exit_code, r.signal, r.timed_out) == (137, 9, False)


def test_ten_megabytes_of_output_arrive_intact(client: AgentClient, tmp_path: Path) -> None:
    started = time.monotonic()
    r = client.exec(["sh", "-c", "head -c 10485760 /dev/urandom | tee out.bin"], cwd=str(tmp_path))
    elapsed = time.monotonic() - started
    assert r.exit_code == 0
    assert len(r.stdout) == 10 * 1024 * 1024
    assert hashlib.sha256(r.stdout).digest() == hashlib.sha256((tmp_path / "out.bin").read_bytes()).digest()
    assert elapsed < 10


def test_max_output_keeps_the_start_and_drains_the_rest(client: AgentClient) -> None:
    seen: list[tuple[str, int]] = []
    r = client.exec(
        ["sh", "-c", "head -c 300000 /dev/zero; echo tail >&2"],
        max_output=1000,
        on_output=lambda stream, chunk: seen.append((stream, len(chunk))),
    )
    assert r.exit_code == 0 and r.truncated
    assert r.stdout == b"\0" * 1000
    assert r.stderr == b"tail\n"
    assert sum(n for s, n in seen if s == "stdout") == 300000
    assert ("stderr", 5) in seen


def test_output_streams_before_the_command_ends(client: AgentClient) -> None:
    arrivals: list[float] = []
    started = time.monotonic()
    r = client.exec(
        ["sh", "-c", "echo first; sleep 0.5; echo second"],
        on_output=lambda stream, chunk: arrivals.append(time.monotonic() - started),
    )
    assert r.stdout == b"first\nsecond\n"
    assert len(arrivals) == 2 and arrivals[1] - arrivals[0] > 0.3


def test_signal_reaches_a_running_process(client: AgentClient) -> None:
    with client.open_process(["sleep", "30"], stdin=False) as proc:
        time.sleep(0.1)
        proc.signal(signal.SIGTERM)
        events = list(proc.events())
    assert events[-1] == ("exit", ExitInfo(code=143, signal=15, timed_out=False))


def test_client_disconnect_kills_the_process(client: AgentClient) -> None:
    proc = client.open_process(["sh", "-c", "sleep 60 & echo $!; sleep 60"], stdin=False)
    kind, data = next(proc.events())
    assert kind == "stdout"
    grandchild = int(data)
    proc.close()
    assert gone(proc.pid)
    assert gone(grandchild)


def test_interactive_stdin_and_close(client: AgentClient) -> None:
    with client.open_process(["sh", "-c", "read a; echo got $a; cat"]) as proc:
        proc.send_stdin(b"one\n")
        events = proc.events()
        assert next(events) == ("stdout", b"got one\n")
        proc.send_stdin(b"rest")
        proc.close_stdin()
        rest = list(events)
    assert rest == [("stdout", b"rest"), ("exit", ExitInfo(0, 0, False))]


def test_tty_exec_runs_on_a_pty(client: AgentClient) -> None:
    with client.open_process(["sh", "-c", "tty; test -t 0 && test -t 2 && echo all-tty"], tty=True) as proc:
        events = list(proc.events())
    output = b"".join(d for k, d in events if k == "stdout").decode()
    assert {k for k, _ in events} == {"stdout", "exit"}
    assert re.match(r"/dev/pts/\d+\r\n", output), output
    assert "all-tty" in output
    assert events[-1] == ("exit", ExitInfo(0, 0, False))


def test_tty_resize_is_seen_by_stty(client: AgentClient) -> None:
    with client.open_process(
        ["sh", "-c", "stty size; read x; stty size"], tty=True, rows=24, cols=80
    ) as proc:
        events = proc.events()
        buf = b""
        while b"24 80" not in buf:
            kind, data = next(events)
            assert kind == "stdout"
            buf += data
        proc.resize(50, 132)
        proc.send_stdin(b"go\n")
        rest = list(events)
    output = b"".join(d for k, d in rest if k == "stdout")
    assert b"50 132" in output
    assert rest[-1] == ("exit", ExitInfo(0, 0, False))


def test_tty_ctrl_c_interrupts_the_foreground_command(client: AgentClient) -> None:
    """^C typed into the terminal is a SIGINT for the foreground process group, as in a
    real terminal, even while the command floods its output."""
    with client.open_process(
        ["sh", "-c", "trap 'echo trapped' INT; echo go; yes >/dev/null; echo after-$?"], tty=True
    ) as proc:
        events = proc.events()
        buf = b""
        while b"go" not in buf:
            buf += next(events)[1]  # type: ignore[operator]
        time.sleep(0.3)
        proc.send_stdin(b"\x03")
        rest = list(events)
    output = b"".join(d for k, d in rest if k == "stdout")
    assert b"after-130" in output, output
    assert rest[-1] == ("exit", ExitInfo(0, 0, False))


def test_many_concurrent_execs_are_all_correct(client: AgentClient) -> None:
    def run(i: int) -> tuple[int, bytes, bytes, int]:
        r = client.exec(
            [
                "sh",
                "-c",
                'echo "$0"; head -c 200000 /dev/zero | wc -c; echo e$0 >&2; exit $(($0 % 5))',
                str(i),
            ]
        )
        return i, r.stdout, r.stderr, r.exit_code

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(run, range(20)))
    for i, out, err, code in results:
        assert out.split() == [str(i).encode(), b"200000"]
        assert err == f"e{i}\n".encode()
        assert code == i % 5


def test_concurrent_exec_threads_with_stdin(client: AgentClient) -> None:
    payloads = [os.urandom(300_000 + i) for i in range(8)]
    results: dict[int, bytes] = {}

    def run(i: int) -> None:
        results[i] = client.exec(["cat"], stdin=payloads[i]).stdout

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(results[i] == payloads[i] for i in range(8))


def test_commands_start_with_default_signal_state(client: AgentClient) -> None:
    # The agent blocks SIGPIPE and handles SIGTERM; none of that may reach a command.
    status = client.exec(["sh", "-c", "grep -E '^Sig(Blk|Ign):' /proc/self/status"]).stdout.decode()
    fields = dict(line.split(":\t") for line in status.splitlines())
    assert int(fields["SigBlk"], 16) == 0
    assert not int(fields["SigIgn"], 16) & (1 << (signal.SIGPIPE - 1))
    r = client.exec(["sh", "-c", "(yes; echo $? >&2) | head -n 1 >/dev/null"])
    assert r.stderr == b"141\n"  # `yes` died of SIGPIPE, as in any shell


# -- spares (handlers forked ahead of time) --------------------------------------------------


def children(pid: int) -> set[int]:
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(") ", 1)[1].split()[1]) == pid:
                    out.add(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def wait_for_children(pid: int, count: int, within: float = 5.0) -> set[int]:
    """``count`` children that stay the same a moment: a short-lived child of the agent's
    start-up (a probe) must not be taken for a spare."""
    deadline = time.monotonic() + within
    while True:
        kids = children(pid)
        if len(kids) == count:
            time.sleep(0.2)
            if children(pid) == kids:
                return kids
        if time.monotonic() > deadline:
            return kids
        time.sleep(0.02)


def open_files(pid: int) -> set[str]:
    """What pid's fds point to, e.g. 'pipe:[123]'; the fds themselves do not matter."""
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            out.add(os.readlink(fd))
        except OSError:
            pass
    return out


def test_spares_wait_ready_and_hold_nothing_of_the_main_process(agent_bin: Path, tmp_path: Path) -> None:
    own = start_agent(agent_bin, tmp_path)
    try:
        main_files = open_files(own.proc.pid)
        main_pipes = {f for f in main_files if f.startswith("pipe:")}
        listener = {f for f in main_files if f.startswith("socket:")}
        assert len(listener) == 1
        spares = wait_for_children(own.proc.pid, 2)
        assert len(spares) == 2
        for pid in spares:
            # Once set up (just after fork it still has everything), a spare shares only the
            # notification pipe with the main process: never its self-pipe.
            deadline = time.monotonic() + 5
            while len(shared := open_files(pid) & main_pipes) > 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(shared) <= 1, shared
        with own.client.open_process(["sleep", "30"], stdin=False) as proc:
            handler = int(Path(f"/proc/{proc.pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])
            assert handler in spares
            held = open_files(handler)
            assert not held & main_pipes, held & main_pipes
            assert not held & listener  # a handler no longer accepts connections
            assert own.client.ping()["version"] == "1"  # the other spare serves meanwhile
    finally:
        stop_agent(own)


def test_a_spare_that_dies_is_replaced(agent_bin: Path, tmp_path: Path) -> None:
    own = start_agent(agent_bin, tmp_path)
    try:
        spares = wait_for_children(own.proc.pid, 2)
        assert len(spares) == 2
        for pid in spares:
            os.kill(pid, signal.SIGKILL)
        assert own.client.exec(["echo", "still here"]).stdout == b"still here\n"
        assert len(wait_for_children(own.proc.pid, 2)) == 2
        assert not children(own.proc.pid) & spares
        assert b"ended while waiting" in own.log.read_bytes()
    finally:
        stop_agent(own)


def test_a_burst_of_connections_while_spares_are_busy(agent_bin: Path, tmp_path: Path) -> None:
    own = start_agent(agent_bin, tmp_path)
    try:
        # Both spares (and more) busy with long commands: new connections still get served.
        long = [own.client.open_process(["sleep", "30"], stdin=False) for _ in range(3)]
        with ThreadPoolExecutor(30) as pool:
            out = list(pool.map(lambda i: own.client.exec(["echo", str(i)]).stdout, range(30)))
        assert out == [f"{i}\n".encode() for i in range(30)]
        for proc in long:
            proc.close()
        # Connections that hang up unheard do not cost a spare for good.
        for _ in range(10):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(own.socket))
        assert own.client.exec(["true"]).exit_code == 0
        assert len(wait_for_children(own.proc.pid, 2)) == 2
    finally:
        stop_agent(own)


# -- files ---------------------------------------------------------------------------------


def test_binary_file_round_trip(client: AgentClient, tmp_path: Path) -> None:
    data = bytes(range(256)) * (3 * 1024 * 1024 // 256)
    target = tmp_path / "sub" / "dir" / "blob.bin"
    assert client.write_file(str(target), data, mode=0o600) == len(data)
    assert target.read_bytes() == data
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert client.read_file(str(target)) == data
    st, chunks = client.iter_file(str(target), chunk_size=100_000)
    parts = list(chunks)
    assert st.type == "file" and st.size == len(data) and st.mode == 0o600
    assert max(len(p) for p in parts) <= 100_000
    assert b"".join(parts) == data


def test_write_accepts_an_iterable_and_can_append(client: AgentClient, tmp_path: Path) -> None:
    target = tmp_path / "parts.txt"
    assert client.write_file(str(target), [b"a" * 10, b"", b"b" * 700_000]) == 700_010
    assert client.write_file(str(target), b"!", append=True) == 1
    assert target.read_bytes() == b"a" * 10 + b"b" * 700_000 + b"!"
    assert client.write_file(str(target), b"") == 0
    assert target.read_bytes() == b""


def test_write_is_atomic_when_the_client_disconnects(agent: RunningAgent, tmp_path: Path) -> None:
    target = tmp_path / "keep.txt"
    target.write_bytes(b"original")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(agent.socket))
        s.sendall(encode_frame("W", encode_fields([("path", str(target))])))
        s.sendall(encode_frame("D", b"half of the new content"))
        time.sleep(0.1)
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".hangar-write-")]
    deadline = time.monotonic() + 3
    while [p for p in tmp_path.iterdir() if p.name != "keep.txt"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    assert target.read_bytes() == b"original"


def test_write_without_mkdirs_needs_the_parent(client: AgentClient, tmp_path: Path) -> None:
    with pytest.raises(AgentFileError) as exc:
        client.write_file(str(tmp_path / "missing" / "f"), b"x" * 2_000_000, mkdirs=False)
    assert exc.value.errno_name == "ENOENT"


def test_write_over_a_directory_is_eisdir(client: AgentClient, tmp_path: Path) -> None:
    with pytest.raises(AgentFileError) as exc:
        client.write_file(str(tmp_path), b"x")
    assert exc.value.errno_name == "EISDIR"


def test_write_through_a_symlink_keeps_the_link(client: AgentClient, tmp_path: Path) -> None:
    (tmp_path / "real").write_bytes(b"old")
    (tmp_path / "link").symlink_to("real")
    client.write_file(str(tmp_path / "link"), b"new")
    assert (tmp_path / "link").is_symlink()
    assert (tmp_path / "real").read_bytes() == b"new"


def test_read_errors(client: AgentClient, tmp_path: Path) -> None:
    with pytest.raises(AgentFileError) as exc:
        client.read_file(str(tmp_path / "missing"))
    assert exc.value.errno_name == "ENOENT"
    with pytest.raises(AgentFileError) as exc:
        client.read_file(str(tmp_path))
    assert exc.value.errno_name == "EISDIR"


def test_read_with_offset_and_length(agent: RunningAgent, tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"0123456789")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(agent.socket))
        s.sendall(
            encode_frame("R", encode_fields([("path", str(tmp_path / "f")), ("offset", 3), ("length", 4)]))
        )
        data = s.makefile("rb").read()
    frames = []
    while data:
        kind, length = struct.unpack(">cI", data[:5])
        frames.append((kind, data[5 : 5 + length]))
        data = data[5 + length :]
    assert frames[0][0] == b"T" and decode_fields(frames[0][1])["size"] == "10"
    assert frames[1:] == [(b"D", b"3456"), (b"K", b"")]


def test_list_dir_reports_types_without_following_symlinks(client: AgentClient, tmp_path: Path) -> None:
    (tmp_path / "file.txt").write_bytes(b"12345")
    (tmp_path / "sub").mkdir(mode=0o750)
    (tmp_path / "link").symlink_to("sub")
    os.mkfifo(tmp_path / "fifo")
    entries = {e.name: e for e in client.list_dir(str(tmp_path))}
    assert set(entries) == {"file.txt", "sub", "link", "fifo"}
    assert (entries["file.txt"].type, entries["file.txt"].size) == ("file", 5)
    assert entries["file.txt"].path == str(tmp_path / "file.txt")
    assert (entries["sub"].type, entries["sub"].mode) == ("dir", 0o750)
    assert (entries["link"].type, entries["link"].size) == ("symlink", 3)
    assert entries["fifo"].type == "other"
    assert abs(entries["file.txt"].mtime - (tmp_path / "file.txt").stat().st_mtime) < 1e-3


def test_list_dir_errors(client: AgentClient, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(AgentFileError) as exc:
        client.list_dir(str(tmp_path / "f"))
    assert exc.value.errno_name == "ENOTDIR"
    with pytest.raises(AgentFileError) as exc:
        client.list_dir(str(tmp_path / "missing"))
    assert exc.value.errno_name == "ENOENT"


def test_list_dir_with_many_entries(client: AgentClient, tmp_path: Path) -> None:
    for i in range(2000):
        (tmp_path / f"f{i:04d}-{'x' * 100}").touch()
    names = [e.name for e in client.list_dir(str(tmp_path))]
    assert names == sorted(p.name for p in tmp_path.iterdir())


def test_a_listing_past_the_clients_bounds_is_refused_not_held(
    client: AgentClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The frames come from the sandbox: the client holds at most so many entries, and bytes.
    for i in range(11):
        (tmp_path / f"f{i:02d}").touch()
    monkeypatch.setattr(agent_client, "MAX_LIST_ENTRIES", 11)
    assert len(client.list_dir(str(tmp_path))) == 11
    monkeypatch.setattr(agent_client, "MAX_LIST_ENTRIES", 10)
    with pytest.raises(AgentFileError, match="too many to list") as exc:
        client.list_dir(str(tmp_path))
    assert exc.value.errno_name == "E2BIG"
    monkeypatch.setattr(agent_client, "MAX_LIST_ENTRIES", 100)
    monkeypatch.setattr(agent_client, "MAX_LIST_BYTES", 200)
    with pytest.raises(AgentFileError, match="too many to list"):
        client.list_dir(str(tmp_path))
    assert client.ping()["version"] == "1"  # the agent goes on


def test_stat(client: AgentClient, tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"abc")
    f.chmod(0o640)
    os.utime(f, (1_700_000_000.25, 1_700_000_000.25))
    st = client.stat(str(f))
    assert (st.type, st.size, st.mode) == ("file", 3, 0o640)
    assert st.mtime == pytest.approx(1_700_000_000.25)
    (tmp_path / "l").symlink_to("f")
    assert client.stat(str(tmp_path / "l")).type == "symlink"
    assert client.stat(str(tmp_path)).type == "dir"
    with pytest.raises(AgentFileError) as exc:
        client.stat(str(tmp_path / "missing"))
    assert exc.value.errno_name == "ENOENT"


def test_mkdir_and_remove(client: AgentClient, tmp_path: Path) -> None:
    deep = tmp_path / "a" / "b" / "c"
    client.mkdir(str(deep), mode=0o700)
    client.mkdir(str(deep))  # already there: fine
    assert deep.is_dir() and stat.S_IMODE(deep.stat().st_mode) == 0o700
    (deep / "file").write_text("x")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "keep").write_text("keep")
    (tmp_path / "a" / "link-out").symlink_to(tmp_path / "outside")

    with pytest.raises(AgentFileError) as exc:
        client.remove(str(tmp_path / "a"))
    assert exc.value.errno_name == "ENOTEMPTY"
    client.remove(str(tmp_path / "a"), recursive=True)
    assert not (tmp_path / "a").exists()
    assert (tmp_path / "outside" / "keep").read_text() == "keep"  # the symlink was not followed

    (tmp_path / "f").write_text("x")
    client.remove(str(tmp_path / "f"))
    assert not (tmp_path / "f").exists()
    with pytest.raises(AgentFileError) as exc:
        client.remove(str(tmp_path / "f"))
    assert exc.value.errno_name == "ENOENT"

    (tmp_path / "file").write_text("x")
    with pytest.raises(AgentFileError) as exc:
        client.mkdir(str(tmp_path / "file"))
    assert exc.value.errno_name == "EEXIST"


def test_relative_paths_are_einval(client: AgentClient) -> None:
    calls = [
        lambda: client.stat("relative/path"),
        lambda: client.read_file("relative"),
        lambda: client.write_file("relative", b"x"),
        lambda: client.list_dir("."),
        lambda: client.mkdir("a/b"),
        lambda: client.remove("a"),
    ]
    for call in calls:
        with pytest.raises(AgentFileError) as exc:
            call()
        assert exc.value.errno_name == "EINVAL"


# -- protocol robustness -------------------------------------------------------------------


def test_unknown_request_is_einval(agent: RunningAgent) -> None:
    assert raw_request(agent, encode_frame("J", b""))[0] == b"F"
    kind, fields = raw_request(agent, encode_frame("J", b""))
    assert (kind, fields["errno"]) == (b"F", "EINVAL")


def test_oversized_frame_is_rejected(agent: RunningAgent) -> None:
    kind, fields = raw_request(agent, struct.pack(">cI", b"E", 2 * 1024 * 1024))
    assert (kind, fields["errno"]) == (b"F", "EMSGSIZE")


def test_garbage_does_not_hurt_the_agent(agent: RunningAgent) -> None:
    for junk in [b"", b"\x00", b"E\x00\x00", b"E\x00\x00\x00\x05abc", os.urandom(3000)]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(agent.socket))
            s.sendall(junk)
    kind, fields = raw_request(agent, encode_frame("E", b"noequals\0arg\0"))
    assert (kind, fields["errno"]) == (b"F", "EINVAL")
    kind, fields = raw_request(agent, encode_frame("E", encode_fields([("arg", "true"), ("env", "NOVALUE")])))
    assert (kind, fields["errno"]) == (b"F", "EINVAL")
    assert agent.client.ping()["version"] == "1"
    assert agent.proc.poll() is None


def test_fields_round_trip_with_equals_and_bytes() -> None:
    payload = encode_fields([("arg", "a=b"), ("arg", b"\xff"), ("n", 5), ("flag", True)])
    assert payload == b"arg=a=b\0arg=\xff\0n=5\0flag=1\0"
    assert decode_fields(b"k=v=w\0x=\0") == {"k": "v=w", "x": ""}
    with pytest.raises(ValueError):
        encode_fields([("arg", "nul\0inside")])


# -- lifecycle -----------------------------------------------------------------------------


def test_sigterm_stops_the_agent_and_its_commands(agent_bin: Path, tmp_path: Path) -> None:
    own = start_agent(agent_bin, tmp_path)
    try:
        proc = own.client.open_process(["sleep", "60"], stdin=False)
        time.sleep(0.1)
        own.proc.send_signal(signal.SIGTERM)
        assert own.proc.wait(5) == 0
        assert gone(proc.pid)
        assert not own.socket.exists()
        proc.close()
    finally:
        stop_agent(own)


# -- quiesce, detach and re-attach (checkpoint support) ------------------------------------


def test_quiesce_detaches_live_commands_ends_the_rest_and_reattach_continues_them(
    agent_bin: Path, tmp_path: Path
) -> None:
    from runtime.launchers.agent.protocol import AgentDetached

    running = start_agent(agent_bin, tmp_path)
    try:
        c = running.client
        counter = c.open_process(["sh", "-c", "i=0; while :; do i=$((i+1)); echo $i; sleep 0.05; done"],
                                 detachable=True)  # fmt: skip
        shell = c.open_process(["sh"], tty=True, detachable=True)
        plain = c.open_process(["sleep", "100"])  # not detachable: a checkpoint ends it
        events = counter.events()
        first = int(next(events)[1].split()[0])

        c.quiesce()
        # Nothing listens now, and every connection let go: the live ones with an 'H' frame.
        assert not running.socket.exists()
        with pytest.raises(AgentDetached):
            for _ in events:
                pass
        with pytest.raises(AgentError):
            list(plain.events())
        assert gone(plain.pid)
        assert not gone(counter.pid, within=0.3) and not gone(shell.pid, within=0.1)
        with pytest.raises(AgentUnavailable):
            counter.reattach()

        running.proc.send_signal(signal.SIGUSR2)  # what the launcher sends after a restore
        c.wait_ready(5)
        counter.reattach()
        numbers: list[int] = []
        for _kind, data in counter.events():
            numbers += [int(n) for n in data.split()]
            if len(numbers) > 5:
                break
        # The stream goes on from where it was: nothing lost, nothing repeated.
        assert numbers[0] > first and numbers == list(range(numbers[0], numbers[0] + len(numbers)))

        shell.reattach()
        shell.send_stdin(b"echo re$((1+1))attached\n")
        seen = b""
        for _kind, data in shell.events():
            seen += data
            if b"re2attached" in seen:
                break
        counter.signal(signal.SIGKILL)
        exit_info = [d for _k, d in counter.events()][-1]
        assert exit_info.signal == signal.SIGKILL

        with pytest.raises(AgentFileError) as err:  # nobody detached under that pid
            c.attach(counter.pid)
        assert err.value.errno_name == "ESRCH"
        shell.close()
    finally:
        stop_agent(running)


def test_a_command_that_exits_while_detached_reports_its_exit_after_reattach(
    agent_bin: Path, tmp_path: Path
) -> None:
    running = start_agent(agent_bin, tmp_path)
    try:
        c = running.client
        proc = c.open_process(["sh", "-c", "read x; echo got $x; exit 7"], detachable=True)
        c.quiesce()
        with pytest.raises(AgentError):
            list(proc.events())
        running.proc.send_signal(signal.SIGUSR2)
        c.wait_ready(5)
        proc.reattach()
        proc.send_stdin(b"it\n")
        out = list(proc.events())
        assert out[0] == ("stdout", b"got it\n") and out[-1][1].code == 7
        assert c.ping()  # and the agent serves as before
    finally:
        stop_agent(running)


def test_a_live_command_may_be_silent_longer_than_the_request_timeout(agent: RunningAgent) -> None:
    # The client's io_timeout bounds requests; a command's stream has only its own timeout.
    c = AgentClient(agent.socket, io_timeout=0.3)
    proc = c.open_process(["sh", "-c", "sleep 1; echo done"])
    out = list(proc.events())
    assert out[0] == ("stdout", b"done\n") and out[-1][1].code == 0


# -- tunnels (preview URLs) -------------------------------------------------------------------


def test_a_tunnel_carries_bytes_both_ways_with_half_closes(client: AgentClient) -> None:
    """``T`` connects to a port on loopback and relays raw bytes: the request fully sent and
    half-closed, the server's whole answer back, then the close."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    got: list[bytes] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            data = b""
            while chunk := conn.recv(65536):  # until the tunnel passes our half-close on
                data += chunk
            got.append(data)
            conn.sendall(hashlib.sha256(data).digest() + data[::-1])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    payload = os.urandom(3 * 1024 * 1024)  # far more than the agent's buffers
    with client.tunnel(port, io_timeout=10) as sock:
        sender = threading.Thread(target=lambda: (sock.sendall(payload), sock.shutdown(socket.SHUT_WR)))
        sender.start()
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        sender.join()
    t.join(5)
    server.close()
    assert got == [payload]
    assert answer == hashlib.sha256(payload).digest() + payload[::-1]


def test_a_tunnel_to_a_port_nobody_listens_on_is_refused_clearly(client: AgentClient) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # free, and nobody listens
    with pytest.raises(AgentFileError) as info:
        client.tunnel(port)
    assert info.value.errno_name == "ECONNREFUSED" and f"port {port}" in str(info.value)
    for bad in (0, 70000):
        with pytest.raises(AgentFileError, match="port must be"):
            client.tunnel(bad)


def test_a_tunnel_ends_when_the_agent_quiesces(agent: RunningAgent) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    sock = agent.client.tunnel(server.getsockname()[1], io_timeout=10)
    conn, _ = server.accept()
    agent.client.quiesce()  # completes: the tunnel let go of its connection
    assert sock.recv(1) == b""
    conn.close()
    server.close()
    sock.close()
    os.kill(agent.proc.pid, signal.SIGUSR2)  # listen again, for the next tests
    agent.client.wait_ready(5)
