"""The launcher conformance suite: every runtime passes these, unchanged.

Parametrised over every registered launcher whose own probe passes here (gVisor, the reduced
test registration of it with network and checkpoints off: tests/launchers/reduced.py, and the
QEMU microVM where QEMU and its guest kernel are installed: its VMs boot under TCG here, so
``-k "not microvm"`` leaves them out of a quick run). The cases that only run commands and move
files share one sandbox per runtime; the rest make their own.
Only the public interface (runtime/launchers/base.py) is used; what a runtime cannot do
(``capabilities()``) it must refuse. A runtime's own internals are tested under
``tests/launchers/<name>/``. Real runtimes (runsc here), never fakes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from runtime.host.images.store import ImageStore
from runtime.launchers.base import (
    PSEUDO_FS_REFUSED,
    ExecRequest,
    FileOpError,
    Launcher,
    LauncherError,
    ProcessExit,
    ProcessRequest,
    SandboxNotRunning,
    SandboxSpec,
)
from tests.launchers.helpers import (
    assert_nothing_left,
    make_launcher,
    remove_all,
    usable_launchers,
    wait_until_true,
)
from tests.support import requires_runsc

pytestmark = [requires_runsc]


@pytest.fixture(scope="module", params=usable_launchers())
def launcher_state(request, tmp_path_factory) -> tuple[str, Path]:
    """(the launcher's name, its state dir)."""
    return request.param, tmp_path_factory.mktemp(f"launcher-{request.param}")


@pytest.fixture(scope="module")
def launcher(launcher_state, agent_cache_dir) -> Iterator[Launcher]:
    launcher = make_launcher(*launcher_state, agent_cache_dir)
    yield launcher
    remove_all(launcher)  # and its node's tables (a node id of its own)


@pytest.fixture(scope="module")
def busybox(image_store: ImageStore):
    return image_store.build_busybox()


def _spec(busybox, **overrides) -> SandboxSpec:
    return SandboxSpec(
        id="t" + uuid.uuid4().hex[:12],
        rootfs=busybox.rootfs,
        cpu=overrides.pop("cpu", 1.0),
        memory_mb=overrides.pop("memory_mb", 256),
        env=overrides.pop("env", {"GREETING": "hello"}),
        hostname=overrides.pop("hostname", "box"),
        disk_mb=overrides.pop("disk_mb", None),
    )


@pytest.fixture
def make_sandbox(launcher: Launcher, busybox) -> Iterator[Callable[..., dict]]:
    """A sandbox of the test's own (fresh, or with a spec of its own)."""
    created: list[dict] = []

    def make(**overrides) -> dict:
        handle = launcher.create(_spec(busybox, **overrides))
        created.append(handle)
        return handle

    yield make
    for handle in created:
        launcher.destroy(handle)


@pytest.fixture(scope="module")
def sandbox(launcher: Launcher, busybox) -> Iterator[dict]:
    """One sandbox (make_sandbox's default spec) shared by the runtime's tests that only run
    commands and move files in it, each in paths of its own: a microVM boots in seconds under
    TCG, and a boot per test was most of this suite's time. A test that needs a sandbox
    nothing else has touched makes one (``make_sandbox``)."""
    handle = launcher.create(_spec(busybox))
    yield handle
    launcher.destroy(handle)


def run(launcher: Launcher, handle: dict, argv, **kw):
    if isinstance(argv, str):
        argv = ["/bin/sh", "-c", argv]
    return launcher.exec(handle, ExecRequest(argv=argv, **kw))


# -- exec -------------------------------------------------------------------------------------


def test_exit_codes_are_reported(launcher, sandbox):
    assert run(launcher, sandbox, ["true"]).exit_code == 0
    assert run(launcher, sandbox, "exit 3").exit_code == 3
    killed = run(launcher, sandbox, "kill -TERM $$")
    assert killed.exit_code == 143 and killed.signal == 15


def test_stdout_and_stderr_are_separate(launcher, sandbox):
    r = run(launcher, sandbox, "echo out; echo err >&2; echo out2")
    assert r.stdout == b"out\nout2\n"
    assert r.stderr == b"err\n"


def test_stdin_is_passed_to_the_command(launcher, sandbox):
    data = os.urandom(300_000)
    r = run(launcher, sandbox, ["cat"], stdin=data)
    assert r.exit_code == 0 and r.stdout == data


def test_env_from_spec_and_request(launcher, sandbox):
    r = run(launcher, sandbox, "echo $GREETING $EXTRA", env={"EXTRA": "world"})
    assert r.stdout == b"hello world\n"
    assert run(launcher, sandbox, "echo $GREETING", env={"GREETING": "over"}).stdout == b"over\n"


def test_cwd(launcher, sandbox):
    assert run(launcher, sandbox, ["pwd"], cwd="/tmp").stdout == b"/tmp\n"


def test_missing_command_is_a_clear_error(launcher, sandbox):
    with pytest.raises(FileOpError) as info:
        run(launcher, sandbox, ["/no/such/binary"])
    assert info.value.errno_name == "ENOENT"


def test_timeout_kills_the_command(launcher, sandbox):
    start = time.monotonic()
    r = run(launcher, sandbox, "echo started; sleep 30", timeout=1.0)
    assert r.timed_out is True
    assert r.stdout == b"started\n"
    assert time.monotonic() - start < 10
    # The process is really gone: nothing named sleep is left.
    assert b"sleep 30" not in run(launcher, sandbox, ["ps"]).stdout


def test_large_output_arrives_intact(launcher, sandbox):
    size = 10 * 1024 * 1024
    r = run(
        launcher, sandbox, f"head -c {size} /dev/urandom > /tmp/big; cat /tmp/big; sha256sum /tmp/big >&2"
    )
    assert r.exit_code == 0
    assert len(r.stdout) == size
    assert hashlib.sha256(r.stdout).hexdigest() == r.stderr.split()[0].decode()


def test_output_streams_to_the_callback(launcher, sandbox):
    seen: list[tuple[str, bytes]] = []
    r = launcher.exec(
        sandbox,
        ExecRequest(argv=["/bin/sh", "-c", "echo a; echo b >&2"]),
        on_output=lambda s, b: seen.append((s, b)),
    )
    assert r.exit_code == 0
    assert b"".join(b for s, b in seen if s == "stdout") == b"a\n"
    assert b"".join(b for s, b in seen if s == "stderr") == b"b\n"


def test_concurrent_execs(launcher, sandbox):
    results: dict[int, bytes] = {}

    def one(i: int) -> None:
        results[i] = run(launcher, sandbox, f"echo {i}").stdout

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: f"{i}\n".encode() for i in range(16)}


