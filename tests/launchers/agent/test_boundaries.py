"""Where the agent's word stops being trusted: ``no_pseudo_fs`` (a caller kept out of /proc and
/sys) enforced by the agent, run on the host, and the client facing an agent that lies (a
sandbox can answer for its own agent: the socket's directory is its own).

Run with: .venv/bin/python -m pytest tests/launchers/agent/test_boundaries.py -p no:django -q
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from runtime.launchers.agent.build import agent_binary
from runtime.launchers.agent.client import AgentClient
from runtime.launchers.agent.protocol import PSEUDO_FS_REFUSED, AgentError, AgentFileError
from tests.launchers.agent.support import start_agent, stop_agent


@pytest.fixture(scope="module")
def host_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentClient]:
    running = start_agent(agent_binary(tmp_path_factory.mktemp("bin")), tmp_path_factory.mktemp("run"))
    yield running.client
    stop_agent(running)


# -- no_pseudo_fs, enforced by the agent ----------------------------------------------------------


def test_no_pseudo_fs_refuses_proc_and_sys_for_read_list_and_stat(
    host_agent: AgentClient, tmp_path: Path
) -> None:
    client = host_agent
    (tmp_path / "plain").write_text("hi\n")
    (tmp_path / "to-proc").symlink_to("/proc/self/environ")
    (tmp_path / "to-proc-dir").symlink_to("/proc")
    (tmp_path / "to-plain").symlink_to(tmp_path / "plain")
    held = open(tmp_path / "plain", "rb")  # noqa: SIM115 - kept open: /proc/<pid>/fd/<n> reaches it
    fd_link = f"/proc/{os.getpid()}/fd/{held.fileno()}"
    try:
        for path in ("/proc/self/environ", "/proc/thread-self/environ", "/proc/1/environ",
                     str(tmp_path / "to-proc"), str(tmp_path / "to-proc-dir") + "/self/environ", fd_link,
                     "/sys/kernel/uevent_seqnum"):  # fmt: skip
            with pytest.raises(AgentFileError) as info:
                client.iter_file(path, no_pseudo_fs=True)
            assert info.value.errno_name == PSEUDO_FS_REFUSED and "/proc or /sys" in info.value.message, path
            if not path.endswith("to-proc"):  # stat describes that symlink itself (below)
                with pytest.raises(AgentFileError) as info:
                    client.stat(path, no_pseudo_fs=True)
                assert info.value.errno_name == PSEUDO_FS_REFUSED, path
        for path in ("/proc", "/proc/self/fd", "/sys", str(tmp_path / "to-proc-dir")):
            with pytest.raises(AgentFileError) as info:
                client.list_dir(path, no_pseudo_fs=True)
            assert info.value.errno_name == PSEUDO_FS_REFUSED, path
        # Ordinary files and symlinks to them; stat describes a symlink, unfollowed.
        for path in (tmp_path / "plain", tmp_path / "to-plain"):
            assert b"".join(client.iter_file(str(path), no_pseudo_fs=True)[1]) == b"hi\n"
        assert client.stat(str(tmp_path / "to-proc"), no_pseudo_fs=True).type == "symlink"
        assert client.stat(str(tmp_path / "plain"), no_pseudo_fs=True).size == 3
        assert {e.name for e in client.list_dir(str(tmp_path), no_pseudo_fs=True)} >= {"plain", "to-proc"}
        assert client.list_dir("/", no_pseudo_fs=True)
        for path, errno_name in (("/nope/x", "ENOENT"), (str(tmp_path / "plain") + "/x", "ENOTDIR")):
            with pytest.raises(AgentFileError) as info:
                client.iter_file(path, no_pseudo_fs=True)
            assert info.value.errno_name == errno_name, path
        (tmp_path / "loop").symlink_to(tmp_path / "loop")
        with pytest.raises(AgentFileError) as info:
            client.iter_file(str(tmp_path / "loop"), no_pseudo_fs=True)
        assert info.value.errno_name == "ELOOP"
        # Other callers read /proc as before.
        assert b"".join(client.iter_file("/proc/self/environ")[1])
    finally:
        held.close()


# -- an agent that lies ---------------------------------------------------------------------------


@contextlib.contextmanager
def liar(tmp_path: Path, reply: Callable[[socket.socket], None]) -> Iterator[AgentClient]:
    """A listener answering every request with ``reply(conn)``, and a client with a short
    timeout pointed at it."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "agent.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                _, length = struct.unpack(">cI", conn.recv(5, socket.MSG_WAITALL))
                conn.recv(length, socket.MSG_WAITALL)
                with contextlib.suppress(OSError):
                    reply(conn)
                    time.sleep(0.2)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield AgentClient(path, connect_timeout=1.0, io_timeout=2.0)
    finally:
        listener.close()


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    return struct.pack(">cI", kind, len(payload)) + payload


