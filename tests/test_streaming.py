"""Streamed answers' error handling (dashboard/streaming.py), driven with async generators that
fail where a real stream can: on its first read, or after lines have gone out. The HTTP side
(daphne cutting a download, 4xx before the first byte) is in tests/api/test_files_api.py and
tests/api/test_processes_api.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from dashboard.streaming import ndjson_response
from runtime.errors import NodeUnavailable, NotFound


async def _lines(response) -> list[dict]:
    return [json.loads(line) async for chunk in response for line in chunk.splitlines() if line]


def test_an_error_after_the_first_line_ends_the_stream_with_an_error_line() -> None:
    closed = []

    async def body() -> AsyncIterator[bytes]:
        try:
            yield b'{"type":"stdout","data":"one"}\n'
            raise NotFound("no run 'r1' in team alpha")
        finally:
            closed.append(True)

    async def go() -> list[dict]:
        return await _lines(await ndjson_response(body()))

    assert asyncio.run(go()) == [
        {"type": "stdout", "data": "one"},
        {"type": "error", "message": "no run 'r1' in team alpha"},
    ]
    assert closed == [True]


def test_an_unexpected_error_later_says_so_without_its_internals(caplog) -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b'{"type":"start"}\n'
        raise RuntimeError("connection to db 10 went away")

    async def go() -> list[dict]:
        return await _lines(await ndjson_response(body()))

    lines = asyncio.run(go())
    assert lines[-1] == {
        "type": "error",
        "message": "the stream failed on the server; its log has the details",
    }
    assert "went away" in caplog.text  # logged for the operator, never sent


def test_an_error_on_the_first_read_is_raised_before_any_header() -> None:
    async def body() -> AsyncIterator[bytes]:
        raise NotFound("no process 7 in sandbox sb1")
        yield b""  # pragma: no cover

    async def broken() -> AsyncIterator[bytes]:
        raise ConnectionError("the channel layer is down")
        yield b""  # pragma: no cover

    with pytest.raises(NotFound):
        asyncio.run(ndjson_response(body()))
    with pytest.raises(NodeUnavailable, match="the stream could not start"):
        asyncio.run(ndjson_response(broken()))


def test_a_quiet_stream_starts_after_the_wait_and_keeps_its_first_line(monkeypatch) -> None:
    monkeypatch.setattr("dashboard.streaming.FIRST_LINE_WAIT_S", 0.05)

    async def body() -> AsyncIterator[bytes]:
        await asyncio.sleep(0.3)
        yield b'{"type":"stdout","data":"late"}\n'

    async def go() -> tuple[float, list[dict]]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        response = await ndjson_response(body())
        answered = loop.time() - started
        return answered, await _lines(response)

    answered, lines = asyncio.run(go())
    assert answered < 0.25 and lines == [{"type": "stdout", "data": "late"}]
