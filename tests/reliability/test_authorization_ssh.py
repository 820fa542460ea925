"""Who may open a shell through the SSH gateway: every kind of key holder × harness (their own
team's, another team's, one that does not exist), with the real OpenSSH client against
``hangar ssh-gateway`` and a harness running in gVisor. What each cell should answer is in
:data:`EXPECTED`, this test's own table (a shell is a member's right; a key registered with a
token acts at most as that token could; another team's harness answers exactly as a missing
one), not read from ``runtime/services/ssh_keys.py``."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest
from django.contrib.auth import get_user_model

from runtime.models import Harness, Membership, Sandbox, Team
from runtime.services import auth as auth_svc
from runtime.services.ssh_keys import ssh_key_add
from tests.support import requires_runsc
from tests.test_ssh_gateway import box, gateway, keys, ssh  # noqa: F401 (fixtures)

pytestmark = [requires_runsc, pytest.mark.timeout(300)]

# Key holders, and how each stands towards team "alpha" (whose harness "box" runs).
HOLDERS = {
    "alpha's owner": "owner",  # alice, who made the harness
    "alpha's admin": "admin",
    "alpha's member": "member",
    "alpha's viewer": "viewer",
    "staff, alpha's member": "member",
    "beta's owner": "outside",  # mallory: another team's
    "a member who left alpha": "left",  # registered while a member, then removed
    "a key registered for beta only": "beta-key",  # alpha's member, the key registered with beta's token
    # alice's keys, registered through the API with a token that may not open shells
    "a key registered with alice's viewer token": "viewer-token",
    "a key registered with alice's ssh_keys-only token": "viewer-token",
    "an unregistered key": "unregistered",
}
# What each gets at alpha's harness ("own"), at a harness of a team none of them is in
# ("another team's") and at a name nothing has ("nonexistent"): "shell", "no harness" (the
# words for a name that is no harness of theirs), "member or above" (refused for its role),
# "not registered" (authentication fails).
NOBODY = {"another team's": "no harness", "nonexistent": "no harness"}
EXPECTED = {
    "owner": {"own": "shell", **NOBODY},
    "admin": {"own": "shell", **NOBODY},
    "member": {"own": "shell", **NOBODY},
    "viewer": {"own": "member or above", **NOBODY},
    "viewer-token": {"own": "member or above", **NOBODY},
    "outside": {"own": "no harness", **NOBODY},
    "left": {"own": "no harness", **NOBODY},
    "beta-key": {"own": "no harness", **NOBODY},
    "unregistered": dict.fromkeys(("own", "another team's", "nonexistent"), "not registered"),
}


def _keypair(root: Path, i: int) -> Path:
    path = root / f"holder-{i}"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True, capture_output=True
    )
    return path


def _holders(pairs: dict[str, Path], tmp_path: Path, server: str) -> dict[str, Path]:
    """Each holder's private key, registered (or not) as its name says."""
    User = get_user_model()
    alpha, beta = Team.objects.get(name="alpha"), Team.objects.get(name="beta")
    alice, mallory = User.objects.get(username="alice"), User.objects.get(username="mallory")
    ssh_key_add(user=mallory, name="m", public_key=pairs["mallory"].with_suffix(".pub").read_text())
    out = {
        "alpha's owner": pairs["alice"],
        "an unregistered key": pairs["stranger"],
        "beta's owner": pairs["mallory"],
    }
    for i, (holder, how) in enumerate(HOLDERS.items()):
        if holder in out:
            continue
        key = out[holder] = _keypair(tmp_path, i)
        public = key.with_suffix(".pub").read_text()
        if how == "viewer-token":  # through the API, as a script holding that token would
            kw = {"role": "viewer"} if "viewer" in holder else {"scopes": ["ssh_keys:write"]}
            raw = auth_svc.token_create(user=alice, team=alpha, **kw).raw
            r = httpx.post(f"{server}/api/v1/ssh-keys", headers={"Authorization": f"Bearer {raw}"},
                           json={"name": f"k{i}", "public_key": public}, timeout=30)  # fmt: skip
            assert r.status_code == 201 and r.json()["role"] == "viewer", r.text
            continue
        user = User.objects.create_user(
            username=f"ssh-{i}", password="x", is_staff=holder.startswith("staff")
        )
        Membership.objects.create(
            user=user, team=alpha, role=how if how in ("admin", "member", "viewer") else "member"
        )
        team = None
        if how == "beta-key":
            Membership.objects.create(user=user, team=beta, role="member")
            team = beta
        ssh_key_add(user=user, name="k", public_key=public, team=team)
        if how == "left":
            Membership.objects.filter(user=user).delete()
    return out


def _answer(result: subprocess.CompletedProcess[bytes], target: str) -> str:
    err = result.stderr.decode(errors="replace")
    if result.returncode == 0 and result.stdout == b"in-the-box\n":
        return "shell"
    if result.returncode == 255 and f"no harness '{target}' in your teams" in err:
        return "no harness"
    if result.returncode == 255 and "a shell needs member or above" in err:
        return "member or above"
    if result.returncode == 255 and "is not registered with Hangar" in err and "Permission denied" in err:
        return "not registered"
    return f"exit {result.returncode}: {err.strip()[-160:]!r} {result.stdout[-80:]!r}"


def test_the_ssh_matrix(server, api, other_api, box, gateway, keys, tmp_path, report):  # noqa: F811
    """Every key holder × harness answers as the table says; nothing runs in the harness for a
    refused one; another team's harness is refused in the very words a missing one is."""
    gamma = Team.objects.create(name="gamma")  # no holder's team
    sb = Sandbox.objects.create(
        team=gamma, image="minimal", image_digest="sha256:" + "b" * 64, status="stopped"
    )
    Harness.objects.create(
        team=gamma, name="gammabox", agent="custom", image="minimal", sandbox=sb, setup="done"
    )
    holders = _holders(keys, tmp_path, server)
    targets = {"own": "box", "another team's": "gammabox", "nonexistent": "nosuchbox"}
    failures, n, shells = [], 0, []
    for holder, key in holders.items():
        for whose, target in targets.items():
            r = ssh(gateway, key, f"echo in-the-box; touch /workspace/intruder-{n}", user=target, quiet=False,
                    timeout=60)  # fmt: skip
            got, want = _answer(r, target), EXPECTED[HOLDERS[holder]][whose]
            if got != want:
                failures.append(f"{holder:>50} {whose:>15} ({target}): {got} (want {want})")
            if want == "shell":
                shells.append(n)
            n += 1
    assert n == len(HOLDERS) * len(targets)
    # Whatever was refused ran nothing: only the shells the table allows left their marker.
    listed = ssh(gateway, keys["alice"], "ls /workspace", user="box")
    made = sorted(
        int(line.rsplit("-", 1)[1]) for line in listed.stdout.decode().split() if "intruder-" in line
    )
    if made != shells:
        failures.append(f"markers left by cells {made}, but only {shells} may run anything")
    assert not failures, f"{len(failures)} of {n} cells:\n" + "\n".join(failures)
    report.held(
        "authorization",
        "SSH: key holder (4 roles, staff, another team's owner, removed member, a key registered for "
        "another team, keys registered with a viewer's or an ssh_keys-only token, unregistered) x harness "
        "(own, another team's, nonexistent), the real OpenSSH client",
        cells=n,
    )
