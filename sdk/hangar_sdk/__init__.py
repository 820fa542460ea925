"""Hangar's Python SDK: sandboxes, their commands, processes and files, and harnesses, against
a Hangar server's API (``HANGAR_URL`` and ``HANGAR_TOKEN``). Reference: docs/sdk.md."""

from ._errors import (
    AuthError,
    CommandTimeout,
    ConflictError,
    HangarError,
    NetworkError,
    NotFoundError,
    QuotaError,
    RateLimitError,
    ServerError,
    TooLargeError,
    ValidationError,
)
from ._models import ExecResult, FileEntry, HarnessInfo, ProcessInfo, RunInfo, SandboxInfo
from ._transport import __version__
from .aio import AsyncFiles, AsyncProcess, AsyncSandbox
from .harness import AsyncHarness, AsyncRun, Harness, Run
from .sandbox import Files, Output, Process, Sandbox
from .terminal import AsyncTerminal, Terminal

__all__ = [
    "AsyncFiles",
    "AsyncHarness",
    "AsyncProcess",
    "AsyncRun",
    "AsyncSandbox",
    "AsyncTerminal",
    "AuthError",
    "CommandTimeout",
    "ConflictError",
    "ExecResult",
    "FileEntry",
    "Files",
    "HangarError",
    "Harness",
    "HarnessInfo",
    "NetworkError",
    "NotFoundError",
    "Output",
    "Process",
    "ProcessInfo",
    "QuotaError",
    "RateLimitError",
    "Run",
    "RunInfo",
    "Sandbox",
    "SandboxInfo",
    "ServerError",
    "Terminal",
    "TooLargeError",
    "ValidationError",
    "__version__",
]
