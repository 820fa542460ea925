"""``hangar sandbox …`` against the real stack: create and list with --json (stdout exactly
one JSON document), exec streaming and exiting with the command's status, cp both ways with a
progress bar, logs of events and of a process, pause and resume, rm, and errors as one line."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time

import pytest

from hangar_sdk import Sandbox
from tests.cli.conftest import HANGAR
from tests.support import requires_runsc, wait_until

pytestmark = [requires_runsc, pytest.mark.timeout(300)]


def test_create_list_get_exec_and_rm(cli, team_token, server):
    made = cli("sandbox", "create", "--image", "busybox", "--memory-mb", "256", "--timeout-s", "120",
               "--env", "WHO=cli", "--metadata", "owner=tests", "--json")  # fmt: skip
    assert made.returncode == 0, made.stderr
    sandbox = json.loads(made.stdout)  # the whole of stdout: one document
    sid = sandbox["id"]
    try:
        assert sandbox["status"] == "running" and sandbox["metadata"] == {"owner": "tests"}

        listed = cli("sandbox", "list", "--json")
        assert listed.returncode == 0 and sid in [s["id"] for s in json.loads(listed.stdout)]
        table = cli("sandbox", "ls", "--status", "running")
        assert table.stdout.splitlines()[0].split()[:3] == ["ID", "STATUS", "IMAGE"]
        assert any(line.startswith(sid) and "running" in line for line in table.stdout.splitlines())
        got = cli("sandbox", "get", sid)
        assert "busybox" in got.stdout and "meta owner" in got.stdout

        # Output streamed to the right stream; the command's status is the CLI's.
        run = cli("sandbox", "exec", sid, "--cwd", "/tmp", "--", "sh", "-c",
                  'echo "out $WHO $(pwd)"; echo err >&2; exit 3')  # fmt: skip
        assert (run.returncode, run.stdout, run.stderr) == (3, "out cli /tmp\n", "err\n")
        piped = cli("sandbox", "exec", sid, "-i", "--", "wc", "-c", input="twelve bytes")
        assert (piped.returncode, piped.stdout.strip()) == (0, "12")
        line = cli("sandbox", "exec", sid, "-c", "--", "echo a | tr a b")
        assert line.stdout == "b\n"
        slow = cli("sandbox", "exec", sid, "--timeout-s", "0.5", "--", "sleep", "5")
        assert slow.returncode == 124 and "timed out" in slow.stderr
        # -- inside the command is the command's own.
        dashes = cli("sandbox", "exec", sid, "--", "echo", "--", "x")
        assert dashes.stdout == "-- x\n"

        sb = Sandbox.get(sid, url=server, token=team_token)
        p = sb.exec("echo from-background; sleep 0.5; echo done; exit 5", background=True)
        logs = cli("sandbox", "logs", sid, "--process", str(p.id))
        assert logs.returncode == 5 and logs.stdout == "from-background\ndone\n"
        procs = cli("sandbox", "ps", sid, "--json")
        assert procs.returncode == 0, procs.stderr
        (bg,) = [row for row in json.loads(procs.stdout) if row["id"] == p.id]  # the whole of stdout
        assert (bg["status"], bg["exit_code"]) == ("exited", 5), bg
        events = cli("sandbox", "logs", sid, "--no-follow")
        assert events.returncode == 0 and "-> running" in events.stdout

        paused = cli("sandbox", "pause", sid, "--json")
        assert paused.returncode == 0, paused.stderr
        assert json.loads(paused.stdout)["status"] == "paused"
        refused = cli("sandbox", "exec", sid, "--", "true")
        assert (
            refused.returncode == 1
            and refused.stderr.startswith("hangar: ")
            and "Traceback" not in refused.stderr
        )
        assert "paused" in refused.stderr
        resumed = cli("sandbox", "resume", sid)
        assert resumed.returncode == 0 and "running" in resumed.stderr
        assert cli("sandbox", "exec", sid, "--", "true").returncode == 0
    finally:
        gone = cli("sandbox", "rm", sid)
    assert gone.returncode == 0 and f"{sid}: deleted" in gone.stderr
    wait_until(lambda: Sandbox.get(sid, url=server, token=team_token).status == "deleted", 30, what="deleted")


def test_logs_follows_new_events_and_ends_when_the_sandbox_is_deleted(cli, server, team_token):
    sid = json.loads(cli("sandbox", "create", "--image", "busybox", "--memory-mb", "256", "--json").stdout)[
        "id"
    ]
    follow = subprocess.Popen([str(HANGAR), "sandbox", "logs", sid], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=cli.env)  # fmt: skip
    assert follow.stdout is not None and follow.stderr is not None
    seen = b""

    def until(marker: bytes, timeout: float = 60) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while marker not in seen:
            assert time.monotonic() < deadline, f"{marker!r} never came: {seen!r}"
            if select.select([follow.stdout], [], [], 1)[0]:
                seen += os.read(follow.stdout.fileno(), 65536)

    try:
        until(b"-> running")  # what there was when it started
        # Events from after the command started, through the API: it follows them.
        sb = Sandbox.get(sid, url=server, token=team_token)
        sb.pause()
        until(b"-> paused")
        sb.resume()
        until(b"paused -> ")
        assert follow.poll() is None  # still following
        assert cli("sandbox", "rm", sid).returncode == 0
        assert follow.wait(timeout=60) == 0  # a deleted sandbox has no more events: it ends
        seen += follow.stdout.read()
        assert b"-> deleted" in seen and follow.stderr.read() == b"", seen
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()
        cli("sandbox", "rm", sid)


def test_cp_copies_directories_and_files_both_ways_with_a_progress_bar(cli, tmp_path):
    src = tmp_path / "src"
    (src / "pkg" / "deep").mkdir(parents=True)
    (src / "empty").mkdir()
    (src / "a.py").write_text("print('a')\n")
    (src / "pkg" / "deep" / "b.txt").write_text("b\n")
    big = os.urandom(5 * 1024 * 1024)
    (src / "big.bin").write_bytes(big)
    sid = json.loads(cli("sandbox", "create", "--image", "busybox", "--memory-mb", "256", "--json").stdout)[
        "id"
    ]
    try:
        up = cli("sandbox", "cp", str(src), f"{sid}:/code", "--progress")
        assert up.returncode == 0, up.stderr
        assert "100%" in up.stderr and "5.0 MiB" in up.stderr and "3 file(s)" in up.stderr
        listing = cli("sandbox", "exec", sid, "--", "find", "/code", "-type", "f")
        assert sorted(listing.stdout.split()) == ["/code/a.py", "/code/big.bin", "/code/pkg/deep/b.txt"]
        assert cli("sandbox", "exec", sid, "--", "test", "-d", "/code/empty").returncode == 0

        # A file into an existing directory lands inside it; quiet without --progress off a terminal.
        one = cli("sandbox", "cp", str(src / "a.py"), f"{sid}:/code/pkg")
        assert one.returncode == 0 and "%" not in one.stderr
        assert cli("sandbox", "exec", sid, "--", "cat", "/code/pkg/a.py").stdout == "print('a')\n"

        out = tmp_path / "out"
        down = cli("sandbox", "cp", f"{sid}:/code", str(out))
        assert down.returncode == 0, down.stderr
        assert (out / "big.bin").read_bytes() == big
        assert (out / "pkg" / "deep" / "b.txt").read_text() == "b\n" and (out / "pkg" / "a.py").exists()
        single = cli("sandbox", "cp", f"{sid}:/code/a.py", str(tmp_path))
        assert single.returncode == 0 and (tmp_path / "a.py").read_text() == "print('a')\n"

        missing = cli("sandbox", "cp", f"{sid}:/nope", str(tmp_path))
        assert missing.returncode == 1 and "no such file" in missing.stderr
        both_local = cli("sandbox", "cp", str(src), str(tmp_path / "x"))
        assert both_local.returncode == 2 and "ID:/path" in both_local.stderr
    finally:
        cli("sandbox", "rm", sid)


def test_errors_are_one_line_with_a_non_zero_status(cli, cli_env, server):
    unknown = cli("sandbox", "get", "sb-nosuch")
    assert (
        unknown.returncode == 1 and unknown.stderr.count("\n") == 1 and unknown.stderr.startswith("hangar: ")
    )
    bad_env = cli("sandbox", "create", "--image", "busybox", "--env", "NOEQUALS")
    assert bad_env.returncode == 2 and "KEY=VALUE" in bad_env.stderr
    wrong = cli("sandbox", "list", env={"HANGAR_TOKEN": "hgr_wrong"})
    assert wrong.returncode == 1 and "hangar login" in wrong.stderr and "Traceback" not in wrong.stderr
    no_config = cli("sandbox", "list", env={"HANGAR_URL": "", "HANGAR_TOKEN": ""})
    assert no_config.returncode == 1 and "hangar login" in no_config.stderr
    down = cli("sandbox", "list", env={"HANGAR_URL": "http://127.0.0.1:9"})
    assert down.returncode == 1 and "Traceback" not in down.stderr
    invalid = cli("sandbox", "create", "--image", "busybox", "--memory-mb", "1")
    assert invalid.returncode == 1 and "memory_mb" in invalid.stderr


def test_an_exit_without_a_status_of_its_own_says_why(capsys):
    """A command whose node's bridge stopped (or whose process is gone) ends with 128, as a
    shell reports a death it cannot explain: the CLI says why on stderr, not 128 alone."""
    from hangar_sdk.cli._common import exit_status

    gone = "the stream bridge of node n1 stopped: no more output of this command can come"
    assert (
        exit_status({"type": "exit", "exit_code": None, "signal": 0, "timed_out": False, "error": gone})
        == 128
    )
    assert capsys.readouterr().err == f"hangar: {gone}\n"
    assert exit_status({"type": "exit", "exit_code": 3, "signal": 0, "timed_out": False}) == 3
    assert exit_status({"type": "exit", "exit_code": None, "signal": 9, "timed_out": False}) == 137
    assert capsys.readouterr().err == ""