# -- files ------------------------------------------------------------------------------------


def test_binary_file_round_trip(launcher, sandbox):
    data = bytes(range(256)) * 8192 + os.urandom(1000)
    assert launcher.write_file(sandbox, "/tmp/sub/dir/blob.bin", data) == len(data)
    entry, chunks = launcher.read_file(sandbox, "/tmp/sub/dir/blob.bin")
    assert entry.size == len(data)
    assert b"".join(chunks) == data
    assert run(launcher, sandbox, "wc -c < /tmp/sub/dir/blob.bin").stdout.strip() == str(len(data)).encode()


def test_list_files(launcher, sandbox):
    run(launcher, sandbox, "mkdir -p /tmp/l/d && echo hi > /tmp/l/f && ln -s /etc /tmp/l/s")
    entries = {e.name: e for e in launcher.list_files(sandbox, "/tmp/l")}
    assert {k: v.type for k, v in entries.items()} == {"d": "dir", "f": "file", "s": "symlink"}
    assert entries["f"].size == 3 and entries["f"].path == "/tmp/l/f"


def test_reading_a_missing_file_is_enoent(launcher, sandbox):
    with pytest.raises(FileOpError) as info:
        launcher.read_file(sandbox, "/nope")
    assert info.value.errno_name == "ENOENT"


