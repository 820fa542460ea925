"""The agent presets up to the launch of their CLI, secrets kept out of everything Hangar
writes, idle harnesses pausing themselves (unless a run is going), and the harness quota.

No model API (nor the npm registry) is reachable from a test, so the presets are driven with
a stand-in ``npm`` on the workspace volume: it records how it was called and "installs" a CLI
that records its arguments, environment and stdin. What is real is Hangar's side: finding the
CLI missing, installing it into the workspace's tool directory, recording its ``--version``,
and starting it with the preset's headless arguments and the harness's credentials."""

from __future__ import annotations

import hashlib
import json
import subprocess
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from ..support import WORLD_A, wait_until
from .test_harnesses_api import create, log_text, sh, wait_run, wait_status

pytestmark = pytest.mark.timeout(400)

FAKE_NPM = r"""#!/bin/sh
# A stand-in for npm: records its arguments and installs a stand-in CLI.
echo "npm $*" >> /workspace/.hangar/npm.log
prefix=""; pkg=""
while [ $# -gt 0 ]; do
  case "$1" in --prefix) prefix=$2; shift;; -*|install) ;; *) pkg=$1;; esac; shift
done
case "$pkg" in
  @anthropic-ai/claude-code) bin=claude;; @openai/codex) bin=codex;; opencode-ai) bin=opencode;;
  @mariozechner/pi-coding-agent) bin=pi;; *) echo "no such package $pkg" >&2; exit 1;;
esac
mkdir -p "$prefix/bin"
cat > "$prefix/bin/$bin" <<EOF
#!/bin/sh
if [ "\$1" = "--version" ]; then echo "9.9.9 (stand-in \$0)"; exit 0; fi
printf '%s\n' "\$@" > /tmp/argv.txt
env | cut -d= -f1 | sort > /tmp/env.txt
echo "ANTHROPIC_API_KEY \$(printf %s "\$ANTHROPIC_API_KEY" | sha256sum | cut -d' ' -f1)" > /tmp/keys.txt
echo "OPENAI_API_KEY \$(printf %s "\$OPENAI_API_KEY" | sha256sum | cut -d' ' -f1)" >> /tmp/keys.txt
cat > /tmp/stdin.txt
echo "stand-in $bin ran"
EOF
chmod 755 "$prefix/bin/$bin"
"""
PRESET_CASES = [
    ("claude-code", "claude", ["-p", "{p}", "--dangerously-skip-permissions"], "ANTHROPIC_API_KEY", ["IS_SANDBOX"]),
    ("codex", "codex", ["exec", "--dangerously-bypass-approvals-and-sandbox", "--skip-git-repo-check", "{p}"],
     "OPENAI_API_KEY", ["CODEX_HOME"]),
    ("opencode", "opencode", ["run", "{p}"], "ANTHROPIC_API_KEY", []),
    ("pi", "pi", ["-p", "{p}"], "ANTHROPIC_API_KEY", []),
]  # fmt: skip


