"""Compile the guest agent once per source version and cache the binary.

The binary is static, so the same file runs inside any image (glibc, musl or none at all).
Its name carries a hash of the source and the flags: a changed agent gets a new file, and
sandboxes still running the old one keep theirs.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ...host.locks import file_lock

AGENT_SOURCE = Path(__file__).with_name("hangar-agent.c")
AGENT_CFLAGS: tuple[str, ...] = ("-static", "-O2", "-Wall", "-Wextra")
INSTALL_HINT = "install a C compiler and static libc: apt-get install gcc libc6-dev"
COMPILE_TIMEOUT = 120.0


class AgentBuildError(RuntimeError):
    """gcc is missing or could not build the agent; the message carries gcc's output."""


def default_cache_dir() -> Path:
    data_dir = os.environ.get("HANGAR_DATA_DIR")
    if data_dir:
        return Path(data_dir) / "bin"
    return Path.home() / ".local" / "share" / "hangar" / "bin"


def agent_digest(source: bytes | None = None) -> str:
    """16 hex digits identifying this source compiled with these flags."""
    if source is None:
        source = AGENT_SOURCE.read_bytes()
    h = hashlib.sha256(source)
    h.update(b"\0" + " ".join(AGENT_CFLAGS).encode())
    return h.hexdigest()[:16]


def agent_binary(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Path of the compiled agent, compiling it first if this version is not cached yet.

    Safe to call from several processes at once: one compiles, under a lock, while the others
    wait and then find the finished binary, which appears by rename, never half-written.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / f"hangar-agent-{agent_digest()}"
    if _usable(target):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with file_lock(cache / ".hangar-agent.lock"):
        if _usable(target):
            return target
        _compile(target)
    return target


def _usable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _compile(target: Path) -> None:
    gcc = shutil.which("gcc")
    if gcc is None:
        raise AgentBuildError(f"cannot build the sandbox agent: gcc not found; {INSTALL_HINT}")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        try:
            proc = subprocess.run(
                [gcc, *AGENT_CFLAGS, "-o", str(tmp), str(AGENT_SOURCE)],
                capture_output=True,
                text=True,
                timeout=COMPILE_TIMEOUT,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            raise AgentBuildError(
                f"building the sandbox agent timed out after {COMPILE_TIMEOUT:.0f}s"
            ) from exc
        except OSError as exc:
            raise AgentBuildError(f"cannot run gcc: {exc}; {INSTALL_HINT}") from exc
        if proc.returncode != 0:
            output = (proc.stderr or proc.stdout).strip()[-4000:]
            raise AgentBuildError(f"building the sandbox agent failed:\n{output}\n({INSTALL_HINT})")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
