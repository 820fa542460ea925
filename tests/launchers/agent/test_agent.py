"""The guest agent, run directly on the host (no gVisor) and driven through its Python client:
its build, ping and exec (its files, spares, protocol robustness, quiesce and tunnels are in
test_files.py).

Run with: .venv/bin/python -m pytest tests/launchers/agent -p no:django -q
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import socket
import stat
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from runtime.launchers.agent import build
from runtime.launchers.agent.build import AgentBuildError, agent_binary
from runtime.launchers.agent.client import AgentClient
from runtime.launchers.agent.protocol import (
    AgentFileError,
    AgentUnavailable,
    ExitInfo,
)
from tests.launchers.agent.support import (
    BASE_ENV_VALUE,
    RunningAgent,
    gone,
)

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
