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


def test_a_stream_quiet_past_the_keepalive_sends_keepalive_lines_between_its_own(settings) -> None:
    settings.HANGAR_STREAM_KEEPALIVE_S = 0.1

    async def body() -> AsyncIterator[bytes]:
        yield b'{"type":"stdout","data":"one"}\n'
        await asyncio.sleep(0.35)
        yield b'{"type":"stdout","data":"two"}\n'

    lines = asyncio.run(_collect(body()))
    assert lines[0] == {"type": "stdout", "data": "one"} and lines[-1] == {"type": "stdout", "data": "two"}
    assert 2 <= len(lines[1:-1]) <= 4 and all(line == {"type": "keepalive"} for line in lines[1:-1])


def test_a_client_that_leaves_during_a_keepalive_wait_ends_the_body(settings) -> None:
    settings.HANGAR_STREAM_KEEPALIVE_S = 0.05
    ended = []

    async def body() -> AsyncIterator[bytes]:
        try:
            yield b'{"type":"start"}\n'
            await asyncio.sleep(60)
            yield b'{"type":"stdout","data":"never"}\n'
        finally:
            ended.append(True)

    async def go() -> list[bytes]:
        stream = (await ndjson_response(body())).streaming_content
        got = [await anext(stream), await anext(stream)]
        await stream.aclose()  # the client hung up
        return got

    assert asyncio.run(go()) == [b'{"type":"start"}\n', b'{"type":"keepalive"}\n'] and ended == [True]


async def _collect(body: AsyncIterator[bytes]) -> list[dict]:
    return await _lines(await ndjson_response(body))
