#!/usr/bin/env python3
"""OTLP span ingest and the trace page, on Postgres (issue 20).

(a) Ingest: ``--exporters`` processes, each the real OpenTelemetry SDK's OTLP/HTTP protobuf
    exporter (``OTLPSpanExporter.export``, what a ``BatchSpanProcessor`` calls) sending batches
    of ``--batch`` spans back to back, GenAI-shaped (invoke_agent → chat / execute_tool, with
    attributes, events, a shared resource). The spans are made before the clock starts; what is
    timed is the exporters' encoding and posting and the server's parsing and storing. Reported:
    spans/s stored (the spans in the database over the wall time from the first send to the last
    answer), the server process's CPU and Postgres's (the bench database's backends) per 1,000
    spans, and the exporters' share of the machine's CPUs.
(b) The trace page: ``/traces/{id}/`` for a trace of ``--page-spans`` spans, its time as the
    client sees it on localhost (the server's time and a loopback round trip), and in Chromium
    (Debian's, through Playwright) the longest task while it loads and scrolls.

Targets (issue 20): (a) ≥ 20,000 spans/s with the client on the same machine; (b) ≤ 300 ms, and
no long task over 200 ms.

With ``--baseline REV`` the same is measured against that commit's code (a ``git worktree`` of
it in the temporary dir), both servers up at once on their own databases, rounds interleaved
(baseline, current, current, baseline, …). Each side is Hangar's server process alone
(``python -m dashboard.server``: what serves ``/v1/traces``; the worker, beat and bridge of a
`hangar up` are not on this path), with its own temporary data dir, an embedded Redis and a
fresh Postgres database (``--database-url``, suffixed ``_current``/``_baseline``, dropped and
made anew, migrated by that side's code). Prints a table and writes JSON (default
bench/results/traces.json).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _common import write_results  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TICK = os.sysconf("SC_CLK_TCK")


# -- the spans ---------------------------------------------------------------------------------


def make_spans(n: int, seed: int, one_trace: bool = False) -> list:
    """``n`` finished SDK spans, an agent's shape: invoke_agent, then chat and execute_tool turns
    (``one_trace``: all under one root, else a trace per 19 spans)."""
    import random

    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    kept: list = []

    class Keep(SpanExporter):
        def export(self, spans):  # type: ignore[no-untyped-def]
            kept.extend(spans)
            return SpanExportResult.SUCCESS

    provider = TracerProvider(resource=Resource.create({
        "service.name": "bench-agent", "hangar.sandbox.id": f"sbbench{seed}", "hangar.run.id": f"runbench{seed}",
        "host.name": "bench",
    }))  # fmt: skip
    provider.add_span_processor(SimpleSpanProcessor(Keep()))
    tracer = provider.get_tracer("bench.agent", "1.0")
    rnd = random.Random(seed)

    def turns(count: int) -> None:
        """``count`` spans: chat, execute_tool, chat, …"""
        for i in range(count):
            if i % 2:
                tool_call()
                continue
            with tracer.start_as_current_span("chat claude", attributes={
                "gen_ai.operation.name": "chat", "gen_ai.request.model": "claude-x",
                "gen_ai.usage.input_tokens": rnd.randint(100, 5000), "gen_ai.usage.output_tokens": rnd.randint(10, 900),
                "gen_ai.conversation.id": f"conv-{seed}",
            }):  # fmt: skip
                pass

    def tool_call() -> None:
        with tracer.start_as_current_span("execute_tool bash", attributes={
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "bash",
            "gen_ai.tool.call.arguments": '{"cmd": "pytest -q tests/test_x.py"}',
            "gen_ai.tool.call.result": "ok " * 40, "process.exit_code": rnd.choice([0, 0, 0, 1]),
        }) as tool:  # fmt: skip
            tool.add_event("output", {"bytes": rnd.randint(1, 5000)})

    root_attrs = {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "bench"}
    if one_trace:
        with tracer.start_as_current_span("invoke_agent", attributes=root_attrs):
            turns(n - 1)
    while len(kept) < n:
        with tracer.start_as_current_span("invoke_agent", attributes=root_attrs):
            turns(18)
    return kept[:n]


def _exporter_main(conn, seed: int, batch: int) -> None:  # type: ignore[no-untyped-def]
    """One exporter process: ("make", batches) makes spans; ("send", url, token) sends them."""
    import logging

    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    logging.disable(logging.WARNING)  # the exporter logs each retry
    batches: list = []
    while True:
        msg = conn.recv()
        if msg[0] == "make":
            spans = make_spans(msg[1] * batch, seed)
            seed += 1000
            batches = [spans[i : i + batch] for i in range(0, len(spans), batch)]
            conn.send("made")
        elif msg[0] == "send":
            _, url, token = msg
            exporter = OTLPSpanExporter(endpoint=f"{url}/v1/traces", headers={"Authorization": f"Bearer {token}"},
                                        timeout=60)  # fmt: skip
            conn.send("ready")
            conn.recv()  # go
            cpu, start, failed = time.process_time(), time.time(), 0
            for b in batches:
                failed += exporter.export(b) != SpanExportResult.SUCCESS
            conn.send(
                {"cpu_s": time.process_time() - cpu, "start": start, "end": time.time(), "failed": failed}
            )
            exporter.shutdown()
        else:
            return


# -- a side: one checkout's server -------------------------------------------------------------


@dataclass
class Side:
    name: str
    root: Path
    database_url: str
    data_dir: Path
    port: int
    procs: list[subprocess.Popen] = field(default_factory=list)
    token: str = ""
    password: str = ""
    server_pid: int = 0
    figures: dict[str, list[float]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HANGAR_", "DJANGO_"))}
        env.update(DATABASE_URL=self.database_url, REDIS_URL=f"unix://{self.data_dir / 'redis.sock'}?db=0",
                   HANGAR_DATA_DIR=str(self.data_dir), HANGAR_NODE_NAME=f"bench-traces-{self.name}",
                   DJANGO_SETTINGS_MODULE="dashboard.settings", PYTHONUNBUFFERED="1")  # fmt: skip
        return env

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, mode=0o700)
        _fresh_database(self.database_url)
        sock = self.data_dir / "redis.sock"
        self.procs.append(subprocess.Popen(
            ["redis-server", "--port", "0", "--unixsocket", str(sock), "--save", "", "--appendonly", "no",
             "--dir", str(self.data_dir), "--logfile", str(self.data_dir / "redis.log")],
            start_new_session=True,
        ))  # fmt: skip
        setup = (
            "import django; django.setup()\n"
            "from django.core.management import call_command; call_command('migrate', verbosity=0)\n"
            "from runtime.services.auth import bootstrap_admin, token_create\n"
            "user, team, password = bootstrap_admin()\n"
            "print(token_create(user=user, team=team, name='bench').raw, password)\n"
        )
        out = subprocess.run([sys.executable, "-c", setup], cwd=self.root, env=self.env(), check=True,
                             capture_output=True, text=True).stdout.split()  # fmt: skip
        self.token, self.password = out[-2], out[-1]
        log = open(self.data_dir / "server.log", "wb")  # noqa: SIM115 - the server's, for its life
        server = subprocess.Popen(
            [sys.executable, "-m", "dashboard.server", "-b", "127.0.0.1", "-p", str(self.port), "-v", "0",
             "dashboard.asgi:application"],
            cwd=self.root, env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.procs.append(server)
        self.server_pid = server.pid
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{self.url}/api/v1/health", timeout=2).status_code in (200, 503):
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the {self.name} server did not start: see {self.data_dir / 'server.log'}"
                )
            time.sleep(0.2)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)

    def query(self, sql: str) -> list[tuple]:
        import psycopg

        with psycopg.connect(self.database_url, autocommit=True) as conn:
            return conn.execute(sql).fetchall()


def _fresh_database(url: str, create: bool = True) -> None:
    import psycopg

    parsed = urlparse(url)
    name = parsed.path.lstrip("/")
    with psycopg.connect(parsed._replace(path="/postgres").geturl(), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if create:
            conn.execute(f'CREATE DATABASE "{name}"')


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def _postgres_cpu(side: Side) -> dict[int, float]:
    dbname = urlparse(side.database_url).path.lstrip("/")
    pids = side.query(
        f"SELECT pid FROM pg_stat_activity WHERE datname = '{dbname}' AND pid <> pg_backend_pid()"
    )
    return {pid: _cpu_s(pid) for (pid,) in pids}


# -- (a) ingest --------------------------------------------------------------------------------


def ingest_round(side: Side, workers: list, batches: int, batch: int) -> dict[str, float]:
    for conn in workers:
        conn.send(("make", batches))
    for conn in workers:
        conn.recv()
    before_rows = side.query("SELECT count(*) FROM runtime_tracespan")[0][0]
    for conn in workers:
        conn.send(("send", side.url, side.token))
    for conn in workers:
        conn.recv()
    server_cpu, pg_cpu = _cpu_s(side.server_pid), _postgres_cpu(side)
    for conn in workers:
        conn.send(("go",))
    done = [conn.recv() for conn in workers]
    server_cpu = _cpu_s(side.server_pid) - server_cpu
    pg_after = _postgres_cpu(side)
    postgres_cpu = sum(cpu - pg_cpu.get(pid, 0.0) for pid, cpu in pg_after.items())
    stored = side.query("SELECT count(*) FROM runtime_tracespan")[0][0] - before_rows
    wall = max(d["end"] for d in done) - min(d["start"] for d in done)
    client_cpu = sum(d["cpu_s"] for d in done)
    return {
        "spans_sent": len(workers) * batches * batch, "spans_stored": stored,
        "failed_exports": sum(d["failed"] for d in done), "wall_s": wall, "spans_per_s": stored / wall,
        "server_cpu_ms_per_1000": server_cpu / stored * 1e6, "postgres_cpu_ms_per_1000": postgres_cpu / stored * 1e6,
        "client_cpu_share": client_cpu / (wall * (os.cpu_count() or 1)),
    }  # fmt: skip


# -- (b) the trace page ------------------------------------------------------------------------


def big_trace(side: Side, spans: list) -> str:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    exporter = OTLPSpanExporter(
        endpoint=f"{side.url}/v1/traces", headers={"Authorization": f"Bearer {side.token}"}
    )
    for i in range(0, len(spans), 512):
        if exporter.export(spans[i : i + 512]) != SpanExportResult.SUCCESS:
            raise RuntimeError("could not send the big trace")
    exporter.shutdown()
    return format(spans[0].context.trace_id, "032x")


def _signed_in(side: Side) -> httpx.Client:
    web = httpx.Client(base_url=side.url, timeout=60, follow_redirects=False)
    web.get("/login/")
    r = web.post("/login/", data={"username": "admin", "password": side.password,
                                  "csrfmiddlewaretoken": web.cookies["csrftoken"]},
                 headers={"Referer": f"{side.url}/login/"})  # fmt: skip
    if r.status_code != 302:
        raise RuntimeError(f"sign-in failed: {r.status_code}")
    return web


def page_times(side: Side, trace_id: str, n: int) -> list[float]:
    times = []
    web = _signed_in(side)
    try:
        for i in range(n + 1):
            start = time.perf_counter()
            r = web.get(f"/traces/{trace_id}/")
            if r.status_code != 200:
                raise RuntimeError(f"the trace page: {r.status_code}")
            if i:  # the first one warms the server's caches (templates)
                times.append(time.perf_counter() - start)
    finally:
        web.close()
    return times


LONG_TASKS = """
window.__longTasks = [];
new PerformanceObserver(list => { for (const e of list.getEntries()) window.__longTasks.push(e.duration); })
  .observe({type: "longtask", buffered: true});
