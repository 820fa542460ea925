"""Neighbours: two Hangars on one host (a developer's `hangar up` beside the test suite's, or
several nodes on one machine), each the real `hangar up` on its own Postgres, Redis and data
disk (tests/reliability/stack.py), under load side by side. What one does to its own sandboxes,
its network and its host state (creates, deletes, a SIGKILL of everything and the start-up
reconcile that follows) never touches the other's: the other's load sees no error, its
long-lived sandboxes (one on each runtime the machine has: gVisor, and the microVM where QEMU
and its guest kernel are installed) keep their processes and files, their address pools are
disjoint and none of one's sandboxes can reach the other's."""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import itertools
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from runtime.launchers.microvm import boot
from tests.reliability.stack import Stack, host_resources
from tests.support import requires_runsc

pytestmark = [requires_runsc, pytest.mark.slow, pytest.mark.timeout(900)]

# The residents' runtimes: every one this machine has (the load itself runs on gVisor).
RUNTIMES = ["gvisor"] + (["microvm"] if boot.missing() is None else [])
RESIDENT = {"gvisor": {}, "microvm": {"memory_mb": 256}}
LOAD_S = 45.0  # each stack's load runs this long; A is SIGKILLed and started again within it
WORKERS = 2  # concurrent clients per stack


@pytest.fixture(scope="module")
def stacks(tmp_path_factory) -> Iterator[tuple[Stack, Stack]]:
    a = Stack(tmp_path_factory.mktemp("neighbour-a"), disk_mb=640, name="na")
    b = Stack(tmp_path_factory.mktemp("neighbour-b"), disk_mb=640, name="nb")
    try:
        for s in (a, b):
            s.mount_data_disk()
            s.start_postgres()
            s.start_redis()
            s.bootstrap()
            s.start()
        yield a, b
    finally:
        for s in (a, b):
            s.close()


def create(api: httpx.Client, **extra) -> dict:
    r = api.post(
        "/sandboxes", json={"image": "busybox", "memory_mb": 128, "timeout_s": 900, **extra}, timeout=180
    )
    assert r.status_code == 201, r.text
    return r.json()


def sh(api: httpx.Client, sandbox_id: str, cmd: str) -> dict:
    r = api.post(f"/sandboxes/{sandbox_id}/exec", json={"cmd": cmd}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def background(api: httpx.Client, sandbox_id: str, cmd: str) -> int:
    """Start ``cmd`` as a background process of the sandbox: its pid there."""
    r = api.post(f"/sandboxes/{sandbox_id}/exec", json={"cmd": cmd, "background": True}, timeout=60)
    assert r.status_code == 202, r.text
    return int(r.json()["pid"])


def address(api: httpx.Client, sandbox_id: str) -> ipaddress.IPv4Interface:
    out = sh(api, sandbox_id, "ip -4 -o addr show | grep -v ' lo ' | head -1")["stdout"].split()
    return ipaddress.IPv4Interface(out[3])


@dataclass
class Resident:
    id: str
    pid: int
    addr: ipaddress.IPv4Interface


@dataclass
class Load:
    """One stack's clients: create (half of them with a network), exec, a file written and read
    back, delete; every failure kept with what it was."""

    stack: Stack
    until: float
    ops: int = 0
    errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    addresses: set[ipaddress.IPv4Address] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, worker: int) -> None:
        n = 0
        with self.stack.api() as api:
            while time.monotonic() < self.until:
                n += 1
                step = "create"
                try:
                    started = time.monotonic()
                    network = {"network": {"egress": "all"}} if n % 2 else {}
                    sb = create(api, **network)
                    step = "exec"
                    got = sh(api, sb["id"], f"echo {worker}-{n}")
                    assert got["stdout"] == f"{worker}-{n}\n", got
                    if network:
                        ip = address(api, sb["id"]).ip
                        with self.lock:
                            self.addresses.add(ip)
                    step = "files"
                    body = f"payload {worker}-{n}".encode()
                    r = api.put(f"/sandboxes/{sb['id']}/files", params={"path": "/p.txt"}, content=body)
                    assert r.status_code in (200, 201, 204), r.text
                    r = api.get(f"/sandboxes/{sb['id']}/files", params={"path": "/p.txt"})
                    assert r.status_code == 200 and r.content == body, r.text
                    step = "delete"
                    r = api.delete(f"/sandboxes/{sb['id']}")
                    assert r.status_code in (202, 204), r.text
                    with self.lock:
                        self.ops += 1
                        self.latencies.append(time.monotonic() - started)
                except (httpx.HTTPError, AssertionError, ValueError, IndexError) as exc:
                    with self.lock:
                        self.errors.append(f"{step}: {type(exc).__name__}: {str(exc)[:200]}")
                    time.sleep(0.5)

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self.run, args=(w,), daemon=True) for w in range(WORKERS)]
        for t in threads:
            t.start()
        return threads


def _wait(check, within: float, what: str):
    deadline = time.monotonic() + within
    last: object = None
    while time.monotonic() < deadline:
        try:
            out = check()
            if out:
                return out
        except (httpx.HTTPError, AssertionError, ValueError) as exc:
            last = exc
        time.sleep(0.5)
    raise AssertionError(f"{what} not within {within} s: {last!r}")


def _residents(api: httpx.Client, name: str) -> dict[str, Resident]:
    """A long-lived sandbox on each runtime, with a network, a process of its own and a file."""
    out = {}
    for runtime in RUNTIMES:
        sb = create(api, network={"egress": "all"}, runtime=runtime, **RESIDENT[runtime])
        pid = background(api, sb["id"], "sleep 100000")  # an exec's own leftovers end with it
        api.put(f"/sandboxes/{sb['id']}/files", params={"path": "/resident.txt"}, content=name.encode())
        out[runtime] = Resident(sb["id"], pid, address(api, sb["id"]))
    return out


