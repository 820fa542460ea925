"""What the API answers, as plain dataclasses. Each field has the name of a field of the
server's schema component (``SCHEMA`` maps each class to it; tests/sdk/test_models.py holds
them together), so SDK and API cannot drift apart silently. Fields the server adds later are
ignored, so an older SDK keeps working with a newer server."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """An instance of the dataclass ``cls`` from an answer, keeping only the fields it knows."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class SandboxInfo:
    """A sandbox as the server last described it (``GET /sandboxes/{id}``)."""

    id: str
    status: str
    status_reason: str = ""
    image: str = ""
    runtime: str = ""
    node: str | None = None
    node_selector: dict[str, str] = field(default_factory=dict)  # labels its node must carry
    cpu: float = 0.0
    memory_mb: int = 0
    disk_mb: int = 0
    timeout_s: int = 0
    created_at: str | None = None
    started_at: str | None = None
    stopped_at: str | None = None
    expires_at: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    network: dict[str, Any] = field(default_factory=dict)
    previews: list[dict[str, Any]] = field(default_factory=list)
    pause_mode: str = ""
    paused_mode: str = ""


@dataclass
class ExecResult:
    """A command that ran to its end. A non-zero ``exit_code`` is a result, not an exception."""

    exit_code: int
    stdout: str
    stderr: str
    duration_ms: float
    timed_out: bool = False
    truncated: bool = False
    id: int | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass
class FileEntry:
    """One entry of a directory listing; ``type`` is ``file``, ``dir``, ``symlink`` or ``other``."""

    name: str
    path: str
    type: str
    size: int
    mode: int = 0
    mtime: float = 0.0


@dataclass
class ProcessInfo:
    """A streamed or background command (``GET /sandboxes/{id}/processes/{pid}``)."""

    id: int
    status: str
    kind: str = ""
    pid: int | None = None
    argv: list[str] = field(default_factory=list)
    exit_code: int | None = None
    signal: int = 0
    timed_out: bool = False
    error: str = ""
    duration_ms: float | None = None


@dataclass
class HarnessInfo:
    """A harness (``GET /harnesses/{id}``)."""

    id: str
    name: str
    status: str
    agent: str = ""
    setup: str = ""
    setup_error: str = ""
    image: str = ""
    runtime: str = ""
    sandbox: str | None = None
    sandbox_status: str | None = None
    volume: str | None = None
    repo: dict[str, Any] | None = None
    ssh_command: str = ""


@dataclass
class RunInfo:
    """A run of a harness's agent (``GET /runs/{id}``)."""

    id: str
    harness: str
    status: str
    prompt: str = ""
    exit_code: int | None = None
    error: str = ""
    duration_ms: float | None = None
    diff: str = ""
    diff_truncated: bool = False
    timeout_s: int = 0
    process: int | None = None
    sandbox: str | None = None


# Each model and the component of the server's OpenAPI schema it reads.
SCHEMA: dict[type, str] = {
    SandboxInfo: "SandboxOut",
    ExecResult: "ExecOut",
    FileEntry: "FileEntryOut",
    ProcessInfo: "ProcessOut",
    HarnessInfo: "HarnessOut",
    RunInfo: "RunOut",
}
