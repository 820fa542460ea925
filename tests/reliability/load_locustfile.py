"""The load suite's API clients, run by locust (headless) from tests/reliability/test_load.py.

The plan is a JSON file named by ``HANGAR_LOAD_PLAN``: ``{"calls": N, "out": PATH, "teams":
[{"token", "sandboxes"}]}``; the figures are written to ``out`` as the run ends (locust's own
CSV is written on a timer and may miss the last second). Each client is one of a team's (round robin over the teams) and sends its
calls one after another, with no pause, at that team's sandboxes: a blocking exec, a file
written, a file read back, a directory listed, the team's sandboxes listed, one sandbox got.
Every answer is checked (status and content): a wrong one is a failure in locust's figures.
Exactly ``calls`` calls are sent in all; then the run ends.
"""

from __future__ import annotations

import itertools
import json
import os
import random
from pathlib import Path

import gevent
from locust import HttpUser, constant, events, task
from locust.exception import StopUser

PLAN = json.loads(Path(os.environ["HANGAR_LOAD_PLAN"]).read_text())
CALLS: int = PLAN["calls"]
_clients = itertools.count()
# Calls handed out and calls answered (gevent: one thread, so plain counters hold).
budget = {"left": CALLS, "answered": 0}


class ApiClient(HttpUser):
    wait_time = constant(0)

    def on_start(self) -> None:
        self.number = next(_clients)
        team = PLAN["teams"][self.number % len(PLAN["teams"])]
        self.client.headers["Authorization"] = f"Bearer {team['token']}"
        self.sandboxes: list[str] = team["sandboxes"]
        self.written: dict[str, tuple[str, bytes]] = {}  # sandbox: (path, content) last written
        self.serial = itertools.count()
        self.write_file()

    def take(self) -> None:
        if budget["left"] <= 0:
            raise StopUser()
        budget["left"] -= 1

    def pick(self) -> str:
        return random.choice(self.sandboxes)

    @task(4)
    def exec_command(self) -> None:
        self.take()
        n = next(self.serial)
        with self.client.post(
            f"/api/v1/sandboxes/{self.pick()}/exec", json={"cmd": f"echo $(({n} * 2))"},
            name="POST /sandboxes/{id}/exec", catch_response=True,
        ) as r:  # fmt: skip
            if r.status_code != 200:
                r.failure(f"{r.status_code}: {r.text[:300]}")
            elif (r.json()["exit_code"], r.json()["stdout"]) != (0, f"{n * 2}\n"):
                r.failure(f"wrong answer: {r.text[:300]}")

    @task(2)
    def write_file(self) -> None:
        self.take()
        sandbox, n = self.pick(), next(self.serial)
        path = f"/tmp/load-{self.number}-{n}.txt"
        content = f"client {self.number} call {n}\n".encode() * 64
        with self.client.put(
            f"/api/v1/sandboxes/{sandbox}/files", params={"path": path}, data=content,
            headers={"Content-Type": "application/octet-stream"},
            name="PUT /sandboxes/{id}/files", catch_response=True,
        ) as r:  # fmt: skip
            if r.status_code != 200 or r.json().get("size") != len(content):
                r.failure(f"{r.status_code}: {r.text[:300]}")
            else:
                self.written[sandbox] = (path, content)

    @task(2)
    def read_file(self) -> None:
        if not self.written:
            return self.write_file()
        self.take()
        sandbox, (path, content) = random.choice(list(self.written.items()))
        with self.client.get(
            f"/api/v1/sandboxes/{sandbox}/files", params={"path": path},
            name="GET /sandboxes/{id}/files", catch_response=True,
        ) as r:  # fmt: skip
            if r.status_code != 200 or r.content != content:
                r.failure(f"{r.status_code}: {r.content[:300]!r}")

    @task(1)
    def list_files(self) -> None:
        self.take()
        with self.client.get(
            f"/api/v1/sandboxes/{self.pick()}/files/list", params={"path": "/"},
            name="GET /sandboxes/{id}/files/list", catch_response=True,
        ) as r:  # fmt: skip
            if r.status_code != 200 or "bin" not in {e["name"] for e in r.json()}:
                r.failure(f"{r.status_code}: {r.text[:300]}")

    @task(1)
    def list_sandboxes(self) -> None:
        self.take()
        with self.client.get("/api/v1/sandboxes", name="GET /sandboxes", catch_response=True) as r:
            if r.status_code != 200 or {s["id"] for s in r.json()} != set(self.sandboxes):
                r.failure(f"{r.status_code}: {r.text[:300]}")

    @task(2)
    def get_sandbox(self) -> None:
        self.take()
        sandbox = self.pick()
        with self.client.get(
            f"/api/v1/sandboxes/{sandbox}", name="GET /sandboxes/{id}", catch_response=True
        ) as r:
            if r.status_code != 200 or (r.json()["id"], r.json()["status"]) != (sandbox, "running"):
                r.failure(f"{r.status_code}: {r.text[:300]}")


@events.request.add_listener
def _answered(**_: object) -> None:
    budget["answered"] += 1


@events.test_start.add_listener
def _end_after_the_last_answer(environment, **_: object) -> None:
    # A client that finds the budget spent stops; the run ends once every call is answered
    # (locust would otherwise keep the stopped clients' run going until --run-time).
    def watch() -> None:
        while budget["answered"] < CALLS:
            gevent.sleep(0.05)
        environment.runner.quit()

    gevent.spawn(watch)


@events.quitting.add_listener
def _write_figures(environment, **_: object) -> None:
    def figures(entry) -> dict[str, object]:
        return {
            "calls": entry.num_requests, "failures": entry.num_failures, "rps": round(entry.total_rps, 1),
            **{f"p{q}_ms": round(entry.get_response_time_percentile(q / 100)) for q in (50, 95, 99)},
            "max_ms": round(entry.max_response_time or 0),
        }  # fmt: skip

    stats = environment.stats
    Path(PLAN["out"]).write_text(
        json.dumps({
            "total": figures(stats.total),
            "endpoints": {name: figures(entry) for (name, _method), entry in sorted(stats.entries.items())},
            "errors": [f"{e.name}: {e.error} (x{e.occurrences})" for e in stats.errors.values()],
        }, indent=2)
    )  # fmt: skip
