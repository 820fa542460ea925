"""Per-sandbox networks: a network namespace, a veth pair, an address pair from a private
pool, NAT out, and an egress policy enforced by nftables on the host, below the sandbox.

gVisor runs with its own network stack (``--network=sandbox``) inside the namespace: it takes
the namespace's interface and addresses over, so the sandbox's packets leave through the veth
and the host's kernel, where the policy applies; nothing inside the sandbox can change it.

Layout (``nft list table inet hangar_<node id>``; every host-global name carries the node's
id, see hostnames.py, so several nodes on one machine never touch each other's)::

    chain forward   (hook forward)  iifname vmap @by_iface   → the sandbox's own chain
                                     oifname "h<id>*": established only (nothing connects in)
    chain input     (hook input)    iifname "h<id>*": established only (the host and its
                                     services, Postgres, Redis, the control plane: never)
    chain sb_<id>  (vm_<id>)         IPv6 drop; a source other than its address: drop;
                                     always-denied drop;
                                     then the policy (none: drop; all: accept; allowlist:
                                     the listed addresses and address:port pairs), then drop

A microVM (``Network(kind="vm")``, ``setup(tap=True)``) has the same host side; in its
namespace the veth's end and a tap device are bridged and the guest's kernel holds the address
(QEMU runs in the namespace). Its namespaces and chains are named ``hangarvm-<node id>-<id>``
and ``vm_<id>``, so the gVisor launcher's reconciliation never takes them for its own leftovers.

Always denied, whatever the policy: other sandboxes (the pool), link-local and metadata
addresses (169.254.0.0/16), loopback, private and shared ranges (the node's management
networks), multicast and reserved ranges; ``HANGAR_NETWORK_EXCEPTIONS`` (CIDRs an admin
allows) are cut out of that list. Every change of a sandbox's policy is one ``nft -f``
transaction: the chain is flushed and refilled atomically.

Host names in an allowlist are resolved on the host (never by the sandbox) and the answers
pinned: the sandbox's ``/etc/hosts`` maps each name to exactly the addresses the policy
allows, and :meth:`Network.refresh` re-resolves them (the node does it on every
reconciliation), so a name that moves is followed and a sandbox cannot reach another address
by resolving a listed name to it itself.

Debian's runsc refuses ``--network=sandbox`` on newer kernels ("cannot run with network
enabled in root network namespace"): it decides that from ``/proc/sys/net/core/rmem_default``
being visible, which newer kernels show in every namespace. :func:`unshare_wrapper` runs runsc
in a private mount namespace with a tmpfs over ``/proc/sys/net``, which passes that test
without giving up gVisor's own network stack (``--network=host`` would hand the sandbox the
host kernel's stack, a far larger attack surface).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import ipaddress
import json
import logging
import os
import socket
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..launchers.base import LauncherError
from .hostnames import HostNames, address_pool, release_pool
from .locks import file_lock

log = logging.getLogger(__name__)
LEGACY_TABLE = "hangar"  # the one table of every node before names carried the node's id
EGRESS = ("none", "allowlist", "all")
RECORDS = (".json", ".policy", ".names")  # what leases/ keeps of a sandbox: its lease, policy, pinned names
ACCESS_SET = "hangar_access"  # (host-side veth . port) pairs let in to the node's gateway port
HANGAR_HOST = "hangar.internal"  # the name a sandbox allowed to reach Hangar uses
TAP = "tap0"  # a virtual machine's interface in its namespace (Network.setup with tap)
ALWAYS_DENIED = (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.168.0.0/16", "224.0.0.0/4", "240.0.0.0/4",
)  # fmt: skip


class NetworkError(LauncherError):
    pass


@dataclass(frozen=True)
class Allowed:
    """One allowlist entry, parsed: a network, or a host name (resolved later); a port or any."""

    text: str
    network: ipaddress.IPv4Network | None
    host: str | None
    port: int | None


@dataclass
class Policy:
    egress: str = "none"
    allow: list[str] = field(default_factory=list)
    # The sandbox may reach Hangar itself at hangar.internal (the node's gateway port, which
    # forwards to Hangar's API and OTLP endpoint): a harness's agent uses its API token there.
    hangar: bool = False

    @property
    def enabled(self) -> bool:
        return self.egress != "none" or self.hangar

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"egress": self.egress, "allow": list(self.allow)}
        if self.hangar:
            out["hangar"] = True
        return out


HOST_RE_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789-.")


def parse_allow(entry: str) -> Allowed:
    """``"api.example.com"``, ``"api.example.com:443"``, ``"1.2.3.4"``, ``"1.2.3.4:8080"`` or
    ``"10.1.0.0/16"``; raises ValueError with what is wrong."""
    text = (entry or "").strip().lower()
    if not text:
        raise ValueError("an empty allowlist entry")
    if "/" in text:
        try:
            net = ipaddress.ip_network(text, strict=False)
        except ValueError:
            raise ValueError(f"{entry!r} is not a CIDR network") from None
        if net.version != 4:
            raise ValueError(f"{entry!r}: sandboxes have IPv4 only")
        return Allowed(text, net, None, None)
    host, port = text, None
    if text.count(":") == 1:
        host, _, port_s = text.partition(":")
        if not port_s.isdigit() or not 1 <= int(port_s) <= 65535:
            raise ValueError(f"{entry!r}: the port must be a number from 1 to 65535")
        port = int(port_s)
    elif ":" in text:
        raise ValueError(f"{entry!r}: sandboxes have IPv4 only")
    try:
        addr = ipaddress.IPv4Address(host)
        return Allowed(text, ipaddress.IPv4Network(f"{addr}/32"), None, port)
    except ValueError:
        pass
    if not host or len(host) > 253 or not set(host) <= HOST_RE_CHARS or host.startswith(("-", ".")):
        raise ValueError(f"{entry!r} is not a host name, address or CIDR network")
    return Allowed(text, None, host, port)


def validate_policy(value: Any) -> Policy:
    """A policy from the API's ``{"egress": …, "allow": […]}``; raises ValueError."""
    if value is None:
        return Policy()
    if not isinstance(value, dict):
        raise ValueError('network is an object: {"egress": "none" | "allowlist" | "all", "allow": [...]}')
    egress = value.get("egress", "none")
    if egress not in EGRESS:
        raise ValueError(f"egress must be one of {', '.join(EGRESS)}, got {egress!r}")
    allow = value.get("allow") or []
    if not isinstance(allow, list) or len(allow) > 200:
        raise ValueError("allow is a list of at most 200 host names, host:port, addresses or CIDRs")
    parsed = [parse_allow(a) for a in allow]
    if egress == "allowlist" and not parsed:
        raise ValueError('egress "allowlist" needs at least one entry in allow')
    if egress != "allowlist" and parsed:
        raise ValueError(f'allow is for egress "allowlist" (egress is {egress!r})')
    hangar = value.get("hangar", False)
    if not isinstance(hangar, bool):
        raise ValueError("hangar is true or false (whether the sandbox may reach Hangar at hangar.internal)")
    return Policy(egress=egress, allow=[a.text for a in parsed], hangar=hangar)


