"""The sandbox API end to end: HTTP to a real daphne server, a real Celery worker process,
real runsc sandboxes, real Postgres and Redis."""

from __future__ import annotations

import hashlib
import os
import time

import pytest
from django.conf import settings

from runtime.node.local import launcher_for
from tests.support import MiB, RssWatch, SlowReader, requires_runsc, rss_bytes, unix_sockets, wait_until

pytestmark = [requires_runsc]


def create(api, **body):
    body.setdefault("image", "busybox")
    body.setdefault("memory_mb", 256)
    r = api.post("/sandboxes", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def test_create_exec_files_delete(api):
    sb = create(api, env={"FOO": "bar"}, metadata={"owner": "ci"})
    assert sb["status"] == "running", sb
    assert sb["node"] == settings.HANGAR_NODE_NAME and sb["image"] == "busybox" and sb["runtime"] == "gvisor"
    assert sb["metadata"] == {"owner": "ci"}
    assert sb["started_at"] and sb["expires_at"]
    sid = sb["id"]

    r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "echo $FOO; echo oops >&2; exit 4"})
    assert r.status_code == 200
    out = r.json()
    assert out["stdout"] == "bar\n" and out["stderr"] == "oops\n" and out["exit_code"] == 4
    assert out["timed_out"] is False and out["duration_ms"] > 0

    r = api.post(
        f"/sandboxes/{sid}/exec", json={"cmd": ["cat"], "stdin": "piped", "cwd": "/tmp", "env": {"A": "1"}}
    )
    assert r.json()["stdout"] == "piped"

    data = os.urandom(2 * 1024 * 1024)
    r = api.put(f"/sandboxes/{sid}/files", params={"path": "/work/data.bin"}, content=data)
    assert r.status_code == 200 and r.json()["size"] == len(data)
    r = api.get(f"/sandboxes/{sid}/files", params={"path": "/work/data.bin"})
    assert r.status_code == 200 and r.content == data
    r = api.get(f"/sandboxes/{sid}/files/list", params={"path": "/work"})
    assert [(e["name"], e["type"], e["size"]) for e in r.json()] == [("data.bin", "file", len(data))]

    assert api.get(f"/sandboxes/{sid}").json()["status"] == "running"
    stats = api.get(f"/sandboxes/{sid}/stats").json()
    assert stats["memory_limit_bytes"] == 256 * 1024 * 1024 and stats["cpu_seconds"] > 0
    # Its own disk, of the default size, holds what it wrote.
    assert sb["disk_mb"] == 10240 and 9 << 30 < stats["disk_limit_bytes"] <= 10 << 30
    assert stats["disk_bytes"] >= len(data)
    assert sid in [s["id"] for s in api.get("/sandboxes").json()]
    assert [s["id"] for s in api.get("/sandboxes", params={"status": "running"}).json()] == [sid]

    r = api.delete(f"/sandboxes/{sid}")
    assert r.status_code == 204
    wait_until(lambda: api.get(f"/sandboxes/{sid}").json()["status"] == "deleted", 30, what="deleted")
    assert sid not in launcher_for("gvisor").states()
    assert sid not in [s["id"] for s in api.get("/sandboxes").json()]
    kinds = [
        (e["status_from"], e["status_to"])
        for e in api.get(f"/sandboxes/{sid}/events").json()
        if e["kind"] == "status"
    ]
    assert ("pending", "starting") in kinds and ("starting", "running") in kinds
    assert ("running", "stopping") in kinds and ("stopping", "deleted") in kinds


def test_create_without_wait_returns_pending_then_runs(api):
    sb = create(api, wait=False)
    assert sb["status"] in ("pending", "starting", "running")
    wait_until(lambda: api.get(f"/sandboxes/{sb['id']}").json()["status"] == "running", 30, what="running")


def test_exec_timeout(api):
    sid = create(api)["id"]
    start = time.monotonic()
    out = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "sleep 30", "timeout_s": 1}).json()
    assert out["timed_out"] is True
    assert time.monotonic() - start < 10


def test_unknown_image_is_400_naming_the_images(api):
    r = api.post("/sandboxes", json={"image": "nope"})
    assert r.status_code == 400
    assert "nope" in r.json()["detail"] and "busybox" in r.json()["detail"]


