"""Preview URLs against real sandboxes: busybox's httpd (with CGI scripts for request bodies and
a streamed answer) and a websocket echo server written in busybox sh, reached through the
test server at ``{port}-{id}.localhost`` (the Host header picks the preview)."""

from __future__ import annotations

import contextlib
import hashlib
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from websockets.exceptions import ConnectionClosedOK

from tests.api.test_sandboxes_api import BIG, create
from tests.support import MiB, RssWatch, SlowReader, requires_runsc, wait_until

pytestmark = [requires_runsc]

CGI_ECHO = """#!/bin/sh
printf 'Content-Type: text/plain\\r\\n\\r\\n'
cat
"""
# An answer in two parts: the second only once the test has seen the first (a file appears).
CGI_STREAM = """#!/bin/sh
printf 'Content-Type: text/event-stream\\r\\n\\r\\n'
printf 'data: first\\n\\n'
while [ ! -e /tmp/go ]; do sleep 0.1; done
printf 'data: second\\n\\n'
"""
# A websocket server in busybox sh (one connection per process, under nc -ll -e): the
# handshake, then each masked client frame (< 126 bytes) echoed back upper-cased.
WS_SERVER = r"""#!/bin/sh
key=""
while IFS= read -r line; do
  line=$(printf '%s' "$line" | tr -d '\r')
  [ -z "$line" ] && break
  case "$line" in [Ss]ec-[Ww]eb[Ss]ocket-[Kk]ey:*) key=$(printf '%s' "${line#*:}" | tr -d ' ');; esac
done
accept=$(printf '%s' "${key}258EAFA5-E914-47DA-95CA-C5AB0DC85B11" | sha1sum | cut -d' ' -f1 | xxd -r -p | base64)
printf 'HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: %s\r\n\r\n' "$accept"
while :; do
  set -- $(dd bs=1 count=2 2>/dev/null | od -An -tu1)
  [ $# -lt 2 ] && exit 0
  op=$(( $1 & 15 )); len=$(( $2 & 127 ))
  set -- $(dd bs=1 count=4 2>/dev/null | od -An -tu1)
  m0=$1; m1=$2; m2=$3; m3=$4
  data=$(dd bs=1 count=$len 2>/dev/null | od -An -tu1)
  if [ $op -eq 8 ]; then printf '\x88\x00'; exit 0; fi
  out=""; i=0
  for b in $data; do
    case $((i % 4)) in 0) m=$m0;; 1) m=$m1;; 2) m=$m2;; *) m=$m3;; esac
    c=$(( b ^ m )); [ $c -ge 97 ] && [ $c -le 122 ] && c=$(( c - 32 ))
    out="$out\\x$(printf %02x $c)"; i=$((i + 1))
  done
  printf "\\x81\\x$(printf %02x $len)$out"
done
"""


def put(api, sid: str, path: str, data: str | bytes, mode: str | None = None) -> None:
    r = api.put(f"/sandboxes/{sid}/files", params={"path": path}, content=data)
    assert r.status_code == 200, r.text
    if mode:
        assert (
            api.post(f"/sandboxes/{sid}/exec", json={"cmd": f"chmod {mode} {path}"}).json()["exit_code"] == 0
        )


def background(api, sid: str, cmd: str) -> None:
    r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": cmd, "background": True})
    assert r.status_code == 202, r.text


@pytest.fixture
def web(api):
    """A sandbox serving /www on port 8000 (with /cgi-bin) and a websocket echo on 8001."""
    sb = create(api, ports=[8000, {"port": 8001, "public": False}], memory_mb=256)
    sid = sb["id"]
    put(api, sid, "/www/index.html", "<h1>hello from the sandbox</h1>\n")
    put(api, sid, "/www/cgi-bin/echo", CGI_ECHO, "755")
    put(api, sid, "/www/cgi-bin/stream", CGI_STREAM, "755")
    put(api, sid, "/ws.sh", WS_SERVER, "755")
    background(api, sid, "httpd -f -p 127.0.0.1:8000 -h /www")
    background(api, sid, "nc -ll -p 8001 -e /ws.sh")
    wait_until(lambda: api.post(f"/sandboxes/{sid}/exec", json={"cmd": "wget -q -O- http://127.0.0.1:8000/ >/dev/null"})
               .json()["exit_code"] == 0, 20, what="httpd")  # fmt: skip
    return api.get(f"/sandboxes/{sid}").json()


def preview(server: str, sid: str, port: int, **kw) -> httpx.Client:
    host = f"{port}-{sid}.localhost"
    kw.setdefault("timeout", 30)
    return httpx.Client(base_url=server, headers={"Host": host, **kw.pop("headers", {})}, **kw)


