#!/usr/bin/env python3
"""The dashboard's live paths, end to end through daphne, the channel layer, the node's stream
bridge, the sandbox's agent and a gVisor PTY:

(a) keystroke echo: one key at a time into a terminal running `cat >/dev/null` (so the
    terminal's own echo answers), time from sending the key to its echo arriving; every
    100th key is Enter;
(b) terminal throughput: `cat` of a file of --mb megabytes in the terminal, read through the
    websocket with flow control on (`?flow=1`, every frame acknowledged as xterm.js does);
(c) Ctrl-C while `yes` floods a terminal (read and acknowledged as xterm.js does): time until
    the prompt is back;
(d) pages with 1,000 sandboxes in the team: the sandboxes list (first and a later page), a
    sandbox's page and the overview, signed in as the admin.

Starts its own `hangar up` on the embedded default in a temporary data dir. Prints a table and
writes JSON (default bench/results/dashboard.json). Needs root and runsc.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import websockets

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _common import client, pct, start_hangar, stop_hangar, write_results  # noqa: E402

PROMPT = b"BENCH$ "


class Terminal:
    """A websocket viewer of one terminal that collects output (and acknowledges it)."""

    def __init__(self, ws: websockets.ClientConnection, flow: bool) -> None:
        self.ws = ws
        self.flow = flow
        self.buf = bytearray()
        self.total = 0

    async def until(self, needle: bytes, timeout: float = 60.0) -> None:
        try:
            await asyncio.wait_for(self._until(needle), timeout)
        except TimeoutError:
            if needle == b"never":
                raise
            raise RuntimeError(
                f"{needle!r} did not come within {timeout} s; last: {bytes(self.buf[-200:])!r}"
            ) from None

    async def _until(self, needle: bytes) -> None:
        if True:
            while needle not in self.buf:
                msg = await self.ws.recv()
                if isinstance(msg, str):
                    continue  # control messages (pong, exit)
                self.total += len(msg)
                self.buf += msg
                if len(self.buf) > 1 << 16:
                    del self.buf[: -(1 << 12)]
                if self.flow:
                    await self.ws.send(json.dumps({"type": "ack", "bytes": len(msg)}))
        self.buf.clear()


def ms(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "median_ms": statistics.median(values) * 1000,
        "p99_ms": pct(values, 99) * 1000,
        "max_ms": max(values) * 1000,
    }


async def keystroke_echo(ws_url: str, token: str, n: int) -> list[float]:
    headers = {"Authorization": f"Bearer {token}"}
    async with websockets.connect(ws_url, additional_headers=headers, max_size=None) as ws:
        term = Terminal(ws, flow=False)
        await term.until(PROMPT)
        await ws.send(b"cat >/dev/null\n")
        await term.until(b"cat >/dev/null\r\n")
        await asyncio.sleep(0.5)  # cat is reading: from here on the terminal echoes each key
        times = []
        for i in range(n):
            key, echo = (b"\n", b"\r\n") if i % 100 == 99 else (b"x", b"x")
            start = time.perf_counter()
            await ws.send(key)
            await term.until(echo, timeout=10)
            times.append(time.perf_counter() - start)
        await ws.send(b"\x03")  # ^C: cat ends
        await term.until(PROMPT)
    return times


async def ctrl_c_under_flood(ws_url: str, token: str, rounds: int) -> list[float]:
    """`yes` flat out for a second, read and acknowledged like a browser; then ^C: time until
    the prompt is back."""
    headers = {"Authorization": f"Bearer {token}"}
    times = []
    async with websockets.connect(f"{ws_url}?flow=1", additional_headers=headers, max_size=None) as ws:
        term = Terminal(ws, flow=True)
        await ws.send(b"\n")
        await term.until(PROMPT)
        for _ in range(rounds):
            await ws.send(b"yes\n")
            await term.until(b"y\r\n" * 100)
            try:
                await asyncio.wait_for(term.until(b"never"), 1.0)  # read flat out for a second
            except TimeoutError:
                pass
            start = time.perf_counter()
            await ws.send(b"\x03")
            await term.until(PROMPT, timeout=30)
            times.append(time.perf_counter() - start)
    return times


async def cat_throughput(ws_url: str, token: str, size: int) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {token}"}
    async with websockets.connect(f"{ws_url}?flow=1", additional_headers=headers, max_size=None) as ws:
        term = Terminal(ws, flow=True)
        await term.until(PROMPT)
        await ws.send(b"cat /tmp/big; echo END-$((40+2))\n")
        await term.until(b"cat /tmp/big")
        start, before = time.perf_counter(), term.total
        await term.until(b"END-42", timeout=3600)
        elapsed = time.perf_counter() - start
        received = term.total - before
    return {
        "file_bytes": size,
        "received_bytes": received,
        "seconds": elapsed,
        "mb_per_s": size / elapsed / 1e6,
    }


def seed_sandboxes(data_dir: Path, admin: str, count: int) -> None:
    """``count`` stopped sandboxes in the admin's team, written straight into the database
    (starting 1,000 real ones is another benchmark: this one times the pages)."""
    code = f"""