"""


def browser_long_tasks(side: Side, trace_id: str, n: int) -> list[float]:
    """The longest task of each of ``n`` loads of the page (with a scroll through it), in ms."""
    from playwright.sync_api import sync_playwright

    out = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        context = browser.new_context(base_url=side.url, viewport={"width": 1440, "height": 900})
        page = context.new_page()
        page.goto("/login/")
        page.fill("#id_username", "admin")
        page.fill("#id_password", side.password)
        page.click("#login-form button[type=submit]")
        page.wait_for_load_state("networkidle")
        context.add_init_script(LONG_TASKS)
        for _ in range(n):
            page.goto(f"/traces/{trace_id}/", wait_until="load")
            page.wait_for_selector("#waterfall")
            for _ in range(10):
                page.mouse.wheel(0, 2000)
                page.wait_for_timeout(50)
            page.wait_for_timeout(300)
            out.append(max(page.evaluate("window.__longTasks"), default=0.0))
        browser.close()
    return out


# -- the run -----------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="ingest rounds per side")
    parser.add_argument("--exporters", type=int, default=4, help="exporter processes sending at once")
    parser.add_argument("--batches", type=int, default=40, help="batches per exporter per round")
    parser.add_argument("--batch", type=int, default=512, help="spans per export request")
    parser.add_argument("--page-spans", type=int, default=10_000)
    parser.add_argument("--page-n", type=int, default=10, help="loads of the trace page (browser: a third)")
    parser.add_argument("--baseline", help="a commit to measure against (e.g. the parent of a change)")
    parser.add_argument("--database-url", default="postgres://postgres@127.0.0.1:5432/hangar_bench_traces")
    parser.add_argument("--port", type=int, default=8795, help="the current side's; the baseline's is +1")
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "traces.json"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hangar-bench-traces-"))
    sides = [Side("current", ROOT, f"{args.database_url}_current", work / "current", args.port)]
    if args.baseline:
        base = work / "baseline-src"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.baseline],
                       check=True, capture_output=True)  # fmt: skip
        sides.insert(
            0, Side("baseline", base, f"{args.database_url}_baseline", work / "baseline", args.port + 1)
        )
    ctx = mp.get_context("spawn")
    workers, procs = [], []
    results: dict[str, object] = {"cpus": os.cpu_count(), "exporters": args.exporters, "batch": args.batch,
                                  "batches_per_exporter": args.batches, "baseline": args.baseline,
                                  "loadavg_start": Path("/proc/loadavg").read_text().split()[:3]}  # fmt: skip
    try:
        for side in sides:
            print(f"starting the {side.name} server (migrating a fresh database)…", flush=True)
            side.start()
        for k in range(args.exporters):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_exporter_main, args=(theirs, k, args.batch), daemon=True)
            proc.start()
            workers.append(mine)
            procs.append(proc)
        rounds: dict[str, list[dict[str, float]]] = {s.name: [] for s in sides}
        for r in range(args.rounds):
            for side in sides if r % 2 == 0 else sides[::-1]:
                got = ingest_round(side, workers, args.batches, args.batch)
                rounds[side.name].append(got)
                print(f"  round {r + 1} {side.name}: {got['spans_per_s']:,.0f} spans/s "
                      f"(server {got['server_cpu_ms_per_1000']:.0f} ms CPU / 1,000 spans, "
                      f"client {got['client_cpu_share']:.0%} of the CPUs)", flush=True)  # fmt: skip
        results["ingest"] = rounds
        print(f"the trace page: a trace of {args.page_spans:,} spans…", flush=True)
        spans = make_spans(args.page_spans, 424242, one_trace=True)
        page: dict[str, dict[str, object]] = {}
        for side in sides:
            trace_id = big_trace(side, spans)
            page[side.name] = {"server_ms": [t * 1000 for t in page_times(side, trace_id, args.page_n)]}
            if CHROMIUM:
                page[side.name]["longest_task_ms"] = browser_long_tasks(
                    side, trace_id, max(1, args.page_n // 3)
                )
        results["page"] = page
    finally:
        for conn in workers:
            conn.send(("quit",))
        for proc in procs:
            proc.join(10)
        for side in sides:
            side.stop()
            _fresh_database(side.database_url, create=False)  # nothing of the bench's is left behind
        if args.baseline:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / "baseline-src")],
                           capture_output=True)  # fmt: skip
        shutil.rmtree(work, ignore_errors=True)

    results["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    print()
    print(f"load average at the start and the end: {results['loadavg_start']} {results['loadavg_end']}")
    print(f"{'measure':58} " + " ".join(f"{s.name:>14}" for s in sides) + "   target")
    med = statistics.median

    def row(label: str, values: list[str], target: str = "") -> None:
        print(f"{label:58} " + " ".join(f"{v:>14}" for v in values) + f"   {target}")

    row("ingest, spans/s (median of rounds)", [f"{med(r['spans_per_s'] for r in rounds[s.name]):,.0f}" for s in sides],
        "≥ 20,000")  # fmt: skip
    row(
        "  server CPU per 1,000 spans, ms",
        [f"{med(r['server_cpu_ms_per_1000'] for r in rounds[s.name]):.0f}" for s in sides],
    )
    row(
        "  Postgres CPU per 1,000 spans, ms",
        [f"{med(r['postgres_cpu_ms_per_1000'] for r in rounds[s.name]):.0f}" for s in sides],
    )
    row(
        "  exporters' share of the CPUs",
        [f"{med(r['client_cpu_share'] for r in rounds[s.name]):.0%}" for s in sides],
    )
    row("  failed exports", [str(sum(r["failed_exports"] for r in rounds[s.name])) for s in sides])
    row(f"trace page, {args.page_spans:,} spans, median ms", [f"{med(page[s.name]['server_ms']):.1f}" for s in sides],  # type: ignore[arg-type]
        "≤ 300")  # fmt: skip
    if CHROMIUM:
        row("  Chromium: longest task, worst load, ms", [f"{max(page[s.name]['longest_task_ms']):.0f}" for s in sides],  # type: ignore[arg-type]
            "≤ 200")  # fmt: skip
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
