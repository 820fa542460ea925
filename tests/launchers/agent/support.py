"""What the guest agent's tests share: the agent run directly on the host (no gVisor),
stopped, and spoken to with raw frames."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from runtime.launchers.agent.client import AgentClient
from runtime.launchers.agent.protocol import (
    AgentUnavailable,
    decode_fields,
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
