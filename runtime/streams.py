"""The wire between the stream bridge (one per node) and whoever follows a live process.

A live process (a streamed or background exec, a terminal) is owned by its node's bridge
(:mod:`runtime.node.bridge`). Its output is one byte sequence with absolute offsets; the bridge
keeps the recent part in a ring and publishes every chunk to the process's Channels group.
A follower joins the group, then asks the bridge to *attach* from an offset; the bridge answers
on the follower's own channel with ``proc.synced`` (what the ring holds, whether the process
has exited), then the retained output from the asked offset, in order with live chunks.
Because both paths carry offsets, a follower drops what it already has, notices a gap (a
message the layer dropped when its channel was full) and re-attaches from where it is.

This module is the shared vocabulary: names of channels and groups, the message types, and
:class:`Follower`, the pure state machine that turns messages into an ordered byte stream.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from typing import Any

# Message types (the bridge's channel receives the first group, followers the second).
START, ATTACH, DETACH, ACK, INPUT, EOF, RESIZE, SIGNAL, KILL = (
    "proc.start", "proc.attach", "proc.detach", "proc.ack", "proc.input", "proc.eof",
    "proc.resize", "proc.signal", "proc.kill",
)  # fmt: skip
STARTED, FAILED, OUTPUT, SYNCED, EXIT, UNKNOWN = (
    "proc.started", "proc.failed", "proc.output", "proc.synced", "proc.exit", "proc.unknown",
)  # fmt: skip
# To an input's sender that asked (``ack_to``): its input up to ``upto`` was written to the
# process's stdin (or will never be: the process ended), or was ``refused`` (too much unread).
INPUT_ACKED = "proc.input_acked"

_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]")


def bridge_channel(node_name: str) -> str:
    return "hangar.bridge." + _UNSAFE.sub("-", node_name)[:80]


# A running bridge says so: it keeps this key (its instance id) alive in Redis, refreshed every
# BRIDGE_ALIVE_EVERY_S with a TTL of BRIDGE_ALIVE_TTL_S. A follower that hears nothing for a
# while looks: the key gone (twice in a row), or another instance's, means the bridge that held
# its process died or restarted, and no more of its output will come.
BRIDGE_ALIVE_TTL_S = 10
BRIDGE_ALIVE_EVERY_S = 2.0


def bridge_alive_key(node_name: str) -> str:
    return f"hangar:bridge-alive:{_UNSAFE.sub('_', node_name)}"


def proc_group(key: str) -> str:
    return "hangar.proc." + key


def exec_key(exec_id: int) -> str:
    return f"x{exec_id}"


def terminal_key(terminal_id: str) -> str:
    return f"t{terminal_id}"


class OutputRing:
    """The last ``capacity`` bytes of a process's output, as (offset, stream, data) chunks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.chunks: deque[tuple[int, str, bytes]] = deque()
        self.start = 0  # offset of the oldest byte retained
        self.end = 0  # offset just past the newest byte
        self.size = 0
        self.totals: dict[str, int] = {}  # bytes per stream since the start, dropped ones too

    def append(self, stream: str, data: bytes) -> int:
        offset = self.end
        self.chunks.append((offset, stream, data))
        self.end += len(data)
        self.size += len(data)
        self.totals[stream] = self.totals.get(stream, 0) + len(data)
        while self.size > self.capacity and len(self.chunks) > 1:
            off, _, old = self.chunks.popleft()
            self.size -= len(old)
            self.start = off + len(old)
        return offset

    def text(self, stream: str, limit: int) -> str:
        """The retained output of one stream (its last ``limit`` bytes), decoded for storage
        (NUL, which a database text column cannot hold, becomes U+FFFD like other bytes that
        are not text)."""
        data = b"".join(d for _, s, d in self.chunks if s == stream)
        return data[-limit:].decode("utf-8", errors="replace").replace("\x00", "\ufffd") if limit > 0 else ""

    def since(self, offset: int) -> list[tuple[int, str, bytes]]:
        out = []
        for off, stream, data in self.chunks:
            if off + len(data) <= offset:
                continue
            if off < offset:
                data, off = data[offset - off :], offset
            out.append((off, stream, data))
        return out


@dataclass
class Follower:
    """Turns bridge messages (live and replayed, in any interleaving) into ordered output.

    ``feed(message)`` returns events: ``("output", stream, bytes, end_offset)``,
    ``("skipped", nbytes)`` when the ring no longer held what was wanted, ``("exit", info)``
    once all output before the exit was delivered, ``("unknown", None)`` when the bridge does
    not know the process, and ``("resync", offset)``: the caller must send an attach from
    ``offset`` (a gap was seen)."""

    want: int = 0
    syncing: bool = True  # an attach is outstanding
    exit_info: dict[str, Any] | None = None
    exit_end: int | None = None
    done: bool = False
    sync_end: int | None = None  # where the ring ended at the last attach

    def feed(self, msg: dict[str, Any]) -> list[tuple[Any, ...]]:
        if self.done:
            return []
        kind = msg.get("type")
        events: list[tuple[Any, ...]] = []
        if kind == OUTPUT:
            self._take(msg["offset"], msg["stream"], msg["data"], events)
        elif kind == SYNCED:
            # The attach answer: sent before the replayed chunks, which follow in order.
            self.syncing = False
            self.sync_end = msg["end"]
            if msg.get("exit") is not None:
                self.exit_info, self.exit_end = msg["exit"], msg["end"]
            if msg["start"] > self.want:
                # The ring no longer holds what was wanted: skip to its oldest byte.
                events.append(("skipped", msg["start"] - self.want))
                self.want = msg["start"]
        elif kind == EXIT:
            self.exit_info, self.exit_end = msg["exit"], msg["end"]
            if msg["end"] > self.want and not self.syncing:
                self.syncing = True
                events.append(("resync", self.want))
        elif kind == UNKNOWN:
            self.done = True
            return [("unknown", None)]
        if self.exit_info is not None and self.exit_end is not None and self.want >= self.exit_end:
            self.done = True
            events.append(("exit", self.exit_info))
        return events

    def _take(self, offset: int, stream: str, data: bytes, events: list[tuple[Any, ...]]) -> None:
        end = offset + len(data)
        if end <= self.want:
            return  # already delivered
        if offset > self.want:
            if not self.syncing:
                self.syncing = True
                events.append(("resync", self.want))
            return
        if offset < self.want:
            data = data[self.want - offset :]
        self.want = end
        events.append(("output", stream, data, end))


class Masker:
    """Replaces secrets' values in a byte stream with ``***``, across chunk boundaries: the
    end of a chunk that could be the start of a value is held back until the next chunk (or
    :meth:`flush`) says whether it is. Nothing else is delayed."""

    MASK = b"***"

    def __init__(self, values: list[str] | tuple[str, ...]) -> None:
        self.values = sorted({v.encode() for v in values if v}, key=len, reverse=True)
        self.held = b""

    def feed(self, data: bytes) -> bytes:
        if not self.values:
            return data
        buf = self.held + data
        for v in self.values:
            buf = buf.replace(v, self.MASK)
        keep = 0
        for v in self.values:
            for n in range(min(len(v) - 1, len(buf)), keep, -1):
                if buf.endswith(v[:n]):
                    keep = n
                    break
        self.held = buf[len(buf) - keep :] if keep else b""
        return buf[: len(buf) - keep] if keep else buf

    def flush(self) -> bytes:
        out, self.held = self.held, b""
        return out