import django
django.setup()
from django.contrib.auth import get_user_model
from runtime.models import Membership, Sandbox
user = get_user_model().objects.get(username={admin!r})
team = Membership.objects.filter(user=user).first().team
Sandbox.objects.bulk_create([
    Sandbox(team=team, created_by=user, image="busybox", image_digest="sha256:bench", status="stopped",
            status_reason="seeded by bench/dashboard.py")
    for _ in range({count})
])
"""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(HANGAR_DATA_DIR=str(data_dir), DJANGO_SETTINGS_MODULE="dashboard.settings")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True)


def page_times(url: str, admin: str, password: str, sandbox_id: str, n: int) -> dict[str, dict[str, float]]:
    with httpx.Client(base_url=url, timeout=60, follow_redirects=False) as web:
        web.get("/login/")
        r = web.post(
            "/login/",
            data={"username": admin, "password": password, "csrfmiddlewaretoken": web.cookies["csrftoken"]},
            headers={"Referer": f"{url}/login/"},
        )
        if r.status_code != 302:
            raise RuntimeError(f"sign-in failed: {r.status_code}")
        results = {}
        for name, path in [
            ("sandboxes list", "/sandboxes/"),
            ("sandboxes list, page 10", "/sandboxes/?page=10"),
            ("sandboxes list, running only", "/sandboxes/?status=running"),
            ("sandbox page (terminal tab)", f"/sandboxes/{sandbox_id}/"),
            ("sandbox page, commands tab", f"/sandboxes/{sandbox_id}/?tab=commands"),
            ("overview", "/"),
        ]:
            times = []
            for _ in range(n):
                start = time.perf_counter()
                r = web.get(path)
                times.append(time.perf_counter() - start)
                if r.status_code != 200:
                    raise RuntimeError(f"GET {path}: {r.status_code}")
            results[name] = ms(times)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--sandboxes", type=int, default=1000)
    parser.add_argument("--page-n", type=int, default=30)
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "dashboard.json"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hangar-bench-"))
    hangar = None
    results: dict[str, object] = {"cpus": os.cpu_count()}
    try:
        hangar = start_hangar(work / "data", args.port)
        ws_base = hangar.url.replace("http://", "ws://")
        with client(hangar.url, hangar.token) as api:
            sb = api.post("/sandboxes", json={"image": "busybox", "memory_mb": 512, "timeout_s": 3600}).json()
            if sb.get("status") != "running":
                raise RuntimeError(f"create failed: {sb}")
            term = api.post(f"/sandboxes/{sb['id']}/terminals", json={"env": {"PS1": PROMPT.decode()}}).json()
            ws_url = f"{ws_base}{term['websocket']}"

            print(f"keystroke echo: {args.keys} keys…", flush=True)
            keys = asyncio.run(keystroke_echo(ws_url, hangar.token, args.keys))
            results["keystroke_echo"] = ms(keys)

            print("Ctrl-C under `yes`: 10 rounds…", flush=True)
            results["ctrl_c_prompt_back"] = ms(asyncio.run(ctrl_c_under_flood(ws_url, hangar.token, 10)))

            size = args.mb * 1_000_000
            line = "0123456789abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqrstuvwxyzABCDEFG"
            made = api.post(
                f"/sandboxes/{sb['id']}/exec",
                json={"cmd": f"yes {line} | head -c {size} > /tmp/big && wc -c < /tmp/big", "timeout_s": 600},
            ).json()
            if made.get("stdout", "").strip() != str(size):
                raise RuntimeError(f"could not make the file: {made}")
            print(f"terminal throughput: cat of {args.mb} MB…", flush=True)
            term2 = api.post(
                f"/sandboxes/{sb['id']}/terminals", json={"env": {"PS1": PROMPT.decode()}}
            ).json()
            results["cat_throughput"] = asyncio.run(
                cat_throughput(f"{ws_base}{term2['websocket']}", hangar.token, size)
            )

            print(f"pages with {args.sandboxes} sandboxes…", flush=True)
            seed_sandboxes(work / "data", hangar.admin, args.sandboxes)
            results["pages"] = page_times(hangar.url, hangar.admin, hangar.password, sb["id"], args.page_n)
            results["pages_sandboxes"] = args.sandboxes + 1
            api.delete(f"/sandboxes/{sb['id']}")
    finally:
        stop_hangar(hangar, work)

    k = results["keystroke_echo"]
    c = results["cat_throughput"]
    print()
    print(f"{'measure':<44} {'median':>10} {'p99':>10} {'max':>10}")
    print(
        f"{'keystroke echo (ms), n=' + str(k['n']):<44} {k['median_ms']:>10.2f} {k['p99_ms']:>10.2f} {k['max_ms']:>10.2f}"
    )
    c2 = results["ctrl_c_prompt_back"]
    label = f"Ctrl-C under yes: prompt back (ms), n={c2['n']}"
    print(f"{label:<44} {c2['median_ms']:>10.2f} {c2['p99_ms']:>10.2f} {c2['max_ms']:>10.2f}")
    for name, t in results["pages"].items():
        label = f"{name} (ms)"
        print(f"{label:<44} {t['median_ms']:>10.2f} {t['p99_ms']:>10.2f} {t['max_ms']:>10.2f}")
    print(
        f"cat {c['file_bytes'] / 1e6:.0f} MB in a terminal: {c['seconds']:.1f} s, {c['mb_per_s']:.2f} MB/s"
        f" ({c['received_bytes']} bytes on the websocket)"
    )
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