def test_a_private_preview_takes_its_signed_link_then_a_cookie_or_a_team_token(web, server, api, other_api):
    sid = web["id"]
    urls = {p["port"]: p for p in web["previews"]}
    assert set(urls) == {8000, 8001} and not urls[8000]["public"]
    link = urlsplit(urls[8000]["url"])
    assert link.hostname == f"8000-{sid}.localhost" and "hangar_token=" in link.query
    with preview(server, sid, 8000) as c:
        r = c.get("/")
        assert r.status_code == 401 and "private" in r.text
        assert c.get("/?hangar_token=forged").status_code == 401
        r = c.get(f"/?{link.query}&x=1")
        assert r.status_code == 302 and r.headers["location"] == "/?x=1"
        assert "HttpOnly" in r.headers["set-cookie"]
        r = c.get("/")  # the cookie now
        assert r.status_code == 200 and r.text == "<h1>hello from the sandbox</h1>\n"
    # A token for another port, or another sandbox, opens nothing here.
    other_port = urlsplit(urls[8001]["url"]).query
    with preview(server, sid, 8000) as c:
        assert c.get(f"/?{other_port}").status_code == 401
    # API tokens: the sandbox's team's, not another team's.
    team_token = api.headers["Authorization"]
    with preview(server, sid, 8000, headers={"Authorization": team_token}) as c:
        assert c.get("/").status_code == 200
    with preview(server, sid, 8000, headers={"Authorization": other_api.headers["Authorization"]}) as c:
        assert c.get("/").status_code == 401


def test_bodies_stream_both_ways_and_public_ports_need_no_token(web, server, api):
    sid = web["id"]
    assert api.post(f"/sandboxes/{sid}/ports", json={"port": 8000, "public": True}).status_code == 201
    with preview(server, sid, 8000) as c:
        body = bytes(range(256)) * 4096  # 1 MiB, every byte value
        r = c.post("/cgi-bin/echo", content=body)
        assert r.status_code == 200 and r.content == body
        # A streamed answer arrives as it is written: the first event before the second exists.
        with c.stream("GET", "/cgi-bin/stream") as r:
            assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
            lines = r.iter_lines()
            assert next(lines) == "data: first"
            api.post(f"/sandboxes/{sid}/exec", json={"cmd": "touch /tmp/go"})
            assert [line for line in lines if line] == ["data: second"]
        assert c.get("/missing").status_code == 404  # the server's own answer, passed on
    # A port without a preview URL, and one where nothing listens, say so.
    with preview(server, sid, 9000) as c:
        r = c.get("/")
        assert r.status_code == 404 and "has no preview URL" in r.text
    api.post(f"/sandboxes/{sid}/ports", json={"port": 9000, "public": True})
    with preview(server, sid, 9000) as c:
        r = c.get("/")
        assert r.status_code == 502 and "Nothing in sandbox" in r.text
    assert api.delete(f"/sandboxes/{sid}/ports/9000").status_code == 204
    assert [p["port"] for p in api.get(f"/sandboxes/{sid}/ports").json()] == [8000, 8001]


def test_a_websocket_through_a_private_preview(web, server):
    from websockets.sync.client import connect

    sid = web["id"]
    url = next(p["url"] for p in web["previews"] if p["port"] == 8001)
    query = urlsplit(url).query
    host, port = urlsplit(server).hostname, urlsplit(server).port

    def dial(q: str):
        sock = socket.create_connection((host, port))
        return connect(f"ws://8001-{sid}.localhost:{port}/echo?{q}", sock=sock, open_timeout=20)

    with dial(query) as ws:
        ws.send("hello")
        assert ws.recv(timeout=20) == "HELLO"
        ws.send("again")
        assert ws.recv(timeout=20) == "AGAIN"
    with pytest.raises(Exception, match="4401|401|rejected"):
        dial("hangar_token=forged").close()


BROKEN_SERVER = """#!/bin/sh
# Answers any request with a chunked body, then leaves in the middle of it.
while read -r line; do [ "$line" = "$(printf '\\r')" ] && break; done
printf 'HTTP/1.1 200 OK\\r\\nTransfer-Encoding: chunked\\r\\n\\r\\n5\\r\\nhello\\r\\n'
"""


