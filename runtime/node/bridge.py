"""The node's stream bridge: owns the live processes of the sandboxes on this node.

Streamed and background execs and terminals outlive any one client: a browser tab closes, a
script reconnects, several viewers watch one terminal. So they are not held by the websocket
consumer or the HTTP request that started them but by this long-running asyncio process, one
per node (``hangar bridge``, started by ``hangar up`` and ``hangar node``). It listens on the
Channels layer at :func:`runtime.streams.bridge_channel`, holds each process's connection to
the sandbox's agent, keeps recent output in a ring, publishes every chunk to the process's
group, and writes the outcome to the process's row when it ends.

Flow control (the xterm.js guide's watermarks, server side). Viewers that acknowledge what
they consumed (``flow``) hold the process back: while the slowest of them is more than
``HIGH`` bytes behind, the bridge stops reading from the agent, the agent stops reading the
PTY, and the command blocks in write(). Reading resumes below ``LOW``. A viewer that stops
acknowledging for ``STALE_S`` stops counting, so one frozen tab cannot stall the others.
Input (keystrokes, Ctrl-C) travels separately and is never held back by output.

Input flow control. What a command has not read yet waits here, in order, up to
``HANGAR_STDIN_PENDING_BYTES`` per process; input past that is refused. A sender names a
channel (``ack_to``) and is told of a refusal there (``proc.input_acked`` with ``refused``);
a sender whose input is one byte stream (``stream``: an upload) has everything more refused
once some was, so that no stream goes in with a gap in it (a terminal's keystrokes are taken
again once the command reads). A sender that also asks (``ack``) is told as its input is written to the command's
stdin (up to an offset of its own, ``upto``): that is how the SSH gateway keeps at most a
window in flight and, through SSH's own flow control, holds back a client uploading faster
than the command reads (:class:`runtime.services.processes.InputSender`).

A write to a command that does not read blocks its thread (one per such process: the bridge's
thread pool is sized for many), never the loop. A kill that cannot reach the command because
its connection is held by such a write hangs up instead: the agent then kills the command's
process group.

Activity. Input, resizes, acknowledgements (output being read) and attaches mark a process
active (a viewer's ping does not: it only keeps a connection open). Every
``HANGAR_ACTIVITY_REPORT_S`` the bridge reports the sandboxes with a process active in the last
``2 ×`` that (:func:`sandboxes_touch`): they are not idle, and their expiry is pushed out so a
terminal in use does not expire under an engineer's hands.

What does not survive: the bridge's connections are the processes' lifelines (the agent kills
a command whose connection closes), so restarting the bridge ends the live processes of its
node. On start it marks what it no longer holds as ended, saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from redis.exceptions import ConnectionError as RedisConnectionError

from .. import streams
from ..aio import within
from ..launchers.base import FileOpError, LauncherError, Process, ProcessExit, ProcessRequest
from ..notify import redis_client
from .local import launcher_for, local_address_pools

log = logging.getLogger("hangar.bridge")

HIGH = settings.HANGAR_FLOW_HIGH_BYTES  # 128 KiB by default
STDIN_PENDING = settings.HANGAR_STDIN_PENDING_BYTES  # 8 MiB
KILL_WAIT_S = 1.0  # a kill not delivered by then (the connection is held by unread input): hang up
THREADS = 512  # blocking calls at once: writes to commands that do not read each hold one
STARTS = 8  # commands started at once (each waits on its sandbox's agent, on a thread)
STARTING_QUEUE = 256  # messages kept for a command while it starts; past that, input is refused
LOW = settings.HANGAR_FLOW_LOW_BYTES  # 32 KiB
STALE_S = 15.0
COALESCE_BYTES = 256 * 1024
KEEP_ENDED_S = 600.0
HOUSEKEEPING_S = 1.0


@dataclass
class Viewer:
    flow: bool
    acked: int
    last_ack: float = field(default_factory=time.monotonic)


@dataclass
class LiveProcess:
    key: str
    sandbox_id: str
    kind: str  # exec | terminal
    process: Process
    ring: streams.OutputRing
    started: float = field(default_factory=time.monotonic)
    viewers: dict[str, Viewer] = field(default_factory=dict)
    may_read: threading.Event = field(default_factory=threading.Event)
    # (destination channel or None for the group, message); the sender merges runs of output.
    outbox: deque[tuple[str | None, dict[str, Any]]] = field(default_factory=deque)
    outbox_ready: asyncio.Event = field(default_factory=asyncio.Event)
    stdin: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    stdin_pending: int = 0  # input bytes queued and not yet written to the command
    stdin_refused: int = 0  # input bytes refused because too much was pending
    refused_to: set[str] = field(default_factory=set)  # senders refused once: refused from then on
    exit: dict[str, Any] | None = None
    ended_at: float | None = None
    duration_ms: float = 0.0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    active_at: float = field(default_factory=time.monotonic)  # last input, ack, attach or ping
    # Secrets' values masked out of the output (a harness's runs), per stream.
    maskers: dict[str, streams.Masker] | None = None

    def __post_init__(self) -> None:
        self.may_read.set()

    def post(self, channel: str | None, msg: dict[str, Any]) -> None:
        self.outbox.append((channel, msg))
        self.outbox_ready.set()


class Bridge:
    def __init__(self, node_name: str, layer: Any) -> None:
        self.node_name = node_name
        self.channel = streams.bridge_channel(node_name)
        self.layer = layer
        self.procs: dict[str, LiveProcess] = {}
        # Processes being started (their sandbox's agent may take a while to answer), with the
        # messages that came for them meanwhile: handled in order once the start is done.
        self.starting: dict[str, list[dict[str, Any]]] = {}
        self._start_slots = asyncio.Semaphore(STARTS)
        self.closing = False  # the loop has ended: a start that finishes now is not kept
        self.loop: asyncio.AbstractEventLoop | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.instance = uuid.uuid4().hex
        self._alive_at = 0.0

    def _spawn(self, coro: Any) -> None:
        """Run ``coro`` beside the dispatch loop (which must never wait on one command)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- running ---------------------------------------------------------------------------

    async def run(self, ready: asyncio.Event | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.loop.set_default_executor(ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="bridge"))
        await asyncio.to_thread(_mark_lost_on_start, self.node_name)
        await self._say_alive()
        housekeeping = asyncio.create_task(self._housekeeping())
        tunnel_server = None
        if settings.HANGAR_TUNNEL_PORT:  # other machines' servers reach this node's sandboxes
            from .tunnels import serve

            tunnel_server = await serve(
                settings.HANGAR_NODE_ADDRESS, settings.HANGAR_TUNNEL_PORT, self.node_name
            )
        door = None
        if settings.HANGAR_SANDBOX_GATEWAY_PORT:  # hangar.internal for sandboxes let through
            from .door import Door

            try:
                pools = await asyncio.to_thread(local_address_pools)
                door = Door(port=settings.HANGAR_SANDBOX_GATEWAY_PORT, target=settings.HANGAR_INTERNAL_URL,
                            pools=pools)  # fmt: skip
                await door.start()
            except (OSError, LauncherError) as exc:
                log.error("bridge: hangar.internal cannot listen on port %d (%s); harnesses on this node will "
                          "not reach Hangar", settings.HANGAR_SANDBOX_GATEWAY_PORT, exc)  # fmt: skip
                door = None
        log.info("bridge for node %s listening on %s", self.node_name, self.channel)
        if ready is not None:
            ready.set()
        try:
            backoff = 0.5
            while True:
                try:
                    msg = await self.layer.receive(self.channel)
                except (OSError, RedisConnectionError) as exc:
                    # Redis restarting or out of reach: the bridge outlives it, its processes
                    # with it, and takes messages again once it is back.
                    log.warning("bridge: Redis unreachable (%s); trying again in %.1f s", exc, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                backoff = 0.5
                try:
                    await self.dispatch(msg)
                except Exception:  # one bad message must not take the node's streams down
                    log.exception("bridge: failed to handle %s", msg.get("type"))
        finally:
            housekeeping.cancel()
            self.closing = True
            for task in list(self._background):  # starts under way among them
                task.cancel()
            with contextlib.suppress(Exception):  # followers learn at once that nothing more comes
                await asyncio.to_thread(redis_client().delete, streams.bridge_alive_key(self.node_name))
            if tunnel_server is not None:
                tunnel_server.close()
            if door is not None:
                await door.close()
            for lp in list(self.procs.values()):
                with contextlib.suppress(Exception):
                    lp.process.close()

    async def dispatch(self, msg: dict[str, Any]) -> None:
        """One message from the layer. A start runs beside the loop (a sandbox slow to answer,
        one being paused, must not hold up every other stream of the node); what comes for
        that process meanwhile waits for it."""
        key = msg.get("key", "")
        if key in self.starting:
            if len(self.starting[key]) < STARTING_QUEUE:
                self.starting[key].append(msg)
            elif msg.get("type") == streams.INPUT:  # bounded: the sender is told, as for a full stdin
                self._spawn(self._ack_input(msg, refused=True))
            else:
                log.warning("bridge: %s is still starting; dropped a %s", key, msg.get("type"))
        elif msg.get("type") == streams.START:
            self.starting[key] = []
            self._spawn(self._start_then_the_rest(msg))
        else:
            await self._handle(msg)

    async def _start_then_the_rest(self, msg: dict[str, Any]) -> None:
        key = msg["key"]
        try:
            async with self._start_slots:
                await self._start_or_say_why(msg)
        finally:
            waiting = self.starting.get(key, [])
            while waiting:  # what comes while these are handled joins the list, in order
                queued = waiting.pop(0)
                try:
                    if queued.get("type") == streams.START:
                        await self._start_or_say_why(queued)
                    else:
                        await self._handle(queued)
                except Exception:
                    log.exception("bridge: failed to handle %s", queued.get("type"))
            self.starting.pop(key, None)

    async def _start_or_say_why(self, msg: dict[str, Any]) -> None:
        """:meth:`_start`; an unexpected failure is told to the starter, unless the command did
        start (then the starter's wait runs out, and the command's row stays: it runs)."""
        try:
            await self._start(msg)
        except Exception as exc:
            log.exception("bridge: failed to start %s", msg["key"])
            if msg["key"] not in self.procs:
                with contextlib.suppress(Exception):
                    await self.layer.send(msg["reply"], {"type": streams.FAILED, "key": msg["key"], "error": "runtime",
                                                         "message": f"the node could not start it: {exc}"})  # fmt: skip

    async def _handle(self, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        lp = self.procs.get(msg.get("key", ""))
        if lp is not None and kind != streams.DETACH:
            lp.active_at = time.monotonic()
        if kind == streams.ATTACH:
            if lp is None:
                await self.layer.send(msg["reply"], {"type": streams.UNKNOWN, "key": msg.get("key")})
            else:
                self._attach(lp, msg)
            return
        if lp is None:
            if kind == streams.INPUT:
                self._spawn(self._ack_input(msg))  # nothing to wait for: the process is not here
            return
        if kind == streams.ACK:
            viewer = lp.viewers.get(msg["reply"])
            if viewer is not None and msg["offset"] > viewer.acked:
                viewer.acked = msg["offset"]
                viewer.last_ack = time.monotonic()
                self._update_flow(lp)
        elif kind == streams.DETACH:
            lp.viewers.pop(msg["reply"], None)
            self._update_flow(lp)
        elif kind == streams.INPUT:
            size = len(msg.get("data") or b"")
            sender = msg.get("ack_to") or ""
            if lp.exit is not None:
                self._spawn(self._ack_input(msg))
            elif (size and lp.stdin_pending + size > STDIN_PENDING) or sender in lp.refused_to:
                if not lp.stdin_refused:
                    log.warning("bridge: %s has %d bytes of input it has not read; refusing more",
                                lp.key, lp.stdin_pending)  # fmt: skip
                lp.stdin_refused += size
                if sender and msg.get("stream"):
                    lp.refused_to.add(sender)
                self._spawn(self._ack_input(msg, refused=True))
            else:
                lp.stdin_pending += size
                lp.stdin.put_nowait((kind, msg))
        elif kind in (streams.EOF, streams.RESIZE, streams.SIGNAL):
            if lp.exit is None:
                lp.stdin.put_nowait((kind, msg))
        elif kind == streams.KILL:
            if lp.exit is None:
                self._spawn(self._kill(lp))

    async def _kill(self, lp: LiveProcess) -> None:
        # SIGKILL to its process group through the agent: the exit is then reported as usual
        # (signal 9), which hanging up would not do. But the connection may be held by a write
        # the command does not read (the agent reads no frame past it): then hang up.
        try:
            await within(asyncio.to_thread(lp.process.send_signal, 9), KILL_WAIT_S)
        except TimeoutError:
            log.info("bridge: %s did not take its kill within %.0f s (unread input); hanging up", lp.key,
                     KILL_WAIT_S)  # fmt: skip
            with contextlib.suppress(Exception):
                lp.process.close()
        except (OSError, LauncherError):
            pass

    # -- starting ----------------------------------------------------------------------------

    async def _start(self, msg: dict[str, Any]) -> None:
        key, reply = msg["key"], msg["reply"]
        # A starter that follows the output at once attaches with the start (``attach``: the
        # fields of an ATTACH): its viewer is in place before the first byte is read, and the
        # start costs one round trip through the layer, not two.
        attach = msg.get("attach")
        if key in self.procs:
            if attach:
                self._attach(self.procs[key], attach)
            await self.layer.send(reply, {"type": streams.STARTED, "key": key, "pid": self.procs[key].process.pid,
                                          "attached": bool(attach), "recorded": False})  # fmt: skip
            return
        req = ProcessRequest(
            argv=list(msg["argv"]), env=dict(msg.get("env") or {}), cwd=msg.get("cwd") or None,
            tty=bool(msg.get("tty")), rows=int(msg.get("rows") or 24), cols=int(msg.get("cols") or 80),
            stdin=True, timeout=msg.get("timeout") or None,
        )  # fmt: skip
        try:
            launcher = launcher_for(msg["runtime"])
            process, recorded = await asyncio.to_thread(_open_process, launcher, msg["handle"], req, key)
        except FileOpError as exc:
            await self.layer.send(
                reply, {"type": streams.FAILED, "key": key, "error": "start", "errno": exc.errno_name,
                        "message": exc.message},
            )  # fmt: skip
            return
        except (LauncherError, KeyError) as exc:
            await self.layer.send(
                reply, {"type": streams.FAILED, "key": key, "error": "runtime", "message": str(exc)}
            )
            return
        ring_bytes = (
            settings.HANGAR_TERMINAL_SCROLLBACK_BYTES if req.tty else settings.HANGAR_PROCESS_OUTPUT_BYTES
        )
        lp = LiveProcess(
            key=key, sandbox_id=msg["sandbox_id"], kind=msg.get("kind", "exec"), process=process,
            ring=streams.OutputRing(ring_bytes),
        )  # fmt: skip
        if msg.get("mask"):
            lp.maskers = {name: streams.Masker(msg["mask"]) for name in ("stdout", "stderr")}
        if self.closing:  # the bridge ended while it started: nobody would ever close it
            with contextlib.suppress(Exception):
                process.close()
            return
        self.procs[key] = lp
        initial = msg.get("stdin_data")
        if initial:
            lp.stdin_pending += len(initial)
            lp.stdin.put_nowait((streams.INPUT, {"data": initial}))
        if not msg.get("stdin_open"):
            lp.stdin.put_nowait((streams.EOF, {}))
        lp.tasks = [
            asyncio.create_task(self._send_loop(lp)),
            asyncio.create_task(self._input_loop(lp)),
        ]
        if attach:
            self._attach(lp, attach)
        # The starter hears first; the output waits in the agent's connection meanwhile (the
        # reply must not queue behind the output's messages on this loop).
        try:
            await self.layer.send(reply, {"type": streams.STARTED, "key": key, "pid": process.pid,
                                          "attached": bool(attach), "recorded": recorded})  # fmt: skip
        finally:
            threading.Thread(target=self._pump, args=(lp,), name=f"pump-{key}", daemon=True).start()

    # -- output ------------------------------------------------------------------------------

    def _pump(self, lp: LiveProcess) -> None:
        """Reader thread: agent -> loop. Waits on ``may_read`` before each read (flow control)."""
        assert self.loop is not None
        events = lp.process.events()
        try:
            while True:
                lp.may_read.wait()
                kind, data = next(events)
                if isinstance(data, ProcessExit):
                    info = {"exit_code": data.exit_code, "signal": data.signal, "timed_out": data.timed_out}
                    self.loop.call_soon_threadsafe(self._ended, lp, info, "")
                    return
                self.loop.call_soon_threadsafe(self._output, lp, kind, data)
        except StopIteration:
            self.loop.call_soon_threadsafe(self._ended, lp, None, "the process ended without an exit status")
        except LauncherError as exc:
            self.loop.call_soon_threadsafe(self._ended, lp, None, str(exc))
        except Exception as exc:  # the thread must always report an end
            log.exception("bridge: reader for %s failed", lp.key)
            self.loop.call_soon_threadsafe(self._ended, lp, None, f"stream failed: {exc}")

    def _output(self, lp: LiveProcess, stream: str, data: bytes) -> None:
        if lp.maskers is not None and stream in lp.maskers:
            data = lp.maskers[stream].feed(data)
            if not data:
                return
        offset = lp.ring.append(stream, data)
        lp.post(
            None, {"type": streams.OUTPUT, "key": lp.key, "offset": offset, "stream": stream, "data": data}
        )
        self._update_flow(lp)

    def _ended(self, lp: LiveProcess, info: dict[str, Any] | None, error: str) -> None:
        if lp.exit is not None:
            return
        if lp.maskers is not None:
            maskers, lp.maskers = lp.maskers, None
            for stream, masker in maskers.items():
                held = masker.flush()
                if held:
                    self._output(lp, stream, held)
        lp.ended_at = time.monotonic()
        lp.duration_ms = (lp.ended_at - lp.started) * 1000.0
        lp.exit = (
            info if info is not None else {"exit_code": None, "signal": 0, "timed_out": False, "error": error}
        ) | {"duration_ms": round(lp.duration_ms, 1)}
        lp.may_read.set()
        self._spawn(self._record_then_exit(lp))
        # Input it will never read: its senders need not wait for it.
        while not lp.stdin.empty():
            kind, msg = lp.stdin.get_nowait()
            if kind == streams.INPUT:
                lp.stdin_pending -= len(msg.get("data") or b"")
                self._spawn(self._ack_input(msg))
        with contextlib.suppress(Exception):
            lp.process.close()

    async def _record_then_exit(self, lp: LiveProcess) -> None:
        # The row first, as one statement: whoever hears of the exit and then asks for the
        # process finds it ended. What else listens for the end (a run's) hears after the exit
        # is sent (_send_loop), so that its queries are not on the way.
        await asyncio.to_thread(_record_end, lp.key, lp.exit or {}, lp.ring, lp.duration_ms)
        lp.post(None, {"type": streams.EXIT, "key": lp.key, "end": lp.ring.end, "exit": lp.exit})

    async def _send_loop(self, lp: LiveProcess) -> None:
        """One sender per process keeps its messages in order: replays and live chunks alike.
        When output comes faster than the layer takes it (a PTY in gVisor hands over a few
        bytes per read), contiguous chunks queued for the same destination go as one message:
        latency stays one message when idle, throughput grows with the backlog."""
        group = streams.proc_group(lp.key)
        while True:
            if not lp.outbox:
                lp.outbox_ready.clear()
                await lp.outbox_ready.wait()
                continue
            channel, msg = lp.outbox.popleft()
            if msg["type"] == streams.OUTPUT:
                msg = _coalesce(lp.outbox, channel, msg)
            try:
                if channel is None:
                    await self.layer.group_send(group, msg)
                else:
                    await self.layer.send(channel, msg)
            except Exception as exc:  # a full channel: the follower sees the gap and re-attaches
                log.debug("bridge: could not deliver to %s: %s", channel or group, exc)
            if msg["type"] == streams.EXIT:
                self._spawn(asyncio.to_thread(_announce_end, lp.key))

    def _attach(self, lp: LiveProcess, msg: dict[str, Any]) -> None:
        reply = msg["reply"]
        offset = max(0, int(msg.get("offset") or 0))
        if msg.get("live"):
            offset = lp.ring.end
        lp.viewers[reply] = Viewer(flow=bool(msg.get("flow")), acked=max(offset, lp.ring.start))
        lp.post(reply, {"type": streams.SYNCED, "key": lp.key, "start": max(lp.ring.start, offset),
                        "end": lp.ring.end, "exit": lp.exit, "bridge": self.instance})  # fmt: skip
        # The replay goes through the same ordered sender (which merges it into large messages),
        # so live chunks queued after it cannot overtake it.
        for off, stream, data in lp.ring.since(offset):
            lp.post(
                reply, {"type": streams.OUTPUT, "key": lp.key, "offset": off, "stream": stream, "data": data}
            )
        self._update_flow(lp)

    def _update_flow(self, lp: LiveProcess) -> None:
        if lp.exit is not None:
            return
        now = time.monotonic()
        counted = [v.acked for v in lp.viewers.values() if v.flow and now - v.last_ack < STALE_S]
        behind = lp.ring.end - min(counted) if counted else 0
        if behind > HIGH:
            lp.may_read.clear()
        elif behind <= LOW:
            lp.may_read.set()

    # -- input -------------------------------------------------------------------------------

    async def _input_loop(self, lp: LiveProcess) -> None:
        """Writes to the agent from a thread, in order, so a command that does not read its
        stdin never blocks the loop."""
        while lp.exit is None:
            kind, msg = await lp.stdin.get()
            try:
                if kind == streams.INPUT:
                    data = bytes(msg.get("data") or b"")
                    try:
                        if data:
                            await asyncio.to_thread(lp.process.send_stdin, data)
                    finally:
                        lp.stdin_pending -= len(data)
                        if msg.get("ack"):  # not waited for: the next write goes at once
                            self._spawn(self._ack_input(msg))
                elif kind == streams.EOF:
                    await asyncio.to_thread(lp.process.close_stdin)
                elif kind == streams.RESIZE:
                    await asyncio.to_thread(lp.process.resize, int(msg["rows"]), int(msg["cols"]))
                elif kind == streams.SIGNAL:
                    await asyncio.to_thread(lp.process.send_signal, int(msg["signal"]))
            except (OSError, LauncherError, ValueError, KeyError) as exc:
                log.debug("bridge: input to %s failed: %s", lp.key, exc)
            except Exception:  # the loop must go on: senders wait on what it writes
                log.exception("bridge: input to %s failed", lp.key)

    async def _ack_input(self, msg: dict[str, Any], refused: bool = False) -> None:
        """Tell the sender (``ack_to``) of a refusal, or, if it asked (``ack``), that its input
        up to ``upto`` is written or moot (the process ended, or is not here)."""
        if not msg.get("ack_to") or not (refused or msg.get("ack")):
            return
        reply = {"type": streams.INPUT_ACKED, "key": msg.get("key"), "upto": msg.get("upto", 0)}
        if refused:
            reply["refused"] = True
        try:
            await self.layer.send(msg["ack_to"], reply)
        except Exception as exc:  # the sender is gone, or its channel full: it resends nothing
            log.debug("bridge: could not acknowledge input to %s: %s", msg["ack_to"], exc)

    # -- housekeeping ------------------------------------------------------------------------

    async def _say_alive(self) -> None:
        """Keep this bridge's liveness key (its instance id) in Redis (see streams)."""
        self._alive_at = time.monotonic()
        key = streams.bridge_alive_key(self.node_name)
        try:
            await asyncio.to_thread(redis_client().set, key, self.instance, ex=streams.BRIDGE_ALIVE_TTL_S)
        except Exception as exc:  # Redis away: said again at the next tick
            log.warning("bridge: could not say it is alive: %s", exc)

    async def _housekeeping(self) -> None:
        report_every = float(settings.HANGAR_ACTIVITY_REPORT_S)
        reported = time.monotonic()
        while True:
            await asyncio.sleep(HOUSEKEEPING_S)
            now = time.monotonic()
            if now - self._alive_at >= streams.BRIDGE_ALIVE_EVERY_S:
                await self._say_alive()
            if now - reported >= report_every:
                reported = now
                active = {
                    lp.sandbox_id
                    for lp in self.procs.values()
                    if lp.exit is None and now - lp.active_at < 2 * report_every
                }
                if active:
                    asyncio.ensure_future(asyncio.to_thread(_touch, active))
            for key, lp in list(self.procs.items()):
                if lp.exit is None:
                    self._update_flow(lp)  # a stale viewer stops counting
                elif lp.ended_at is not None and now - lp.ended_at > KEEP_ENDED_S:
                    for task in lp.tasks:
                        task.cancel()
                    del self.procs[key]


def _coalesce(
    outbox: deque[tuple[str | None, dict[str, Any]]], channel: str | None, msg: dict[str, Any]
) -> dict[str, Any]:
    data: bytearray | None = None
    end = msg["offset"] + len(msg["data"])
    while outbox:
        next_channel, nxt = outbox[0]
        if (
            next_channel != channel or nxt["type"] != streams.OUTPUT or nxt["stream"] != msg["stream"]
            or nxt["offset"] != end or end - msg["offset"] >= COALESCE_BYTES
        ):  # fmt: skip
            break
        outbox.popleft()
        if data is None:
            data = bytearray(msg["data"])
        data += nxt["data"]
        end += len(nxt["data"])
    return msg if data is None else {**msg, "data": bytes(data)}


# -- rows (run in a thread) -------------------------------------------------------------------


def _open_process(launcher: Any, handle: Any, req: ProcessRequest, key: str) -> tuple[Process, bool]:
    """Start the process and write its pid to its row (an exec's), in the thread that waited for
    the start: the starter then has no trip to the database of its own before it answers.
    Whether the pid was written (if not, the starter writes it)."""
    from django.db import close_old_connections

    from ..services.processes import process_record_pid

    process = launcher.open_process(handle, req)
    if not key.startswith("x"):
        return process, False
    try:
        close_old_connections()
        process_record_pid(key=key, pid=process.pid)
    except Exception:
        log.exception("bridge: could not record the pid of %s", key)
        return process, False
    return process, True


def _record_end(key: str, info: dict[str, Any], ring: streams.OutputRing, duration_ms: float) -> None:
    from django.db import close_old_connections

    from ..services.processes import process_record_end

    close_old_connections()
    try:
        process_record_end(key=key, info=info, ring=ring, duration_ms=duration_ms)
    except Exception:
        log.exception("bridge: could not record the end of %s", key)
    finally:
        close_old_connections()


def _announce_end(key: str) -> None:
    from django.db import close_old_connections

    from ..services.processes import process_end_announce

    close_old_connections()
    try:
        process_end_announce(key=key)
    except Exception:
        log.exception("bridge: could not announce the end of %s", key)
    finally:
        close_old_connections()


def _touch(sandbox_ids: set[str]) -> None:
    from django.db import close_old_connections

    from ..services.sandboxes import sandboxes_touch

    close_old_connections()
    try:
        sandboxes_touch(sandbox_ids=sandbox_ids)
    except Exception:
        log.exception("bridge: could not record activity in %s", sorted(sandbox_ids))
    finally:
        close_old_connections()


def _mark_lost_on_start(node_name: str) -> None:
    from ..services.processes import processes_mark_lost

    n = processes_mark_lost(
        node_name=node_name,
        reason="the node's stream bridge restarted, which ends the processes it held",
    )
    if n:
        log.warning("bridge: marked %d process(es) of node %s as lost", n, node_name)


def run_bridge(node_name: str | None = None) -> None:
    """Entry point of ``hangar bridge``: serve this node's live processes until killed."""
    from channels.layers import get_channel_layer

    from .local import local_node_name

    bridge = Bridge(node_name or local_node_name(), get_channel_layer())
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(bridge.run())