@pytest.mark.parametrize(
    "body, word",
    [
        ({"memory_mb": 1}, "memory_mb"),
        ({"cpu": 1000}, "cpu"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"cpu": "x"}, "cpu"),
        ({"disk_mb": 10}, "disk_mb: Input should be greater than or equal to 64"),
        ({"disk_mb": 10**9}, "disk_mb: Input should be less than or equal to 102400"),
        ({"cpu": True}, "cpu: Input should be a valid number"),  # not 1
        ({"memory_mb": "512"}, "memory_mb: Input should be a valid integer"),
        # An object field given anything else is refused, not read as an object of defaults.
        ({"network": [None, None]}, "network: Value error, must be a JSON object, not an array"),
        ({"network": "all"}, "network: Value error, must be a JSON object, not a string"),
        ({"network": 1}, "network: Value error, must be a JSON object, not a number"),
    ],
)
def test_bad_sizes_are_422_with_the_allowed_range(api, body, word):
    r = api.post("/sandboxes", json={"image": "busybox", **body})
    assert r.status_code == 422
    assert word in r.json()["detail"]


def test_other_teams_sandbox_is_404(api, other_api):
    sid = create(api)["id"]
    assert other_api.get(f"/sandboxes/{sid}").status_code == 404
    assert other_api.post(f"/sandboxes/{sid}/exec", json={"cmd": "true"}).status_code == 404
    assert other_api.get(f"/sandboxes/{sid}/files", params={"path": "/etc/passwd"}).status_code == 404
    assert other_api.put(f"/sandboxes/{sid}/files", params={"path": "/x"}, content=b"x").status_code == 404
    assert other_api.delete(f"/sandboxes/{sid}").status_code == 404
    assert sid not in [s["id"] for s in other_api.get("/sandboxes").json()]
    assert api.get(f"/sandboxes/{sid}").json()["status"] == "running"
    assert api.get("/sandboxes/sbdoesnotexist").status_code == 404


def test_exec_and_files_on_a_deleted_sandbox_are_409(api):
    sid = create(api)["id"]
    api.delete(f"/sandboxes/{sid}")
    r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "true"})
    assert r.status_code == 409 and r.json()["status"] in ("stopping", "deleted")
    assert api.get(f"/sandboxes/{sid}/files", params={"path": "/etc/passwd"}).status_code == 409


def test_client_mistakes_are_4xx_never_500(api):
    sid = create(api)["id"]
    checks = [
        api.post(f"/sandboxes/{sid}/exec", json={"cmd": ""}),
        api.post(f"/sandboxes/{sid}/exec", json={"cmd": []}),
        api.post(f"/sandboxes/{sid}/exec", json={"cmd": ["/no/such/bin"]}),
        api.post(f"/sandboxes/{sid}/exec", json={"cmd": "true", "cwd": "relative"}),
        api.post(f"/sandboxes/{sid}/exec", json={"cmd": "true", "timeout_s": -1}),
        api.post(f"/sandboxes/{sid}/exec", json={"cmd": "true", "env": {"1BAD": "x"}}),
        api.post(f"/sandboxes/{sid}/exec", content=b"not json", headers={"Content-Type": "application/json"}),
        api.get(f"/sandboxes/{sid}/files", params={"path": "relative"}),
        api.get(f"/sandboxes/{sid}/files"),
        api.get(f"/sandboxes/{sid}/files/list", params={"path": "/etc/passwd"}),
        api.get(f"/sandboxes/{sid}/files", params={"path": "/tmp"}),
        api.get("/sandboxes", params={"status": "bogus"}),
        api.get("/sandboxes", params={"limit": 0}),
        api.get("/sandboxes", params={"offset": -1}),
        api.post("/sandboxes", json={"image": "busybox", "env": {"A=B": "x"}}),
        api.post("/sandboxes", json={}),
    ]
    for r in checks:
        assert 400 <= r.status_code < 500, (r.request.url, r.status_code, r.text)
        assert r.json()["detail"]
    assert api.get(f"/sandboxes/{sid}/files", params={"path": "/missing"}).status_code == 404


def test_requests_without_a_valid_token_are_401(server, local_node):
    import httpx

    assert httpx.get(f"{server}/api/v1/sandboxes").status_code == 401
    r = httpx.get(f"{server}/api/v1/sandboxes", headers={"Authorization": "Bearer hgr_wrong"})
    assert r.status_code == 401 and "token" in r.json()["detail"]
    assert httpx.get(f"{server}/api/v1/health").status_code == 200
    assert httpx.get(f"{server}/api/v1/openapi.json").json()["info"]["title"] == "Hangar API"