def test_no_pseudo_fs_keeps_reads_and_listings_out_of_proc_and_sys_by_any_path(launcher, make_sandbox):
    handle = make_sandbox(env={"SECRET_VALUE": "s3cr3t"})
    # Symlinks into /proc, and a deleted file that only a magic link under /proc/<pid>/fd still
    # reaches (its bytes are on an ordinary filesystem: checking the file alone would pass it).
    holder = launcher.open_process(handle, ProcessRequest(
        argv=["/bin/sh", "-c", "echo s3cr3t > /tmp/gone; exec 3</tmp/gone; rm /tmp/gone; echo ready; sleep 600"],
    ))  # fmt: skip
    try:
        assert next(iter(holder.events())) == ("stdout", b"ready\n")
        run(launcher, handle, f"ln -s /proc/1/environ /tmp/env; ln -s /proc/{holder.pid}/fd/3 /tmp/fd; "
                              "ln -s /proc/self /tmp/me; echo hi > /tmp/plain; "
                              "ln -s /tmp/plain /tmp/link-to-plain")  # fmt: skip
        for path in ("/proc/1/environ", "/proc/self/environ", "/proc/thread-self/environ", "/proc/1/task/1/environ",
                     "/tmp/env", "/tmp/fd", f"/proc/{holder.pid}/fd/3", "/tmp/me/environ", "/sys/kernel/uevent_seqnum",
                     "/proc/self/root/tmp/plain"):  # fmt: skip
            with pytest.raises(FileOpError) as info:
                b"".join(launcher.read_file(handle, path, no_pseudo_fs=True)[1])
            assert info.value.errno_name == PSEUDO_FS_REFUSED, path
        for path in ("/proc", "/proc/1/fd", "/sys", "/tmp/me"):
            with pytest.raises(FileOpError) as info:
                launcher.list_files(handle, path, no_pseudo_fs=True)
            assert info.value.errno_name == PSEUDO_FS_REFUSED, path
        # Ordinary files, through symlinks too, and /dev, read as always.
        for path in ("/tmp/plain", "/tmp/link-to-plain"):
            assert b"".join(launcher.read_file(handle, path, no_pseudo_fs=True)[1]) == b"hi\n"
        assert "plain" in {e.name for e in launcher.list_files(handle, "/tmp", no_pseudo_fs=True)}
        assert {e.name for e in launcher.list_files(handle, "/", no_pseudo_fs=True)} >= {"tmp", "proc", "etc"}
        assert "null" in {e.name for e in launcher.list_files(handle, "/dev", no_pseudo_fs=True)}
        # Without the flag, /proc is read as before.
        assert b"SECRET_VALUE=s3cr3t" in b"".join(launcher.read_file(handle, "/proc/1/environ")[1])
    finally:
        holder.close()


# -- isolation --------------------------------------------------------------------------------


def test_the_kernel_is_not_the_hosts(launcher, sandbox):
    inside = run(launcher, sandbox, ["uname", "-r"]).stdout.decode().strip()
    assert inside and inside != os.uname().release


def test_host_files_are_not_visible(launcher, sandbox, tmp_path):
    marker = tmp_path / f"host-marker-{uuid.uuid4().hex}"
    marker.write_text("host secret")
    r = run(launcher, sandbox, f"cat {marker}; ls {tmp_path}")
    assert b"host secret" not in r.stdout
    assert r.exit_code != 0


def test_what_the_sandbox_writes_to_its_console_does_not_stop_it_answering(launcher, sandbox):
    # Root in the sandbox can write to PID 1's stdout and stderr, which the runtime may keep on
    # the host (where it lands is the runtime's own test: tests/launchers/<name>/).
    r = run(launcher, sandbox, "head -c 8388608 /dev/zero > /proc/1/fd/2; echo done")
    assert r.stdout == b"done\n"
    assert run(launcher, sandbox, "echo still here").stdout == b"still here\n"


def test_host_processes_are_not_visible(launcher, make_sandbox):
    sandbox = make_sandbox()  # fresh: its processes counted below are the agent's alone
    sleeper = subprocess.Popen(["sleep", "3600"], start_new_session=True)
    try:
        ps = run(launcher, sandbox, ["ps", "-o", "pid,args"]).stdout.decode()
        assert "sleep 3600" not in ps
        assert len(ps.strip().splitlines()) < 10  # the agent, the shell, ps: not the host's hundreds
    finally:
        sleeper.kill()


