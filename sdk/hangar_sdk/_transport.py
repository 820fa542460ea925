"""Where the SDK finds the server, and how it sends a :class:`~hangar_sdk._api.Call`: with the
token, a timeout fitted to the call, bounded retries, and error answers raised as exceptions.
The sync and async transports share everything but the waiting."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from ._api import Call
from ._config import load_stored
from ._errors import HangarError, NetworkError, error_for

__version__ = "0.1.0"
API_PREFIX = "/api/v1"
CONNECT_TIMEOUT_S = 10.0
# Retries: at most this many tries of one call, backing off 0.25 s, 0.5 s, 1 s… (capped), or
# as long as the server's Retry-After says (capped too: a client waits, it does not hang).
MAX_TRIES = 4
BACKOFF_S = 0.25
MAX_BACKOFF_S = 5.0
MAX_RETRY_AFTER_S = 30.0
RETRY_STATUSES = (502, 503)


@dataclass(frozen=True)
class Config:
    """The API's base URL (ending in ``/api/v1``) and the token."""

    url: str
    token: str

    @classmethod
    def resolve(cls, url: str | None = None, token: str | None = None) -> Config:
        """From the arguments, else ``HANGAR_URL`` and ``HANGAR_TOKEN``, else what ``hangar
        login`` stored, else (inside a harness) ``HANGAR_API_URL`` and ``HANGAR_API_TOKEN``. A
        URL with or without ``/api/v1`` will do."""
        env = os.environ
        url = url or env.get("HANGAR_URL")
        token = token or env.get("HANGAR_TOKEN")
        if not (url and token):
            stored = load_stored()
            url = url or stored.get("url")
            token = token or stored.get("token")
        url = url or env.get("HANGAR_API_URL")
        token = token or env.get("HANGAR_API_TOKEN")
        if not url:
            raise HangarError(
                "no server: pass url=, set HANGAR_URL (e.g. http://127.0.0.1:8000) or run `hangar login`"
            )
        if not token:
            raise HangarError("no token: pass token=, set HANGAR_TOKEN (hgr_…) or run `hangar login`")
        return cls(url=api_base(url), token=token)


def api_base(url: str) -> str:
    base = url.rstrip("/")
    return base if base.endswith(API_PREFIX) else base + API_PREFIX


def retry_delay(call: Call, tries: int, *, status: int | None = None, retry_after: float | None = None,
                exc: Exception | None = None) -> float | None:  # fmt: skip
    """How long to wait before sending ``call`` again, or None not to. Idempotent calls are
    sent again after a 502/503, a 429 that says when (Retry-After) or a broken connection. Any
    call is sent again when nothing of it reached the server (no connection), or when the
    server refused it with a Retry-After before doing anything (a 429 for too many commands in
    flight), unless its body was a stream that cannot be read twice."""
    if tries >= MAX_TRIES:
        return None
    backoff = min(BACKOFF_S * 2 ** (tries - 1), MAX_BACKOFF_S)
    replayable = call.content is None or isinstance(call.content, bytes)
    if exc is not None:
        unsent = isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
        return backoff if replayable and (call.idempotent or unsent) else None
    if status == 429 and retry_after is not None and replayable:
        return min(max(retry_after, backoff), MAX_RETRY_AFTER_S)
    if status in RETRY_STATUSES and call.idempotent:
        return backoff
    return None


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _headers(config: Config) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.token}", "User-Agent": f"hangar-runtime-sdk/{__version__}"}


def _request(client: httpx.Client | httpx.AsyncClient, call: Call) -> httpx.Request:
    return client.build_request(
        call.method, call.path, params=call.params, json=call.json, content=call.content,
        headers=call.headers or None, timeout=httpx.Timeout(call.read_timeout, connect=CONNECT_TIMEOUT_S),
    )  # fmt: skip


def _network_error(call: Call, exc: Exception) -> NetworkError:
    return NetworkError(f"{call.method} {call.path}: {type(exc).__name__}: {exc}")


class Transport:
    """Sends calls with one ``httpx.Client`` (its connections are kept and reused)."""

    def __init__(self, config: Config, client: httpx.Client | None = None) -> None:
        self.config = config
        self.client = client or httpx.Client(base_url=config.url, headers=_headers(config))

    def send(self, call: Call, *, stream: bool = False) -> httpx.Response:
        tries = 1
        while True:
            try:
                response = self.client.send(_request(self.client, call), stream=stream)
            except httpx.TransportError as exc:
                delay = retry_delay(call, tries, exc=exc)
                if delay is None:
                    raise _network_error(call, exc) from exc
            else:
                if response.status_code < 400:
                    return response
                if stream:
                    response.read()
                    response.close()
                retry_after = _retry_after(response)
                delay = retry_delay(call, tries, status=response.status_code, retry_after=retry_after)
                if delay is None:
                    raise error_for(response.status_code, response.content, retry_after)
            time.sleep(delay)
            tries += 1

    def json(self, call: Call) -> Any:
        response = self.send(call)
        return response.json() if response.content else None

    def opening(self, call: Call) -> Any:
        """:meth:`json` for the call that makes this transport's first object: a failure
        closes its connections, since nothing will hold them."""
        try:
            return self.json(call)
        except BaseException:
            self.close()
            raise

    @contextlib.contextmanager
    def stream(self, call: Call) -> Iterator[httpx.Response]:
        response = self.send(call, stream=True)
        try:
            yield response
        except httpx.TransportError as exc:
            raise _network_error(call, exc) from exc
        finally:
            response.close()

    def lines(self, call: Call) -> Iterator[str]:
        """The lines of a streamed (NDJSON) answer as they come."""
        with self.stream(call) as response:
            yield from response.iter_lines()

    def close(self) -> None:
        self.client.close()


class AsyncTransport:
    """:class:`Transport`, awaited, with one ``httpx.AsyncClient``."""

    def __init__(self, config: Config, client: httpx.AsyncClient | None = None) -> None:
        self.config = config
        self.client = client or httpx.AsyncClient(base_url=config.url, headers=_headers(config))

    async def send(self, call: Call, *, stream: bool = False) -> httpx.Response:
        tries = 1
        while True:
            try:
                response = await self.client.send(_request(self.client, call), stream=stream)
            except httpx.TransportError as exc:
                delay = retry_delay(call, tries, exc=exc)
                if delay is None:
                    raise _network_error(call, exc) from exc
            else:
                if response.status_code < 400:
                    return response
                if stream:
                    await response.aread()
                    await response.aclose()
                retry_after = _retry_after(response)
                delay = retry_delay(call, tries, status=response.status_code, retry_after=retry_after)
                if delay is None:
                    raise error_for(response.status_code, response.content, retry_after)
            await asyncio.sleep(delay)
            tries += 1

    async def json(self, call: Call) -> Any:
        response = await self.send(call)
        return response.json() if response.content else None

    async def opening(self, call: Call) -> Any:
        try:
            return await self.json(call)
        except BaseException:
            await self.close()
            raise

    @contextlib.asynccontextmanager
    async def stream(self, call: Call) -> AsyncIterator[httpx.Response]:
        response = await self.send(call, stream=True)
        try:
            yield response
        except httpx.TransportError as exc:
            raise _network_error(call, exc) from exc
        finally:
            await response.aclose()

    async def lines(self, call: Call) -> AsyncIterator[str]:
        async with self.stream(call) as response:
            async for line in response.aiter_lines():
                yield line

    async def close(self) -> None:
        await self.client.aclose()
