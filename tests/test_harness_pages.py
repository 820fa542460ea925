"""The harness pages (list, a harness, a run) and the profile's SSH keys, through Django's test
client. The rows are made directly: these tests need no sandbox runtime (the end-to-end
tests in tests/api/test_harnesses_api.py and tests/browser drive real harnesses)."""

from __future__ import annotations

import subprocess

import pytest
from django.contrib.auth import get_user_model

from runtime.models import (
    Harness,
    HarnessLogEntry,
    Image,
    ImageJob,
    Membership,
    Node,
    Run,
    Sandbox,
    SshKey,
    Team,
    Volume,
)
from tests.support import GVISOR


def _member(username: str, team: Team, role: str):
    user = get_user_model().objects.create_user(username, password="pw")
    Membership.objects.create(user=user, team=team, role=role)
    return user


@pytest.fixture
def crew(db) -> Team:
    return Team.objects.create(name="crew")


@pytest.fixture
def harness(crew) -> Harness:
    sb = Sandbox.objects.create(team=crew, image="base", image_digest="x", status="running")
    vol = Volume.objects.create(team=crew, name="web-workspace", size_mb=1024)
    h = Harness.objects.create(team=crew, name="web", agent="claude-code", image="base", sandbox=sb, volume=vol,
                               setup="done", repo_url="https://example.com/web.git", repo_branch="main",
                               agent_version="1.0.0 (Claude Code)")  # fmt: skip
    HarnessLogEntry.objects.create(harness=h, source="setup", text="cloning https://example.com/web.git")
    return h


def test_the_list_and_a_harness_page_show_state_repository_ssh_command_runs_and_log(client, crew, harness):
    client.force_login(_member("mel", crew, "member"))
    page = client.get("/harnesses/").content.decode()
    assert 'href="/harnesses/' in page and ">web<" in page and "https://example.com/web.git" in page
    assert 'id="harness-form"' in page and 'value="claude-code"' in page

    run = Run.objects.create(harness=harness, prompt="fix the bug", status="succeeded", exit_code=0,
                             duration_ms=1234, diff="diff --git a/x b/x\n+added\n-removed\n")  # fmt: skip
    page = client.get(f"/harnesses/{harness.id}/").content.decode()
    assert 'id="harness-status"' in page and "running" in page
    assert 'value="ssh -p 2222 web@localhost"' in page and "add your public key" in page
    assert "https://example.com/web.git" in page and "main" in page and "1.0.0 (Claude Code)" in page
    assert "web-workspace" in page and "cloning https://example.com/web.git" in page
    assert f'href="/runs/{run.id}/"' in page and "fix the bug" in page
    assert 'id="new-terminal"' in page and 'id="run-form"' in page and 'id="pause-button"' in page
    # Claude Code with no ANTHROPIC_API_KEY among its secrets: the page says so.
    assert 'id="harness-credentials"' in page
    # One click to their traces, from the harness, its run and its sandbox.
    assert f'href="/traces/?harness={harness.id}"' in page

    page = client.get(f"/runs/{run.id}/").content.decode()
    assert (
        "fix the bug" in page
        and '<span class="d+">+added</span>' in page
        and '<span class="d-">-removed' in page
    )
    from runtime.services.spans import run_trace

    assert f'href="/traces/{run_trace(run.id).trace_id}/"' in page and f'href="/traces/?run={run.id}"' in page
    page = client.get(f"/sandboxes/{harness.sandbox_id}/").content.decode()
    assert f'href="/traces/?sandbox={harness.sandbox_id}"' in page

    polled = client.get(f"/harnesses/{harness.id}/log/?after=0").content.decode()
    assert "cloning" in polled and "harness-log-poll" in polled
    last = HarnessLogEntry.objects.latest("id").id
    assert "cloning" not in client.get(f"/harnesses/{harness.id}/log/?after={last}").content.decode()