def test_sandboxes_cannot_see_each_others_files(launcher, make_sandbox):
    a, b = make_sandbox(), make_sandbox()
    launcher.write_file(a, "/root/only-in-a", b"a's data")
    assert run(launcher, a, "cat /root/only-in-a").stdout == b"a's data"
    r = run(launcher, b, "cat /root/only-in-a; find / -name only-in-a 2>/dev/null")
    assert b"a's data" not in r.stdout and b"only-in-a" not in r.stdout


def test_file_api_dotdot_and_symlinks_never_reach_the_host(launcher, sandbox, tmp_path):
    marker = tmp_path / "host-only.txt"
    marker.write_text("HOST CONTENT")
    # A symlink inside the sandbox pointing at a host path that exists on the host.
    run(launcher, sandbox, f"ln -s {marker} /tmp/escape; ln -s {tmp_path} /tmp/escape-dir")
    for path in ("/tmp/escape", f"/../../../..{marker}", f"/tmp/escape-dir/{marker.name}"):
        try:
            _, chunks = launcher.read_file(sandbox, path)
            assert b"HOST CONTENT" not in b"".join(chunks)
        except FileOpError as exc:
            assert exc.errno_name in ("ENOENT", "ELOOP", "EACCES")
    # Writing through the symlink lands inside the sandbox, never on the host file.
    try:
        launcher.write_file(sandbox, "/tmp/escape-dir/host-only.txt", b"overwritten")
    except FileOpError:
        pass
    assert marker.read_text() == "HOST CONTENT"


def test_image_is_never_written_by_a_sandbox(launcher, sandbox, busybox):
    before = sorted(p.name for p in (busybox.rootfs / "etc").iterdir())
    run(launcher, sandbox, "echo x > /etc/written-by-sandbox; rm -f /etc/hostname")
    assert sorted(p.name for p in (busybox.rootfs / "etc").iterdir()) == before


def test_memory_limit_kills_the_sandbox_and_says_why(launcher, make_sandbox):
    handle = make_sandbox(memory_mb=160)
    with pytest.raises(SandboxNotRunning) as info:
        # dd's one 600 MB buffer, filled from /dev/zero at memory speed, against a 160 MB limit
        # (a pipe into `tail -c` filled it at the pipe's pace: a minute under TCG).
        run(launcher, handle, "dd if=/dev/zero bs=600000000 count=1 | wc -c", timeout=60)
    assert "out of memory" in info.value.reason
    st = launcher.states()[handle["id"]]
    assert st.status == "stopped" and "out of memory" in (st.reason or "")


# -- lifecycle --------------------------------------------------------------------------------


def test_create_is_idempotent(launcher, busybox, make_sandbox):
    handle = make_sandbox()
    spec = SandboxSpec(id=handle["id"], rootfs=busybox.rootfs, memory_mb=256)
    again = launcher.create(spec)
    assert again["id"] == handle["id"]
    assert run(launcher, again, ["true"]).exit_code == 0


def test_suspend_then_destroy_leave_nothing_behind(launcher, busybox):
    spec = SandboxSpec(id="t" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256)
    handle = launcher.create(spec)
    assert launcher.states()[spec.id].status == "running"
    launcher.suspend(handle, keep_files=False)
    assert launcher.states().get(spec.id) is None or launcher.states()[spec.id].status in (
        "stopped",
        "missing",
    )
    launcher.destroy(handle)
    launcher.destroy(handle)  # twice is harmless
    assert_nothing_left(launcher, spec.id)


def test_a_suspended_sandbox_starts_again_over_its_files(launcher, busybox):
    spec = SandboxSpec(id="t" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256)
    handle = launcher.create(spec)
    try:
        run(launcher, handle, "echo kept > /root/f; sleep 600 &")
        launcher.suspend(handle)
        launcher.suspend(handle)  # twice is harmless
        handle = launcher.create(spec)
        assert run(launcher, handle, "cat /root/f").stdout == b"kept\n"
        assert b"sleep 600" not in run(launcher, handle, ["ps", "-o", "args"]).stdout  # processes ended
    finally:
        launcher.destroy(handle)
    assert_nothing_left(launcher, spec.id)


def test_destroy_by_id_cleans_up_an_orphan(launcher, busybox):
    spec = SandboxSpec(id="t" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256)
    launcher.create(spec)
    # Reconciliation: the node knows the id alone (no row keeps its handle).
    launcher.destroy(launcher.handle_for(spec.id))
    assert_nothing_left(launcher, spec.id)


