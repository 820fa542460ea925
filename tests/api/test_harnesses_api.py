"""Harnesses end to end, with real parts: a git repository served by ``git daemon`` on the
test machine (in the ``world`` namespace) is cloned into a new harness's workspace volume in
gVisor; a scripted agent run edits files; the run's diff shows the change; pause and resume
keep the edit and the git state."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from runtime.models import AuditEvent

from ..support import WORLD_A, wait_until

pytestmark = pytest.mark.timeout(300)
GIT_NET = {"egress": "allowlist", "allow": [f"{WORLD_A}:9418"]}
# The scripted agent: appends the prompt (from $HANGAR_PROMPT) to the README, writes a new
# file with what it read on stdin, and says where it ran.
AGENT = (
    'echo "$HANGAR_PROMPT" >> README.md; read -r line; printf "%s\\n" "$line" > from-stdin.txt; '
    'echo "agent ran in $(pwd) as run $HANGAR_RUN_ID"'
)


def wait_status(api: httpx.Client, hid: str, want: str, timeout: float = 120) -> dict:
    seen = {}

    def check() -> bool:
        seen.update(api.get(f"/harnesses/{hid}").json())
        assert seen["status"] != "failed" or want == "failed", seen
        return seen["status"] == want

    wait_until(
        check, timeout, what=f"harness {hid} {want} (last: {seen.get('status')} {seen.get('setup_error')})"
    )
    return seen


def wait_run(api: httpx.Client, run_id: str, timeout: float = 120) -> dict:
    seen = {}

    def done() -> bool:
        seen.update(api.get(f"/runs/{run_id}").json())
        return seen["status"] not in ("queued", "running")

    try:
        wait_until(done, timeout, what=f"run {run_id} to end")
    except AssertionError:
        raise AssertionError(f"run {run_id} did not end within {timeout} s: {seen}") from None
    return seen


def sh(api: httpx.Client, sandbox: str, cmd: str) -> dict:
    # Commands name paths relative to their cwd: Debian 12's runsc (2022) answers statx() on an
    # absolute path with EINVAL, which Debian's coreutils (ls -l /x, stat /x) trip over.
    r = api.post(f"/sandboxes/{sandbox}/exec", json={"cmd": cmd, "timeout_s": 60})
    assert r.status_code == 200, r.text
    return r.json()


def log_text(api: httpx.Client, hid: str) -> str:
    return "\n".join(e["text"] for e in api.get(f"/harnesses/{hid}/logs").json())


def create(api: httpx.Client, **fields) -> dict:
    body = {"agent": "custom", "command": AGENT, "image": "minimal", "disk_mb": 256, "memory_mb": 512,
            "network": GIT_NET, **fields}  # fmt: skip
    r = api.post("/harnesses", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def test_a_repository_is_cloned_a_run_edits_it_and_pause_resume_keeps_the_edit(
    api, minimal_image, git_server
):
    h = create(api, name="web", repo={"url": git_server})
    assert h["status"] == "creating" and h["volume_name"] == "web-workspace"
    assert h["ssh_command"].startswith("ssh -p ") and h["ssh_command"].split()[-1].startswith("web@")
    h = wait_status(api, h["id"], "running")
    log = log_text(api, h["id"])
    assert f"cloning {git_server}" in log and "checked out main" in log and "workspace ready" in log

    out = sh(
        api, h["sandbox"], "cd /workspace && git log --oneline && ls -a && echo HOME=$HOME && git status -s"
    )
    assert "first" in out["stdout"] and "README.md" in out["stdout"] and "app.py" in out["stdout"]
    # Hangar's own files (.hangar/, lost+found/) do not show in git status.
    assert out["stdout"].rstrip().endswith("HOME=/workspace/.hangar/home"), out["stdout"]
    # The harness's own API token and OTLP settings are in its environment.
    env = sh(api, h["sandbox"], "env")["stdout"]
    assert "HANGAR_API_TOKEN=hgr_" in env and "OTEL_EXPORTER_OTLP_ENDPOINT=" in env
    assert f"hangar.harness.id={h['id']}" in env

    r = api.post(f"/harnesses/{h['id']}/runs", json={"prompt": "add a usage section"})
    assert r.status_code == 201, r.text
    run = r.json()
    assert run["status"] == "queued"
    # The log streams (NDJSON) and ends with the run's record.
    with api.stream("GET", f"/runs/{run['id']}/logs") as resp:
        lines = [json.loads(x) for x in resp.iter_lines() if x]
    out_text = "".join(x.get("data", "") for x in lines if x["type"] == "stdout")
    assert f"agent ran in /workspace as run {run['id']}" in out_text
    assert lines[-1]["type"] == "run" and lines[-1]["id"] == run["id"]
    run = wait_run(api, run["id"])
    assert run["status"] == "succeeded" and run["exit_code"] == 0 and run["duration_ms"] > 0, run
    assert "+add a usage section" in run["diff"] and "README.md" in run["diff"]
    assert "+add a usage section" in run["diff"].split("+++ b/from-stdin.txt")[1]
    assert ".hangar" not in run["diff"]
    assert f"run {run['id']} succeeded" in log_text(api, h["id"])
    # The run's trace: its diff under its root, the run as the GenAI conversation; the harness's
    # traces hold the plain commands run in its sandbox too (tied to it by its sandbox), not only its runs.
    from .test_hangar_spans import _trace

    spans = _trace(api, run["trace_id"], {"invoke_agent", "run.diff"})
    assert spans["run.diff"]["parent_span_id"] == spans["invoke_agent"]["span_id"]
    assert spans["run.diff"]["attributes"]["hangar.run.id"] == run["id"]
    assert spans["invoke_agent"]["attributes"]["gen_ai.conversation.id"] == run["id"]
    roots = {t["root_name"] for t in api.get("/traces", params={"harness": h["id"]}).json()}
    assert {"invoke_agent", "exec"} <= roots, roots

    # The agent's own config lives in its HOME, on the volume.
    config = 'mkdir -p "$HOME/.claude" && echo \'{"theme": "dark"}\' > "$HOME/.claude/settings.json"'
    assert sh(api, h["sandbox"], config)["exit_code"] == 0
    r = api.post(f"/harnesses/{h['id']}/pause", json={"wait": True})
    assert r.status_code == 200 and r.json()["status"] == "paused", r.text
    r = api.post(f"/harnesses/{h['id']}/resume", json={"wait": True})
    assert r.status_code == 200, r.text
    wait_status(api, h["id"], "running")
    out = sh(
        api, h["sandbox"], "cd /workspace && cat README.md && git status --porcelain && git log --oneline"
    )
    assert "add a usage section" in out["stdout"]
    assert (
        " M README.md" in out["stdout"] and "?? from-stdin.txt" in out["stdout"] and "first" in out["stdout"]
    )
    assert sh(api, h["sandbox"], 'cat "$HOME/.claude/settings.json"')["stdout"] == '{"theme": "dark"}\n'

    # A second run's diff is only what that run did.
    assert [x["id"] for x in api.get(f"/harnesses/{h['id']}/runs").json()] == [run["id"]]
    second = wait_run(api, api.post(f"/harnesses/{h['id']}/runs", json={"prompt": "x"}).json()["id"])
    added = [ln for ln in second["diff"].splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    assert added == ["+x", "+x"], second["diff"]  # README.md and from-stdin.txt


def test_pause_and_resume_without_a_body_answer_once_done(api, minimal_image):
    # As for sandboxes, wait is true unless the body says otherwise.
    h = create(api, name="waits", network={"egress": "none"})
    wait_status(api, h["id"], "running")
    r = api.post(f"/harnesses/{h['id']}/pause")
    assert (
        r.status_code == 200 and r.json()["status"] == "paused" and r.json()["sandbox_status"] == "paused"
    ), r.text
    r = api.post(f"/harnesses/{h['id']}/resume")
    assert r.status_code == 200 and r.json()["sandbox_status"] == "running", r.text
    # wait: false answers at once (the pause is usually still under way then).
    r = api.post(f"/harnesses/{h['id']}/pause", json={"wait": False})
    assert r.status_code == 200 and r.json()["sandbox_status"] in ("pausing", "paused"), r.text
    wait_status(api, h["id"], "paused")


def test_a_branch_is_checked_out_and_runs_end_failed_timed_out_or_cancelled(api, minimal_image, git_server):
    h = create(api, name="branchy", repo={"url": git_server, "branch": "feature"},
               command='case "$HANGAR_PROMPT" in fail) exit 3;; sleep) sleep 60;; esac; echo ok')  # fmt: skip
    h = wait_status(api, h["id"], "running")
    listing = sh(api, h["sandbox"], "cd /workspace && ls")
    assert "feature.txt" in listing["stdout"], (listing, log_text(api, h["id"]))
    assert "checked out feature" in log_text(api, h["id"])

    failed = api.post(f"/harnesses/{h['id']}/runs", json={"prompt": "fail"}).json()
    slow = api.post(f"/harnesses/{h['id']}/runs", json={"prompt": "sleep", "timeout_s": 2}).json()
    assert wait_run(api, failed["id"])["status"] == "failed"
    assert api.get(f"/runs/{failed['id']}").json()["exit_code"] == 3
    slow = wait_run(api, slow["id"])
    assert slow["status"] == "timed_out" and "timeout of 2 s" in slow["error"], slow

    cancelled = api.post(f"/harnesses/{h['id']}/runs", json={"prompt": "sleep"}).json()
    wait_until(
        lambda: api.get(f"/runs/{cancelled['id']}").json()["status"] == "running", 60, what="run started"
    )
    t0 = time.monotonic()
    r = api.post(f"/runs/{cancelled['id']}/cancel")
    assert r.status_code == 200, r.text
    done = wait_run(api, cancelled["id"], timeout=30)
    assert done["status"] == "cancelled" and time.monotonic() - t0 < 20
    r = api.post(f"/runs/{cancelled['id']}/cancel")
    assert r.status_code == 409 and "cancelled" in r.json()["detail"]


def test_bad_input_is_refused_with_reasons(api, minimal_image, other_api):
    cases = [
        ({"name": "Bad Name", "agent": "custom", "command": "x"}, 422, "invalid harness name"),
        ({"name": "ok", "agent": "gpt-9"}, 422, "agent: Input should be 'claude-code'"),
        ({"name": "ok", "agent": "custom"}, 422, "needs a command"),
        ({"name": "ok", "agent": "claude-code", "command": "x"}, 422, "command is for the custom agent"),
        ({"name": "ok", "agent": "custom", "command": "x", "repo": {"url": "https://u:pw@example.com/r.git"}}, 422,
         "must not carry a password"),
        ({"name": "ok", "agent": "custom", "command": "x", "repo": {"url": "not a url"}}, 422, "not a git URL"),
        ({"name": "ok", "agent": "custom", "command": "x", "repo": {"url": "https://h/r.git", "branch": "-x"}}, 422,
         "not a valid branch"),
        ({"name": "ok", "agent": "custom", "command": "x", "secrets": ["NOPE"]}, 422, "no secret named 'NOPE'"),
        ({"name": "ok", "agent": "custom", "command": "x", "image": "nope"}, 400, "unknown image 'nope'"),
        ({"name": "ok", "agent": "custom", "command": "x", "network": {"egress": "sideways"}}, 422, "egress"),
    ]  # fmt: skip
    for body, status, words in cases:
        r = api.post("/harnesses", json={"image": "minimal", **body})
        assert r.status_code == status and words in r.json()["detail"], (body, r.status_code, r.text)
    assert api.get("/harnesses").json() == []
    assert api.get("/volumes").json() == [], "a refused harness left a volume behind"
    for path in ("/harnesses/nope", "/runs/nope"):
        assert api.get(path).status_code == 404
    r = api.post("/harnesses/nope/runs", json={"prompt": "x"})
    assert r.status_code == 404


def test_other_teams_cannot_see_or_touch_a_harness_and_deleting_keeps_the_volume(
    api, other_api, minimal_image, git_server
):
    h = create(api, name="mine", network={"egress": "none"})
    h = wait_status(api, h["id"], "running")
    run = api.post(f"/harnesses/{h['id']}/runs", json={"prompt": "x"}).json()
    for method, path in (("GET", f"/harnesses/{h['id']}"), ("GET", "/harnesses/mine"),
                         ("POST", f"/harnesses/{h['id']}/pause"), ("DELETE", f"/harnesses/{h['id']}"),
                         ("GET", f"/runs/{run['id']}"), ("GET", f"/runs/{run['id']}/logs"),
                         ("POST", f"/runs/{run['id']}/cancel"),
                         ("POST", f"/harnesses/{h['id']}/runs")):  # fmt: skip
        r = other_api.request(method, path, json={"prompt": "x"} if path.endswith("/runs") else None)
        assert r.status_code == 404, (method, path, r.status_code)
    assert other_api.get("/harnesses").json() == []
    # A sandbox cannot pass itself off as a harness's (whose token its environment would get).
    r = other_api.post("/sandboxes", json={"image": "busybox", "metadata": {"harness": h["id"]}})
    assert r.status_code == 422 and "Hangar's own" in r.json()["detail"]
    # The same name in another team is fine; twice in one team is not.
    r = api.post("/harnesses", json={"name": "mine", "agent": "custom", "command": "x", "image": "minimal"})
    assert r.status_code == 409
    wait_run(api, run["id"])

    r = api.delete(f"/harnesses/{h['id']}")
    assert r.status_code == 204
    assert api.get(f"/harnesses/{h['id']}").status_code == 404
    vols = {v["name"]: v for v in api.get("/volumes").json()}
    assert "mine-workspace" in vols, "deleting a harness deleted its volume without being asked"
    # The kept volume becomes a new harness's workspace, files and all.
    wait_until(
        lambda: not api.get("/volumes/mine-workspace").json()["attached_to"], 60, what="volume released"
    )
    again = create(api, name="mine", volume="mine-workspace", network={"egress": "none"})
    again = wait_status(api, again["id"], "running")
    assert "from-stdin.txt" in sh(api, again["sandbox"], "cd /workspace && ls")["stdout"]
    r = api.delete(f"/harnesses/{again['id']}", params={"delete_volume": "true"})
    assert r.status_code == 204
    wait_until(lambda: "mine-workspace" not in {v["name"] for v in api.get("/volumes").json()}, 60,
               what="the volume deleted with its harness")  # fmt: skip


def test_logs_of_an_unknown_run_are_a_404_before_any_byte(api):
    # A short timeout: a log stream that hangs instead of answering fails here at once.
    with httpx.Client(base_url=api.base_url, headers=api.headers, timeout=10) as client:
        r = client.get("/runs/nosuchrun/logs")
        assert r.status_code == 404 and "no run 'nosuchrun'" in r.json()["detail"]
        r = client.get("/runs/nosuchrun/logs", params={"offset": "99999999999999999999"})
        assert r.status_code == 422 and "offset" in r.json()["detail"]


# An HTTP request from inside a sandbox with bash alone (the minimal image has no curl).
BASH_HTTP = r"""
req() {
  u=${HANGAR_API_URL#http://}; hp=${u%%/*}; host=${hp%:*}; port=${hp#*:}
  exec 3<>"/dev/tcp/$host/$port" || exit 9
  printf '%s %s HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s' \
    "$1" "$2" "$hp" "$HANGAR_API_TOKEN" "${#3}" "$3" >&3
  cat <&3
}
"""


def test_the_agent_reaches_hangars_api_at_hangar_internal_with_its_token(api, minimal_image):
    h = create(api, name="caller", network={"egress": "none"})
    h = wait_status(api, h["id"], "running")
    assert h["network"]["hangar"] is True
    env = sh(api, h["sandbox"], "echo $HANGAR_API_URL; getent hosts hangar.internal")["stdout"].split()
    assert env[0].startswith("http://hangar.internal:") and env[0].endswith("/api/v1"), env
    gateway = env[1]
    script = (
        BASH_HTTP
        + 'req GET /api/v1/sandboxes ""; echo; req POST /api/v1/sandboxes \'{"image": "busybox", "wait": true}\'; '
        + f'echo; req PUT /api/v1/sandboxes/{h["sandbox"]}/network \'{{"egress": "all"}}\''
        + '; echo; echo PAGES; req GET /login/ ""; echo; req POST /admin/login/ ""'
    )
    r = api.post(
        f"/sandboxes/{h['sandbox']}/exec", json={"cmd": ["/bin/bash", "-c", script], "timeout_s": 60}
    )
    out = r.json()["stdout"]
    assert "HTTP/1.1 200" in out and h["sandbox"] in out, out
    assert "HTTP/1.1 201" in out, out
    assert "HTTP/1.1 403" in out and "cannot change its harness's network" in out, out
    # Only the API and OTLP pass the node's door: the sign-in page and the admin never answer.
    pages = out.split("PAGES", 1)[1]
    assert pages.count("HTTP/1.1 403") == 2 and pages.count("hangar.internal passes only") == 2, pages
    # A terminal opened on the harness's sandbox, wherever from, starts in /workspace.
    from runtime.models import Terminal

    t = api.post(f"/sandboxes/{h['sandbox']}/terminals", json={"name": "from-the-api"})
    assert t.status_code == 201, t.text
    assert Terminal.objects.get(id=t.json()["id"]).cwd == "/workspace"
    made = [s for s in api.get("/sandboxes").json() if s["image"] == "busybox"]
    assert len(made) == 1 and made[0]["status"] == "running", (
        "the agent's sandbox is the team's like any other"
    )
    # Its token is the harness's own: revoked when the harness goes (checked below), and
    # hangar.internal is closed to sandboxes not let through.
    r = api.put(f"/sandboxes/{h['sandbox']}/network", json={"egress": "none", "hangar": False})
    assert r.status_code == 200, r.text
    probe = f"timeout 5 bash -c 'exec 3<>/dev/tcp/{gateway}/{env[0].rsplit(':', 1)[1].split('/')[0]}' && echo open"
    assert "open" not in sh(api, h["sandbox"], probe)["stdout"]
    token = sh(api, h["sandbox"], "echo $HANGAR_API_TOKEN")["stdout"].strip()
    assert api.delete(f"/harnesses/{h['id']}").status_code == 204
    r = httpx.get(f"{api.base_url}sandboxes", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 401, "a deleted harness's token still works"


def hangar_call(
    api: httpx.Client, sandbox: str, method: str, path: str, body: dict | None = None
) -> tuple[int, str]:
    """A request to Hangar's API from inside ``sandbox`` (busybox wget, through hangar.internal,
    with the harness's own token): its status and body."""
    post = f"--post-data '{json.dumps(body or {})}' " if method == "POST" else ""
    cmd = ('wget -S -O - --header "Authorization: Bearer $HANGAR_API_TOKEN" --header "Content-Type: application/json" '
           f'{post}"$HANGAR_API_URL{path}" 2>&1')  # fmt: skip
    out = sh(api, sandbox, cmd)["stdout"]
    statuses = re.findall(r"HTTP/1\.[01] (\d{3})", out)
    assert statuses, out
    return int(statuses[-1]), out


def test_a_harness_token_reaches_only_its_own_sandbox_and_those_it_creates(api, server):
    a = create(api, name="agent-a", image="busybox", command="cat", network={"egress": "none"})
    b = create(api, name="agent-b", image="busybox", command="cat", network={"egress": "none"})
    a, b = wait_status(api, a["id"], "running"), wait_status(api, b["id"], "running")
    mine, theirs = a["sandbox"], b["sandbox"]
    sh(api, theirs, "echo agent-b-credentials > /workspace/creds")

    # From inside harness A, with its own token: harness B's sandbox is not there at all.
    for method, path, body in (("GET", f"/sandboxes/{theirs}", None),
                               ("POST", f"/sandboxes/{theirs}/exec", {"cmd": "cat /workspace/creds"}),
                               ("GET", f"/sandboxes/{theirs}/files?path=/workspace/creds", None),
                               ("POST", f"/sandboxes/{theirs}/terminals", {}),
                               ("GET", f"/sandboxes/{theirs}/processes", None)):  # fmt: skip
        status, out = hangar_call(api, mine, method, path, body)
        assert status == 404 and "agent-b-credentials" not in out, (method, path, out)
    # Its own sandbox is.
    status, out = hangar_call(api, mine, "POST", f"/sandboxes/{mine}/exec", {"cmd": "echo own-$((2+2))"})
    assert status == 200 and "own-4" in out, out
    assert hangar_call(api, mine, "GET", f"/sandboxes/{mine}/files/list?path=/workspace")[0] == 200
    # A sandbox it creates is its own too, and the list shows only what it reaches.
    status, out = hangar_call(api, mine, "POST", "/sandboxes", {"image": "busybox", "memory_mb": 256})
    assert status == 201, out
    made = json.JSONDecoder().raw_decode(out[out.index("{") :])[0]["id"]
    status, out = hangar_call(api, mine, "POST", f"/sandboxes/{made}/exec", {"cmd": "echo made-$((3+3))"})
    assert status == 200 and "made-6" in out, out
    status, out = hangar_call(api, mine, "GET", "/sandboxes")
    assert status == 200 and mine in out and made in out and theirs not in out, out
    # Nothing else of the team's: no volumes, harnesses, secrets or tokens, and a sandbox it
    # creates gets neither the team's other secrets nor a volume (another workspace, say).
    for path in ("/volumes", "/harnesses", "/secrets", "/tokens"):
        assert hangar_call(api, mine, "GET", path)[0] == 403, path
    api.post("/secrets", json={"name": "OTHER_KEY", "value": "not-for-agent-a"})
    assert (
        hangar_call(api, mine, "POST", "/sandboxes", {"image": "busybox", "secrets": ["OTHER_KEY"]})[0] == 403
    )
    body = {"image": "busybox", "volumes": [{"volume": b["volume_name"], "mount_path": "/mnt"}]}
    assert hangar_call(api, mine, "POST", "/sandboxes", body)[0] == 403

    # busybox wget shows no error's body: the audited refusals say why.
    def refused() -> str:
        return " ".join(AuditEvent.objects.filter(action="api.refused").values_list("message", flat=True))

    wait_until(lambda: "only its harness's secrets" in refused() and "cannot attach volumes" in refused(), 10,
               what="the refusals audited")  # fmt: skip
    # The same holds on websockets: harness B's sandbox is not found for A's token.
    token = sh(api, mine, "echo $HANGAR_API_TOKEN")["stdout"].strip()
    url = server.replace("http://", "ws://") + f"/ws/v1/sandboxes/{theirs}/exec"
    with connect(url, additional_headers={"Authorization": f"Bearer {token}"}, open_timeout=20) as ws:
        with pytest.raises(ConnectionClosed) as closed:  # accepted, then closed: not this token's
            while True:
                ws.recv(timeout=15)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4404
    with connect(url.replace(theirs, made), additional_headers={"Authorization": f"Bearer {token}"}) as ws:
        ws.send(json.dumps({"cmd": "echo via-socket"}))
        assert json.loads(ws.recv(timeout=15))["type"] == "start"