def sends(*frames: bytes) -> Callable[[socket.socket], None]:
    return lambda conn: conn.sendall(b"".join(frames))


STAT = b"size=3\0mode=644\0mtime=1.0\0type=file\0"


@pytest.mark.parametrize(
    "answer",
    [
        frame(b"T", b"size=-1\0mode=644\0mtime=1.0\0type=file\0"),  # a negative size
        frame(b"T", b"size=99999999999999999999\0mode=644\0mtime=1.0\0type=file\0"),  # past 2**63
        frame(b"T", b"size=3\0mode=644\0mtime=nan\0type=file\0"),
        frame(b"T", b"size=3\0mode=777777\0mtime=1.0\0type=file\0"),
        frame(b"T", b"size=3\0mode=644\0mtime=1.0\0type=fifo\0"),
        frame(b"T", b"no equals sign\0"),
        struct.pack(">cI", b"T", (1 << 20) + 1),  # a frame over the limit: nothing is allocated for it
        struct.pack(">cI", b"T", 1000) + b"short",  # a truncated frame, then the agent hangs up
        frame(b"\x00", STAT),  # not a frame type
        frame(b"D", b"data before the stat"),
    ],
)
def test_a_malformed_answer_is_an_agent_error_at_once(tmp_path: Path, answer: bytes) -> None:
    with liar(tmp_path, sends(answer)) as client:
        started = time.monotonic()
        with pytest.raises(AgentError):
            b"".join(client.iter_file("/f")[1])
        assert time.monotonic() - started < 1.5  # never the io timeout, never a hang


def test_a_malformed_listing_or_write_answer_is_an_agent_error(tmp_path: Path) -> None:
    for name in (b"", b"../escape", b"a/b", b".."):
        with liar(
            tmp_path / name.hex(), sends(frame(b"N", b"name=" + name + b"\0" + STAT), frame(b"K"))
        ) as c:
            with pytest.raises(AgentError, match="directory entry"):
                c.list_dir("/d")
    with liar(tmp_path / "w", sends(frame(b"K", b"size=lots\0"))) as c:
        with pytest.raises(AgentError, match="write reply"):
            c.write_file("/f", b"abc")


def test_an_answer_that_does_not_say_it_kept_out_of_proc_is_refused(tmp_path: Path) -> None:
    # An agent older than no_pseudo_fs ignores the field; its answer must not reach a viewer.
    with liar(tmp_path, sends(frame(b"T", STAT), frame(b"D", b"SECRET=1"), frame(b"K"))) as client:
        with pytest.raises(AgentFileError) as info:
            client.iter_file("/proc/1/environ", no_pseudo_fs=True)
        assert info.value.errno_name == PSEUDO_FS_REFUSED and "older than the check" in info.value.message
        assert b"".join(client.iter_file("/proc/1/environ")[1]) == b"SECRET=1"  # asked for nothing: served
    with liar(tmp_path / "l", sends(frame(b"N", b"name=environ\0" + STAT), frame(b"K"))) as client:
        with pytest.raises(AgentFileError):
            client.list_dir("/proc/1", no_pseudo_fs=True)
    with liar(tmp_path / "s", sends(frame(b"K", STAT))) as client:
        with pytest.raises(AgentFileError):
            client.stat("/proc/1/environ", no_pseudo_fs=True)


def test_a_quiesce_answer_that_never_ends_is_refused(tmp_path: Path) -> None:
    def endless(conn: socket.socket) -> None:
        conn.sendall(frame(b"K"))
        while True:
            conn.sendall(b"x" * 65536)

    with liar(tmp_path, endless) as client, pytest.raises(AgentError, match="kept sending"):
        client.quiesce()