def test_sandboxes_survive_the_process_that_started_them(launcher, launcher_state, busybox, agent_cache_dir):
    """Sandboxes are detached: a fresh launcher instance (a restarted node) re-adopts them,
    by the handle it persisted and by their id alone."""
    spec = SandboxSpec(id="t" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256)
    handle = launcher.create(spec)
    try:
        fresh = make_launcher(*launcher_state, agent_cache_dir)
        assert fresh.states()[spec.id].status == "running"
        assert run(fresh, handle, "echo still here").stdout == b"still here\n"
        assert run(fresh, fresh.handle_for(spec.id), "echo by id").stdout == b"by id\n"
    finally:
        launcher.destroy(handle)


def test_stats_report_memory_and_cpu(launcher, sandbox):
    run(launcher, sandbox, "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done")
    stats = launcher.stats(sandbox)
    assert stats.memory_bytes > 0
    assert stats.cpu_seconds > 0
    assert stats.memory_limit_bytes == 256 * 1024 * 1024


@pytest.mark.alone  # reads the host's free disk space: no other worker's test may write meanwhile
def test_a_write_past_the_sandboxs_disk_fails_inside_it_and_the_host_is_not_filled(
    launcher, launcher_state, make_sandbox
):
    sandbox = make_sandbox(disk_mb=64)
    # What `df /` says inside is its disk, not the host's filesystem.
    total_mb = int(run(launcher, sandbox, "df -m /").stdout.splitlines()[1].split()[1])
    assert 40 <= total_mb <= 64, total_mb
    host_free = shutil.disk_usage(launcher_state[1]).free
    r = run(launcher, sandbox, "dd if=/dev/zero of=/fill bs=1M count=100; echo rc=$?", timeout=60)
    assert b"rc=0" not in r.stdout and b"No space left on device" in r.stderr, r
    kept = int(run(launcher, sandbox, "wc -c < /fill").stdout)
    assert 32 << 20 < kept < 64 << 20  # it had the disk's size, not more
    assert host_free - shutil.disk_usage(launcher_state[1]).free < 100 << 20
    stats = launcher.stats(sandbox)
    # What the sandbox can use of it: 64 MB less the filesystem's own (journal, inode tables).
    assert 48 << 20 < stats.disk_limit_bytes <= 64 << 20 and stats.disk_bytes >= kept
    # The space comes back once the file is deleted: the sandbox goes on working.
    r = run(launcher, sandbox, "rm /fill && dd if=/dev/zero of=/again bs=1M count=40 && echo ok")
    assert r.stdout.endswith(b"ok\n"), r
    # A sandbox's disk is its own: another one's is empty, whatever this one wrote.
    other = make_sandbox(disk_mb=64)
    assert run(launcher, other, "ls /again; echo rc=$?").stdout.endswith(b"rc=1\n")


def test_states_reports_every_sandbox_at_once(launcher, make_sandbox):
    alive, dying = make_sandbox(), make_sandbox()
    launcher.suspend(dying)
    states = launcher.states()
    assert states[alive["id"]].status == "running"
    assert states[dying["id"]].status in ("stopped", "missing")


def _read_until(events, needle: bytes, limit: int = 1 << 20) -> bytes:
    buf = b""
    while needle not in buf:
        kind, data = next(events)
        assert kind == "stdout", (kind, data, buf)
        buf += data
        assert len(buf) < limit, buf[-200:]
    return buf


def test_live_process_with_a_tty_takes_input_resize_and_ctrl_c(launcher, sandbox):
    req = ProcessRequest(
        argv=["sh", "-c", "trap 'echo trapped' INT; stty size; read x; echo got-$x; stty size; sh -c 'echo sleeping; exec sleep 30'; echo after-$?"],
        tty=True, rows=20, cols=70,
    )  # fmt: skip
    proc = launcher.open_process(sandbox, req)
    try:
        events = proc.events()
        _read_until(events, b"20 70")
        proc.resize(40, 120)
        proc.send_stdin(b"hello\n")
        assert b"40 120" in _read_until(events, b"sleeping")  # sleeping: from what becomes sleep
        proc.send_stdin(b"\x03")  # the terminal's ^C: SIGINT to the foreground group
        rest = list(events)
    finally:
        proc.close()
    output = b"".join(d for k, d in rest if k == "stdout")
    assert b"after-130" in output, output
    assert rest[-1] == ("exit", ProcessExit(0, 0, False))