def test_viewers_look_but_cannot_act_and_other_teams_get_404(client, crew, harness):
    client.force_login(_member("vic", crew, "viewer"))
    page = client.get(f"/harnesses/{harness.id}/").content.decode()
    assert (
        'id="run-form"' not in page and 'id="pause-button"' not in page and 'id="delete-button"' not in page
    )
    for path in ("pause", "resume", "delete", "terminals", "runs"):
        assert client.post(f"/harnesses/{harness.id}/{path}/", {"prompt": "x"}).status_code == 403, path
    assert client.post("/harnesses/", {"name": "x", "agent": "custom"}).status_code == 403
    other = Team.objects.create(name="other")
    client.force_login(_member("otto", other, "owner"))
    assert client.get(f"/harnesses/{harness.id}/").status_code == 404
    assert client.post(f"/harnesses/{harness.id}/pause/").status_code == 404
    assert 'data-name="web"' not in client.get("/harnesses/").content.decode()


def test_the_create_form_explains_bad_input(client, crew, harness):
    client.force_login(_member("mel", crew, "member"))
    r = client.post("/harnesses/", {"name": "Bad Name", "agent": "custom", "command": "x"})
    assert r.status_code == 422 and "invalid harness name" in r.content.decode()
    r = client.post("/harnesses/", {"name": "ok", "agent": "custom", "command": "x", "cpu": "lots"})
    assert r.status_code == 422 and "CPU must be a number" in r.content.decode()


def test_without_the_base_image_the_form_says_so_and_offers_only_the_images_there_are(client, crew, settings):
    Image.objects.create(name="busybox", digest="sha256:b")
    client.force_login(_member("mel", crew, "member"))
    page = client.get("/harnesses/?new=1").content.decode()
    assert 'id="image-missing"' in page and "The base image is not built on this Hangar yet" in page
    assert "Building it takes a minute or two" in page and "they need an image with Node.js and npm" in page
    select = page.split('id="h-image"')[1].split("</select>")[0]
    assert '<option value="">base: not built yet</option>' in select and '<option value="busybox">' in select
    assert 'value="base"' not in select
    # A member is told whom to ask, and what they run.
    assert 'id="ask-admin"' in page and "hangar image build base" in page and 'id="build-image"' not in page
    # Creating on it anyway is a clear form error, not a 500.
    for image in ("", "base"):
        r = client.post("/harnesses/", {"name": "web", "agent": "claude-code", "image": image})
        text = r.content.decode()
        assert r.status_code == 400, (image, r.status_code)
        assert (
            "unknown image &#x27;base&#x27;; images available: busybox; base is not built on this Hangar yet"
            in text
        )
        assert "`hangar image build base` (a minute or two)" in text and 'id="harness-error"' in text
    assert not Harness.objects.exists()


def test_with_the_base_image_the_form_preselects_it_and_says_nothing_more(client, crew):
    for name in ("base", "busybox", "minimal"):
        Image.objects.create(name=name, digest=f"sha256:{name}")
    client.force_login(_member("mel", crew, "member"))
    page = client.get("/harnesses/?new=1").content.decode()
    assert 'id="image-needed"' not in page
    select = page.split('id="h-image"')[1].split("</select>")[0]
    assert '<option value="base" selected>' in select and "not built yet" not in select


