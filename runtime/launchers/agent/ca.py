"""Certificates every sandbox trusts from its start (``HANGAR_SANDBOX_CA_CERTS``), as an
agent-based launcher gives them.

On a network that inspects TLS the node trusts the organisation's CA and a sandbox, with its
image's own store, does not: npm, pip, git and the agents' CLIs fail with
``SELF_SIGNED_CERT_IN_CHAIN``. A node given a PEM bundle makes every sandbox trust it:

- the bundle is copied to a node-side file named by its content (a checkpointed sandbox's
  saved configuration names it, so it never changes under one) and mounted read-only at
  :data:`SANDBOX_PATH`; nothing is written into a sandbox's root filesystem from the host,
  where a symlink the sandbox made could redirect the write;
- :data:`ENV_VARS` point at it in the sandbox's base environment (a create's own env wins);
- once the agent listens, the certificates the image's system store lacks are appended to it
  through the agent, which resolves the path inside the sandbox. Only those missing are
  added, so a restart or a resume over the same files adds nothing twice.

Standard library only, like every launcher module.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
from pathlib import Path

from ..base import LauncherError, Mount
from .client import AgentClient
from .protocol import AgentError, AgentFileError

log = logging.getLogger(__name__)

SANDBOX_PATH = "/.hangar/ca-certificates.crt"
# OpenSSL (curl, Python, git built on it), Node.js (npm and the agents' CLIs, which add these
# to their own list), requests and pip, git, curl.
ENV_VARS = ("SSL_CERT_FILE", "NODE_EXTRA_CA_CERTS", "REQUESTS_CA_BUNDLE", "GIT_SSL_CAINFO", "CURL_CA_BUNDLE")
# The system stores of Debian, Ubuntu and Alpine; RHEL and Fedora (the second is a link to the
# first there, a file of its own on older releases); openSUSE. A link is written through.
SYSTEM_STORES = (
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
)
# A store is read into the node's memory: the sandbox may have grown one without bound.
MAX_STORE_BYTES = 16 * 1024 * 1024
_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----([A-Za-z0-9+/=\s]+?)-----END CERTIFICATE-----")


def certificates(pem: bytes) -> list[bytes]:
    """The PEM certificates in ``pem``, each with plain ``\\n`` line ends, in order."""
    out = []
    for m in _PEM.finditer(pem):
        body = b"".join(m.group(1).split())
        lines = [body[i : i + 64] for i in range(0, len(body), 64)]
        out.append(b"\n".join([b"-----BEGIN CERTIFICATE-----", *lines, b"-----END CERTIFICATE-----"]))
    return out


def read_bundle(path: str | os.PathLike[str]) -> list[bytes]:
    """The certificates of the PEM file at ``path``; ValueError says why there are none."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    certs = certificates(data)
    if not certs:
        raise ValueError(f"{path} holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
    return certs


def _node_certs(stores: tuple[str, ...]) -> list[bytes]:
    """The certificates of the node's own system store (the first there is), or none."""
    for path in stores:
        with contextlib.suppress(OSError, ValueError):
            return read_bundle(path)
    return []


def _bodies(certs: list[bytes]) -> set[bytes]:
    return {b"".join(c.splitlines()[1:-1]) for c in certs}


class SandboxCA:
    """One node's bundle: where it is mounted, the environment naming it, and its install
    into a sandbox's system store."""

    def __init__(
        self, source: str | os.PathLike[str], directory: Path, node_stores: tuple[str, ...] = SYSTEM_STORES
    ) -> None:
        try:
            self.certs = read_bundle(source)
        except ValueError as exc:
            raise LauncherError(f"HANGAR_SANDBOX_CA_CERTS: {exc}") from None
        # The mounted file is what SSL_CERT_FILE, REQUESTS_CA_BUNDLE, GIT_SSL_CAINFO and
        # CURL_CA_BUNDLE name, and those replace a tool's own list: so it holds the public CAs the
        # node itself trusts as well, and a bundle of just the organisation's CA breaks nothing.
        combined, seen = [], set()
        for cert in [*self.certs, *_node_certs(node_stores)]:
            body = b"".join(cert.splitlines()[1:-1])
            if body not in seen:
                seen.add(body)
                combined.append(cert)
        content = b"\n".join(combined) + b"\n"
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{hashlib.sha256(content).hexdigest()[:32]}.crt"
        if not self.path.is_file():
            tmp = directory / f".{self.path.name}.{os.getpid()}"
            tmp.write_bytes(content)
            tmp.chmod(0o644)
            os.replace(tmp, self.path)
        self._bodies = _bodies(self.certs)

    def mount(self) -> Mount:
        return Mount(source=str(self.path), destination=SANDBOX_PATH, read_only=True)

    def env(self) -> dict[str, str]:
        return dict.fromkeys(ENV_VARS, SANDBOX_PATH)

    def install(self, client: AgentClient) -> list[str]:
        """Append the certificates each system store of the sandbox lacks; the stores changed.
        A store that cannot be read or written is left as it is (the variables still name the
        bundle), with a warning."""
        changed = []
        for path in SYSTEM_STORES:
            try:
                current = _read_bounded(client, path)
                if current is None:
                    continue
                have = _bodies(certificates(current))
                missing = [c for c in self.certs if b"".join(c.splitlines()[1:-1]) not in have]
                if not missing:
                    continue
                sep = b"" if not current or current.endswith(b"\n") else b"\n"
                client.write_file(path, current + sep + b"\n".join(missing) + b"\n", mode=0o644, mkdirs=False)
                changed.append(path)
            except AgentError as exc:
                log.warning("could not add the sandbox CA certificates to %s: %s", path, exc)
        return changed


def _read_bounded(client: AgentClient, path: str) -> bytes | None:
    """The store's content, or None where there is none (missing, not a regular file, too big)."""
    try:
        _, chunks = client.iter_file(path)
    except AgentFileError:
        return None
    parts, size = [], 0
    # Closing the started generator hangs up on the agent (a file too big is not read on).
    with contextlib.closing(chunks):  # type: ignore[type-var]
        for chunk in chunks:
            size += len(chunk)
            if size > MAX_STORE_BYTES:
                log.warning("%s in the sandbox is over %d bytes: left as it is", path, MAX_STORE_BYTES)
                return None
            parts.append(chunk)
    return b"".join(parts)
