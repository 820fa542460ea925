"""The launcher conformance suite: every runtime passes these, unchanged.

Parametrised over ``LAUNCHERS``; a new runtime adds a factory there and nothing else. The
tests use real runtimes (runsc here), never fakes.
"""

from __future__ import annotations

import contextlib
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

from runtime.launchers.base import (
    ExecRequest,
    FileOpError,
    Launcher,
    ProcessExit,
    ProcessRequest,
    SandboxNotRunning,
    SandboxSpec,
)
from runtime.launchers.gvisor import GVisorLauncher
from runtime.launchers.images import ImageStore
from tests.support import requires_runsc


def _gvisor(state_dir: Path, agent_cache: Path) -> Launcher:
    return GVisorLauncher(state_dir=state_dir, agent_cache_dir=agent_cache)


LAUNCHERS: dict[str, Callable[[Path, Path], Launcher]] = {"gvisor": _gvisor}

pytestmark = [requires_runsc]


@pytest.fixture(scope="module", params=sorted(LAUNCHERS))
def launcher(request, tmp_path_factory, agent_cache_dir) -> Iterator[Launcher]:
    state = tmp_path_factory.mktemp(f"launcher-{request.param}")
    launcher = LAUNCHERS[request.param](state, agent_cache_dir)
    yield launcher
    for sandbox_id in launcher.list():
        launcher.destroy_id(sandbox_id)
    if isinstance(launcher, GVisorLauncher):
        launcher.disks.drain()  # its spare disks (loop mounts)


@pytest.fixture(scope="module")
def busybox(image_store: ImageStore):
    return image_store.build_busybox()


@pytest.fixture
def make_sandbox(launcher: Launcher, busybox) -> Iterator[Callable[..., dict]]:
    created: list[dict] = []

    def make(**overrides) -> dict:
        spec = SandboxSpec(
            id="t" + uuid.uuid4().hex[:12],
            rootfs=busybox.rootfs,
            cpu=overrides.pop("cpu", 1.0),
            memory_mb=overrides.pop("memory_mb", 256),
            env=overrides.pop("env", {"GREETING": "hello"}),
            hostname=overrides.pop("hostname", "box"),
            disk_mb=overrides.pop("disk_mb", None),
        )
        handle = launcher.create(spec)
        created.append(handle)
        return handle

    yield make
    for handle in created:
        launcher.destroy(handle)


@pytest.fixture
def sandbox(make_sandbox) -> dict:
    return make_sandbox()


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


# -- isolation --------------------------------------------------------------------------------


def test_kernel_is_gvisors_not_the_hosts(launcher, sandbox):
    inside = run(launcher, sandbox, ["uname", "-r"]).stdout.decode().strip()
    assert inside and inside != os.uname().release


def test_host_files_are_not_visible(launcher, sandbox, tmp_path):
    marker = tmp_path / f"host-marker-{uuid.uuid4().hex}"
    marker.write_text("host secret")
    r = run(launcher, sandbox, f"cat {marker}; ls {tmp_path}")
    assert b"host secret" not in r.stdout
    assert r.exit_code != 0


def test_what_the_sandbox_writes_to_its_console_cannot_fill_the_hosts_disk(launcher, sandbox):
    # Root in the sandbox can write to PID 1's stdout and stderr, which runsc keeps in a host
    # file: 8 MB of it must not land on the host's disk, nor stop the agent answering.
    r = run(launcher, sandbox, "head -c 8388608 /dev/zero > /proc/1/fd/2; echo done")
    assert r.stdout == b"done\n"
    assert run(launcher, sandbox, "echo still here").stdout == b"still here\n"
    if isinstance(launcher, GVisorLauncher):
        # Outside its root filesystem and its disk (whose size is the limit of what it writes there).
        d = Path(sandbox["dir"])
        total = sum(p.stat().st_blocks * 512 for p in d.rglob("*") if p.is_file()
                    and not p.is_relative_to(d / "rootfs") and not p.is_relative_to(d / "disk"))  # fmt: skip
        assert total < 2 << 20, total
        assert len(launcher._console_tail(Path(sandbox["dir"]))) <= 500


