"""The guest agent, run directly on the host (no gVisor): its spares, files, protocol
robustness, lifecycle, quiesce and re-attach, and tunnels (build, ping and exec are in
test_agent.py).

Run with: .venv/bin/python -m pytest tests/launchers/agent -p no:django -q
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import stat
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from runtime.launchers.agent import client as agent_client
from runtime.launchers.agent.client import AgentClient
from runtime.launchers.agent.protocol import (
    AgentError,
    AgentFileError,
    AgentUnavailable,
    decode_fields,
    encode_fields,
    encode_frame,
)
from tests.launchers.agent.support import (
    RunningAgent,
    gone,
    raw_request,
    start_agent,
    stop_agent,
)

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
