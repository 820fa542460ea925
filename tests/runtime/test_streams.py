"""The stream wire's pure parts: the output ring and the follower's ordering and gap rules."""

from __future__ import annotations

from runtime import streams


def out(offset: int, data: bytes, stream: str = "stdout") -> dict:
    return {"type": streams.OUTPUT, "offset": offset, "stream": stream, "data": data}


def synced(start: int, end: int, exit: dict | None = None) -> dict:
    return {"type": streams.SYNCED, "start": start, "end": end, "exit": exit}


def test_ring_keeps_the_newest_bytes_and_counts_all():
    ring = streams.OutputRing(10)
    assert ring.append("stdout", b"abcd") == 0
    assert ring.append("stderr", b"efgh") == 4
    assert ring.append("stdout", b"ijkl") == 8
    assert (ring.start, ring.end) == (4, 12)  # the oldest chunk went
    assert ring.totals == {"stdout": 8, "stderr": 4}
    assert ring.since(6) == [(6, "stderr", b"gh"), (8, "stdout", b"ijkl")]
    assert ring.since(0)[0] == (4, "stderr", b"efgh")
    assert ring.text("stdout", 3) == "jkl"


def test_follower_delivers_in_order_and_drops_duplicates():
    f = streams.Follower()
    assert f.feed(synced(0, 3)) == []
    assert f.feed(out(0, b"abc")) == [("output", "stdout", b"abc", 3)]
    # A live copy of a replayed chunk, and one that overlaps, deliver only what is new.
    assert f.feed(out(0, b"abc")) == []
    assert f.feed(out(2, b"cde")) == [("output", "stdout", b"de", 5)]


def test_follower_asks_again_after_a_gap_and_once_only():
    f = streams.Follower()
    f.feed(synced(0, 0))
    assert f.feed(out(4, b"late")) == [("resync", 0)]
    assert f.feed(out(8, b"later")) == []  # already re-syncing
    assert f.feed(synced(0, 13)) == []
    assert f.feed(out(0, b"0123")) == [("output", "stdout", b"0123", 4)]


def test_follower_skips_what_the_ring_no_longer_holds():
    f = streams.Follower()
    assert f.feed(synced(100, 120)) == [("skipped", 100)]
    assert f.feed(out(100, b"x" * 20)) == [("output", "stdout", b"x" * 20, 120)]


def test_follower_reports_exit_only_after_all_output():
    f = streams.Follower()
    f.feed(synced(0, 0))
    exit_info = {"exit_code": 3, "signal": 0, "timed_out": False}
    # The exit overtook a chunk the layer dropped: re-sync first, exit once the bytes are in.
    assert f.feed({"type": streams.EXIT, "end": 5, "exit": exit_info}) == [("resync", 0)]
    events = f.feed(synced(0, 5, exit_info))
    assert events == []
    assert f.feed(out(0, b"hello")) == [("output", "stdout", b"hello", 5), ("exit", exit_info)]
    assert f.done and f.feed(out(5, b"more")) == []


def test_follower_unknown_process_ends_it():
    f = streams.Follower()
    assert f.feed({"type": streams.UNKNOWN}) == [("unknown", None)]
    assert f.done


def test_bridge_channel_names_are_valid_for_channels():
    assert streams.bridge_channel("node a/1") == "hangar.bridge.node-a-1"
    assert streams.proc_group(streams.exec_key(12)) == "hangar.proc.x12"
