"""The routes of /e2b/envd: Connect's ``POST /<service>/<Method>`` for both services, and the
plain HTTP ``/files`` and ``/health``."""

from __future__ import annotations

from django.http import HttpRequest
from django.http.response import HttpResponseBase
from django.urls import path

from . import filesystem, process
from .files import files, health
from .protocol import (
    RpcError,
    Stream,
    Unary,
    client_stream_response,
    error_response,
    stream_response,
    unary_response,
)

UNARY: dict[str, Unary] = {
    "process.Process/List": process.list_processes,
    "process.Process/SendInput": process.send_input,
    "process.Process/SendSignal": process.send_signal,
    "process.Process/CloseStdin": process.close_stdin,
    "process.Process/Update": process.update,
    "filesystem.Filesystem/Stat": filesystem.stat,
    "filesystem.Filesystem/MakeDir": filesystem.make_dir,
    "filesystem.Filesystem/Move": filesystem.move,
    "filesystem.Filesystem/ListDir": filesystem.list_dir,
    "filesystem.Filesystem/Remove": filesystem.remove,
    "filesystem.Filesystem/CreateWatcher": filesystem.create_watcher,
    "filesystem.Filesystem/GetWatcherEvents": filesystem.get_watcher_events,
    "filesystem.Filesystem/RemoveWatcher": filesystem.remove_watcher,
}
CLIENT_STREAM: dict[str, Unary] = {"process.Process/StreamInput": process.stream_input}
SERVER_STREAM: dict[str, Stream] = {
    "process.Process/Start": process.start,
    "process.Process/Connect": process.connect,
    "filesystem.Filesystem/WatchDir": filesystem.watch_dir,
}


async def rpc(request: HttpRequest, method: str) -> HttpResponseBase:
    if request.method != "POST":
        return error_response(RpcError("unimplemented", "Connect calls are POST"))
    if method in SERVER_STREAM:
        return await stream_response(request, SERVER_STREAM[method])
    if method in CLIENT_STREAM:
        return await client_stream_response(request, CLIENT_STREAM[method])
    if method in UNARY:
        return await unary_response(request, UNARY[method])
    return error_response(RpcError("unimplemented", f"Hangar's envd has no method {method}"))


urlpatterns = [
    path("files", files),
    path("health", health),
    path("<path:method>", rpc),
]