def test_an_answer_the_sandbox_breaks_off_reaches_the_browser_incomplete(api, server):
    """The server in the sandbox dies mid-answer: the browser's connection is cut, so it sees
    a broken body, never a complete-looking short one."""
    sb = create(api, ports=[{"port": 8002, "public": True}], memory_mb=256)
    sid = sb["id"]
    put(api, sid, "/broken.sh", BROKEN_SERVER, "755")
    background(api, sid, "nc -ll -p 8002 -e /broken.sh")
    wait_until(lambda: "hello" in api.post(f"/sandboxes/{sid}/exec", json={
        "cmd": "printf 'GET / HTTP/1.1\\r\\n\\r\\n' | timeout 2 nc 127.0.0.1 8002"}).json()["stdout"], 20,
        what="the broken server")  # fmt: skip
    with preview(server, sid, 8002) as c, pytest.raises(httpx.RemoteProtocolError):
        c.get("/").read()


def test_a_paused_sandbox_with_auto_resume_is_resumed_by_a_request(api, server):
    sb = create(
        api, ports=[{"port": 8000, "public": True}], auto_resume=True, pause_mode="checkpoint", memory_mb=256
    )
    sid = sb["id"]
    put(api, sid, "/www/index.html", "still here\n")
    background(api, sid, "httpd -f -p 127.0.0.1:8000 -h /www")
    wait_until(lambda: api.post(f"/sandboxes/{sid}/exec", json={"cmd": "wget -q -O- http://127.0.0.1:8000/"})
               .json()["stdout"] == "still here\n", 20, what="httpd")  # fmt: skip
    assert api.post(f"/sandboxes/{sid}/pause", json={}).json()["status"] == "paused"
    with preview(server, sid, 8000, timeout=120) as c:
        r = c.get("/")
        assert r.status_code == 200 and r.text == "still here\n", r.text
    assert api.get(f"/sandboxes/{sid}").json()["status"] == "running"
    # Without auto_resume, a paused sandbox's preview says so.
    other = create(api, ports=[{"port": 8000, "public": True}], memory_mb=256)
    api.post(f"/sandboxes/{other['id']}/pause", json={})
    with preview(server, other["id"], 8000) as c:
        r = c.get("/")
        assert r.status_code == 503 and "paused" in r.text and r.headers["retry-after"]


def test_preview_ports_are_validated(api):
    r = api.post("/sandboxes", json={"image": "busybox", "ports": [0], "wait": False})
    assert (
        r.status_code == 422 and r.json()["detail"] == "ports.0: Input should be greater than or equal to 1"
    )
    sb = create(api, memory_mb=256)
    assert api.post(f"/sandboxes/{sb['id']}/ports", json={"port": 70000}).status_code == 422
    assert api.delete(f"/sandboxes/{sb['id']}/ports/8000").status_code == 404


def test_preview_links_use_the_configured_domain(settings):
    from runtime.services import previews

    settings.HANGAR_PREVIEW_DOMAIN, settings.HANGAR_PREVIEW_SCHEME, settings.HANGAR_PREVIEW_PORT = (
        "preview.example.com", "https", 443)  # fmt: skip
    assert previews.base_url("sbabc", 3000) == "https://3000-sbabc.preview.example.com"
    assert previews.parse_host("3000-sbabc.preview.example.com") == (3000, "sbabc")
    assert previews.parse_host("3000-sbabc.preview.example.com:443") == (3000, "sbabc")
    assert previews.parse_host("3000-sbabc.evil.com") is None
    assert previews.parse_host("99999-sbabc.preview.example.com") is None
    token = previews.sign("sbabc", 3000)
    assert previews.verify(token, "sbabc", 3000) and not previews.verify(token, "sbabc", 3001)


def test_a_10_mb_download_streams_through_without_being_held_whole(api, server_process):
    server = server_process.url
    sb = create(api, ports=[{"port": 8000, "public": True}], memory_mb=256)
    sid = sb["id"]
    api.post(
        f"/sandboxes/{sid}/exec",
        json={"cmd": "mkdir -p /www && head -c 10485760 /dev/urandom > /www/big.bin"},
    )
    want = (
        api.post(f"/sandboxes/{sid}/exec", json={"cmd": "sha256sum /www/big.bin"}).json()["stdout"].split()[0]
    )
    background(api, sid, "httpd -f -p 127.0.0.1:8000 -h /www")
    wait_until(lambda: api.post(f"/sandboxes/{sid}/exec", json={"cmd": "wget -q -O /dev/null http://127.0.0.1:8000/big.bin"})
               .json()["exit_code"] == 0, 20, what="httpd")  # fmt: skip
    with preview(server, sid, 8000) as c:
        c.get("/big.bin")  # once, so what the server keeps for good is in the baseline
        digest, size = hashlib.sha256(), 0
        with RssWatch(server_process.pid) as rss, c.stream("GET", "/big.bin") as r:
            assert r.status_code == 200
            for chunk in r.iter_bytes():
                digest.update(chunk)
                size += len(chunk)
    assert size == 10 * 1024 * 1024 and digest.hexdigest() == want
    assert rss.growth < 6 * MiB, f"the server grew by {rss.growth // MiB} MiB while streaming 10 MiB"