def test_images_and_health(api):
    images = api.get("/images").json()
    assert [i["name"] for i in images] == ["busybox"]
    assert images[0]["nodes"] == [settings.HANGAR_NODE_NAME] and images[0]["digest"].startswith("sha256:")
    health = api.get("/health").json()
    assert health["status"] == "ok" and health["nodes"][0]["name"] == settings.HANGAR_NODE_NAME


def test_memory_limit_fails_the_sandbox_with_the_reason(api):
    sid = create(api, memory_mb=160)["id"]
    r = api.post(
        f"/sandboxes/{sid}/exec", json={"cmd": "head -c 700000000 /dev/zero | tail -c 600000000 | wc -c"}
    )
    assert r.status_code == 409
    assert "out of memory" in r.json()["detail"]
    sb = api.get(f"/sandboxes/{sid}").json()
    assert sb["status"] == "failed" and "out of memory" in sb["status_reason"]


def test_a_sandbox_that_plants_a_symlink_at_its_agent_socket_fails_saying_so(api, tmp_path):
    import socket

    sid = create(api)["id"]
    # A host socket the symlink aims at: it must never be connected to.
    host = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    host.bind(str(tmp_path / "host.sock"))
    host.listen(1)
    host.setblocking(False)
    plant = f"rm /.hangar/run/agent.sock && ln -s {tmp_path}/host.sock /.hangar/run/agent.sock"
    assert api.post(f"/sandboxes/{sid}/exec", json={"cmd": plant}).json()["exit_code"] == 0
    said = "the sandbox replaced its agent's socket with a symlink; Hangar does not follow it"
    r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "true"})
    assert r.status_code == 409 and said in r.json()["detail"] and "None" not in r.json()["detail"], r.text
    sb = api.get(f"/sandboxes/{sid}").json()
    assert sb["status"] == "failed" and sb["status_reason"] == said
    with pytest.raises(BlockingIOError):
        host.accept()
    host.close()


def test_list_is_newest_first_and_pages(api):
    ids = [create(api, wait=False)["id"] for _ in range(3)]
    listed = [s["id"] for s in api.get("/sandboxes").json()]
    assert listed == ids[::-1]
    assert [s["id"] for s in api.get("/sandboxes", params={"limit": 2}).json()] == ids[::-1][:2]
    assert [s["id"] for s in api.get("/sandboxes", params={"limit": 2, "offset": 2}).json()] == ids[:1]


def test_api_answers_keep_security_headers_set_no_cookie_and_record_the_tokens_user(api):
    """/api/ has a middleware stack of its own (dashboard/asgi.py) and checks tokens on the
    blocking pool: the headers stay, and what a request does is still put down to the token's
    user (the actor set on that thread reaches the view)."""
    from runtime.models import AuditEvent

    r = api.post("/sandboxes", json={"image": "busybox", "memory_mb": 256, "wait": False})
    assert r.status_code == 201, r.text
    assert r.headers["x-content-type-options"] == "nosniff" and r.headers["x-frame-options"] == "DENY"
    assert "set-cookie" not in r.headers
    created = AuditEvent.objects.get(action="sandbox.create", target=r.json()["id"])
    assert (created.actor, created.via, created.team_name) == ("alice", "api", "alpha")
    assert api.get("/sandboxes/sbnosuchthing").status_code == 404


def test_static_files_are_served_by_the_app(server):
    import httpx

    r = httpx.get(f"{server}/static/vendor/htmx/htmx.min.js")
    assert r.status_code == 200 and b"htmx" in r.content
    assert httpx.get(f"{server}/static/hangar/hangar.css").status_code == 200


BIG = 400 * MiB


def big_file(api, sid: str, path: str = "/tmp/big") -> None:
    """A sparse file of :data:`BIG` bytes (zeros), made in an instant."""
    cmd = f"dd if=/dev/zero of={path} bs={MiB} seek={BIG // MiB - 1} count=1 2>/dev/null"
    r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": cmd})
    assert r.json()["exit_code"] == 0, r.text


