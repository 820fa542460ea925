"""Names a node takes on its host, made its own by the node's id.

Some of what a node makes is global to the machine it runs on: the nftables tables, the
interface and network namespace names, the cgroup parent, the address pool of its sandboxes'
networks. Two Hangars on one machine (a developer's ``hangar up`` beside the test suite,
several nodes on one host) must never share one of them: a node's reconciliation removes what
it finds under its names that it does not know, so a shared name means one node tearing down
the other's sandboxes. Each node therefore keeps an id in its state directory, made once, and
puts it in every such name. Node *names* are not unique between installs (the default is the
host name); the id is.

The address pool is chosen too when it is not configured: the first ``/16`` from
``POOL_CANDIDATES`` that no other node on this machine has claimed and that no route of the
host's overlaps. Claims are files in ``CLAIMS_DIR`` naming the state directory that made them;
one whose owner no longer holds that pool is stale and taken over. The choice is kept in the
state directory, so it never changes under running sandboxes.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import re
import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..launchers.base import LauncherError
from .locks import file_lock

log = logging.getLogger(__name__)

ID_FILE = "node-id"
ID_RE = re.compile(r"^[0-9a-f]{6}$")  # hex only: no id can make a prefix that is another's
CLAIMS_DIR = Path("/var/lib/hangar/address-pools")
LEGACY_POOL = "10.88.0.0/16"  # every node's pool before pools were chosen per node
POOL_CANDIDATES = tuple(f"10.{b}.0.0/16" for b in range(88, 128))


def node_id(state_dir: str | os.PathLike[str]) -> str:
    """The id kept in ``state_dir`` (made on first use): six hex digits."""
    path = Path(state_dir) / ID_FILE
    with contextlib.suppress(OSError):
        held = path.read_text().strip()
        if ID_RE.fullmatch(held):
            return held
        raise LauncherError(
            f"{path} holds {held!r}, not a node id (six hex digits): remove it to make a new one"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(path.with_name(f".{ID_FILE}.lock")):
        with contextlib.suppress(FileNotFoundError):
            return path.read_text().strip()  # another process of this node made it meanwhile
        made = secrets.token_hex(3)
        tmp = path.with_name(f".{ID_FILE}.tmp")
        tmp.write_text(made + "\n")
        os.replace(tmp, path)
        return made


@dataclass(frozen=True)
class HostNames:
    """Every host-global name of one node, from its id."""

    node_id: str

    @property
    def table(self) -> str:  # nftables: inet <table> (filter) and ip <table>_nat
        return f"hangar_{self.node_id}"

    @property
    def iface_prefix(self) -> str:  # host side of a sandbox's veth: prefix + 8 hex = 15 chars
        return f"h{self.node_id}"

    @property
    def netns_prefix(self) -> str:
        return f"hangar-{self.node_id}-"

    @property
    def cgroup_parent(self) -> str:
        return f"hangar-{self.node_id}"


def _claim_path(claims_dir: Path, pool: ipaddress.IPv4Network) -> Path:
    return claims_dir / str(pool).replace("/", "_")


def _pool_file(state_dir: Path) -> Path:
    return state_dir / "network" / "pool"


def _claims(claims_dir: Path) -> dict[ipaddress.IPv4Network, str]:
    """Pools claimed by live owners (state dirs that still hold them) → their owner."""
    out = {}
    for p in claims_dir.glob("10.*"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            owner = json.loads(p.read_text())["owner"]
            pool = ipaddress.IPv4Network(p.name.replace("_", "/"))
            with contextlib.suppress(OSError):
                if _pool_file(Path(owner)).read_text().strip() == str(pool):
                    out[pool] = owner
    return out


def _routed() -> list[ipaddress.IPv4Network]:
    """Networks the host routes (its own and any other software's), which a pool must miss."""
    try:
        out = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True,
                             timeout=10).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return []
    nets = []
    for line in out.splitlines():
        first = line.split()[0] if line.split() else ""
        if first in ("local", "broadcast", "unreachable", "prohibit", "blackhole"):
            first = line.split()[1] if len(line.split()) > 1 else ""
        with contextlib.suppress(ValueError):
            if first != "default":
                nets.append(ipaddress.IPv4Network(first, strict=False))
    return nets


def address_pool(
    state_dir: str | os.PathLike[str], configured: str = "", *, claims_dir: Path | None = None
) -> ipaddress.IPv4Network:
    """This node's pool for sandbox addresses: ``configured`` if given, else the one it chose
    before, else a free one (see the module's doc). Raises LauncherError when the pool is
    another node's on this machine."""
    state = Path(state_dir).resolve()
    claims_dir = claims_dir or CLAIMS_DIR
    claims_dir.mkdir(parents=True, exist_ok=True)
    mine = _pool_file(state)
    with file_lock(claims_dir / ".lock"):
        chosen = configured
        if not chosen:
            with contextlib.suppress(OSError):
                chosen = mine.read_text().strip()
        if not chosen and any((state / "network" / "leases").glob("*.json")):
            chosen = LEGACY_POOL  # leases made before pools were chosen: they are in the old one
        taken = _claims(claims_dir)
        if chosen:
            pool = ipaddress.IPv4Network(chosen)
            for other, holder in taken.items():
                if other.overlaps(pool) and Path(holder) != state:
                    raise LauncherError(
                        f"the sandbox address pool {pool} overlaps {other}, which the Hangar node at {holder} "
                        "uses on this machine: set HANGAR_NETWORK_POOL to another range"
                    )
        else:
            routed = _routed()
            free = [
                ipaddress.IPv4Network(c) for c in POOL_CANDIDATES
                if not any(ipaddress.IPv4Network(c).overlaps(t) for t in [*taken, *routed])
            ]  # fmt: skip
            if not free:
                raise LauncherError(
                    "no free /16 for sandbox addresses among 10.88-10.127: set HANGAR_NETWORK_POOL"
                )
            pool = free[0]
        mine.parent.mkdir(parents=True, exist_ok=True)
        if not mine.exists() or mine.read_text().strip() != str(pool):
            mine.write_text(f"{pool}\n")
        claim = _claim_path(claims_dir, pool)
        owner = None
        with contextlib.suppress(OSError, ValueError, AttributeError):
            owner = json.loads(claim.read_text()).get("owner")
        if owner != str(state):
            claim.write_text(json.dumps({"owner": str(state)}) + "\n")
    return pool


def release_pool(state_dir: str | os.PathLike[str], *, claims_dir: Path | None = None) -> None:
    """Give the node's pool back (its state is being removed)."""
    state = Path(state_dir).resolve()
    claims_dir = claims_dir or CLAIMS_DIR
    with contextlib.suppress(OSError, ValueError):
        pool = ipaddress.IPv4Network(_pool_file(state).read_text().strip())
        claim = _claim_path(claims_dir, pool)
        if json.loads(claim.read_text()).get("owner") == str(state):
            claim.unlink()
        _pool_file(state).unlink()