def unshare_wrapper(argv: list[str]) -> list[str]:
    """``argv`` (a ``runsc run|restore``) in a private mount namespace where /proc/sys/net is
    an empty tmpfs: see the module's doc."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount -t tmpfs -o size=4k tmpfs /proc/sys/net && exec "$@"', "runsc", *argv]  # fmt: skip


def _run(argv: list[str], stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetworkError(f"{' '.join(argv[:4])} failed: {(proc.stderr or proc.stdout).strip()[:500]}")
    return proc


@dataclass
class Lease:
    index: int
    netns: str
    veth: str
    host_ip: str
    sandbox_ip: str
    prefix: int = 30
    table: str = (
        LEGACY_TABLE  # the nftables table its rules are in (a lease older than node ids: the old one)
    )

    @property
    def netns_path(self) -> str:
        return f"/var/run/netns/{self.netns}"


class Network:
    """The node's sandbox networks, kept under ``state_dir/network`` (leases) and in the
    kernel (namespaces, veths, the nftables table)."""

    def __init__(
        self,
        state_dir: Path,
        names: HostNames,
        pool: str = "",
        exceptions: Iterable[str] = (),
        nameservers: Iterable[str] | None = None,
        resolve: Callable[[str], list[str]] | None = None,
        gateway_port: int = 0,
        claims_dir: Path | None = None,
        kind: str = "",
    ) -> None:
        self.state_dir = Path(state_dir)
        self.dir = self.state_dir / "network"
        self.names = names
        # A second launcher's networks on the same node (``kind``: "vm" for the microVM's) share
        # its table and interface prefix (so the node-wide rules hold them too) but not its
        # namespace and chain names: each launcher's reconciliation finds only its own.
        self.kind = kind
        self.netns_prefix = f"hangar{kind}-{names.node_id}-" if kind else names.netns_prefix
        self.chain_prefix = f"{kind}_" if kind else "sb_"
        self.gateway_port = gateway_port  # where hangar.internal answers on the host side (0: nowhere)
        self.configured_pool = pool  # empty: chosen on first use (hostnames.address_pool)
        if pool and ipaddress.IPv4Network(pool).prefixlen > 28:
            raise NetworkError(f"the sandbox address pool {pool} is too small")
        self.claims_dir = claims_dir
        self._pool: ipaddress.IPv4Network | None = None
        self.exceptions = [ipaddress.IPv4Network(e) for e in exceptions]
        self.nameservers = list(nameservers) if nameservers else _host_nameservers()
        self.resolve = resolve or _resolve
        self._base_ok = False

    @property
    def pool(self) -> ipaddress.IPv4Network:
        if self._pool is None:
            self._pool = address_pool(self.state_dir, self.configured_pool, claims_dir=self.claims_dir)
        return self._pool

    @property
    def slots(self) -> int:
        return self.pool.num_addresses // 4

    # -- the node-wide part ----------------------------------------------------------------

    def denied(self) -> list[str]:
        """Always-denied networks, minus an admin's exceptions, plus the pool (other sandboxes,
        which no exception opens)."""
        nets = [ipaddress.IPv4Network(n) for n in ALWAYS_DENIED]
        out: list[ipaddress.IPv4Network] = []
        for net in nets:
            pieces = [net]
            for exc in self.exceptions:
                nxt: list[ipaddress.IPv4Network] = []
                for p in pieces:
                    if exc.subnet_of(p) and exc != p:
                        nxt.extend(p.address_exclude(exc))
                    elif p.subnet_of(exc):
                        continue
                    else:
                        nxt.append(p)
                pieces = nxt
            out.extend(pieces)
        return [str(n) for n in ipaddress.collapse_addresses([*out, self.pool])]

    def ensure_base(self) -> None:
        """The node-wide table, forwarding and NAT for this pool: made once (checked once per
        process, so a sandbox's start pays nothing for it after that)."""
        if self._base_ok:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        table, prefix, pool = self.names.table, self.names.iface_prefix, self.pool
        with file_lock(self.dir / ".lock"):
            with open("/proc/sys/net/ipv4/ip_forward", "w") as f:
                f.write("1")
            if _run(["nft", "list", "table", "inet", table], check=False).returncode != 0:
                _run(["nft", "-f", "-"], stdin=self._base_script())
            nat = _run(["nft", "list", "chain", "ip", f"{table}_nat", "postrouting"], check=False).stdout
            if f"ip saddr {pool} " not in nat:
                _run(["nft", "add", "rule", "ip", f"{table}_nat", "postrouting", "ip", "saddr", str(pool),
                      "oifname", "!=", f"{prefix}*", "masquerade"])  # fmt: skip
        self._base_ok = True

    def _base_script(self) -> str:
        t, p = self.names.table, self.names.iface_prefix
        return f"""
add table inet {t}
add map inet {t} by_iface {{ type ifname : verdict; }}
add chain inet {t} forward {{ type filter hook forward priority 0; policy accept; }}
add chain inet {t} input {{ type filter hook input priority 0; policy accept; }}
add set inet {t} {ACCESS_SET} {{ type ifname . inet_service; }}
add rule inet {t} input iifname . tcp dport @{ACCESS_SET} accept
add rule inet {t} forward iifname vmap @by_iface
add rule inet {t} forward iifname "{p}*" drop
add rule inet {t} forward oifname "{p}*" ct state established,related accept
add rule inet {t} forward oifname "{p}*" drop
add rule inet {t} input iifname "{p}*" ct state established,related accept
add rule inet {t} input iifname "{p}*" drop
add table ip {t}_nat
add chain ip {t}_nat postrouting {{ type nat hook postrouting priority 100; }}
"""

    def remove_base(self) -> None:
        """The node-wide tables and the pool's claim, once no sandbox of the node holds a
        network (a node's state being removed; tests)."""
        _run(["nft", "delete", "table", "inet", self.names.table], check=False)
        _run(["nft", "delete", "table", "ip", f"{self.names.table}_nat"], check=False)
        release_pool(self.state_dir, claims_dir=self.claims_dir)
        self._base_ok, self._pool = False, None

    # -- leases -----------------------------------------------------------------------------

    def _lease_path(self, sandbox_id: str) -> Path:
        return self.dir / "leases" / f"{sandbox_id}.json"

    def lease_of(self, sandbox_id: str) -> Lease | None:
        with contextlib.suppress(OSError, ValueError):
            return Lease(**json.loads(self._lease_path(sandbox_id).read_text()))
        return None

    def _lease(self, sandbox_id: str) -> Lease:
        held = self.lease_of(sandbox_id)
        if held is not None:
            return held
        (self.dir / "leases").mkdir(parents=True, exist_ok=True)
        with file_lock(self.dir / ".lock"):
            used = set()
            for p in (self.dir / "leases").glob("*.json"):
                with contextlib.suppress(OSError, ValueError):
                    used.add(json.loads(p.read_text())["index"])
            start = int(hashlib.sha1(sandbox_id.encode()).hexdigest(), 16) % self.slots
            for k in range(self.slots):
                i = (start + k) % self.slots
                if i == 0 or i in used:  # slot 0 holds the pool's network address
                    continue
                base = self.pool.network_address + 4 * i
                netns, veth = self._link_names(sandbox_id)
                lease = Lease(index=i, netns=netns, veth=veth, host_ip=str(base + 1), sandbox_ip=str(base + 2),
                              table=self.names.table)  # fmt: skip
                self._write_lease(sandbox_id, lease)
                return lease
        raise NetworkError(f"no free address in the sandbox pool {self.pool}")

    def _write_lease(self, sandbox_id: str, lease: Lease) -> None:
        self._lease_path(sandbox_id).write_text(json.dumps(lease.__dict__))

    def _link_names(self, sandbox_id: str) -> tuple[str, str]:
        """The sandbox's namespace and host-side interface (15 characters, the kernel's most)."""
        digest = hashlib.sha1(sandbox_id.encode()).hexdigest()[: 15 - len(self.names.iface_prefix)]
        return f"{self.netns_prefix}{sandbox_id}", f"{self.names.iface_prefix}{digest}"

    def chain_of(self, sandbox_id: str) -> str:
        """The nftables chain that holds the sandbox's policy."""
        return f"{self.chain_prefix}{sandbox_id}"

    # -- one sandbox ------------------------------------------------------------------------

    def setup(self, sandbox_id: str, policy: Policy, tap: bool = False) -> tuple[Lease, dict[str, list[str]]]:
        """The sandbox's namespace, veth and addresses, fresh (runsc takes the addresses over
        each time it starts), and its policy; returns the lease and the pinned names (which the
        launcher writes into the sandbox through its agent, never from the host: a host-side
        write into the sandbox's root would follow a symlinked /etc out of it).

        With ``tap`` (a virtual machine's network), the namespace's end of the veth holds no
        address: it and a tap device (:data:`TAP`, which QEMU started in the namespace opens)
        are the two ports of a bridge, and the guest's kernel holds the sandbox's address. The
        host's side, its rules included, is the same either way."""
        self.ensure_base()
        lease = self._lease(sandbox_id)
        self._delete_links(lease)
        if lease.table != self.names.table:
            # Leased before names carried the node's id (a checkpoint from then): the same
            # addresses, which the saved network stack holds, under this node's own names.
            self._unhook(lease, self.chain_of(sandbox_id))
            netns, veth = self._link_names(sandbox_id)
            lease = dataclasses.replace(lease, netns=netns, veth=veth, table=self.names.table)
            self._write_lease(sandbox_id, lease)
        try:
            # Two `ip -batch` runs, the host's side and the namespace's: a process each, not one
            # per command, on the path of every networked sandbox's start.
            host_side = (
                f"netns add {lease.netns}\n"
                f"link add {lease.veth} type veth peer name eth0 netns {lease.netns}\n"
                f"addr add {lease.host_ip}/{lease.prefix} dev {lease.veth}\n"
                f"link set {lease.veth} up\n"
            )
            if tap:
                ns_side = (
                    "link add br0 type bridge\n"
                    f"tuntap add dev {TAP} mode tap\n"
                    "link set eth0 master br0\n"
                    f"link set {TAP} master br0\n"
                    f"link set eth0 up\nlink set {TAP} up\nlink set br0 up\nlink set lo up\n"
                )
            else:
                ns_side = (
                    f"addr add {lease.sandbox_ip}/{lease.prefix} dev eth0\n"
                    "link set eth0 up\n"
                    "link set lo up\n"
                    f"route add default via {lease.host_ip}\n"
                )
            _run(["ip", "-batch", "-"], stdin=host_side)
            _run(["ip", "-n", lease.netns, "-batch", "-"], stdin=ns_side)
            names = self.apply(sandbox_id, policy)
        except BaseException:
            self._delete_links(lease)
            raise
        return lease, names

    def _resolved(self, policy: Policy) -> tuple[list[tuple[str, int | None]], dict[str, list[str]]]:
        """(address or network, port) pairs the policy allows, and each host name's addresses."""
        pairs: list[tuple[str, int | None]] = []
        names: dict[str, list[str]] = {}
        for a in (parse_allow(x) for x in policy.allow):
            if a.network is not None:
                pairs.append((str(a.network), a.port))
                continue
            assert a.host is not None
            addrs = names.setdefault(a.host, self.resolve(a.host))
            pairs.extend((addr, a.port) for addr in addrs)
        return pairs, names

    def apply(self, sandbox_id: str, policy: Policy) -> dict[str, list[str]]:
        """Put the policy in force, atomically; returns the host names' pinned addresses."""
        lease = self.lease_of(sandbox_id)
        if lease is None:
            raise NetworkError(f"sandbox {sandbox_id} has no network")
        chain, t = self.chain_of(sandbox_id), lease.table
        pairs, names = self._resolved(policy) if policy.egress == "allowlist" else ([], {})
        # Only packets leaving the sandbox reach this chain, and every one is judged: no
        # "established" shortcut, so a connection opened under a looser policy stops at once.
        lines = [
            f"add chain inet {t} {chain}",
            f"flush chain inet {t} {chain}",
            f"add rule inet {t} {chain} meta nfproto ipv6 drop",
            # Its own address only: a guest kernel (a microVM's) can send any source address.
            f"add rule inet {t} {chain} ip saddr != {lease.sandbox_ip} drop",
        ]
        if policy.egress == "all" and self.nameservers:  # its resolvers, wherever they are
            servers = ", ".join(self.nameservers)
            for proto in ("udp", "tcp"):
                lines.append(f"add rule inet {t} {chain} ip daddr {{ {servers} }} {proto} dport 53 accept")
        lines.append(f"add rule inet {t} {chain} ip daddr {{ {', '.join(self.denied())} }} drop")
        if policy.egress == "all":
            lines.append(f"add rule inet {t} {chain} accept")
        elif policy.egress == "allowlist":
            anyport = sorted({n for n, p in pairs if p is None})
            ported = sorted({f"{n} . {p}" for n, p in pairs if p is not None})
            if anyport:
                lines.append(f"add rule inet {t} {chain} ip daddr {{ {', '.join(anyport)} }} accept")
            if ported:
                for proto in ("tcp", "udp"):
                    lines.append(
                        f"add rule inet {t} {chain} ip daddr . {proto} dport {{ {', '.join(ported)} }} accept"
                    )
        lines.append(f"add rule inet {t} {chain} drop")
        lines.append(f'add element inet {t} by_iface {{ "{lease.veth}" : jump {chain} }}')
        if self.gateway_port:
            # Adding first makes the delete safe whether or not it was there.
            element = f'{{ "{lease.veth}" . {self.gateway_port} }}'
            lines.append(f"add element inet {t} {ACCESS_SET} {element}")
            if not policy.hangar:
                lines.append(f"delete element inet {t} {ACCESS_SET} {element}")
        _run(["nft", "-f", "-"], stdin="\n".join(lines) + "\n")
        # What is in force, for refresh(): the node's own record, not a database snapshot.
        self._policy_path(sandbox_id).write_text(json.dumps(policy.as_dict()))
        return names

    def _policy_path(self, sandbox_id: str) -> Path:
        return self.dir / "leases" / f"{sandbox_id}.policy"

    def applied(self, sandbox_id: str) -> Policy | None:
        with contextlib.suppress(OSError, ValueError):
            return validate_policy(json.loads(self._policy_path(sandbox_id).read_text()))
        return None

    def resolution_files(
        self, policy: Policy, names: dict[str, list[str]], gateway: str | None = None
    ) -> dict[str, str]:
        """/etc/hosts (the pinned names) and /etc/resolv.conf for the sandbox: allowlisted
        sandboxes resolve only the pinned names; with all egress they get the node's own
        (non-loopback) nameservers."""
        hosts = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        if policy.hangar and gateway:
            hosts.append(f"{gateway}\t{HANGAR_HOST}")
        hosts += [f"{addrs[0]}\t{name}" for name, addrs in sorted(names.items()) if addrs]
        servers = self.nameservers if policy.egress == "all" else []
        resolv = (
            "".join(f"nameserver {s}\n" for s in servers) or "# no DNS: names allowed are in /etc/hosts\n"
        )
        return {"/etc/hosts": "\n".join(hosts) + "\n", "/etc/resolv.conf": resolv}

    def teardown(self, sandbox_id: str, release: bool = True) -> None:
        """Remove the namespace, the veth and the sandbox's rules; ``release``: its addresses
        and every record of it too."""
        lease = self.lease_of(sandbox_id)
        chain = self.chain_of(sandbox_id)
        if lease is not None:
            self._delete_links(lease)
            self._unhook(lease, chain)
        else:
            _run(["nft", "delete", "chain", "inet", self.names.table, chain], check=False)
        if release:
            for suffix in RECORDS:
                (self.dir / "leases" / f"{sandbox_id}{suffix}").unlink(missing_ok=True)

    def _unhook(self, lease: Lease, chain: str) -> None:
        """The sandbox's rules out of its table: its interface's jump, its gateway access, its chain."""
        _run(
            ["nft", "delete", "element", "inet", lease.table, "by_iface", f'{{ "{lease.veth}" }}'],
            check=False,
        )
        if self.gateway_port:
            _run(["nft", "delete", "element", "inet", lease.table, ACCESS_SET,
                  f'{{ "{lease.veth}" . {self.gateway_port} }}'], check=False)  # fmt: skip
        _run(["nft", "delete", "chain", "inet", lease.table, chain], check=False)

    def _delete_links(self, lease: Lease) -> None:
        if os.path.exists(f"/sys/class/net/{lease.veth}"):
            _run(["ip", "link", "delete", lease.veth], check=False)
        if os.path.exists(lease.netns_path):
            _run(["ip", "netns", "delete", lease.netns], check=False)

    def refresh(self, sandbox_id: str) -> dict[str, list[str]] | None:
        """Re-resolve the names of the policy in force and re-apply it if an answer changed;
        returns the new pinned names then, else None."""
        policy = self.applied(sandbox_id)
        if (
            policy is None
            or policy.egress != "allowlist"
            or not any(parse_allow(a).host for a in policy.allow)
        ):
            return None
        stamp = self.dir / "leases" / f"{sandbox_id}.names"
        _, names = self._resolved(policy)
        now = json.dumps(names, sort_keys=True)
        with contextlib.suppress(OSError):
            if stamp.read_text() == now:
                return None
        names = self.apply(sandbox_id, policy)
        stamp.write_text(now)
        return names

    # -- what is left behind ------------------------------------------------------------------

    def leftovers(self, live: set[str]) -> list[str]:
        """Sandbox ids with a record, namespace or chain of this node that are not ``live``
        (only this node's: another node on the machine has names of its own)."""
        found: set[str] = set()
        for p in (self.dir / "leases").glob("*"):
            for suffix in RECORDS:
                if p.name.endswith(suffix):
                    found.add(p.name[: -len(suffix)])
        proc = _run(["ip", "netns", "list"], check=False)
        prefix = self.netns_prefix
        for line in proc.stdout.splitlines():
            name = line.split()[0] if line.split() else ""
            if name.startswith(prefix):
                found.add(name[len(prefix) :])
        proc = _run(["nft", "list", "table", "inet", self.names.table], check=False)
        for line in proc.stdout.splitlines():
            line = line.strip()
            if line.startswith(f"chain {self.chain_prefix}"):
                found.add(line.split()[1][len(self.chain_prefix) :])
        return sorted(found - live)

    def cleanup(self, sandbox_id: str) -> None:
        """Everything of a sandbox that is gone: its links and rules (by the names it would
        have when no lease is left to say them) and its records."""
        if self.lease_of(sandbox_id) is None:
            netns, veth = self._link_names(sandbox_id)
            lease = Lease(0, netns, veth, "", "", table=self.names.table)
            self._delete_links(lease)
            self._unhook(lease, self.chain_of(sandbox_id))
        self.teardown(sandbox_id)


def _resolve(host: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return sorted({str(i[4][0]) for i in infos})  # AF_INET: always the address as a string


def _host_nameservers() -> list[str]:
    out = []
    with contextlib.suppress(OSError):
        for line in Path("/etc/resolv.conf").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver":
                with contextlib.suppress(ValueError):
                    addr = ipaddress.ip_address(parts[1])
                    if addr.version == 4 and not addr.is_loopback:
                        out.append(parts[1])
    return out