# After the handshake, 300 binary messages of 1 MiB each (zeros), as fast as the sandbox can.
WS_FLOOD = r"""#!/bin/sh
key=""
while IFS= read -r line; do
  line=$(printf '%s' "$line" | tr -d '\r')
  [ -z "$line" ] && break
  case "$line" in [Ss]ec-[Ww]eb[Ss]ocket-[Kk]ey:*) key=$(printf '%s' "${line#*:}" | tr -d ' ');; esac
done
accept=$(printf '%s' "${key}258EAFA5-E914-47DA-95CA-C5AB0DC85B11" | sha1sum | cut -d' ' -f1 | xxd -r -p | base64)
printf 'HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: %s\r\n\r\n' "$accept"
i=0
while [ $i -lt 300 ]; do
  printf '\202\177\000\000\000\000\000\020\000\000'
  head -c 1048576 /dev/zero
  i=$((i + 1))
done
printf '\210\002\003\350'
sleep 1
"""


@pytest.fixture
def big_site(api):
    """A sandbox serving a sparse 400 MiB /www/big on public port 8000, and 300 MiB of websocket
    messages on public port 8001."""
    sb = create(api, ports=[{"port": 8000, "public": True}, {"port": 8001, "public": True}], memory_mb=256)
    sid = sb["id"]
    put(api, sid, "/flood.sh", WS_FLOOD, "755")
    put(api, sid, "/www/index.html", "ok\n")
    cmd = f"mkdir -p /www && dd if=/dev/zero of=/www/big bs={MiB} seek={BIG // MiB - 1} count=1 2>/dev/null"
    assert api.post(f"/sandboxes/{sid}/exec", json={"cmd": cmd}).json()["exit_code"] == 0
    background(api, sid, "httpd -f -p 127.0.0.1:8000 -h /www")
    background(api, sid, "nc -ll -p 8001 -e /flood.sh")
    wait_until(lambda: api.post(f"/sandboxes/{sid}/exec", json={"cmd": "wget -q -O- http://127.0.0.1:8000/"})
               .json()["stdout"] == "ok\n", 20, what="httpd")  # fmt: skip
    return sid


def test_a_slow_reader_of_a_large_preview_answer_costs_the_server_little_memory(big_site, server_process):
    """Anybody may read a public preview: one who reads 400 MiB at ~1.6 MB/s must not make the
    server hold what the sandbox's server sends faster."""
    host = f"8000-{big_site}.localhost"
    with RssWatch(server_process.pid) as rss:
        reader = SlowReader(server_process.url, "/big", host=host)
        assert reader.status == 200 and int(reader.headers["content-length"]) == BIG
        reader.read_slowly(8)
        slow = rss.growth
        assert reader.read_rest() == BIG
    print(f"preview: server RSS +{slow / MiB:.1f} MiB while slow, +{rss.growth / MiB:.1f} MiB in all")
    assert rss.growth < 64 * MiB, f"the server grew by {rss.growth / MiB:.0f} MiB"


def test_a_websocket_client_that_stops_reading_holds_the_server_back(big_site, server_process):
    """A preview's websocket sends 300 MiB to a client that takes nothing for a while (its library
    stops reading the socket once a few messages wait): the server holds the messages back,
    not in memory, and the client gets every one after."""
    from websockets.sync.client import connect

    port = urlsplit(server_process.url).port
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    with (
        RssWatch(server_process.pid) as rss,
        connect(
            f"ws://8001-{big_site}.localhost:{port}/", sock=sock, open_timeout=20, max_size=None, max_queue=2
        ) as ws,
    ):
        time.sleep(8)
        slow = rss.growth
        got = 0
        with contextlib.suppress(ConnectionClosedOK):
            while True:
                got += len(ws.recv(timeout=60))
    print(
        f"preview websocket: server RSS +{slow / MiB:.1f} MiB while the client waited, +{rss.growth / MiB:.1f} MiB in all"
    )
    assert got == 300 * MiB
    assert rss.growth < 64 * MiB, f"the server grew by {rss.growth / MiB:.0f} MiB"
