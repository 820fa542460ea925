"""hangar-mux on the host: its two ends back to back over a unix socket standing in for the
virtio-serial port (the guest end listens there, as QEMU does), with a real guest agent behind
the guest end. No VM: what is tested is the multiplexing, the flow control and the handshake."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.launchers.agent.build import agent_binary
from runtime.launchers.agent.client import AgentClient
from runtime.launchers.agent.transport import UnixTransport
from runtime.launchers.microvm.boot import mux_binary

pytestmark = pytest.mark.skipif(
    shutil.which("gcc") is None, reason="needs gcc to build hangar-mux and the agent"
)


class Pair:
    def __init__(self, d: Path, mux: Path, agent: Path) -> None:
        self.d, self.mux = d, mux
        self.agent_sock = d / "agent.sock"
        self.port = d / "port.sock"
        self.host_sock = d / "host.sock"
        (d / "config").write_bytes(b"env=A=1\0")
        self.agent = subprocess.Popen([str(agent)], env={"HANGAR_AGENT_SOCKET": str(self.agent_sock),
                                                         "PATH": "/usr/bin:/bin", "GREETING": "hello"})  # fmt: skip
        self.guest = subprocess.Popen(
            [str(mux), "guest", "--listen-port", str(self.port), "--agent", str(self.agent_sock)]
        )
        deadline = time.monotonic() + 10
        while not self.port.exists():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        self.host = subprocess.Popen([str(mux), "host", "--vm", str(self.port), "--listen", str(self.host_sock),
                                      "--config", str(d / "config")])  # fmt: skip
        self.client = AgentClient(UnixTransport(self.host_sock))
        self.client.wait_listening(10)

    def stop(self) -> None:
        for p in (self.host, self.guest, self.agent):
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def binaries(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("mux-bin")
    return mux_binary(d), agent_binary(d)


@pytest.fixture
def pair(binaries, tmp_path) -> Iterator[Pair]:
    p = Pair(tmp_path, *binaries)
    yield p
    p.stop()


def test_the_host_end_listens_only_once_the_guest_says_its_agent_is_up(binaries, tmp_path):
    mux, _ = binaries
    port, host_sock = tmp_path / "port.sock", tmp_path / "host.sock"
    guest = subprocess.Popen(
        [str(mux), "guest", "--listen-port", str(port), "--agent", str(tmp_path / "agent.sock")]
    )
    host = None
    try:
        while not port.exists():
            time.sleep(0.01)
        host = subprocess.Popen([str(mux), "host", "--vm", str(port), "--listen", str(host_sock)])
        time.sleep(0.5)
        assert not host_sock.exists()  # no agent in the guest yet: nothing to connect to
    finally:
        for p in (host, guest):
            if p:
                p.kill()
                p.wait()


def test_exec_reports_output_and_exit_through_the_mux(pair):
    r = pair.client.exec(["/bin/sh", "-c", "echo $GREETING; echo err >&2; exit 3"])
    assert (r.exit_code, bytes(r.stdout), bytes(r.stderr)) == (3, b"hello\n", b"err\n")


def test_stdin_and_output_larger_than_the_window_arrive_intact(pair):
    data = os.urandom(3_000_000)
    r = pair.client.exec(["cat"], stdin=data)
    assert r.exit_code == 0 and bytes(r.stdout) == data


def test_a_file_round_trips_byte_for_byte(pair, tmp_path):
    data = os.urandom(2_500_000)
    pair.client.write_file(str(tmp_path / "blob"), data)
    assert pair.client.read_file(str(tmp_path / "blob")) == data


def test_many_streams_at_once_each_get_their_own_answer(pair):
    results: dict[int, bytes] = {}

    def one(i: int) -> None:
        results[i] = bytes(pair.client.exec(["echo", str(i)]).stdout)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(48)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: f"{i}\n".encode() for i in range(48)}


def test_a_stream_nobody_reads_does_not_hold_up_the_others(pair):
    """Flow control is per stream: a command flooding a connection its client never reads
    fills that stream's window, and every other stream goes on."""
    stalled = pair.client.open_process(["/bin/sh", "-c", "yes flood"], stdin=False)
    try:
        time.sleep(0.5)  # the flood fills its window and stops there
        start = time.monotonic()
        for i in range(5):
            assert bytes(pair.client.exec(["echo", str(i)]).stdout) == f"{i}\n".encode()
        assert time.monotonic() - start < 5
        kind, data = next(iter(stalled.events()))  # and the stalled one is still whole
        assert kind == "stdout" and data.startswith(b"flood\n")
    finally:
        stalled.shutdown()
        stalled.close()


def test_a_live_process_takes_stdin_and_signals(pair):
    proc = pair.client.open_process(["/bin/sh", "-c", "read x; echo got-$x; sleep 30"])
    try:
        proc.send_stdin(b"abc\n")
        events = proc.events()
        assert next(events) == ("stdout", b"got-abc\n")
        proc.signal(15)
        last = list(events)[-1][1]
        assert last.signal == 15
    finally:
        proc.close()


def test_a_tunnel_carries_a_tcp_connection_both_ways(pair):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    sock = pair.client.tunnel(port)
    try:
        payload = os.urandom(1_000_000)
        threading.Thread(target=sock.sendall, args=(payload,), daemon=True).start()
        got = b""
        while len(got) < len(payload):
            got += sock.recv(65536)
        assert got == payload
    finally:
        sock.close()
        server.close()


def test_a_client_that_hangs_up_early_frees_its_stream(pair):
    for _ in range(20):
        s = pair.client.open_process(["/bin/sh", "-c", "sleep 30"])
        s.shutdown()
        s.close()
    assert bytes(pair.client.exec(["echo", "fine"]).stdout) == b"fine\n"


def test_the_host_end_exits_when_the_port_closes(pair):
    pair.guest.kill()
    pair.guest.wait()
    assert pair.host.wait(timeout=10) == 0


def test_a_host_that_goes_is_replaced_by_the_next_one_to_connect(pair):
    """The guest's end takes a new host whenever the last one has gone: over vsock that is how
    a restored VM (a new QEMU, a new host end) is reached again; here the same code over a unix
    socket. A stream open when the host went is gone with it; the new host is served."""
    live = pair.client.open_process(["sleep", "30"])
    pair.host.kill()
    pair.host.wait()
    pair.host_sock.unlink()  # as the launcher does before it starts a host end
    pair.host = subprocess.Popen([str(pair.mux), "host", "--vm", str(pair.port), "--listen", str(pair.host_sock),
                                  "--config", str(pair.d / "config")])  # fmt: skip
    pair.client = AgentClient(UnixTransport(pair.host_sock))
    pair.client.wait_listening(10)
    r = pair.client.exec(["/bin/sh", "-c", "echo again $A"])
    assert (r.exit_code, bytes(r.stdout)) == (0, b"again\n"), r
    live.close()


def test_a_close_the_client_waits_for_reaches_it_at_once(pair):
    """The agent's answer to a quiesce and its close arrive at the host together, and the client
    waits for that close with nothing of its own to send: the host end passes the half-close on
    at once, not only when the stream next has something to do (before, the client waited out
    its timeout and a microVM's checkpoint failed)."""
    started = time.monotonic()
    pair.client.quiesce()
    assert time.monotonic() - started < 3
