"""Dashboard pages through Django's test client: sign-in, the team switcher, the sandboxes list
and its create form, and the sandbox page's tabs and actions (its files, images, volumes,
pause and pools are in test_resource_pages.py). Rows are written with the ORM; nothing here
needs runsc, a worker or a server."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.template.loader import render_to_string
from django.utils import timezone

from dashboard.pages.sandbox_views import sandbox_rows_context
from dashboard.pages.teams import SESSION_KEY
from runtime.models import Exec, Image, Membership, Sandbox, SandboxEvent, Team
from runtime.services.nodes import node_register
from tests.pages.support import S, make_member, make_sandbox
from tests.support import GVISOR

# -- sign-in --------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_sign_in_page_renders_and_signs_in(client, alpha):
    make_member("ann", alpha)
    page = client.get("/login/")
    assert page.status_code == 200
    html = page.content.decode()
    assert 'id="login-form"' in html and "hangar/hangar.css" in html and "/admin/" not in html

    wrong = client.post("/login/", {"username": "ann", "password": "nope"})
    assert wrong.status_code == 200 and "msg error" in wrong.content.decode()

    r = client.post("/login/", {"username": "ann", "password": "pw"})
    assert r.status_code == 302 and r["Location"] == "/sandboxes/"
    assert client.get("/sandboxes/").status_code == 200

    out = client.post("/logout/")
    assert out.status_code == 302 and out["Location"] == "/login/"
    assert client.get("/sandboxes/").status_code == 302


@pytest.fixture
def fresh_throttle():
    from runtime.notify import redis_client

    def clear() -> None:
        keys = list(redis_client().scan_iter("hangar:login:*"))
        if keys:
            redis_client().delete(*keys)

    clear()
    yield
    clear()


@pytest.mark.django_db
def test_failed_sign_ins_make_the_next_ones_wait_on_every_sign_in_form(
    client, alpha, settings, fresh_throttle
):
    import time

    settings.HANGAR_LOGIN_FREE_FAILURES = 3
    make_member("ann", alpha)
    for _ in range(4):  # three free, the fourth makes the next wait 1 s
        wrong = client.post("/login/", {"username": "ann", "password": "nope"})
        assert wrong.status_code == 200 and "msg error" in wrong.content.decode()
    # Now even the right password is not checked: a 429 that says how long to wait.
    r = client.post("/login/", {"username": "ANN ", "password": "pw"})
    assert r.status_code == 429 and int(r["Retry-After"]) >= 1
    assert "Too many failed sign-ins" in r.content.decode()
    assert client.get("/sandboxes/").status_code == 302  # not signed in
    # The admin's sign-in form is no way around it, nor is Django's authenticate().
    staff = get_user_model().objects.get(username="ann")
    staff.is_staff = True
    staff.save()
    r = client.post("/admin/login/?next=/admin/", {"username": "ann", "password": "pw"})
    assert r.status_code == 200 and "Too many failed sign-ins" in r.content.decode()
    assert not client.login(username="ann", password="pw")
    time.sleep(1.1)
    r = client.post("/login/", {"username": "ann", "password": "pw"})
    assert r.status_code == 302  # waited: checked, and right


@pytest.mark.django_db
def test_one_address_trying_many_accounts_is_throttled_too(client, alpha, settings, fresh_throttle):
    settings.HANGAR_LOGIN_FREE_FAILURES = 2  # an address: four times that, 8
    make_member("bob", alpha)
    for i in range(9):
        client.post("/login/", {"username": f"user{i}", "password": "guess"})
    r = client.post("/login/", {"username": "bob", "password": "pw"})
    assert r.status_code == 429


@pytest.mark.django_db
@pytest.mark.parametrize(
    "url",
    [
        "/",
        "/sandboxes/",
        "/sandboxes/sbanything/",
        "/sandboxes/sbanything/?tab=files",
        "/images/",
        "/images/jobs/1/",
        "/team/settings/",
        "/usage/",
        "/usage/1.csv",
        "/audit/",
        "/audit.csv",
    ],
)
def test_pages_require_sign_in(client, url):
    r = client.get(url)
    assert r.status_code == 302 and r["Location"].startswith("/login/?next=")


@pytest.mark.django_db
def test_posts_require_sign_in(client, alpha):
    sandbox = make_sandbox(alpha)
    for url in (f"/sandboxes/{sandbox.id}/stop/", f"/sandboxes/{sandbox.id}/delete/", "/sandboxes/"):
        assert client.post(url).status_code == 302
    assert Sandbox.objects.get(id=sandbox.id).status == S.RUNNING


# -- the list -------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_sandbox_list_shows_the_current_teams_sandboxes_only(client, ann, alpha, beta):
    node = node_register(name="node-a", launchers=GVISOR, cpu=4, memory_mb=8192)
    mine = make_sandbox(alpha, node=node, memory_mb=768)
    theirs = make_sandbox(beta)
    page = client.get("/sandboxes/").content.decode()
    assert mine.id in page and theirs.id not in page
    assert f'id="sb-{mine.id}"' in page and "node-a" in page and "768 MB" in page
    assert 'ws-connect="/ws/ui/sandboxes?since=' in page and "vendor/htmx/ext-ws.min.js" in page
    assert 'class="status running"' in page


@pytest.mark.django_db
def test_sandbox_list_and_page_show_cpu_memory_and_disk_in_use_from_the_last_sample(client, ann, alpha):
    import json

    from runtime.notify import redis_client
    from runtime.services.sandbox_io import STATS_KEY

    sampled, unsampled = make_sandbox(alpha, disk_mb=2048), make_sandbox(alpha)
    sample = {"cpu_pct": 12.4, "memory_bytes": 50 * 1024 * 1024, "disk_bytes": 300 * 1024 * 1024}
    redis_client().hset(STATS_KEY, sampled.id, json.dumps(sample))
    try:
        page = client.get("/sandboxes/").content.decode()
        detail = client.get(f"/sandboxes/{sampled.id}/").content.decode()
        Sandbox.objects.filter(id=sampled.id).update(status=S.PAUSED)  # a paused one uses nothing
        paused = client.get(f"/sandboxes/{sampled.id}/").content.decode()
    finally:
        redis_client().hdel(STATS_KEY, sampled.id)
    row = page.split(f'id="sb-{sampled.id}"')[1].split("</tr>")[0]
    assert "12%" in row and "50.0\xa0MB" in row and '300.0\xa0MB<span class="muted"> / 2048 MB' in row
    row = page.split(f'id="sb-{unsampled.id}"')[1].split("</tr>")[0]
    assert "—<span" in row
    assert "Disk</th>" in page
    disk = detail.split('id="sb-disk">')[1].split("</dd>")[0]
    memory = detail.split('id="sb-memory">')[1].split("</dd>")[0]
    assert "300.0\xa0MB" in disk and "2048 MB" in disk and "50.0\xa0MB" in memory, (disk, memory)
    assert paused.split('id="sb-disk">')[1].split("</dd>")[0] == "2048 MB"


@pytest.mark.django_db
def test_sandbox_list_filters_by_status(client, ann, alpha):
    running = make_sandbox(alpha, S.RUNNING)
    stopped = make_sandbox(alpha, S.STOPPED)
    failed = make_sandbox(alpha, S.FAILED, status_reason="out of memory")
    deleted = make_sandbox(alpha, S.DELETED)

    active = client.get("/sandboxes/").content.decode()
    assert all(s.id in active for s in (running, stopped, failed)) and deleted.id not in active

    only_stopped = client.get("/sandboxes/?status=stopped").content.decode()
    assert stopped.id in only_stopped and running.id not in only_stopped and failed.id not in only_stopped

    only_deleted = client.get("/sandboxes/?status=deleted").content.decode()
    assert deleted.id in only_deleted and running.id not in only_deleted

    only_running = client.get("/sandboxes/?status=running").content.decode()
    assert running.id in only_running and failed.id not in only_running

    running.delete()
    assert "No running sandboxes" in client.get("/sandboxes/?status=running").content.decode()

    # An unknown filter is the default view, not an error.
    assert client.get("/sandboxes/?status=bogus").status_code == 200


@pytest.mark.django_db
def test_empty_list_says_how_to_create_a_sandbox(client, ann):
    page = client.get("/sandboxes/").content.decode()
    assert "No sandboxes yet" in page and "/api/v1/sandboxes" in page and 'id="create-form"' in page


@pytest.mark.django_db
def test_sandbox_list_pages_fifty_at_a_time(client, ann, alpha):
    Sandbox.objects.bulk_create(
        [Sandbox(team=alpha, image="busybox", image_digest="x", status=S.RUNNING) for _ in range(120)]
    )
    first = client.get("/sandboxes/").content.decode()
    assert first.count('class="sb-row"') == 50 and "Page 1 of 3" in first
    last = client.get("/sandboxes/?page=3").content.decode()
    assert last.count('class="sb-row"') == 20 and "101–120 of 120" in last


@pytest.mark.django_db
def test_sandbox_list_with_a_thousand_sandboxes_is_a_bounded_number_of_queries(
    client, ann, alpha, django_assert_max_num_queries
):
    node = node_register(name="node-a", launchers=GVISOR, cpu=64, memory_mb=65536)
    Image.objects.create(name="busybox", digest="sha256:" + "a" * 64).nodes.add(node)
    statuses = [S.RUNNING, S.STOPPED, S.FAILED, S.STARTING, S.DELETED]
    Sandbox.objects.bulk_create(
        [
            Sandbox(
                team=alpha,
                image="busybox",
                image_digest="x",
                node=node,
                status=statuses[i % 5],
                expires_at=timezone.now() + timedelta(minutes=i),
            )
            for i in range(1000)
        ]  # fmt: skip
    )
    with django_assert_max_num_queries(15):
        r = client.get("/sandboxes/")
    assert r.status_code == 200 and r.content.decode().count('class="sb-row"') == 50
    with django_assert_max_num_queries(15):
        r = client.get("/sandboxes/?status=running&page=4")
    assert r.status_code == 200 and r.content.decode().count('data-status="running"') == 50


@pytest.mark.django_db
def test_live_rows_render_as_out_of_band_table_rows(alpha, beta):
    mine, theirs = make_sandbox(alpha, S.STARTING), make_sandbox(beta)
    rows = sandbox_rows_context(team=alpha, ids=[mine.id, theirs.id])
    assert [r.sandbox.id for r in rows] == [mine.id]
    html = render_to_string("hangar/partials/sandbox_rows_oob.html", {"rows": rows})
    assert html.strip().startswith("<template><tr")
    assert f'<tr id="sb-{mine.id}"' in html and 'hx-swap-oob="true"' in html and theirs.id not in html
    assert 'class="status starting"' in html


@pytest.mark.django_db
def test_live_detail_push_replaces_the_header_and_appends_events(alpha):
    sandbox = make_sandbox(alpha, S.FAILED, status_reason="the runtime crashed")
    event = SandboxEvent.objects.create(
        sandbox=sandbox, kind="status", status_from="running", status_to="failed"
    )
    html = render_to_string("hangar/partials/sandbox_live_oob.html", {"sandbox": sandbox, "events": [event]})
    assert 'id="sb-header"' in html and 'hx-swap-oob="true"' in html and "the runtime crashed" in html
    assert 'hx-swap-oob="beforeend:#events-body"' in html and f'id="ev-{event.id}"' in html


# -- the team switcher ----------------------------------------------------------------------------


@pytest.mark.django_db
def test_team_switcher_switches_team_and_refuses_a_foreign_one(client, ann, alpha, beta):
    gamma = Team.objects.create(name="gamma")
    Membership.objects.create(user=ann, team=beta, role=Membership.Role.VIEWER)
    in_alpha, in_beta, in_gamma = make_sandbox(alpha), make_sandbox(beta), make_sandbox(gamma)

    page = client.get("/sandboxes/").content.decode()
    assert 'id="team-select"' in page and in_alpha.id in page and in_beta.id not in page

    r = client.post("/team/", {"team": beta.id, "next": "/sandboxes/"})
    assert r.status_code == 302 and r["Location"] == "/sandboxes/"
    assert client.session[SESSION_KEY] == beta.id
    page = client.get("/sandboxes/").content.decode()
    assert in_beta.id in page and in_alpha.id not in page

    refused = client.post("/team/", {"team": gamma.id})
    assert refused.status_code == 403 and client.session[SESSION_KEY] == beta.id
    assert in_gamma.id not in client.get("/sandboxes/").content.decode()
    assert client.post("/team/", {"team": "nope"}).status_code == 403

    # From a sandbox page of the old team, the switch lands on the list, not on a 404.
    r = client.post("/team/", {"team": alpha.id, "next": f"/sandboxes/{in_beta.id}/"})
    assert r["Location"] == "/sandboxes/"
    assert (
        client.post("/team/", {"team": beta.id, "next": "https://evil.example/"})["Location"] == "/sandboxes/"
    )


@pytest.mark.django_db
def test_user_without_a_team_is_told_so(client):
    client.force_login(get_user_model().objects.create_user("loner", password="pw"))
    page = client.get("/sandboxes/").content.decode()
    assert "not in a team" in page
    assert client.get("/sandboxes/sbwhatever/").status_code == 404


# -- the create form ------------------------------------------------------------------------------


@pytest.mark.django_db
def test_create_form_shows_the_services_validation_errors_and_keeps_the_values(client, ann):
    Image.objects.create(name="busybox", digest="sha256:" + "a" * 64)
    form = {"image": "busybox", "runtime": "gvisor", "cpu": "1", "memory_mb": "999999", "timeout_s": "600",
            "env": "GREETING=hello"}  # fmt: skip
    r = client.post("/sandboxes/", form)
    html = r.content.decode()
    assert r.status_code == 422
    assert "memory_mb must be between 128 and 16384, got 999999" in html
    assert 'value="999999"' in html and "GREETING=hello" in html and 'value="600"' in html

    r = client.post("/sandboxes/", {**form, "memory_mb": "512", "image": "no-such-image"})
    assert (
        r.status_code == 422
        and "unknown image &#x27;no-such-image&#x27;; images available: busybox" in r.content.decode()
    )

    r = client.post("/sandboxes/", {**form, "memory_mb": "512", "env": "1BAD=x"})
    assert r.status_code == 422 and "is not a valid variable name" in r.content.decode()

    r = client.post("/sandboxes/", {**form, "memory_mb": "512", "env": "no equals sign"})
    assert r.status_code == 422 and "expected KEY=VALUE" in r.content.decode()

    r = client.post("/sandboxes/", {**form, "memory_mb": "512", "disk_mb": "8"})
    assert r.status_code == 422 and "disk_mb must be between 64 and 102400, got 8" in r.content.decode()

    r = client.post("/sandboxes/", {**form, "cpu": "lots"})
    assert r.status_code == 422 and "Enter a number" in r.content.decode()
    assert not Sandbox.objects.exists()


@pytest.mark.django_db
def test_create_form_without_a_node_says_so(client, ann):
    Image.objects.create(name="busybox", digest="sha256:" + "a" * 64)
    r = client.post("/sandboxes/", {"image": "busybox", "runtime": "gvisor", "cpu": "1", "memory_mb": "512",
                                    "timeout_s": "600"})  # fmt: skip
    assert r.status_code == 422 and "no node: none has joined" in r.content.decode()


@pytest.mark.django_db
def test_create_redirects_to_the_sandbox_page_which_shows_it_starting(client, ann, alpha):
    node = node_register(name="node-a", launchers=GVISOR, cpu=4, memory_mb=8192)
    Image.objects.create(name="busybox", digest="sha256:" + "a" * 64).nodes.add(node)
    r = client.post("/sandboxes/", {"image": "busybox", "runtime": "gvisor", "cpu": "0.5", "memory_mb": "256",
                                    "timeout_s": "900", "env": "A=1\nB=two=2\n", "on_expire": "pause",
                                    "idle_timeout_s": "600", "disk_mb": "2048"})  # fmt: skip
    sandbox = Sandbox.objects.get(team=alpha)
    assert r.status_code == 302 and r["Location"] == f"/sandboxes/{sandbox.id}/"
    assert sandbox.env == {"A": "1", "B": "two=2"} and sandbox.memory_mb == 256 and sandbox.cpu == 0.5
    assert sandbox.on_expire == "pause" and sandbox.idle_timeout_s == 600 and sandbox.disk_mb == 2048
    page = client.get(r["Location"]).content.decode()
    assert (
        "paused after 600 s" in page
        and "then paused" in page
        and '<dt>Disk</dt><dd id="sb-disk">2048 MB</dd>' in page
    )
    assert "Scheduled on node" in page and 'id="sb-progress"' in page and "spinner" in page
    assert f'ws-connect="/ws/ui/sandboxes/{sandbox.id}?after=' in page


@pytest.mark.django_db
def test_viewer_sees_no_create_form_and_cannot_create(client, alpha):
    client.force_login(make_member("vic", alpha, Membership.Role.VIEWER))
    Image.objects.create(name="busybox", digest="sha256:" + "a" * 64)
    assert 'id="create-form"' not in client.get("/sandboxes/").content.decode()
    r = client.post("/sandboxes/", {"image": "busybox", "runtime": "gvisor", "cpu": "1", "memory_mb": "512",
                                    "timeout_s": "60"})  # fmt: skip
    assert r.status_code == 403 and not Sandbox.objects.exists()


# -- the sandbox page -----------------------------------------------------------------------------


@pytest.mark.django_db
def test_sandbox_page_is_a_404_for_another_teams_sandbox(client, ann, beta):
    theirs = make_sandbox(beta)
    assert client.get(f"/sandboxes/{theirs.id}/").status_code == 404
    assert client.get(f"/sandboxes/{theirs.id}/?tab=events", HTTP_HX_REQUEST="true").status_code == 404
    assert client.post(f"/sandboxes/{theirs.id}/stop/").status_code == 404
    assert client.get(f"/sandboxes/{theirs.id}/files/download?path=/etc/hostname").status_code == 404
    assert Sandbox.objects.get(id=theirs.id).status == S.RUNNING


@pytest.mark.django_db
def test_sandbox_page_header_shows_the_sandbox(client, ann, alpha):
    node = node_register(name="node-a", launchers=GVISOR, cpu=4, memory_mb=8192)
    sandbox = make_sandbox(alpha, node=node, cpu=2, memory_mb=1024)
    page = client.get(f"/sandboxes/{sandbox.id}/").content.decode()
    assert 'id="sb-header"' in page and 'class="status running"' in page and "node-a" in page
    assert (
        "1024 MB" in page
        and 'id="stop-button"' in page
        and 'id="delete-button"' in page
        and "hx-confirm" in page
    )
    assert 'id="extend-button"' in page and "data-expires" in page
    # A running sandbox opens on its terminal tab, which opens a terminal when it has none.
    assert 'id="tab-terminal"' in page and 'class="tab active"' in page and 'id="terminal-opening"' in page
    assert "hangar/terminal.js" in page and "vendor/xterm/xterm.js" in page


@pytest.mark.django_db
def test_failed_sandbox_shows_its_reason_and_tabs_say_they_need_a_running_one(client, ann, alpha):
    sandbox = make_sandbox(alpha, S.FAILED, status_reason="image busybox is not on node node-z")
    page = client.get(f"/sandboxes/{sandbox.id}/").content.decode()
    assert "image busybox is not on node node-z" in page and 'id="events-body"' in page  # opens on Events
    for tab in ("terminal", "commands", "files"):
        fragment = client.get(f"/sandboxes/{sandbox.id}/?tab={tab}", HTTP_HX_REQUEST="true").content.decode()
        assert (
            "<html" not in fragment
            and "This sandbox is failed" in fragment
            and "need a running sandbox" in fragment
        )
    assert 'id="stop-button"' in page and 'id="extend-button"' not in page


@pytest.mark.django_db
def test_events_tab_lists_the_sandboxes_events(client, ann, alpha):
    sandbox = make_sandbox(alpha)
    first = SandboxEvent.objects.create(sandbox=sandbox, kind="status", message="scheduled on node node-a")
    last = SandboxEvent.objects.create(
        sandbox=sandbox, kind="status", status_from="starting", status_to="running"
    )
    fragment = client.get(f"/sandboxes/{sandbox.id}/?tab=events", HTTP_HX_REQUEST="true")
    html = fragment.content.decode()
    assert fragment.status_code == 200 and "<html" not in html and 'id="events-body"' in html
    assert (
        "scheduled on node node-a" in html and f'id="ev-{first.id}"' in html and f'id="ev-{last.id}"' in html
    )
    assert html.index(f'id="ev-{first.id}"') < html.index(f'id="ev-{last.id}"')
    # The same tab by URL is the whole page; its live socket starts after the last event.
    page = client.get(f"/sandboxes/{sandbox.id}/?tab=events").content.decode()
    assert "<html" in page and f"?after={last.id}" in page and "scheduled on node node-a" in page


@pytest.mark.django_db
def test_commands_tab_lists_history_and_shows_stored_output(client, ann, alpha):
    sandbox = make_sandbox(alpha, S.STOPPED)
    done = Exec.objects.create(sandbox=sandbox, kind=Exec.Kind.STREAM, argv=["/bin/sh", "-c", "echo hi; echo oops >&2"],
                               status=Exec.Status.EXITED, exit_code=3, stdout="hi\n", stderr="oops\n",
                               stdout_bytes=3, stderr_bytes=5, duration_ms=1520)  # fmt: skip
    html = client.get(f"/sandboxes/{sandbox.id}/?tab=commands", HTTP_HX_REQUEST="true").content.decode()
    assert f'id="exec-{done.id}"' in html and "echo hi; echo oops &gt;&amp;2" in html and "exit 3" in html
    assert "1.5 s" in html and 'id="command-form"' not in html  # stopped: no new commands
    html = client.get(
        f"/sandboxes/{sandbox.id}/?tab=commands&process={done.id}", HTTP_HX_REQUEST="true"
    ).content.decode()
    assert '<span class="stdout">hi\n</span>' in html and '<span class="stderr">oops\n</span>' in html
    assert "data-ws" not in html.split('id="command-run-view"')[1].split(">")[0]


@pytest.mark.django_db
def test_commands_tab_attaches_to_a_running_process(client, ann, alpha):
    sandbox = make_sandbox(alpha)
    live = Exec.objects.create(sandbox=sandbox, kind=Exec.Kind.STREAM, argv=["/bin/sh", "-c", "sleep 100"],
                               status=Exec.Status.RUNNING)  # fmt: skip
    html = client.get(f"/sandboxes/{sandbox.id}/?tab=commands&process={live.id}").content.decode()
    assert f'data-ws="/ws/v1/sandboxes/{sandbox.id}/exec?process={live.id}"' in html
    assert 'id="command-input"' in html and "hangar/commands.js" in html


@pytest.mark.django_db
def test_empty_commands_history_says_so(client, ann, alpha):
    sandbox = make_sandbox(alpha)
    html = client.get(f"/sandboxes/{sandbox.id}/?tab=commands").content.decode()
    assert "No commands yet" in html


@pytest.mark.django_db
def test_file_errors_are_messages_not_server_errors(client, ann, alpha):
    sandbox = make_sandbox(alpha, S.STOPPED)
    r = client.get(f"/sandboxes/{sandbox.id}/files/download?path=/etc/hostname")
    assert r.status_code == 302 and r["Location"] == f"/sandboxes/{sandbox.id}/?tab=files&path=%2Fetc"
    page = client.get(r["Location"]).content.decode()
    assert "Could not download /etc/hostname" in page and "is stopped" in page

    r = client.post(f"/sandboxes/{sandbox.id}/files/upload", {"path": "/tmp"})
    assert r.status_code == 302
    assert "Choose a file to upload" in client.get(r["Location"]).content.decode()


@pytest.mark.django_db
def test_viewer_may_look_but_not_change(client, alpha):
    client.force_login(make_member("vic", alpha, Membership.Role.VIEWER))
    sandbox = make_sandbox(alpha)
    page = client.get(f"/sandboxes/{sandbox.id}/").content.decode()
    assert 'id="stop-button"' not in page and 'class="role-viewer"' in page
    assert 'id="new-terminal"' not in page and 'id="terminal-opening"' not in page

    assert client.post(f"/sandboxes/{sandbox.id}/stop/").status_code == 403
    assert client.post(f"/sandboxes/{sandbox.id}/delete/").status_code == 403
    assert client.post(f"/sandboxes/{sandbox.id}/keepalive/", {"seconds": "60"}).status_code == 403
    assert client.post(f"/sandboxes/{sandbox.id}/terminals/").status_code == 403
    assert client.post(f"/sandboxes/{sandbox.id}/commands/", {"cmd": "true"}).status_code == 403
    assert client.post(f"/sandboxes/{sandbox.id}/files/upload", {"path": "/"}).status_code == 403
    assert Sandbox.objects.get(id=sandbox.id).status == S.RUNNING


@pytest.mark.django_db
def test_stop_delete_and_extend(client, ann, alpha):
    sandbox = make_sandbox(alpha)  # no node: the services finish the move at once
    r = client.post(f"/sandboxes/{sandbox.id}/keepalive/", {"seconds": "7200"}, HTTP_HX_REQUEST="true")
    html = r.content.decode()
    assert r.status_code == 200 and html.startswith('<section id="sb-header"') and "7200 s from now" in html
    sandbox.refresh_from_db()
    assert sandbox.expires_at > timezone.now() + timedelta(seconds=7100)

    r = client.post(f"/sandboxes/{sandbox.id}/keepalive/", {"seconds": "99999999"}, HTTP_HX_REQUEST="true")
    assert "timeout_s must be between" in r.content.decode()

    r = client.post(f"/sandboxes/{sandbox.id}/stop/")
    assert r.status_code == 302 and r["Location"] == f"/sandboxes/{sandbox.id}/"
    assert Sandbox.objects.get(id=sandbox.id).status == S.STOPPED

    r = client.post(f"/sandboxes/{sandbox.id}/delete/", HTTP_HX_REQUEST="true")
    assert r.status_code == 200 and 'class="status deleted"' in r.content.decode()
    assert Sandbox.objects.get(id=sandbox.id).status == S.DELETED
    assert client.get(f"/sandboxes/{sandbox.id}/").status_code == 200  # the row stays, as deleted


@pytest.mark.django_db
def test_overview_counts_the_current_teams_sandboxes(client, ann, alpha, beta):
    make_sandbox(alpha, S.RUNNING)
    make_sandbox(beta, S.RUNNING)
    make_sandbox(beta, S.RUNNING)
    page = client.get("/").content.decode()
    assert '<div class="num">1</div><div class="label">running sandboxes</div>' in page


@pytest.mark.django_db
def test_the_create_form_and_the_node_table_say_whether_microvm_has_kvm(client, ann):
    """A microVM node says whether its KVM runs guests (the node's probe); the form and the nodes
    table say so beside the runtime, so a user knows a create there boots in seconds, not less."""
    Image.objects.create(name="busybox", digest="sha256:" + "a" * 64)
    caps = {"network": True, "checkpoint": True, "vm": True}
    node_register(
        name="emulated", launchers={**GVISOR, "microvm": {**caps, "kvm": False}}, cpu=2, memory_mb=4096
    )
    page = client.get("/sandboxes/").content.decode()
    assert '<option value="microvm">microvm (emulated: no KVM)</option>' in page, page
    assert "microvm: emulated: no KVM (its nodes say)" in page
    assert '<option value="gvisor" selected>gvisor</option>' in page  # no notes: it has it all, no VM
    nodes = client.get("/", HTTP_HX_REQUEST="true").content.decode()
    assert "microvm (emulated: no KVM)" in nodes
    node_register(name="fast", launchers={"microvm": {**caps, "kvm": True}}, cpu=2, memory_mb=4096)
    assert '<option value="microvm">microvm (KVM)</option>' in client.get("/sandboxes/").content.decode()