def test_staff_build_the_missing_image_from_the_form_and_everyone_sees_its_progress(client, crew, settings):
    Node.objects.create(name=settings.HANGAR_NODE_NAME, launchers=GVISOR)
    staff = _member("root", crew, "member")
    staff.is_staff = True
    staff.save()
    client.force_login(staff)
    page = client.get("/harnesses/?new=1").content.decode()
    assert 'id="build-image"' in page and 'id="ask-admin"' not in page
    r = client.post("/harnesses/new/image/")
    job = ImageJob.objects.get()
    assert (job.kind, job.ref, job.created_by) == ("build", "base", staff)
    assert r.status_code == 302 and r["Location"] == f"/harnesses/?new=1&job={job.id}#new-harness"
    page = client.get(r["Location"]).content.decode()
    # Its progress, live (the Images page's job socket), in place of the button.
    assert f'ws-connect="/ws/ui/images/jobs/{job.id}"' in page and 'id="job-log"' in page
    assert 'id="build-image"' not in page and "Waiting for node" in page

    # A member sees the build that is going, and is not asked to bother an administrator.
    ImageJob.objects.filter(id=job.id).update(status="running", log="I: downloading packages with apt...\n")
    client.force_login(_member("mel", crew, "member"))
    page = client.get("/harnesses/?new=1").content.decode()
    assert "downloading packages with apt" in page and 'id="ask-admin"' not in page
    assert client.post("/harnesses/new/image/").status_code == 403
    assert client.get("/harnesses/new/image/").status_code == 405
    assert ImageJob.objects.count() == 1

    # Once it failed, staff get the button again, beside what went wrong.
    ImageJob.objects.filter(id=job.id).update(status="failed", error="mmdebstrap failed")
    client.force_login(staff)
    page = client.get(f"/harnesses/?new=1&job={job.id}").content.decode()
    assert "mmdebstrap failed" in page and 'id="build-image"' in page


def test_ssh_keys_are_added_shown_and_removed_on_the_profile(client, crew, tmp_path):
    user = _member("mel", crew, "member")
    client.force_login(user)
    key = tmp_path / "id"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "mel@laptop", "-f", str(key)], check=True
    )
    public = (tmp_path / "id.pub").read_text()
    r = client.post("/profile/", {"action": "add", "name": "", "public_key": public})
    assert r.status_code == 302
    row = SshKey.objects.get(user=user)
    assert row.name == "mel@laptop" and row.fingerprint.startswith("SHA256:")
    page = client.get("/profile/").content.decode()
    assert row.fingerprint in page and "mel@laptop" in page
    # The same key again, a private key, garbage: each refused with a reason.
    for text, words in (
        (public, "already registered"),
        (key.read_text(), "private key"),
        ("ssh-ed25519 AAAA", "not an"),
    ):
        r = client.post("/profile/", {"action": "add", "name": "x", "public_key": text})
        assert r.status_code in (409, 422) and words in r.content.decode(), words
    r = client.post("/profile/", {"action": "delete", "key": str(row.id)})
    assert r.status_code == 302 and not SshKey.objects.filter(user=user).exists()


def test_a_key_registered_with_a_teams_token_opens_only_that_teams_harnesses(crew, harness, tmp_path):
    from runtime.errors import NotFound
    from runtime.services.ssh_keys import harness_for_ssh, ssh_key_add

    other = Team.objects.create(name="other")
    user = _member("dual", crew, "member")
    Membership.objects.create(user=user, team=other, role="member")
    theirs = Harness.objects.create(team=other, name="theirs", agent="custom", image="base")
    keys = []
    for name in ("a", "b"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True
        )
        keys.append((tmp_path / f"{name}.pub").read_text())
    scoped = ssh_key_add(user=user, name="ci", public_key=keys[0], team=crew)  # with crew's token
    anywhere = ssh_key_add(user=user, name="laptop", public_key=keys[1])  # on the profile page
    assert harness_for_ssh(user=user, target="web", fingerprint=scoped.fingerprint) == harness
    with pytest.raises(NotFound):
        harness_for_ssh(user=user, target="theirs", fingerprint=scoped.fingerprint)
    assert harness_for_ssh(user=user, target="theirs", fingerprint=anywhere.fingerprint) == theirs


def test_the_log_poll_ignores_a_bad_offset(client, crew, harness):
    client.force_login(_member("mel", crew, "member"))
    r = client.get(f"/harnesses/{harness.id}/log/?after=abc")
    assert r.status_code == 200 and "cloning" in r.content.decode()
