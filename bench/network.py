#!/usr/bin/env python3
"""Networking's costs, in one run against a `hangar up` of its own:

(a) time to create a sandbox and run `echo ok` in it, with egress (its own network namespace,
    veth, nftables chain) and without, interleaved;
(b) a trivial web server in a sandbox (busybox httpd, a 2-byte file) through its preview URL,
    against the same server through the agent's tunnel alone (what the proxy adds is the rest):
    median latency of sequential requests, and requests per second with 8 clients at once.

Prints a table and writes JSON (default bench/results/network.json). Needs root, runsc and nft.
"""

from __future__ import annotations

import argparse
import http.client
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _common import client, start_hangar, stop_hangar, summary, write_results  # noqa: E402

from runtime.launchers.agent.client import AgentClient  # noqa: E402

SPEC = {"image": "busybox", "cpu": 0.5, "memory_mb": 256}


def create_and_exec(api, body: dict) -> float:
    t0 = time.perf_counter()
    r = api.post("/sandboxes", json=body)
    r.raise_for_status()
    sb = r.json()
    out = api.post(f"/sandboxes/{sb['id']}/exec", json={"cmd": "echo ok"}).json()
    elapsed = time.perf_counter() - t0
    if sb["status"] != "running" or out["stdout"] != "ok\n":
        raise RuntimeError(f"sandbox did not come up: {sb.get('status_reason')} {out}")
    api.delete(f"/sandboxes/{sb['id']}")
    return elapsed


class PreviewConn:
    """Keep-alive HTTP/1.1 to the Hangar server, with the preview's Host."""

    def __init__(self, port: int, host: str) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.host = host

    def get(self) -> bytes:
        self.conn.request("GET", "/x", headers={"Host": self.host})
        r = self.conn.getresponse()
        body = r.read()
        if r.status != 200:
            raise RuntimeError(f"preview answered {r.status}: {body[:200]!r}")
        return body


class TunnelConn:
    """One agent tunnel per request (as the proxy opens), HTTP/1.0 over it: the path without
    Hangar's HTTP layer."""

    def __init__(self, socket_path: str) -> None:
        self.client = AgentClient(socket_path)

    def get(self) -> bytes:
        with self.client.tunnel(8000, io_timeout=30) as s:
            s.sendall(b"GET /x HTTP/1.0\r\nHost: bench\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        if b" 200 " not in data.split(b"\r\n", 1)[0]:
            raise RuntimeError(f"tunnel answered {data[:200]!r}")
        return data


def latency(make, n: int) -> list[float]:
    conn = make()
    conn.get()  # warm
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        conn.get()
        out.append(time.perf_counter() - t0)
    return out


def throughput(make, clients: int, seconds: float) -> float:
    done = [0] * clients
    stop = time.monotonic() + seconds

    def run(i: int) -> None:
        conn = make()
        while time.monotonic() < stop:
            conn.get()
            done[i] += 1

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - t0)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", type=int, default=10, help="sandboxes created each way")
    parser.add_argument("--requests", type=int, default=300, help="sequential requests per path")
    parser.add_argument("--seconds", type=float, default=5.0, help="throughput run per path")
    parser.add_argument("--port", type=int, default=8769)
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "network.json"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hangar-bench-"))
    hangar = None
    plain: list[float] = []
    networked: list[float] = []
    try:
        hangar = start_hangar(work / "data", args.port)
        with client(hangar.url, hangar.token) as api:
            create_and_exec(api, SPEC)  # warm the image's page cache
            for _ in range(args.n):
                plain.append(create_and_exec(api, SPEC))
                networked.append(create_and_exec(api, {**SPEC, "network": {"egress": "all"}}))

            sb = api.post("/sandboxes", json={**SPEC, "ports": [{"port": 8000, "public": True}]}).json()
            api.put(f"/sandboxes/{sb['id']}/files", params={"path": "/www/x"}, content=b"ok")
            api.post(f"/sandboxes/{sb['id']}/exec", json={"cmd": "httpd -f -p 127.0.0.1:8000 -h /www",
                                                          "background": True})  # fmt: skip
            time.sleep(0.5)
            sock = str(work / "data" / "runtime" / "gvisor" / "sandboxes" / sb["id"] / "run" / "agent.sock")
            host = f"8000-{sb['id']}.localhost"

            def via_preview() -> PreviewConn:
                return PreviewConn(args.port, host)

            def via_tunnel() -> TunnelConn:
                return TunnelConn(sock)

            lat = {
                "preview": latency(via_preview, args.requests),
                "tunnel": latency(via_tunnel, args.requests),
            }
            rps = {
                "preview": throughput(via_preview, 8, args.seconds),
                "tunnel": throughput(via_tunnel, 8, args.seconds),
            }
    finally:
        stop_hangar(hangar, work)

    added = statistics.median(networked) - statistics.median(plain)
    proxy_ms = (statistics.median(lat["preview"]) - statistics.median(lat["tunnel"])) * 1000
    results = {
        "cpus": os.cpu_count(), "create_exec_no_network": summary(plain), "create_exec_egress_all": summary(networked),
        "network_adds_s": added, "latency_preview": summary(lat["preview"]), "latency_tunnel": summary(lat["tunnel"]),
        "rps_preview": rps["preview"], "rps_tunnel": rps["tunnel"], "proxy_adds_ms": proxy_ms,
        "proxy_keeps_fraction": rps["preview"] / rps["tunnel"],
    }  # fmt: skip
    print()
    print("| measure | median | p95 | n |")
    print("| --- | --- | --- | --- |")
    for name, values in (("create + exec, no network", plain), ("create + exec, egress all", networked),
                         ("GET through the preview URL", lat["preview"]),
                         ("GET through the agent tunnel alone", lat["tunnel"])):  # fmt: skip
        s = summary(values)
        print(f"| {name} | {s['median_s'] * 1000:.1f} ms | {s['p95_s'] * 1000:.1f} ms | {s['n']} |")
    print(f"\nnetworking adds {added * 1000:.1f} ms to create + exec (target ≤ 50 ms)")
    print(f"the preview proxy adds {proxy_ms:.2f} ms median (target ≤ 2 ms); "
          f"{rps['preview']:.0f} req/s through it vs {rps['tunnel']:.0f} through the tunnel alone "
          f"({rps['preview'] / rps['tunnel'] * 100:.0f}%, target ≥ 50%), 8 clients")  # fmt: skip
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