def _sha(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def test_each_preset_is_installed_when_missing_and_launched_headless_with_its_credentials(api, minimal_image):
    keys = {"ANTHROPIC_API_KEY": "sk-ant-test-" + "a" * 20, "OPENAI_API_KEY": "sk-openai-test-" + "b" * 20}
    for name, value in keys.items():
        assert api.post("/secrets", json={"name": name, "value": value}).status_code == 201
    assert api.post("/volumes", json={"name": "agents", "size_mb": 256}).status_code == 201
    # Put the stand-in npm where the harness will find it (its tool directory is on the volume).
    sb = api.post("/sandboxes", json={"image": "minimal", "wait": True,
                                      "volumes": [{"volume": "agents", "mount_path": "/workspace"}]}).json()  # fmt: skip
    r = api.put(f"/sandboxes/{sb['id']}/files", params={"path": "/workspace/.hangar/tools/bin/npm"},
                content=FAKE_NPM.encode())  # fmt: skip
    assert r.status_code in (200, 201, 204), r.text
    assert sh(api, sb["id"], "chmod 755 /workspace/.hangar/tools/bin/npm")["exit_code"] == 0
    assert api.delete(f"/sandboxes/{sb['id']}").status_code in (200, 202, 204)
    wait_until(lambda: not api.get("/volumes/agents").json()["attached_to"], 60, what="the volume released")

    for preset, binary, argv, key, extra_env in PRESET_CASES:
        h = create(api, name=f"h-{binary}", agent=preset, command=None, volume="agents",
                   secrets=list(keys), network={"egress": "none"})  # fmt: skip
        h = wait_status(api, h["id"], "running")
        log = log_text(api, h["id"])
        assert h["agent_version"].startswith("9.9.9 (stand-in"), (preset, h["agent_version"], log)
        package = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex", "opencode": "opencode-ai",
                   "pi": "@mariozechner/pi-coding-agent"}[binary]  # fmt: skip
        assert f"installing {package} into /workspace/.hangar/tools" in log, log
        npm_log = sh(api, h["sandbox"], "cat /workspace/.hangar/npm.log")["stdout"]
        if preset == "codex":  # its telemetry to Hangar, in its config.toml; the token not in any file
            assert "Codex telemetry: to http://hangar.internal:" in log, log
            config = api.get(f"/sandboxes/{h['sandbox']}/files",
                             params={"path": "/workspace/.hangar/home/.codex/config.toml"}).text  # fmt: skip
            assert "[otel]" in config and '/v1/traces", protocol = "binary"' in config, config
            found = sh(api, h["sandbox"], '[ -n "$HANGAR_API_TOKEN" ] || echo no token; grep -rlF "$HANGAR_API_TOKEN" '
                                          "/workspace /root /tmp /etc /home 2>/dev/null; echo end")  # fmt: skip
            assert found["stdout"] == "end\n", found
        assert (
            f"npm install --global --no-fund --no-audit --prefix /workspace/.hangar/tools {package}"
            in npm_log
        )

        prompt = f"make {binary} do it; with 'quotes' and $dollars"
        run = api.post(f"/harnesses/{h['id']}/runs", json={"prompt": prompt}).json()
        run = wait_run(api, run["id"])
        assert run["status"] == "succeeded", (preset, run)
        got = sh(api, h["sandbox"], "cat /tmp/argv.txt; echo ---; cat /tmp/env.txt; echo ---; cat /tmp/keys.txt; "
                                    "echo ---; cat /tmp/stdin.txt")["stdout"]  # fmt: skip
        argv_seen, env_seen, keys_seen, stdin_seen = got.split("---\n")
        assert argv_seen.splitlines() == [a.replace("{p}", prompt) for a in argv], (preset, argv_seen)
        names = set(env_seen.split())
        wanted = {
            key,
            "HANGAR_PROMPT",
            "HANGAR_RUN_ID",
            "HANGAR_API_TOKEN",
            "HANGAR_API_URL",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_HEADERS",
            "OTEL_RESOURCE_ATTRIBUTES",
            *extra_env,
        }
        assert wanted <= names, (preset, wanted - names)
        assert f"{key} {_sha(keys[key])}" in keys_seen, (preset, keys_seen)
        assert stdin_seen == prompt, (preset, stdin_seen)
        assert api.delete(f"/harnesses/{h['id']}").status_code == 204
        wait_until(
            lambda: not api.get("/volumes/agents").json()["attached_to"], 60, what="the volume released"
        )


def test_a_preset_whose_cli_cannot_be_installed_fails_its_setup_with_the_reason(api, minimal_image):
    h = create(api, name="no-npm", agent="claude-code", command=None, network={"egress": "none"})
    h = wait_status(api, h["id"], "failed")
    assert h["setup"] == "failed" and "see the log" in h["setup_error"]
    assert "Claude Code is not in the image and npm is not there to install it" in log_text(api, h["id"])
    r = api.post(f"/harnesses/{h['id']}/runs", json={"prompt": "x"})
    assert r.status_code == 409 and "setup failed" in r.json()["detail"]
    # Resume tries the setup again (here it fails again, for the same reason).
    r = api.post(f"/harnesses/{h['id']}/resume")
    assert r.status_code == 200 and r.json()["setup"] in ("pending", "running", "failed"), r.text
    wait_until(lambda: log_text(api, h["id"]).count("npm is not there") == 2, 60, what="the setup retried")
    assert "trying the workspace setup again" in log_text(api, h["id"])
    assert wait_status(api, h["id"], "failed")["setup"] == "failed"


