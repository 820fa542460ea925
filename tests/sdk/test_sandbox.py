"""The sync SDK against the real server, worker, bridge and runsc sandboxes: commands (run to
the end, streamed, in the background), files and directories, and a sandbox's life."""

from __future__ import annotations

import os
import time

import pytest

from hangar_sdk import ExecResult, NotFoundError, Sandbox
from tests.support import requires_runsc, wait_until

pytestmark = [requires_runsc]


def test_a_command_runs_to_its_end_and_a_non_zero_exit_is_a_result(hangar):
    with Sandbox.create(image="busybox", timeout_s=120, memory_mb=256, env={"WHO": "sdk"}) as sb:
        assert sb.status == "running" and sb.id.startswith("sb")
        r = sb.exec(
            'echo "hi $WHO $EXTRA"; pwd; echo oops >&2', cwd="/tmp", env={"EXTRA": "x y"}, timeout_s=30
        )
        assert isinstance(r, ExecResult)
        assert (r.exit_code, r.stdout, r.stderr) == (0, "hi sdk x y\n/tmp\n", "oops\n")
        assert r.duration_ms > 0 and r.ok and r.id
        failed = sb.exec("echo before; exit 3")
        assert failed.exit_code == 3 and failed.stdout == "before\n" and not failed.ok
        assert sb.exec(["cat"], stdin="piped in").stdout == "piped in"
        slow = sb.exec("sleep 5", timeout_s=0.5)
        assert slow.timed_out and not slow.ok

        assert Sandbox.get(sb.id).status == "running"
        assert sb.id in [s.id for s in Sandbox.list(status="running")]
        before = sb.info.expires_at
        assert sb.keepalive(600).info.expires_at != before
    # The block's end deleted it (the delete finishes in the background); the row stays.
    assert Sandbox.get(sb.id).status in ("stopping", "deleted")
    wait_until(lambda: Sandbox.get(sb.id).status == "deleted", 30, what="the sandbox deleted")
    assert sb.id not in [s.id for s in Sandbox.list(status="running")]
    assert sb.id in [s.id for s in Sandbox.list(status="deleted")]


def test_streamed_output_reaches_the_callbacks_as_it_is_produced(hangar):
    with Sandbox.create(image="busybox", timeout_s=120) as sb:
        seen: list[tuple[float, str, str]] = []
        start = time.monotonic()
        r = sb.exec(
            "echo a; echo e >&2; sleep 1; echo b",
            on_stdout=lambda s: seen.append((time.monotonic() - start, "out", s)),
            on_stderr=lambda s: seen.append((time.monotonic() - start, "err", s)),
        )
        end = time.monotonic() - start
        assert r.exit_code == 0 and r.stdout == "a\nb\n" and r.stderr == "e\n"
        assert r.duration_ms >= 1000 and r.id
        first_a = next(t for t, kind, s in seen if kind == "out" and "a" in s)
        last_b = next(t for t, kind, s in seen if kind == "out" and "b" in s)
        # "a" came before the sleep ended, "b" after it: streamed, not delivered at the end.
        assert first_a < end - 0.7 and last_b - first_a >= 0.8, seen
        assert any(kind == "err" and s == "e\n" for _, kind, s in seen)


def test_a_background_process_is_fed_read_waited_for_and_killed(hangar):
    with Sandbox.create(image="busybox", timeout_s=120) as sb:
        p = sb.exec("cat; echo done >&2", background=True, stdin_open=True)
        assert p.id and p.pid
        p.send_stdin("hello\n")
        p.send_stdin(b"\x00bytes\n")
        deadline = time.monotonic() + 10
        while "bytes" not in p.output().stdout and time.monotonic() < deadline:
            time.sleep(0.1)
        assert p.output().stdout == "hello\n\x00bytes\n"
        assert p.info().status == "running"
        p.close_stdin()
        r = p.wait(timeout=30)
        assert r.exit_code == 0 and r.stdout == "hello\n\x00bytes\n" and r.stderr == "done\n" and r.id == p.id

        sleeper = sb.exec("sleep 300", background=True)
        assert sleeper.info().status == "running"
        sleeper.kill()
        r = sleeper.wait(timeout=30)
        assert r.exit_code == 128 + 9, r  # as a shell reports a SIGKILL
        assert sleeper.info().status != "running"
        # Found again by id, from another handle.
        again = Sandbox.get(sb.id).process(p.id)
        assert again.output().stdout == "hello\n\x00bytes\n"


def test_files_and_directories_travel_both_ways(hangar, tmp_path):
    with Sandbox.create(image="busybox", timeout_s=120) as sb:
        assert sb.files.write("/code/a.py", b"print('hi')\n") == 12
        assert sb.files.read("/code/a.py") == b"print('hi')\n"
        sb.files.write("/code/b.txt", "text é")
        assert sb.files.read_text("/code/b.txt") == "text é"
        entries = {e.name: e for e in sb.files.list("/code")}
        assert entries["a.py"].type == "file" and entries["a.py"].size == 12
        assert entries["a.py"].path == "/code/a.py"
        assert sb.exec("python3 -V 2>/dev/null || cat /code/a.py").stdout

        src = tmp_path / "src"
        (src / "pkg" / "deep").mkdir(parents=True)
        (src / "empty").mkdir()
        (src / "top.txt").write_text("top\n")
        (src / "pkg" / "mod.py").write_text("x = 1\n")
        big = os.urandom(3 * 1024 * 1024 + 7)  # several upload pieces
        (src / "pkg" / "deep" / "big.bin").write_bytes(big)
        assert sb.files.upload_dir(src, "/code/src") == 3
        listing = sb.exec("cd /code/src && find . | sort").stdout.split()
        assert listing == [".", "./empty", "./pkg", "./pkg/deep", "./pkg/deep/big.bin", "./pkg/mod.py",
                           "./top.txt"]  # fmt: skip
        assert sb.exec("wc -c < /code/src/pkg/deep/big.bin").stdout.strip() == str(len(big))

        out = tmp_path / "out"
        assert sb.files.download_dir("/code/src", out) == 3
        assert (out / "top.txt").read_text() == "top\n"
        assert (out / "pkg" / "mod.py").read_text() == "x = 1\n"
        assert (out / "pkg" / "deep" / "big.bin").read_bytes() == big
        assert (out / "empty").is_dir()
        with pytest.raises(NotFoundError):
            sb.files.read("/code/nope")


def test_pause_resume_and_a_preview_url(hangar):
    with Sandbox.create(image="busybox", timeout_s=120) as sb:
        url = sb.preview_url(8000)
        assert "8000" in url and url.startswith("http")
        sb.files.write("/data/kept.txt", b"kept")
        assert sb.pause().status == "paused"
        assert sb.resume().status == "running"
        assert sb.files.read("/data/kept.txt") == b"kept"
        assert sb.refresh().status == "running"


def test_a_terminal_runs_a_shell_that_is_typed_into_and_resized(hangar):
    with Sandbox.create(image="busybox", timeout_s=120) as sb:
        with sb.terminal(rows=24, cols=80) as term:
            term.send("echo $((6*7))-mark; stty size\n")
            assert b"42-mark" in term.read_until("42-mark", timeout=20)
            assert b"24 80" in term.read_until("24 80", timeout=20)
            term.resize(30, 100)
            term.write("stty size\n")  # write and read: send and recv by the names
            term.read_until("30 100", timeout=20)
            term.write("exit 5\n")
            while term.read(timeout=20):
                pass
            assert term.exit_code == 5