def test_ctrl_c_reaches_an_interactive_shells_foreground_job_while_it_floods(launcher, sandbox):
    """An interactive shell puts each job in its own process group and makes it the
    terminal's foreground group: ^C must stop that job (not the shell), echo "^C" and give
    the prompt back, even while the job floods the terminal faster than it is read."""
    proc = launcher.open_process(sandbox, ProcessRequest(argv=["sh", "-i"], tty=True, env={"PS1": "READY$ "}))
    try:
        events = proc.events()
        _read_until(events, b"READY$ ")
        proc.send_stdin(b"yes\n")
        _read_until(events, b"y\r\n" * 200)
        proc.send_stdin(b"\x03")
        started = time.monotonic()
        tail = b""
        while b"READY$ " not in tail[-200:]:
            assert time.monotonic() - started < 20, tail[-300:]
            tail += next(events)[1]  # type: ignore[operator]
        assert b"^C" in tail
        proc.send_stdin(b"echo alive-$((40+2))\n")
        _read_until(events, b"alive-42")
    finally:
        proc.close()


def test_live_process_without_a_tty_streams_and_takes_signals(launcher, sandbox):
    proc = launcher.open_process(
        sandbox, ProcessRequest(argv=["sh", "-c", "echo ready; cat; echo err >&2; sleep 30"])
    )
    try:
        events = proc.events()
        assert next(events) == ("stdout", b"ready\n")
        proc.send_stdin(b"echoed")
        assert next(events) == ("stdout", b"echoed")
        proc.close_stdin()
        assert next(events) == ("stderr", b"err\n")
        proc.send_signal(15)
        assert list(events)[-1] == ("exit", ProcessExit(143, 15, False))
    finally:
        proc.close()


# -- checkpoint and restore -------------------------------------------------------------------


def _collect(process, sink: list, done: threading.Event) -> None:
    try:
        for kind, data in process.events():
            sink.append((kind, data))
    except Exception as exc:  # noqa: BLE001 - the test looks at what ended the stream
        sink.append(("error", exc))
    done.set()


def test_checkpoint_and_restore_keep_processes_memory_and_streams_five_times(launcher, busybox):
    if not launcher.capabilities().checkpoint:
        assert_refuses_checkpoint(launcher, busybox)
        return
    spec = SandboxSpec(id="t" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256)
    handle = launcher.create(spec)
    try:
        # A counter that keeps its count only in memory, streamed to us, and a file it writes.
        counter = launcher.open_process(handle, ProcessRequest(
            argv=["sh", "-c", "i=0; while :; do i=$((i+1)); echo $i; echo $i > /c.new; mv /c.new /count; sleep 0.05; done"]))  # fmt: skip
        out: list = []
        done = threading.Event()
        threading.Thread(target=_collect, args=(counter, out, done), daemon=True).start()
        for cycle in range(5):
            time.sleep(0.3)
            run(launcher, handle, f"echo {cycle} >> /root/cycles")
            before = int(run(launcher, handle, "cat /count").stdout)
            launcher.checkpoint(handle)
            # Nothing runs: CPU and memory freed.
            assert launcher.states().get(spec.id) is None or launcher.states()[spec.id].status != "running"
            time.sleep(0.3)
            launcher.checkpoint(handle)  # a repeated task is harmless
            handle = launcher.restore(spec)
            after = int(run(launcher, handle, "cat /count").stdout)
            # It went on counting from where it was: not restarted from 1, not lost.
            assert before <= after < before + 40, (before, after)
            assert run(launcher, handle, "cat /root/cycles").stdout.split() == [
                b"%d" % i for i in range(cycle + 1)
            ]
        wait_until_true(lambda: sum(1 for k, _ in out if k == "stdout") and
                        int(b"".join(d for k, d in out if k == "stdout").split()[-1]) > after, 10)  # fmt: skip
        numbers = [int(n) for n in b"".join(d for k, d in out if k == "stdout").split()]
        assert numbers == list(range(1, len(numbers) + 1))  # the stream survived, whole, five times
        counter.send_signal(9)
        assert done.wait(10) and isinstance(out[-1][1], ProcessExit) and out[-1][1].signal == 9
    finally:
        launcher.destroy(handle)
    assert_nothing_left(launcher, spec.id)