def test_host_processes_are_not_visible(launcher, sandbox):
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
        # tail -c keeps the last N bytes in memory: 600 MB against a 160 MB limit.
        run(launcher, handle, "head -c 700000000 /dev/zero | tail -c 600000000 | wc -c", timeout=60)
    assert "out of memory" in info.value.reason
    st = launcher.state(handle)
    assert st.status == "stopped" and "out of memory" in (st.reason or "")


# -- lifecycle --------------------------------------------------------------------------------


def test_create_is_idempotent(launcher, busybox, make_sandbox):
    handle = make_sandbox()
    spec = SandboxSpec(id=handle["id"], rootfs=busybox.rootfs, memory_mb=256)
    again = launcher.create(spec)
    assert again["id"] == handle["id"]
    assert run(launcher, again, ["true"]).exit_code == 0


def test_stop_then_destroy_leave_nothing_behind(launcher, busybox):
    spec = SandboxSpec(id="t" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256)
    handle = launcher.create(spec)
    assert spec.id in launcher.list()
    assert launcher.state(handle).status == "running"
    launcher.stop(handle, timeout=5)
    assert launcher.state(handle).status in ("stopped", "missing")
    launcher.destroy(handle)
    launcher.destroy(handle)  # twice is harmless
    assert spec.id not in launcher.list()
    assert launcher.state(handle).status == "missing"
    assert_nothing_left(launcher, spec.id)


def assert_nothing_left(launcher: Launcher, sandbox_id: str) -> None:
    with open("/proc/self/mountinfo") as f:
        assert sandbox_id not in f.read()
    assert not _cgroup_dirs(sandbox_id)
    # Its disk's loop device goes once the kernel has let go of the (lazily unmounted) disk.
    wait_until_true(lambda: not [f for f in loop_backing_files() if sandbox_id in f], 10)
    if isinstance(launcher, GVisorLauncher):
        assert not (launcher.sandboxes_dir / sandbox_id).exists()
        assert not _runsc_lists(launcher, sandbox_id)


def upper_dir(launcher: GVisorLauncher, sandbox_id: str) -> Path:
    """Where the host keeps the files the sandbox wrote (its overlay's upper dir)."""
    d = launcher.sandboxes_dir / sandbox_id
    return d / "disk" / "fs" / "upper" if (d / "disk").exists() else d / "upper"


def _runsc_lists(launcher: GVisorLauncher, sandbox_id: str) -> bool:
    listed = subprocess.run(
        [launcher.runsc, "--root", str(launcher.root), "list", "--quiet"], capture_output=True, text=True
    ).stdout
    return sandbox_id in listed.split()


def _cgroup_dirs(sandbox_id: str) -> list[Path]:
    return [root / "hangar" / sandbox_id for root in Path("/sys/fs/cgroup").iterdir()
            if (root / "hangar" / sandbox_id).exists()]  # fmt: skip


def test_destroy_by_id_cleans_up_an_orphan(launcher, busybox):
    spec = SandboxSpec(id="t" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256)
    launcher.create(spec)
    launcher.destroy_id(spec.id)  # reconciliation path: no handle, only the id
    assert_nothing_left(launcher, spec.id)


def test_sandboxes_survive_the_process_that_started_them(launcher, busybox, agent_cache_dir):
    """Sandboxes are detached: a fresh launcher instance (a restarted node) re-adopts them."""
    spec = SandboxSpec(id="t" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256)
    handle = launcher.create(spec)
    try:
        fresh = type(launcher)(state_dir=launcher.state_dir, agent_cache_dir=agent_cache_dir)  # type: ignore[call-arg]
        assert spec.id in fresh.list()
        assert run(fresh, handle, "echo still here").stdout == b"still here\n"
    finally:
        launcher.destroy(handle)


