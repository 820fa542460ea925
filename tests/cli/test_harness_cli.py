"""``hangar harness …``, ``hangar run …`` and ``hangar volume …`` against the real stack: a
harness created and waited for, a task run with its output followed and its status as the
CLI's, the runs listed, a run's record, logs and diff, and volumes."""

from __future__ import annotations

import json

import pytest

from tests.support import requires_runsc

pytestmark = [requires_runsc, pytest.mark.timeout(300)]

AGENT = 'echo "task: $HANGAR_PROMPT"; echo to-stderr >&2; case "$HANGAR_PROMPT" in fail*) exit 4;; esac'


def test_a_harness_from_create_to_rm(cli):
    made = cli("harness", "create", "cli-h", "--agent", "custom", "--command", AGENT, "--image", "busybox",
               "--memory-mb", "256", "--disk-mb", "32", "--network", "none", "--json")  # fmt: skip
    assert made.returncode == 0, made.stderr
    h = json.loads(made.stdout)
    assert (h["name"], h["status"], h["setup"]) == ("cli-h", "running", "done")
    try:
        assert "cli-h" in cli("harness", "list").stdout
        listed = cli("harness", "list", "--json")
        assert listed.returncode == 0 and [x["id"] for x in json.loads(listed.stdout)] == [h["id"]]
        assert json.loads(cli("harness", "get", "cli-h", "--json").stdout)["id"] == h["id"]

        ran = cli("harness", "run", "cli-h", "write the docs")
        assert ran.returncode == 0, ran.stderr
        assert (
            ran.stdout == "task: write the docs\n" and "to-stderr" in ran.stderr and "succeeded" in ran.stderr
        )
        failed = cli("harness", "run", "cli-h", "fail on purpose", "--json")
        assert failed.returncode == 4
        run = json.loads(failed.stdout)
        assert (run["status"], run["exit_code"]) == ("failed", 4) and run["trace_id"]

        runs = json.loads(cli("harness", "runs", "cli-h", "--json").stdout)
        assert [r["prompt"] for r in runs] == ["fail on purpose", "write the docs"]
        got = cli("run", "get", run["id"])
        assert "failed" in got.stdout and run["trace_id"] in got.stdout
        got_json = cli("run", "get", run["id"], "--json")
        assert got_json.returncode == 0, got_json.stderr
        record = json.loads(got_json.stdout)
        assert (record["id"], record["status"], record["exit_code"]) == (run["id"], "failed", 4)
        assert record["prompt"] == "fail on purpose" and record["trace_id"] == run["trace_id"]
        logs = cli("run", "logs", run["id"])
        assert logs.stdout == "task: fail on purpose\n" and logs.returncode == 4
        assert cli("run", "diff", runs[1]["id"]).returncode == 0
        detached = cli("harness", "run", "cli-h", "later", "-d")
        assert detached.returncode == 0 and detached.stdout.strip().startswith("run")
        cli("run", "cancel", detached.stdout.strip())  # ended already or now: either way not a crash
        assert cli("harness", "logs", "cli-h").returncode == 0
        # A shell in its /workspace (here with a pipe, not a terminal: it works as one).
        shell = cli("harness", "shell", "cli-h", "--", "sh", "-c", "pwd; exit 6", input="")
        assert shell.returncode == 6 and "/workspace" in shell.stdout
    finally:
        gone = cli("harness", "rm", "cli-h", "--delete-volume")
    assert gone.returncode == 0, gone.stderr
    missing = cli("harness", "get", "cli-h")
    assert missing.returncode == 1 and "no harness" in missing.stderr


def test_volumes(cli):
    made = cli("volume", "create", "cli-vol", "--size-mb", "16", "--json")
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["name"] == "cli-vol"
    assert any(v["name"] == "cli-vol" for v in json.loads(cli("volume", "list", "--json").stdout))
    assert "16 MB" in cli("volume", "get", "cli-vol").stdout
    sid = json.loads(cli("sandbox", "create", "--image", "busybox", "--memory-mb", "256",
                         "--volume", "cli-vol:/data", "--json").stdout)["id"]  # fmt: skip
    try:
        assert cli("sandbox", "exec", sid, "--", "sh", "-c", "echo kept > /data/f").returncode == 0
        busy = cli("volume", "rm", "cli-vol")
        assert busy.returncode == 1 and "cli-vol" in busy.stderr
    finally:
        cli("sandbox", "rm", sid)
    from tests.support import wait_until

    wait_until(lambda: cli("volume", "rm", "cli-vol").returncode == 0, 60, interval=1, what="volume removed")
    bad = cli("sandbox", "create", "--image", "busybox", "--volume", "no-path")
    assert bad.returncode == 2 and "NAME:/path" in bad.stderr
