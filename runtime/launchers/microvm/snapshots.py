"""A microVM saved whole (a pause in checkpoint mode) and continued: QEMU's migration of a stopped
VM to a file, and its incoming migration from that file into a QEMU started the same way.

What is saved is the VM's RAM and device state (``checkpoint.img``, about the RAM the guest has
touched: zero pages are a flag each), beside the command line QEMU ran with (``checkpoint.json``):
a restore must start QEMU with the same machine, the same devices in the same order, the same
kernel and root disk. Its disks are not copied: the sandbox's own disk and its volumes' images
stay where they are, unchanged meanwhile (a volume stays held by the checkpoint, see
:func:`runtime.host.volumes.hold_for_checkpoint`). QEMU is driven over its QMP socket.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..base import LauncherError

IMAGE = "checkpoint.img"
META = "checkpoint.json"
# No bandwidth cap on the way to the file (QEMU's default, 32 MiB/s, is for live migration
# over a network: a 200 MB image would take six seconds).
MAX_BANDWIDTH = 1 << 40


class QMPError(LauncherError):
    pass


class QMP:
    """A QMP connection: newline-delimited JSON, a greeting, then commands and their answers
    (events in between are skipped)."""

    def __init__(self, path: Path, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(str(path))
        except OSError as exc:
            self.sock.close()
            raise QMPError(f"cannot reach QEMU's monitor ({path}): {exc}") from None
        self.file = self.sock.makefile("rb")
        self._read()  # the greeting
        self.execute("qmp_capabilities")

    def _read(self) -> dict[str, Any]:
        try:
            line = self.file.readline(1 << 20)
        except OSError as exc:
            raise QMPError(f"QEMU's monitor did not answer: {exc}") from None
        if not line:
            raise QMPError("QEMU's monitor closed the connection")
        try:
            message = json.loads(line)
        except ValueError:
            raise QMPError(f"QEMU's monitor sent {line[:200]!r}") from None
        if not isinstance(message, dict):
            raise QMPError(f"QEMU's monitor sent {line[:200]!r}")
        return message

    def execute(self, command: str, arguments: dict[str, Any] | None = None) -> Any:
        request: dict[str, Any] = {"execute": command}
        if arguments:
            request["arguments"] = arguments
        try:
            self.sock.sendall(json.dumps(request).encode() + b"\n")
        except OSError as exc:
            raise QMPError(f"QEMU's monitor: {exc}") from None
        while True:
            message = self._read()
            if "return" in message:
                return message["return"]
            if "error" in message:
                error = message["error"]
                raise QMPError(
                    f"QEMU: {command}: {error.get('desc', error) if isinstance(error, dict) else error}"
                )

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
            self.sock.close()

    def __enter__(self) -> QMP:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def save(monitor: Path, target: Path, timeout: float) -> None:
    """Stop the VM and migrate it into ``target`` (written beside it, then renamed): returns
    once the file is whole. The VM is left stopped; QEMU is the caller's to end."""
    partial = target.with_name(f".{target.name}.partial")
    partial.unlink(missing_ok=True)
    with QMP(monitor) as qmp:
        qmp.execute("stop")
        qmp.execute("migrate-set-parameters", {"max-bandwidth": MAX_BANDWIDTH})
        qmp.execute("migrate", {"uri": f"exec:cat > {shlex.quote(str(partial))}"})
        deadline = time.monotonic() + timeout
        while True:
            status = qmp.execute("query-migrate").get("status", "")
            if status == "completed":
                break
            if status in ("failed", "cancelled"):
                raise QMPError(f"QEMU could not save the VM: migration {status}")
            if time.monotonic() >= deadline:
                with contextlib.suppress(QMPError):
                    qmp.execute("migrate_cancel")
                raise QMPError(f"QEMU did not save the VM within {timeout:.0f} s")
            time.sleep(0.02)
    partial.replace(target)


def incoming(image: Path) -> list[str]:
    """QEMU's arguments to start from ``image`` (then :func:`resume`)."""
    return ["-incoming", f"exec:cat {shlex.quote(str(image))}"]


def resume(monitor: Path, alive: Callable[[], bool], timeout: float) -> None:
    """Once QEMU has loaded the saved VM, run it: the VM was saved stopped, and a VM arrives
    in the state it left in. ``alive`` says whether QEMU still runs (a load that failed ends it)."""
    deadline = time.monotonic() + timeout
    qmp: QMP | None = None
    try:
        while qmp is None:
            try:
                qmp = QMP(monitor)
            except QMPError:
                if not alive() or time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)
        while True:
            status = qmp.execute("query-status").get("status", "")
            if status == "running":
                return
            if status not in ("inmigrate", "prelaunch"):
                qmp.execute("cont")
                return
            if time.monotonic() >= deadline:
                raise QMPError(f"QEMU did not load the saved VM within {timeout:.0f} s")
            time.sleep(0.01)
    finally:
        if qmp is not None:
            qmp.close()


def discard(d: Path) -> None:
    """The sandbox's checkpoint, gone (restored, or of no more use)."""
    for name in (IMAGE, META, f".{IMAGE}.partial"):
        (d / name).unlink(missing_ok=True)