def test_stats_report_memory_and_cpu(launcher, sandbox):
    run(launcher, sandbox, "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done")
    stats = launcher.stats(sandbox)
    assert stats.memory_bytes > 0
    assert stats.cpu_seconds > 0
    assert stats.memory_limit_bytes == 256 * 1024 * 1024


def test_a_write_past_the_sandboxs_disk_fails_inside_it_and_the_host_is_not_filled(launcher, make_sandbox):
    sandbox = make_sandbox(disk_mb=64)
    # What `df /` says inside is its disk, not the host's filesystem.
    total_mb = int(run(launcher, sandbox, "df -m /").stdout.splitlines()[1].split()[1])
    assert 40 <= total_mb <= 64, total_mb
    host_free = shutil.disk_usage(launcher.state_dir).free
    r = run(launcher, sandbox, "dd if=/dev/zero of=/fill bs=1M count=100; echo rc=$?", timeout=60)
    assert b"rc=0" not in r.stdout and b"No space left on device" in r.stderr, r
    kept = int(run(launcher, sandbox, "wc -c < /fill").stdout)
    assert 32 << 20 < kept < 64 << 20  # it had the disk's size, not more
    assert host_free - shutil.disk_usage(launcher.state_dir).free < 100 << 20
    stats = launcher.stats(sandbox)
    # What the sandbox can use of it: 64 MB less the filesystem's own (journal, inode tables).
    assert 48 << 20 < stats.disk_limit_bytes <= 64 << 20 and stats.disk_bytes >= kept
    # The space comes back once the file is deleted: the sandbox goes on working.
    r = run(launcher, sandbox, "rm /fill && dd if=/dev/zero of=/again bs=1M count=40 && echo ok")
    assert r.stdout.endswith(b"ok\n"), r
    # A sandbox's disk is its own: another one's is empty, whatever this one wrote.
    other = make_sandbox(disk_mb=64)
    assert run(launcher, other, "ls /again; echo rc=$?").stdout.endswith(b"rc=1\n")


def test_runsc_is_present():
    from runtime.launchers.gvisor import default_runsc

    assert shutil.which(default_runsc()), "runsc must be installed by .ci/run"


def test_the_sandbox_cannot_fill_the_host_disk_through_the_agent_dir(launcher, sandbox):
    r = run(launcher, sandbox, "dd if=/dev/zero of=/.hangar/run/fill bs=1M count=50; echo rc=$?")
    assert b"rc=0" not in r.stdout
    run(launcher, sandbox, "rm -f /.hangar/run/fill")
    assert run(launcher, sandbox, "echo still answering").stdout == b"still answering\n"


def test_the_agent_binary_is_read_only(launcher, sandbox):
    r = run(launcher, sandbox, "echo x > /.hangar/agent; echo rc=$?")
    assert b"rc=0" not in r.stdout


def test_states_reports_every_sandbox_at_once(launcher, make_sandbox):
    alive, dying = make_sandbox(), make_sandbox()
    launcher.stop(dying, timeout=2)
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
    if not launcher.can_checkpoint:
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
            launcher.checkpoint(spec.id)
            assert launcher.state(handle).status != "running"  # nothing runs: CPU and memory freed
            frozen = int((upper_dir(launcher, spec.id) / "count").read_text())
            time.sleep(0.3)
            assert int((upper_dir(launcher, spec.id) / "count").read_text()) == frozen
            launcher.checkpoint(spec.id)  # a repeated task is harmless
            if cycle % 2 and isinstance(launcher, GVisorLauncher):
                # What the sandbox held is freed in the background after the pause answered:
                # runsc's record of it and its cgroup go (even cycles restore before that).
                wait_until_true(lambda: not _runsc_lists(launcher, spec.id) and not _cgroup_dirs(spec.id), 30)
            handle = launcher.restore(spec)
            after = int(run(launcher, handle, "cat /count").stdout)
            # It went on counting from where it was: not restarted from 1, not lost.
            assert before <= frozen <= after < frozen + 40, (before, frozen, after)
            assert run(launcher, handle, "cat /root/cycles").stdout.split() == [
                b"%d" % i for i in range(cycle + 1)
            ]
        wait_until_true(lambda: sum(1 for k, _ in out if k == "stdout") and
                        int(b"".join(d for k, d in out if k == "stdout").split()[-1]) > after, 10)  # fmt: skip
        numbers = [int(n) for n in b"".join(d for k, d in out if k == "stdout").split()]
        assert numbers == list(range(1, len(numbers) + 1))  # the stream survived, whole, five times
        if isinstance(launcher, GVisorLauncher):  # each restored image is removed (in the background)
            d = launcher.sandboxes_dir / spec.id
            wait_until_true(lambda: not [p.name for p in d.iterdir() if "checkpoint" in p.name], 30)
        counter.send_signal(9)
        assert done.wait(10) and isinstance(out[-1][1], ProcessExit) and out[-1][1].signal == 9
    finally:
        launcher.destroy_id(spec.id)
    assert_nothing_left(launcher, spec.id)