def test_secret_values_appear_nowhere_hangar_writes(api, minimal_image, git_server, client):
    value = "sk-ant-never-show-" + "q" * 24
    token = "ghp_never_show_" + "r" * 24
    assert api.post("/secrets", json={"name": "ANTHROPIC_API_KEY", "value": value}).status_code == 201
    assert api.post("/secrets", json={"name": "GIT_TOKEN", "value": token}).status_code == 201
    # An agent that prints its key, its whole environment, and exits non-zero with it.
    agent = (
        'echo "key=$ANTHROPIC_API_KEY"; env; echo "$ANTHROPIC_API_KEY" >&2; echo "git=$GIT_TOKEN"; '
        'echo "$ANTHROPIC_API_KEY" > leak.txt; exit 1'
    )
    h = create(api, name="leaky", command=agent, secrets=["ANTHROPIC_API_KEY"],
               repo={"url": git_server, "secret": "GIT_TOKEN"})  # fmt: skip
    h = wait_status(api, h["id"], "running")
    run = wait_run(
        api, api.post(f"/harnesses/{h['id']}/runs", json={"prompt": "print your key"}).json()["id"]
    )
    assert run["status"] == "failed"
    with api.stream("GET", f"/runs/{run['id']}/logs") as resp:
        streamed = resp.read().decode()
    assert "key=***" in streamed and "git=***" in streamed, "the agent's output was not masked"
    # The agent wrote its key into a file: the run's diff shows it masked.
    assert "+++ b/leak.txt" in run["diff"] and "+***" in run["diff"], run["diff"]
    # The values are in the agent's environment (it could use them)...
    got = sh(api, h["sandbox"], 'printf %s "$ANTHROPIC_API_KEY" | sha256sum')["stdout"]
    assert got.split()[0] == hashlib.sha256(value.encode()).hexdigest()
    # ... but not in any file of the workspace (git's credential helper names the variable).
    # (The values go in on stdin: a command's arguments are kept in the database.)
    r = api.post(f"/sandboxes/{h['sandbox']}/exec",
                 json={"cmd": "cd /workspace && grep -rlF -f - . ; echo end", "stdin": f"{value}\n{token}\n"})  # fmt: skip
    assert r.json()["stdout"] == "./leak.txt\nend\n", r.json()  # only the agent's own doing
    gitconfig = sh(api, h["sandbox"], "cat /workspace/.hangar/home/.gitconfig")["stdout"]
    assert "GIT_TOKEN" in gitconfig and token not in gitconfig

    answers = [
        streamed,
        json.dumps(api.get(f"/runs/{run['id']}").json()),
        json.dumps(api.get(f"/harnesses/{h['id']}").json()),
        json.dumps(api.get(f"/harnesses/{h['id']}/logs").json()),
        json.dumps(api.get(f"/harnesses/{h['id']}/runs").json()),
        json.dumps(api.get(f"/sandboxes/{h['sandbox']}").json()),
        json.dumps(api.get(f"/sandboxes/{h['sandbox']}/events").json()),
        json.dumps(api.get(f"/sandboxes/{h['sandbox']}/processes/{run['process']}").json()),
        api.get(f"/sandboxes/{h['sandbox']}/processes/{run['process']}/output").text,
        api.get("/audit").text,
    ]
    from django.contrib.auth import get_user_model

    client.force_login(get_user_model().objects.get(username="alice"))
    for page in (
        f"/harnesses/{h['id']}/",
        f"/runs/{run['id']}/",
        "/harnesses/",
        f"/sandboxes/{h['sandbox']}/",
    ):
        r = client.get(page)
        assert r.status_code == 200, page
        answers.append(r.content.decode())
    for text in answers:
        assert value not in text and token not in text
    db = connection.settings_dict
    dump = subprocess.run(
        ["pg_dump", "--data-only", "-h", db["HOST"] or "127.0.0.1", "-p", str(db["PORT"] or 5432), "-U",
         db["USER"] or "postgres", db["NAME"]], capture_output=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert b"print your key" in dump and b"key=***" in dump  # the run and its output are in it
    assert value.encode() not in dump and token.encode() not in dump


def test_an_idle_harness_pauses_itself_unless_a_run_is_going(api, minimal_image):
    from runtime.models import Sandbox
    from runtime.services.sandboxes import sandboxes_reap_expired

    h = create(api, name="sleepy", idle_timeout_s=30, network={"egress": "none"},
               command='case "$HANGAR_PROMPT" in wait) sleep 120;; esac')  # fmt: skip
    h = wait_status(api, h["id"], "running")
    assert h["idle_timeout_s"] == 30

    def idle_for(seconds: int) -> None:
        then = timezone.now() - timedelta(seconds=seconds)
        Sandbox.objects.filter(id=h["sandbox"]).update(last_activity_at=then, started_at=then)

    run = api.post(f"/harnesses/{h['id']}/runs", json={"prompt": "wait"}).json()
    wait_until(
        lambda: api.get(f"/runs/{run['id']}").json()["status"] == "running", 60, what="the run to start"
    )
    idle_for(300)
    sandboxes_reap_expired()
    assert api.get(f"/harnesses/{h['id']}").json()["status"] == "running", "paused in the middle of a run"
    api.post(f"/runs/{run['id']}/cancel")
    assert wait_run(api, run["id"])["status"] == "cancelled"

    idle_for(300)
    sandboxes_reap_expired()
    wait_status(api, h["id"], "paused", timeout=60)
    # A run on a paused harness resumes it first.
    again = wait_run(api, api.post(f"/harnesses/{h['id']}/runs", json={"prompt": "go"}).json()["id"])
    assert again["status"] == "succeeded", again
    assert api.get(f"/harnesses/{h['id']}").json()["status"] == "running"


def test_the_harness_quota_is_enforced_and_a_refusal_leaves_nothing_behind(api, minimal_image):
    team = api.get("/teams").json()[0]
    r = api.put(f"/teams/{team['id']}/quotas", json={"harnesses": 1})
    assert r.status_code == 200, r.text
    first = create(api, name="one", network={"egress": "none"})
    r = api.post("/harnesses", json={"name": "two", "agent": "custom", "command": "x", "image": "minimal"})
    assert r.status_code == 429 and r.json()["quota"] == "harnesses" and r.json()["limit"] == 1, r.text
    assert [v["name"] for v in api.get("/volumes").json()] == ["one-workspace"]
    assert api.get(f"/teams/{team['id']}/quotas").json()["harnesses"]["used"] == 1
    assert api.delete(f"/harnesses/{first['id']}").status_code == 204
    r = api.post("/harnesses", json={"name": "two", "agent": "custom", "command": "x", "image": "minimal",
                                     "network": {"egress": "none"}})  # fmt: skip
    assert r.status_code == 201, r.text


def test_a_private_repository_is_cloned_with_a_token_from_a_secret(api, minimal_image, private_git_server):
    url, _user, token = private_git_server
    net = {"egress": "allowlist", "allow": [f"{WORLD_A}:8081"]}
    # Without the credential: the clone is refused, and says so (git never prompts).
    h = create(api, name="no-token", repo={"url": url}, network=net)
    h = wait_status(api, h["id"], "failed")
    assert "could not read Username" in log_text(api, h["id"]) or "Authentication failed" in log_text(
        api, h["id"]
    )
    # With it: cloned; git reads the token from the environment when it asks, so fetches work
    # later too, and the token is in no file of the workspace.
    assert api.post("/secrets", json={"name": "REPO_TOKEN", "value": token}).status_code == 201
    h = create(api, name="with-token", repo={"url": url, "secret": "REPO_TOKEN"}, network=net)
    h = wait_status(api, h["id"], "running")
    assert "checked out main" in log_text(api, h["id"])
    out = sh(
        api,
        h["sandbox"],
        "cd /workspace && git fetch origin feature && git log --oneline FETCH_HEAD | head -1",
    )
    assert out["exit_code"] == 0 and "feature" in out["stdout"], out
    r = api.post(f"/sandboxes/{h['sandbox']}/exec",
                 json={"cmd": "cd /workspace && grep -rlF -f - . ; echo end", "stdin": token + "\n"})  # fmt: skip
    assert r.json()["stdout"] == "end\n"
    assert token not in log_text(api, h["id"]) and token not in json.dumps(
        api.get(f"/harnesses/{h['id']}").json()
    )
