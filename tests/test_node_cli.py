"""``hangar node …``: cordon, uncordon, drain, remove; join tokens created (the token alone on
the last line), listed and revoked; the real ``join`` against the real server (a used, expired
or revoked token refused at once, non-zero); and a SIGKILLed node's children gone with it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

from django.utils import timezone

from dashboard import node_cli
from dashboard.cli import main as cli_main
from runtime.models import AuditEvent, Node, NodeJoinToken
from runtime.services import fleet
from runtime.services.nodes import node_register
from tests.support import GVISOR, wait_until

ROOT = Path(__file__).resolve().parents[1]


def _token(capsys, *args: str) -> str:
    assert cli_main(["node", "token", "create", *args]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("hjt_") and out[-1].split() == [out[-1]]  # alone on its line
    return out[-1]


def test_node_commands_change_states_and_say_why_not(transactional_db, capsys):
    node_register(name="cli-node", launchers=GVISOR, cpu=2, memory_mb=2048)
    assert cli_main(["node", "cordon", "cli-node"]) == 0
    assert "cli-node: cordoned" in capsys.readouterr().out
    assert cli_main(["node", "uncordon", "cli-node"]) == 0
    assert cli_main(["node", "drain", "cli-node"]) == 0
    assert "draining" in capsys.readouterr().out
    assert cli_main(["node", "cordon", "cli-node"]) == 2
    assert "is draining" in capsys.readouterr().err
    assert cli_main(["node", "remove", "cli-node"]) == 0
    assert Node.objects.get(name="cli-node").state == Node.State.REMOVED
    assert cli_main(["node", "cordon", "nosuch"]) == 2
    assert "no node named 'nosuch'" in capsys.readouterr().err
    assert AuditEvent.objects.filter(target="cli-node", action="node.remove", via="cli").exists()


def test_join_tokens_from_the_cli_alone_on_the_last_line_listed_and_revoked(transactional_db, capsys):
    raw = _token(capsys)
    stored = NodeJoinToken.objects.get()
    assert stored.uses == 1 and stored.expires_at is None and raw.startswith(stored.prefix)
    raw2 = _token(capsys, "--uses", "3", "--expires-in", "600")
    t2 = NodeJoinToken.objects.get(prefix=raw2[:12])
    assert t2.uses == 3 and timedelta(seconds=590) < t2.expires_at - timezone.now() <= timedelta(seconds=600)
    assert cli_main(["node", "token", "list"]) == 0
    listed = capsys.readouterr().out
    assert stored.prefix in listed and raw not in listed
    assert cli_main(["node", "token", "revoke", str(t2.id)]) == 0
    assert NodeJoinToken.objects.get(id=t2.id).revoked_at is not None
    assert cli_main(["node", "token", "create", "--uses", "0"]) == 2


def _join(server: str, token: str, name: str) -> subprocess.CompletedProcess[str]:
    """The real ``hangar node join`` in a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "dashboard.cli", "node", "join", server, "--token", token, "--name", name],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_join_against_the_real_server_single_use_expiry_revocation(
    transactional_db, server, capsys, monkeypatch, tmp_path
):
    ran = {}

    def run_node(args, env):  # what a bare `hangar node` would do next, with the plane's settings
        ran.update(env=env, name=args.name)
        return 0

    monkeypatch.setattr(node_cli, "run_node", run_node)
    monkeypatch.setenv("HANGAR_DATA_DIR", str(tmp_path))  # where join keeps what it was given
    raw = _token(capsys)
    assert (
        cli_main(
            ["node", "join", server, "--token", raw, "--name", "joined-1", "--labels", "zone=a,disk=ssd"]
        )
        == 0
    )
    assert "joined" in capsys.readouterr().out
    node = Node.objects.get(name="joined-1")
    assert node.labels == {"zone": "a", "disk": "ssd"} and node.state == Node.State.READY
    assert ran["env"]["HANGAR_NODE_NAME"] == "joined-1" and ran["env"]["DATABASE_URL"].startswith(
        "postgres://"
    )
    assert ran["env"]["REDIS_URL"].startswith("redis://")
    # Kept for a bare `hangar node` later, readable by root alone: the node's own database role.
    kept = tmp_path / "node-join.json"
    assert kept.stat().st_mode & 0o777 == 0o600 and json.loads(kept.read_text()) == ran["env"]
    assert "hangar_node_" in ran["env"]["DATABASE_URL"]
    for key in ran["env"]:  # as on a machine whose environment sets none of them (put back after)
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    node_cli.load_joined_settings()
    assert {key: os.environ[key] for key in ran["env"]} == ran["env"]
    monkeypatch.setenv("DATABASE_URL", "postgres://elsewhere/db")  # the environment's own wins
    node_cli.load_joined_settings()
    assert os.environ["DATABASE_URL"] == "postgres://elsewhere/db"
    # Used: the real CLI exits non-zero at once, saying why.
    started = time.monotonic()
    used = _join(server, raw, "joined-2")
    assert used.returncode != 0 and "has been used (1 of 1 joins)" in used.stderr, used
    assert time.monotonic() - started < 30
    expired = fleet.join_token_create(user=None, expires_in_s=60)
    NodeJoinToken.objects.filter(id=expired.token.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    out = _join(server, expired.raw, "joined-3")
    assert out.returncode != 0 and "expired" in out.stderr, out
    revoked = _token(capsys, "--uses", "5")
    assert cli_main(["node", "token", "revoke", str(NodeJoinToken.objects.get(prefix=revoked[:12]).id)]) == 0
    out = _join(server, revoked, "joined-4")
    assert out.returncode != 0 and "revoked" in out.stderr, out
    out = _join(server, "hjt_made-up", "joined-5")
    assert out.returncode != 0 and "unknown join token" in out.stderr, out
    assert not Node.objects.filter(name__in=["joined-2", "joined-3", "joined-4", "joined-5"]).exists()
    assert cli_main(["node", "join", server, "--token", raw, "--labels", "nonsense"]) == 2
    assert "not key=value" in capsys.readouterr().err


def test_a_sigkilled_supervisor_takes_its_children_with_it(tmp_path):
    """`hangar node` runs its worker and bridge under dashboard.supervise: SIGKILL the
    supervisor and they go too (PR_SET_PDEATHSIG), rather than staying half-alive."""
    pids = tmp_path / "pids"
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from dashboard import supervise
        specs = [("worker", ["sh", "-c", "echo $$ >> {pids}; exec sleep 300"]),
                 ("bridge", ["sh", "-c", "echo $$ >> {pids}; exec sleep 300"])]
        children = []
        logs = supervise.start_children(specs, {{"PATH": "/usr/bin:/bin"}}, Path({str(tmp_path)!r}), children)
        sys.exit(supervise.supervise(children, supervise.restarter(specs, {{"PATH": "/usr/bin:/bin"}}, logs)))
    """)
    sup = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    try:
        wait_until(lambda: pids.exists() and len(pids.read_text().split()) == 2, 20, what="both children")
        children = [int(p) for p in pids.read_text().split()]
        assert all(Path(f"/proc/{p}").exists() for p in children)
        sup.send_signal(signal.SIGKILL)
        sup.wait(10)

        def gone(pid: int) -> bool:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().split()[2]
            except FileNotFoundError:
                return True
            return state == "Z"

        wait_until(
            lambda: all(gone(p) for p in children), 10, what="the children to die with their supervisor"
        )
    finally:
        if sup.poll() is None:
            sup.kill()
        for p in pids.read_text().split() if pids.exists() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(p), signal.SIGKILL)