def test_a_slow_reader_of_a_large_download_costs_the_server_little_memory(api, server_process):
    """The server sends a download only as fast as the client takes it: reading 400 MiB at
    ~1.6 MB/s grows the server by a bounded amount (without back-pressure it read the whole
    file in a few seconds and held it for the client)."""
    sid = create(api)["id"]
    big_file(api, sid)
    assert api.get(f"/sandboxes/{sid}/files", params={"path": "/etc/passwd"}).status_code == 200  # warm
    auth = {"Authorization": api.headers["Authorization"]}
    with RssWatch(server_process.pid) as rss:
        reader = SlowReader(server_process.url, f"/api/v1/sandboxes/{sid}/files?path=/tmp/big", auth)
        assert reader.status == 200 and int(reader.headers["content-length"]) == BIG
        reader.read_slowly(8)
        slow = rss.growth
        assert reader.read_rest() == BIG
    print(f"download: server RSS +{slow / MiB:.1f} MiB while slow, +{rss.growth / MiB:.1f} MiB in all")
    assert rss.growth < 64 * MiB, f"the server grew by {rss.growth / MiB:.0f} MiB"


def test_a_client_that_hangs_up_on_a_held_back_download_ends_it(api, server_process):
    sid = create(api)["id"]
    big_file(api, sid)
    assert api.get(f"/sandboxes/{sid}/files", params={"path": "/etc/passwd"}).status_code == 200
    before = unix_sockets(server_process.pid)
    reader = SlowReader(
        server_process.url,
        f"/api/v1/sandboxes/{sid}/files?path=/tmp/big",
        {"Authorization": api.headers["Authorization"]},
    )
    reader.read_slowly(1)
    assert unix_sockets(server_process.pid) > before  # the agent's connection
    reader.close()
    # The app's send that waited for the client ends, and with it the stream from the sandbox.
    wait_until(
        lambda: unix_sockets(server_process.pid) <= before, 15, what="the download's connections to close"
    )
    assert api.get(f"/sandboxes/{sid}/files", params={"path": "/etc/passwd"}).status_code == 200


def test_a_blocking_exec_of_128_mib_costs_the_server_about_what_it_keeps_and_gives_it_back(
    api, server_process
):
    """The output kept (the first HANGAR_EXEC_MAX_OUTPUT_BYTES, 64 MiB, of each stream) is held
    once, and the answer is written from it as the client reads (NULs are 6 bytes each in JSON:
    a 384 MiB answer); past the limit the output is dropped, with ``truncated``."""
    from django.conf import settings

    kept = settings.HANGAR_EXEC_MAX_OUTPUT_BYTES
    sid = create(api)["id"]
    assert api.post(f"/sandboxes/{sid}/exec", json={"cmd": "head -c 1000000 /dev/zero"}).status_code == 200
    with RssWatch(server_process.pid) as rss:
        with api.stream("POST", f"/sandboxes/{sid}/exec", json={"cmd": "head -c 134217728 /dev/zero"}) as r:
            assert r.status_code == 200
            head, size, tail = b"", 0, b""
            for chunk in r.iter_raw():
                head += chunk[: 200 - len(head)]
                size += len(chunk)
                tail = (tail + chunk)[-400:]
    print(f"blocking exec of 128 MiB: server RSS +{rss.growth / MiB:.1f} MiB")
    assert head.startswith(b'{"id": ') and b'"stdout": "\\u0000\\u0000' in head
    assert size > 6 * kept and tail.endswith(b'"timed_out": false, "truncated": true}'), tail
    assert rss.growth < kept + 40 * MiB, f"the server grew by {rss.growth / MiB:.0f} MiB"
    # What it held for the answer is given back.
    wait_until(
        lambda: rss_bytes(server_process.pid) < rss.start + 16 * MiB, 10, what="the memory to be given back"
    )


def test_a_300_mb_upload_is_streamed_to_the_sandbox(api, server_process):
    """The body goes to the sandbox as it is read, never held whole by the server."""
    sid = create(api, memory_mb=1024)["id"]  # gVisor keeps a file it writes in the sandbox's memory
    size, block = 300 * 1000 * 1000, os.urandom(MiB)

    def body():
        left = size
        while left:
            yield block[: min(left, MiB)]
            left -= min(left, MiB)

    assert (
        api.put(f"/sandboxes/{sid}/files", params={"path": "/tmp/small"}, content=b"x" * 1000).status_code
        == 200
    )
    with RssWatch(server_process.pid) as rss:
        r = api.put(
            f"/sandboxes/{sid}/files",
            params={"path": "/tmp/up"},
            content=body(),
            headers={"Content-Length": str(size)},
        )
    print(f"upload of 300 MB: server RSS +{rss.growth / MiB:.1f} MiB")
    assert r.status_code == 200 and r.json() == {"path": "/tmp/up", "size": size}, r.text
    out = api.post(
        f"/sandboxes/{sid}/exec", json={"cmd": "wc -c < /tmp/up; head -c 1048576 /tmp/up | md5sum"}
    ).json()
    assert out["stdout"].split() == [str(size), hashlib.md5(block).hexdigest(), "-"], out
    assert rss.growth < 32 * MiB, f"the server grew by {rss.growth / MiB:.0f} MiB"
    # Chunked (no Content-Length) works the same.
    r = api.put(f"/sandboxes/{sid}/files", params={"path": "/tmp/chunked"}, content=iter([b"ab", b"cd"]))
    assert r.status_code == 200 and r.json()["size"] == 4