def _listening(api: httpx.Client, sandbox_id: str, ip: object) -> str:
    out = sh(api, sandbox_id, f"nc -w 2 {ip} 8080 </dev/null")["stdout"]
    return out if "listening" in out else ""


def _kept(api: httpx.Client, resident: Resident, content: str) -> None:
    """The resident runs, with its process and its file."""
    assert api.get(f"/sandboxes/{resident.id}").json()["status"] == "running"
    got = sh(api, resident.id, f"kill -0 {resident.pid} && cat /resident.txt")
    assert got["exit_code"] == 0 and got["stdout"] == content, got


def test_two_hangars_side_by_side_under_load_never_touch_each_other(stacks, report):
    a, b = stacks
    with a.api() as api_a, b.api() as api_b:
        res_a, res_b = _residents(api_a, "a"), _residents(api_b, "b")
        # Their pools are their own: no address range of one node (one per runtime) overlaps
        # another's, and each resident's address is in its node's pool for its runtime.
        pools = {(s, rt): stack.address_pool(rt) for s, stack in (("a", a), ("b", b)) for rt in RUNTIMES}
        for (one, net), (other, other_net) in itertools.combinations(pools.items(), 2):
            assert not net.overlaps(other_net), (one, net, other, other_net)
        for rt in RUNTIMES:
            assert res_a[rt].addr.ip in pools["a", rt] and res_b[rt].addr.ip in pools["b", rt], (rt, pools)
        # And no sandbox of A's reaches one of B's (a listener in each of B's, a connection from
        # each of A's), while B's own sandbox does.
        for rt, target in res_b.items():
            background(api_b, target.id, "nc -ll -p 8080 -e echo listening")
            ip = target.addr.ip
            own = _wait(
                functools.partial(_listening, api_b, target.id, ip),
                30,
                f"B's {rt} listener on its own address",
            )
            assert "listening" in own
            for src_rt, source in res_a.items():
                reached = sh(api_a, source.id, f"nc -w 2 {ip} 8080 </dev/null; echo rc=$?")["stdout"]
                assert "listening" not in reached, (src_rt, rt, reached)

        until = time.monotonic() + LOAD_S
        loads = {"a": Load(a, until), "b": Load(b, until)}
        threads = [t for load in loads.values() for t in load.start()]
        time.sleep(LOAD_S / 3)
        # A loses everything at once and starts again: its reconcile runs on its own state only.
        killed_at = time.monotonic()
        a.kill_everything()
        a.start()
        a_back_s = time.monotonic() - killed_at
        for t in threads:
            t.join(LOAD_S + 120)
        assert not any(t.is_alive() for t in threads), "a load client hung"

        assert loads["b"].ops >= 3, f"B's load made only {loads['b'].ops} rounds"
        assert not loads["b"].errors, (
            f"B's load failed while A was killed and started: {loads['b'].errors[:5]}"
        )
        assert loads["a"].ops >= 1, f"A's load made no round at all: {loads['a'].errors[:5]}"
        # Both pools stayed apart under load.
        assert all(ip in pools["a", "gvisor"] for ip in loads["a"].addresses), loads["a"].addresses
        assert all(ip in pools["b", "gvisor"] for ip in loads["b"].addresses), loads["b"].addresses

        # B's residents kept their processes and files through A's kill, start and reconcile.
        for resident in res_b.values():
            _kept(api_b, resident, "b")
        # A's own residents were re-adopted by its restart.
        for resident in res_a.values():
            _wait(lambda r=resident: api_a.get(f"/sandboxes/{r.id}").json()["status"] == "running", 60,
                  f"A's resident {resident.id} running")  # fmt: skip
            assert sh(api_a, resident.id, "cat /resident.txt")["stdout"] == "a"

        # A deletes everything it has: nothing of A's is left on the host, and B's is all there.
        for sb in api_a.get("/sandboxes", params={"limit": 1000}).json():
            api_a.delete(f"/sandboxes/{sb['id']}")
        _wait(lambda: not api_a.get("/sandboxes", params={"limit": 1000}).json(), 90, "A empty")
        gone = [r["id"] for r in api_a.get("/sandboxes", params={"status": "deleted", "limit": 1000}).json()]
        host = host_resources()
        leftovers = [
            f"{sid} in {kind}"
            for sid in gone
            for kind, text in host.items()
            if sid in text
            or (kind in ("interfaces", "nftables") and hashlib.sha1(sid.encode()).hexdigest()[:8] in text)
        ]
        assert not leftovers, leftovers
        for rt, resident in res_b.items():
            assert resident.id in host["processes"], f"B's {rt} resident's runtime is gone from the host"
            _kept(api_b, resident, "b")
    b_lat = sorted(loads["b"].latencies)
    report.held(
        "neighbours", "two Hangars under load; one SIGKILLed, started again and emptied beside the other",
        b_rounds=loads["b"].ops, b_errors=0, a_rounds=loads["a"].ops, a_errors_while_down=len(loads["a"].errors),
        a_back_s=round(a_back_s, 1), b_round_p50_s=round(statistics.median(b_lat), 2),
        b_round_max_s=round(b_lat[-1], 2), runtimes="+".join(RUNTIMES),
        pools=" / ".join(f"{s} {rt} {net}" for (s, rt), net in pools.items()),
    )  # fmt: skip
