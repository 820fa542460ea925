"""`hangar up`'s supervisor (dashboard.supervise): a child that dies is started again; one that
keeps dying stops everything, saying which. Run as the real thing, in a process of its own
(it takes SIGCHLD and SIGTERM)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.support import wait_until

ROOT = Path(__file__).resolve().parents[1]


def _supervisor(
    tmp_path: Path, specs: list[tuple[str, list[str]]], healthy_after: float = 60.0
) -> subprocess.Popen[str]:
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from dashboard import supervise
        supervise.RESTART_DELAYS_S = (0.0, 0.2)
        supervise.HEALTHY_AFTER_S = {healthy_after!r}
        specs = {specs!r}
        children = []
        logs = supervise.start_children(specs, {{"PATH": "/usr/bin:/bin"}}, Path({str(tmp_path)!r}), children)
        try:
            rc = supervise.supervise(children, supervise.restarter(specs, {{"PATH": "/usr/bin:/bin"}}, logs))
        finally:
            supervise.stop_all(children)
        sys.exit(rc)
    """)
    return subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def test_a_child_that_dies_is_started_again(tmp_path):
    starts = tmp_path / "starts"
    sup = _supervisor(tmp_path, [("steady", ["sh", "-c", f"echo $$ >> {starts}; exec sleep 300"])])
    try:
        wait_until(
            lambda: starts.exists() and len(starts.read_text().split()) == 1, 10, what="the first start"
        )
        first = int(starts.read_text().split()[0])
        subprocess.run(["kill", "-9", str(first)], check=True)
        wait_until(lambda: len(starts.read_text().split()) == 2, 10, what="the start again")
        second = int(starts.read_text().split()[1])
        assert second != first and Path(f"/proc/{second}").exists()
        time.sleep(0.5)
        assert sup.poll() is None, "the supervisor stopped when a child died"
    finally:
        sup.send_signal(signal.SIGTERM)
        out, _ = sup.communicate(timeout=30)
    assert sup.returncode == 0, out
    assert "steady exited with status -9; starting it again" in out, out
    assert not Path(f"/proc/{second}").exists() or "Z" in Path(f"/proc/{second}/stat").read_text().split()[2]


def test_a_child_that_keeps_dying_stops_everything_saying_which(tmp_path):
    sup = _supervisor(tmp_path, [("steady", ["sleep", "300"]), ("crashing", ["sh", "-c", "exit 3"])])
    out, _ = sup.communicate(timeout=60)
    assert sup.returncode == 1, out
    assert out.count("crashing exited with status 3; starting it again") == 4, out
    assert (
        "crashing exited with status 3 5 times in a row, each within 60 s of starting; stopping everything"
        in out
    ), out
    assert "logs/crashing.log" in out


def test_a_child_that_was_up_a_while_is_started_again_however_often_it_failed_before(tmp_path):
    """Failures spread over a long life (a library that does not survive a Redis restart, now and
    later) are not a crash loop: each exit after a healthy run starts the count afresh, so the
    eighth failure in a row still gets a start again, and the supervisor stays up."""
    starts = tmp_path / "starts"
    sup = _supervisor(
        tmp_path, [("flaky", ["sh", "-c", f"echo $$ >> {starts}; sleep 0.8; exit 3"])], healthy_after=0.5
    )
    try:
        wait_until(lambda: starts.exists() and len(starts.read_text().split()) >= 8, 30, what="eight starts")
        assert sup.poll() is None, "the supervisor gave up on a child that was healthy between failures"
    finally:
        sup.send_signal(signal.SIGTERM)
        out, _ = sup.communicate(timeout=30)
    assert sup.returncode == 0, out
    assert out.count("flaky exited with status 3; starting it again") >= 7, out
    assert "stopping everything" not in out, out


def test_a_child_sigkilled_from_outside_is_started_again_however_soon_and_often(tmp_path):
    """A SIGKILL is something outside ending the child (the OOM killer, an operator, the faults
    suite), not the child failing: six in a row, each moments after its start, still get a start
    again."""
    starts = tmp_path / "starts"
    sup = _supervisor(tmp_path, [("steady", ["sh", "-c", f"echo $$ >> {starts}; exec sleep 300"])])
    try:
        for n in range(1, 7):
            wait_until(lambda n=n: starts.exists() and len(starts.read_text().split()) == n, 10,
                       what=f"start {n}")  # fmt: skip
            subprocess.run(["kill", "-9", starts.read_text().split()[-1]], check=True)
        wait_until(lambda: len(starts.read_text().split()) == 7, 10, what="the seventh start")
        assert sup.poll() is None, "the supervisor gave up on a child killed from outside"
    finally:
        sup.send_signal(signal.SIGTERM)
        out, _ = sup.communicate(timeout=30)
    assert sup.returncode == 0, out
    assert out.count("steady exited with status -9; starting it again") == 6, out
    assert "stopping everything" not in out, out