def test_blocking_execs_past_the_teams_limit_are_429_with_retry_after(api, other_api):
    from concurrent.futures import ThreadPoolExecutor

    from django.conf import settings

    limit = settings.HANGAR_EXEC_BLOCKING_PER_TEAM
    sid = create(api)["id"]
    with ThreadPoolExecutor(limit) as pool:
        running = [
            pool.submit(api.post, f"/sandboxes/{sid}/exec", json={"cmd": "sleep 8"}) for _ in range(limit)
        ]
        time.sleep(2)  # each takes its slot as it arrives, long before its command ends
        refused = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "true"})
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"].isdigit()
        body = refused.json()
        assert body["limit"] == limit and "HANGAR_EXEC_BLOCKING_PER_TEAM" in body["detail"], body
        # Another team is not held up by this one's.
        other = other_api.post("/sandboxes", json={"image": "busybox", "memory_mb": 256}).json()
        assert (
            other_api.post(f"/sandboxes/{other['id']}/exec", json={"cmd": "echo hi"}).json()["stdout"]
            == "hi\n"
        )
        assert [f.result().status_code for f in running] == [200] * limit
    assert api.post(f"/sandboxes/{sid}/exec", json={"cmd": "true"}).status_code == 200


def test_offset_past_what_a_list_can_skip_is_422(api):
    r = api.get("/sandboxes", params={"offset": 9223372036854775808})
    assert r.status_code == 422 and "offset" in r.json()["detail"]


def test_unknown_runtime_is_422_listing_the_runtimes_this_install_has(api):
    r = api.post("/sandboxes", json={"image": "busybox", "runtime": "runc"})
    assert r.status_code == 422
    # gvisor-reduced: the test registration of a second runtime (tests/settings.py); microvm: QEMU
    # microVMs, registered by pyproject.toml whether or not this node can run them.
    assert "runc" in r.json()["detail"] and r.json()["runtimes"] == ["gvisor", "gvisor-reduced", "microvm"]
    r = api.post("/pools", json={"image": "busybox", "runtime": "runc", "size": 1})
    assert r.status_code == 422 and r.json()["runtimes"] == ["gvisor", "gvisor-reduced", "microvm"]


def test_a_runtime_this_install_has_that_no_node_runs_is_503(local_node, monkeypatch):
    from runtime.errors import NoCapacity
    from runtime.launchers import registry
    from runtime.models import Team
    from runtime.services import sandboxes as svc

    # A launcher registered in this process but run by no node.
    monkeypatch.setitem(registry._registered, "othervm", "runtime.launchers.gvisor.launcher:GVisorLauncher")
    with pytest.raises(NoCapacity, match="no node: .*lack runtime othervm") as exc:
        svc.sandbox_create(
            team=Team.objects.create(name="t"),
            user=None,
            request=svc.SandboxRequest(image="busybox", runtime="othervm"),
        )
    assert exc.value.status_code == 503


@pytest.mark.parametrize("mode", [{}, {"stream": True}, {"background": True}])
def test_exec_larger_than_the_agents_frame_is_422_at_once_in_every_mode(api, mode):
    sid = create(api)["id"]
    big = "x" * (1024 * 1024)
    requests = [
        {"cmd": f"echo {big}"},
        {"cmd": ["echo", *([big[:1000]] * 1100)]},
        {"cmd": "true", "env": {"BIG": big}},
    ]
    for body in requests:
        start = time.monotonic()
        r = api.post(f"/sandboxes/{sid}/exec", json={**body, **mode})
        assert r.status_code == 422, r.text
        assert "1048576" in r.json()["detail"] and r.json()["limit"] == 1048576
        assert time.monotonic() - start < 5
    assert api.get(f"/sandboxes/{sid}/processes").json() == []  # no row was made
    from runtime.models import Exec

    assert not Exec.objects.filter(sandbox_id=sid).exists()