def test_a_checkpointed_sandbox_can_be_destroyed_and_restore_needs_a_checkpoint(launcher, busybox):
    if not launcher.can_checkpoint:
        assert_refuses_checkpoint(launcher, busybox)
        return
    spec = SandboxSpec(id="t" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256)
    handle = launcher.create(spec)
    process = launcher.open_process(handle, ProcessRequest(argv=["sleep", "600"]))
    out: list = []
    done = threading.Event()
    threading.Thread(target=_collect, args=(process, out, done), daemon=True).start()
    launcher.checkpoint(spec.id)
    assert (launcher.sandboxes_dir / spec.id / "checkpoint").is_dir()
    launcher.destroy_id(spec.id)
    assert_nothing_left(launcher, spec.id)
    assert done.wait(10) and out[-1][0] == "error"  # the detached stream ends: the sandbox is gone
    with pytest.raises(Exception, match="no checkpoint"):
        launcher.restore(spec)
    launcher.destroy_id(spec.id)
    assert_nothing_left(launcher, spec.id)


def test_a_sandbox_whose_checkpoint_did_not_happen_after_its_quiesce_is_reachable_again(launcher, sandbox):
    """What a checkpoint does when the quiesce times out or runsc checkpoint fails: the agent
    stopped listening, and must listen again (regression: gVisor left the host's socket file,
    the agent's bind there failed with EPERM, and the sandbox was unreachable for good)."""
    if not launcher.can_checkpoint:
        pytest.skip(f"the {launcher.name} runtime has no checkpoints, so nothing quiesces its agent")
    from runtime.launchers import agent_client

    launcher._quiesce_agent(sandbox)
    with pytest.raises(agent_client.AgentUnavailable):
        launcher._client(sandbox).ping()
    for _ in range(2):  # and a second time, as the checkpoint's retries do
        launcher._relisten_and_wait(sandbox["id"], sandbox, 10.0)
        assert run(launcher, sandbox, "echo back").stdout == b"back\n"
        launcher._quiesce_agent(sandbox)
    launcher._relisten_and_wait(sandbox["id"], sandbox, 10.0)
    assert run(launcher, sandbox, "echo again").stdout == b"again\n"


def assert_refuses_checkpoint(launcher, busybox) -> None:
    """A runtime without checkpoints says so, and leaves the sandbox running."""
    from runtime.launchers.base import LauncherError

    spec = SandboxSpec(id="t" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256)
    handle = launcher.create(spec)
    try:
        with pytest.raises(LauncherError, match="cannot checkpoint"):
            launcher.checkpoint(spec.id)
        assert launcher.state(handle).status == "running"
    finally:
        launcher.destroy_id(spec.id)


def loop_backing_files() -> list[str]:
    files = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        with contextlib.suppress(OSError):
            files.append(backing.read_text().strip())
    return files


def wait_until_true(check: Callable[[], object], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