def test_a_checkpointed_sandbox_can_be_destroyed_and_restore_needs_a_checkpoint(launcher, busybox):
    if not launcher.capabilities().checkpoint:
        assert_refuses_checkpoint(launcher, busybox)
        return
    spec = SandboxSpec(id="t" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256)
    handle = launcher.create(spec)
    process = launcher.open_process(handle, ProcessRequest(argv=["sleep", "600"]))
    out: list = []
    done = threading.Event()
    threading.Thread(target=_collect, args=(process, out, done), daemon=True).start()
    launcher.checkpoint(handle)
    launcher.destroy(launcher.handle_for(spec.id))
    assert_nothing_left(launcher, spec.id)
    assert done.wait(10) and out[-1][0] == "error"  # the detached stream ends: the sandbox is gone
    with pytest.raises(LauncherError, match="no checkpoint"):
        launcher.restore(spec)
    launcher.destroy(launcher.handle_for(spec.id))
    assert_nothing_left(launcher, spec.id)


def assert_refuses_checkpoint(launcher: Launcher, busybox) -> None:
    """A runtime without checkpoints says so, and leaves the sandbox running."""
    spec = SandboxSpec(id="t" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256)
    handle = launcher.create(spec)
    try:
        with pytest.raises(LauncherError, match="cannot checkpoint"):
            launcher.checkpoint(handle)
        with pytest.raises(LauncherError, match="cannot restore"):
            launcher.restore(spec)
        assert launcher.states()[spec.id].status == "running"
        assert run(launcher, handle, "echo still here").stdout == b"still here\n"
    finally:
        launcher.destroy(handle)


# -- networks ---------------------------------------------------------------------------------


def test_a_runtime_gives_a_network_exactly_when_it_says_so(launcher, busybox):
    """A sandbox gets a network only from a runtime that says it gives them (one of its own,
    an interface beside loopback); one that does not refuses a create asking for one (the node
    would otherwise start it unconnected), and leaves nothing. (What egress policies let
    through is tested with each runtime's networks, under tests/launchers/<name>/.)"""
    spec = SandboxSpec(id="t" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256,
                       network={"egress": "none", "allow": []})  # fmt: skip
    if launcher.capabilities().network:
        assert launcher.address_pool()
        handle = launcher.create(spec)
        try:
            interfaces = run(launcher, handle, "cat /proc/net/dev").stdout.decode()
            assert "eth0" in interfaces and "lo" in interfaces, interfaces
        finally:
            launcher.destroy(handle)
        assert_nothing_left(launcher, spec.id)
        return
    assert launcher.address_pool() is None
    with pytest.raises(LauncherError, match="no network"):
        launcher.create(spec)
    assert_nothing_left(launcher, spec.id)
    handle = launcher.create(SandboxSpec(id=spec.id, rootfs=busybox.rootfs, memory_mb=256))
    try:
        with pytest.raises(LauncherError, match="no network"):
            launcher.set_network(handle, {"egress": "all", "allow": []})
        launcher.set_network(handle, {"egress": "none", "allow": []})  # nothing to change: fine
    finally:
        launcher.destroy(handle)


def test_capabilities_say_what_the_runtime_gives(launcher):
    caps = launcher.capabilities()
    said = caps.as_dict()
    assert set(said) == {"network", "checkpoint", "kvm", "gpu", "vm", "move", "max_command_bytes"}
    assert all(isinstance(said[k], bool) for k in ("network", "checkpoint", "kvm", "gpu", "vm", "move"))
    assert said["vm"] is (launcher.name == "microvm")  # a kernel of its own
    assert said["max_command_bytes"] is None or said["max_command_bytes"] > 4096
    assert type(launcher).probe({}) is None  # it runs here: this suite runs only those that do
