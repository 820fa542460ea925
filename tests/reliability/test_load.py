"""Load, against the real stack (daphne, a Celery worker, the stream bridge, runsc sandboxes):
100 sandboxes running at once on this 2-core machine, then two rounds in which 50 locust
clients send 1,000 mixed API calls (exec, files written, read and listed, sandboxes listed and
got; ``load_locustfile.py``) while 20 terminals stream over their websockets. Every call is
answered rightly, every terminal keeps echoing during the rounds (p95 and worst bounded), every
sandbox is still running at the end, and no Hangar process grows over the second round."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from tests.support import MiB, RssWatch, requires_runsc, rss_bytes, wait_until

# CI installs the test extra, locust with it: there a missing locust fails (in the test); a
# venv older than the extra skips.
HAS_LOCUST = importlib.util.find_spec("locust") is not None
pytestmark = [
    requires_runsc,
    pytest.mark.slow,
    pytest.mark.skipif(
        not HAS_LOCUST and not os.environ.get("CI"), reason="needs locust (the test extra): make install"
    ),
]

SANDBOXES = 100
TEAMS = 10  # the sandboxes and clients are spread over teams, as on a shared install
CLIENTS = 50
CALLS = 1000
TERMINALS = 20
ROUNDS = 2
# What a Hangar process may grow by over the second round, which does the first one's work
# again: more is memory kept per call (a leak), not the first round's warm-up.
GROWTH_BOUND = 8 * MiB
# A terminal command's echo (200 lines and a marker) while the clients saturate the API: its
# output goes through the server's channel-layer queue, which must keep draining under the load.
# Read one message at a time it did not: the command in flight waited for the whole round (p95
# 10.7-11.5 s in rounds of ~11 s, so 0.95-1.05 of the round); read in batches, p95 2.0-2.7 s
# in the same rounds (0.2-0.25), and 8.5-9.2 s on a day this machine ran ~4x slower (API p50
# 1.9 s, so rounds of ~40 s: about 0.23; docs/reliability.md). So the bound is a share of the round's own length
# (its calls over their rate), whatever the machine's speed that day: the stall breaks it, a
# busy machine does not. A command's worst may not outlast the round (nor 15 s, on a fast day).
ECHO_P95_ROUND_SHARE = 0.5
ECHO_WORST_FLOOR_S = 15.0
LOCUSTFILE = Path(__file__).with_name("load_locustfile.py")


def _owner(n: int) -> str:
    from django.contrib.auth import get_user_model

    from runtime.models import Membership, Team
    from runtime.services.auth import token_create

    user = get_user_model().objects.create_user(username=f"load{n}", password="pw")
    team = Team.objects.create(name=f"load{n}")
    Membership.objects.create(user=user, team=team, role=Membership.Role.OWNER)
    return token_create(user=user, team=team).raw


def _create(server: str, token: str) -> tuple[dict[str, Any], float]:
    started = time.monotonic()
    r = httpx.post(
        f"{server}/api/v1/sandboxes", headers={"Authorization": f"Bearer {token}"}, timeout=180,
        json={"image": "busybox", "cpu": 0.1, "memory_mb": 128, "timeout_s": 1800},
    )  # fmt: skip
    assert r.status_code == 201, r.text
    return r.json(), time.monotonic() - started


def _terminal_streams(
    server: str, token: str, terminal: dict[str, Any], name: str, stop: threading.Event
) -> list[float]:
    """Attach to the terminal and, until ``stop``, have it print 200 lines and a marker the shell
    computes (so the typed line's echo cannot pass for it), reading until each marker: the
    seconds each took. Raises if a marker does not come within 60 s."""
    url = server.replace("http://", "ws://") + terminal["websocket"]
    took: list[float] = []
    with connect(url, additional_headers={"Authorization": f"Bearer {token}"}, open_timeout=30) as ws:
        seen = bytearray()
        while not stop.is_set() or not took:
            started = time.monotonic()
            marker = f"{name}-{len(took)}"
            ws.send(f"seq 1 200; echo {marker}-$((6 * 7))\n".encode())
            want = f"{marker}-42".encode()
            while want not in seen:
                msg = ws.recv(timeout=max(0.01, started + 60 - time.monotonic()))
                seen += msg if isinstance(msg, bytes) else msg.encode()
            del seen[: seen.index(want) + len(want)]
            took.append(time.monotonic() - started)
    return took


def _locust(server: str, plan: Path) -> subprocess.CompletedProcess[str]:
    argv = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", server,
        "-u", str(CLIENTS), "-r", str(CLIENTS), "--run-time", "240s", "--stop-timeout", "30",
        "--only-summary", "--loglevel", "WARNING",
    ]  # fmt: skip
    env = {**os.environ, "HANGAR_LOAD_PLAN": str(plan)}
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)


def _delete_all(server: str, tokens: list[str]) -> float:
    """Delete every sandbox of the teams through the API (ten at a time) and wait until each is
    ``deleted``: the seconds it took. (The test node's own clean-up destroys what is left one at
    a time, minutes for a hundred.)"""
    started = time.monotonic()

    def delete(token: str, sandbox: str) -> None:
        r = httpx.delete(
            f"{server}/api/v1/sandboxes/{sandbox}", headers={"Authorization": f"Bearer {token}"}, timeout=60
        )
        assert r.status_code == 204, r.text

    def alive(token: str) -> list[str]:
        r = httpx.get(f"{server}/api/v1/sandboxes", headers={"Authorization": f"Bearer {token}"}, timeout=60)
        return [s["id"] for s in r.json()]

    with ThreadPoolExecutor(10) as pool:
        list(pool.map(lambda ts: delete(*ts), [(t, s) for t in tokens for s in alive(t)]))
    wait_until(lambda: not any(alive(t) for t in tokens), 180, interval=1, what="every sandbox deleted")
    return time.monotonic() - started


@pytest.mark.timeout(600)
def test_a_hundred_sandboxes_fifty_clients_and_twenty_terminals_without_an_error_or_growth(
    server_process, celery_worker, bridge, local_node, tmp_path, report
):
    assert HAS_LOCUST, "locust is not installed: it is in the test extra (make install)"
    server = server_process.url
    tokens = [_owner(n) for n in range(TEAMS)]
    try:
        _run(server, tokens, server_process, celery_worker, bridge, tmp_path, report)
    finally:
        took = _delete_all(server, tokens)
    report.held(
        "load", f"{SANDBOXES} sandboxes deleted through the API (10 at a time)", total_s=round(took, 1)
    )


def _run(
    server: str, tokens: list[str], server_process, celery_worker, bridge, tmp_path: Path, report
) -> None:

    # 100 sandboxes, created through the API ten at a time, every one running.
    started = time.monotonic()
    with ThreadPoolExecutor(10) as pool:
        created = list(pool.map(lambda n: _create(server, tokens[n % TEAMS]), range(SANDBOXES)))
    took = time.monotonic() - started
    statuses = [sb["status"] for sb, _ in created]
    assert statuses == ["running"] * SANDBOXES, statuses
    sandboxes: dict[str, list[str]] = {t: [] for t in tokens}
    for n, (sb, _) in enumerate(created):
        sandboxes[tokens[n % TEAMS]].append(sb["id"])
    waits = sorted(s for _, s in created)
    report.held(
        "load", f"{SANDBOXES} sandboxes created through the API (10 at a time) and running at once",
        sandboxes=SANDBOXES, total_s=round(took, 1), create_p50_s=round(waits[len(waits) // 2], 2),
        create_p95_s=round(waits[int(len(waits) * 0.95)], 2),
    )  # fmt: skip

    # 20 terminals, each on a sandbox of its own, opened once: each round attaches to all of them.
    terminals = []
    for n in range(TERMINALS):
        token = tokens[n % TEAMS]
        sandbox = sandboxes[token][n // TEAMS]
        with httpx.Client(base_url=f"{server}/api/v1", headers={"Authorization": f"Bearer {token}"}) as api:
            r = api.post(f"/sandboxes/{sandbox}/terminals", json={"name": f"load-{n}"}, timeout=60)
        assert r.status_code == 201, r.text
        terminals.append((token, r.json()))

    teams = [{"token": t, "sandboxes": sandboxes[t]} for t in tokens]
    processes = {"server": server_process.pid, "worker": celery_worker.pid, "bridge": bridge.pid}
    after: list[dict[str, int]] = []
    echo_bounds: list[tuple[int, float, float]] = []
    for round_ in range(1, ROUNDS + 1):
        out, plan = tmp_path / f"round{round_}.json", tmp_path / f"plan{round_}.json"
        plan.write_text(json.dumps({"calls": CALLS, "out": str(out), "teams": teams}))
        stop = threading.Event()
        with RssWatch(server_process.pid, interval=0.1) as watch, ThreadPoolExecutor(TERMINALS) as pool:
            streams = [
                pool.submit(_terminal_streams, server, token, term, f"R{round_}T{n}", stop)
                for n, (token, term) in enumerate(terminals)
            ]
            try:
                locust = _locust(server, plan)
            finally:
                stop.set()
            # Each raises if one of its markers never came.
            echoes = [s.result() for s in streams]
        print(locust.stdout[-20000:], locust.stderr[-20000:])
        assert locust.returncode == 0, f"locust failed (exit {locust.returncode}): its output is above"
        figures = json.loads(out.read_text())
        total = figures["total"]
        assert total["calls"] == CALLS, total
        assert total["failures"] == 0 and not figures["errors"], figures["errors"]
        endpoints = "; ".join(
            f"{name} ×{f['calls']} {f['p50_ms']}/{f['p95_ms']}/{f['p99_ms']}"
            for name, f in figures["endpoints"].items()
        )
        assert len(echoes) == TERMINALS and all(echoes)
        echo_s = sorted(t for e in echoes for t in e)
        echo_p95 = echo_s[int(len(echo_s) * 0.95)]
        round_s = total["calls"] / total["rps"]  # locust's rate: calls over the first to the last
        echo_bounds.append((round_, round_s, echo_p95, echo_s[-1]))
        print(f"round {round_}, each terminal's commands (s):", [[round(t, 2) for t in e] for e in echoes])
        time.sleep(2)  # let the last answers' buffers go before reading the processes' memory
        after.append({name: rss_bytes(pid) for name, pid in processes.items()})
        report.held(
            "load", f"round {round_}: {CALLS} mixed API calls from {CLIENTS} clients (locust) "
            f"and {TERMINALS} terminals streaming at once, on {SANDBOXES} running sandboxes",
            calls=CALLS, errors=0, rps=total["rps"],
            p50_ms=total["p50_ms"], p95_ms=total["p95_ms"], p99_ms=total["p99_ms"], max_ms=total["max_ms"],
            endpoints_p50_p95_p99_ms=endpoints, terminals_echoed=TERMINALS, terminal_commands=len(echo_s),
            terminal_echo_p50_s=round(echo_s[len(echo_s) // 2], 2), terminal_echo_p95_s=round(echo_p95, 2),
            terminal_echo_max_s=round(echo_s[-1], 2), round_s=round(round_s, 1),
            server_rss_mb=round(after[-1]["server"] / MiB, 1), server_peak_rss_mb=round(watch.peak / MiB, 1),
        )  # fmt: skip

    # Every terminal kept streaming through each round, not only in the end.
    for round_, round_s, p95, worst in echo_bounds:
        p95_bound, worst_bound = ECHO_P95_ROUND_SHARE * round_s, max(ECHO_WORST_FLOOR_S, round_s)
        assert p95 <= p95_bound and worst <= worst_bound, (
            f"round {round_} ({round_s:.1f} s): terminal commands echoed in p95 {p95:.2f} s, worst "
            f"{worst:.2f} s (bounds {p95_bound:.1f} s, half the round, and {worst_bound:.1f} s)"
        )

    # Every sandbox is still running after the load.
    for token in tokens:
        r = httpx.get(f"{server}/api/v1/sandboxes", headers={"Authorization": f"Bearer {token}"}, timeout=60)
        assert r.status_code == 200, r.text
        assert {(s["id"], s["status"]) for s in r.json()} == {(s, "running") for s in sandboxes[token]}

    growth = {name: after[-1][name] - after[0][name] for name in processes}
    print("RSS after each round (MB):", [{k: round(v / MiB, 1) for k, v in a.items()} for a in after])
    for name, grew in growth.items():
        assert grew < GROWTH_BOUND, f"the {name} grew {grew / MiB:.1f} MB over round 2: {after}"
    report.held(
        "load", f"no Hangar process grew over round 2 (bound {GROWTH_BOUND // MiB} MB)",
        **{f"{name}_growth_mb": round(grew / MiB, 1) for name, grew in growth.items()},
        **{f"{name}_rss_mb": round(after[-1][name] / MiB, 1) for name in processes},
    )  # fmt: skip
