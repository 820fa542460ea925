"""The dashboard in a real browser (Debian's Chromium driven by Playwright), against the real
server, worker, stream bridge and gVisor sandboxes: what an engineer does on a laptop.

Screenshots of each step land in ``test-artifacts/browser/`` (``HANGAR_TEST_ARTIFACTS``)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator

import pytest

from tests.conftest import ARTIFACTS
from tests.support import WORLD_A, requires_runsc

sync_api = pytest.importorskip("playwright.sync_api", reason="the test extra (pip install -e '.[test]')")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = [
    requires_runsc,
    pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (scripts/install-test-deps.sh)"),
]
SHOTS = ARTIFACTS / "browser"
# Each wait of the browser's: what a page may take on a 2-core machine shared with another test
# worker (`pytest -n 2`) starting sandboxes and harnesses of its own.
TIMEOUT_MS = 90_000


@pytest.fixture(scope="module")
def chromium() -> Iterator[sync_api.Browser]:
    # Playwright's sync API runs an event loop in this thread, which Django's ORM would take
    # for an async context; the fixtures' database calls are plain synchronous ones.
    os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def page(chromium, server, celery_worker, bridge, local_node, team_token) -> Iterator[sync_api.Page]:
    context = chromium.new_context(
        base_url=server, viewport={"width": 1440, "height": 900}, accept_downloads=True
    )
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def sign_in(page: sync_api.Page, shot: bool = False) -> None:
    page.goto("/login/")
    if shot:
        page.screenshot(path=SHOTS / "00-sign-in.png")
    page.fill("#id_username", "alice")  # the team_token fixture's owner of team "alpha"
    page.fill("#id_password", "pw")
    page.click("#login-form button[type=submit]")
    page.wait_for_url(re.compile(r"/(sandboxes/)?$"))


def create_sandbox(page: sync_api.Page) -> str:
    page.goto("/sandboxes/")
    page.click("#create-form button[type=submit]")  # the defaults: busybox, 1 CPU, ...
    page.wait_for_url(re.compile(r"/sandboxes/sb[0-9a-z]+/"))
    sandbox_id = page.url.rstrip("/").split("/sandboxes/")[1].split("/")[0]
    page.wait_for_selector('#sb-header[data-status="running"]')
    return sandbox_id


def terminal_text(page: sync_api.Page) -> str:
    return page.inner_text("#terminal .xterm-rows")


def wait_for_terminal(page: sync_api.Page, pattern: str) -> None:
    page.wait_for_function(
        "re => new RegExp(re, 'm').test(document.querySelector('#terminal .xterm-rows').innerText)",
        arg=pattern,
    )


def terminal_size(page: sync_api.Page, tag: str) -> tuple[int, int]:
    """(rows, cols) as the shell in the terminal sees them."""
    page.keyboard.type(f"echo {tag}=$(stty size | tr ' ' x)=")
    page.keyboard.press("Enter")
    pattern = tag + r"=(\d+)x(\d+)="
    wait_for_terminal(page, pattern)
    rows, cols = re.findall(pattern, terminal_text(page))[-1]
    return int(rows), int(cols)


def test_sign_in_create_a_sandbox_and_use_its_terminal(page):
    sign_in(page, shot=True)
    page.screenshot(path=SHOTS / "01-signed-in.png")
    sandbox_id = create_sandbox(page)

    page.goto(f"/sandboxes/{sandbox_id}/?tab=terminal")
    page.wait_for_selector('#term-status[data-state="connected"]')
    page.click("#terminal")
    page.keyboard.type("echo $((6*7))")
    page.keyboard.press("Enter")
    wait_for_terminal(page, r"^42\s*$")  # the shell's answer on a line of its own
    page.screenshot(path=SHOTS / "02-terminal.png")

    # Reload: the same terminal is still there and its screen comes back.
    page.reload()
    page.wait_for_selector('#term-status[data-state="connected"]')
    wait_for_terminal(page, r"^42\s*$")
    assert "echo $((6*7))" in terminal_text(page)

    # The terminal follows the window: a bigger window, more rows and columns in the shell.
    page.set_viewport_size({"width": 1000, "height": 700})
    narrow = terminal_size(page, "A")
    page.set_viewport_size({"width": 1600, "height": 1000})
    page.wait_for_timeout(500)  # the fit addon and the resize message are debounced
    wide = terminal_size(page, "B")
    assert wide[0] > narrow[0] and wide[1] > narrow[1], (narrow, wide)
    page.screenshot(path=SHOTS / "03-terminal-resized.png")


@pytest.mark.slow
def test_a_microvm_sandbox_from_the_create_form_and_its_terminal(page):
    """The create form's runtime select, a microVM (under TCG here) booted from it, and its
    terminal in the browser: the guest's own kernel answers."""
    from runtime.launchers.microvm import boot

    if boot.missing() is not None:
        pytest.skip(f"no microVM support here: {boot.missing()}")
    sign_in(page)
    page.goto("/sandboxes/")
    page.select_option("#id_runtime", "microvm")
    page.fill("#id_memory_mb", "256")
    page.click("#create-form button[type=submit]")
    page.wait_for_url(re.compile(r"/sandboxes/sb[0-9a-z]+/"))
    page.wait_for_selector('#sb-header[data-status="running"]', timeout=90_000)
    assert "microvm" in page.inner_text("#sb-header")

    page.goto(page.url.split("?")[0] + "?tab=terminal")
    page.wait_for_selector('#term-status[data-state="connected"]')
    page.click("#terminal")
    page.keyboard.type("echo kernel=$(uname -r)=")
    page.keyboard.press("Enter")
    wait_for_terminal(page, rf"^kernel={re.escape(boot.kernel().version)}=\s*$")
    page.screenshot(path=SHOTS / "04-microvm-terminal.png")
    page.on("dialog", lambda d: d.accept())
    page.click("#delete-button")  # the VM goes now, not when the run's node cleans up
    page.wait_for_selector('#sb-header[data-status="deleted"]')


def test_commands_tab_streams_output_and_keeps_history(page):
    sign_in(page)
    sandbox_id = create_sandbox(page)
    page.goto(f"/sandboxes/{sandbox_id}/?tab=commands")
    page.fill("#command-input", "for i in 1 2 3; do echo line-$i; sleep 1; done; echo oops >&2; exit 3")
    page.click("#command-submit")
    # The first line shows while the command is still running: streamed, not at the end.
    page.wait_for_selector("#command-output:has-text('line-1')")
    assert "line-3" not in page.inner_text("#command-output")
    page.screenshot(path=SHOTS / "04-command-running.png")
    page.wait_for_selector("#command-exit:has-text('3')", timeout=20_000)
    out = page.inner_text("#command-output")
    assert "line-1" in out and "line-3" in out and "oops" in out
    assert page.locator("#history-body tr.history-row").count() == 1
    # Its duration (about 3 s of sleeps) shows with the result, in the view and the history.
    assert re.search(r"\b3\.\d s\b", page.inner_text("#command-exit")), page.inner_text("#command-exit")
    assert re.search(r"\b3\.\d s\b", page.inner_text("#history-body tr.history-row .duration"))
    page.screenshot(path=SHOTS / "05-command-done.png")


def test_files_tab_uploads_and_downloads_byte_for_byte(page, tmp_path):
    sign_in(page)
    sandbox_id = create_sandbox(page)
    payload = bytes(range(256)) * 1024 + os.urandom(4096)  # binary, every byte value
    src = tmp_path / "blob.bin"
    src.write_bytes(payload)

    page.goto(f"/sandboxes/{sandbox_id}/?tab=files&path=/tmp")
    page.set_input_files("#upload-input", str(src))
    page.click("#upload-button")
    row = page.wait_for_selector('#file-list tr.file-row[data-name="blob.bin"]')
    assert row is not None
    page.screenshot(path=SHOTS / "06-files.png")

    with page.expect_download() as info:
        page.click('#file-list a.download[data-path="/tmp/blob.bin"]')
    dest = tmp_path / "downloaded.bin"
    info.value.save_as(dest)
    assert dest.read_bytes() == payload

    # A text file opens in the viewer.
    page.goto(f"/sandboxes/{sandbox_id}/?tab=files&path=/etc&file=/etc/passwd")
    assert "root:" in page.inner_text("#file-content")


def test_the_list_follows_status_changes_live_and_events_show_them(page):
    sign_in(page)
    sandbox_id = create_sandbox(page)
    listing = page.context.new_page()
    listing.goto("/sandboxes/")
    row = f"tr#sb-{sandbox_id}"
    listing.wait_for_selector(f'{row}[data-status="running"]')
    listing.wait_for_timeout(300)  # its websocket is open
    listing.screenshot(path=SHOTS / "07-sandboxes.png")

    page.click("#sb-header button:has-text('Stop')")
    # The other tab hears of it over its websocket: no reload, no polling.
    listing.wait_for_selector(f'{row}[data-status="stopped"]', timeout=30_000)
    page.wait_for_selector('#sb-header[data-status="stopped"]')

    page.goto(f"/sandboxes/{sandbox_id}/?tab=events")
    kinds = page.locator("#events-body").inner_text()
    assert "running" in kinds and "stopped" in kinds, kinds
    page.screenshot(path=SHOTS / "08-events.png")


def test_staff_build_an_image_and_watch_its_progress(page):
    from django.contrib.auth import get_user_model

    get_user_model().objects.create_user("root", password="pw", is_staff=True)
    page.goto("/login/")
    page.fill("#id_username", "root")
    page.fill("#id_password", "pw")
    page.click("#login-form button[type=submit]")
    page.wait_for_url(re.compile(r"/(sandboxes/)?$"))
    page.goto("/images/")
    page.select_option("#build-kind", "busybox")
    page.click("#build-button")
    page.wait_for_url(re.compile(r"/images/jobs/\d+/$"))
    # The page follows the job over its websocket: the outcome and the log arrive by themselves.
    page.wait_for_selector('#job-view[data-status="succeeded"]', timeout=120_000)
    assert "building busybox" in page.inner_text("#job-log")
    assert page.locator("#job-done").is_visible()
    page.screenshot(path=SHOTS / "09-image-job.png")
    page.goto("/images/")
    assert page.locator("#jobs-body tr[data-status='succeeded']").count() == 1
    page.screenshot(path=SHOTS / "10-images.png")


def test_create_a_volume_from_the_volumes_page(page):
    sign_in(page)
    page.goto("/volumes/")
    page.fill("#volume-name", "workspace")
    page.fill("#volume-size", "64")
    page.click("#volume-create")
    row = page.wait_for_selector('#volume-list tr[data-name="workspace"]')
    assert "64 MB" in row.inner_text() and "nothing" in row.inner_text()
    page.screenshot(path=SHOTS / "11-volumes.png")


def test_create_a_harness_open_its_terminal_in_workspace_and_run_a_task(page, minimal_image, git_server):
    sign_in(page)
    page.goto("/harnesses/?new=1")
    page.fill("#h-name", "browsed")
    page.select_option("#h-agent", "custom")
    page.fill("#h-command", 'echo "$HANGAR_PROMPT" > TASK.md; echo done')
    page.select_option("#h-image", "minimal")
    page.fill("#h-memory", "512")
    page.fill("#h-disk", "256")
    page.fill("#h-repo", git_server)
    page.select_option("#h-egress", "allowlist")
    page.fill("#h-allow", f"{WORLD_A}:9418")
    page.click("#harness-create")
    page.wait_for_url(re.compile(r"/harnesses/hr[0-9a-z]+/"))
    # The page follows it until it runs; the log shows the clone.
    page.wait_for_selector('#harness-header[data-status="running"]', timeout=120_000)
    page.wait_for_selector("#harness-log :text('checked out main')")
    assert page.input_value("#ssh-command").endswith("browsed@localhost")
    page.screenshot(path=SHOTS / "20-harness.png")

    page.fill("#terminal-name", "editor")
    page.click("#new-terminal")
    page.wait_for_selector('#terminal-tabs .subtab.active:text("editor")')
    page.wait_for_selector("#terminal .xterm-rows")
    page.click("#terminal")
    page.keyboard.type("pwd; git log --oneline | cat")
    page.keyboard.press("Enter")
    wait_for_terminal(page, r"^/workspace\s*$")
    wait_for_terminal(page, r"first\s*$")
    page.screenshot(path=SHOTS / "21-harness-terminal.png")

    page.fill("#run-prompt", "write the task down")
    page.click("#run-start")
    page.wait_for_url(re.compile(r"/runs/run[0-9a-z]+/"))
    page.wait_for_selector('[data-run-status="succeeded"]', timeout=120_000)
    page.wait_for_selector("#run-diff :text('+write the task down')")
    page.screenshot(path=SHOTS / "22-run.png")


def test_the_harness_form_follows_a_build_of_its_image_and_offers_it_once_built(page, local_node):
    """The build itself is the image job's (a real one runs in tests/api/test_images_api.py);
    here one of base is under way, its row made directly and its progress written by the code a
    node's job writes with, and the form open in a member's browser follows it."""
    from runtime.models import ImageJob
    from runtime.node.local import image_store
    from runtime.services.images import _finish, _JobLog, image_register

    sign_in(page)
    page.goto("/harnesses/?new=1")
    assert "The base image is not built on this Hangar yet" in page.inner_text("#image-missing")
    assert "hangar image build base" in page.inner_text("#ask-admin")
    job = ImageJob.objects.create(kind="build", ref="base", node=local_node, status="running")
    page.goto("/harnesses/?new=1")
    page.wait_for_selector("#harness-image-job #job-view[data-status='running']")
    log = _JobLog(job.id)
    log("I: installing remaining packages inside the chroot...")
    log.flush()
    page.wait_for_selector("#job-log:has-text('installing remaining packages')")
    page.screenshot(path=SHOTS / "23-harness-image-building.png")
    # The build's result (busybox's tree stands in for Debian's: only the rows matter here).
    _finish(job.id, image=image_register(info=image_store().get("busybox"), name="base"))
    page.wait_for_selector("#job-view[data-status='succeeded']")
    assert page.input_value("#h-image") == "base"
    assert page.is_hidden("#image-missing")
    page.screenshot(path=SHOTS / "24-harness-image-built.png")


def test_a_trace_page_shows_the_waterfall_and_the_span_panel(page, server, team_token):
    """A GenAI-shaped trace sent by the real OpenTelemetry exporter, then browsed."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    exporter = OTLPSpanExporter(
        endpoint=f"{server}/v1/traces", headers={"Authorization": f"Bearer {team_token}"}
    )
    provider = TracerProvider(resource=Resource.create({"service.name": "browser-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    messages = '[{"role": "user", "content": "why does the test fail?"}]'
    with tracer.start_as_current_span("invoke_agent") as root:
        with tracer.start_as_current_span("chat", attributes={"gen_ai.operation.name": "chat",
                                                              "gen_ai.input.messages": messages}):  # fmt: skip
            pass
        with tracer.start_as_current_span("execute_tool", attributes={"gen_ai.tool.name": "bash"}):
            pass
    provider.shutdown()
    trace_id = format(root.get_span_context().trace_id, "032x")
    sign_in(page)
    page.goto("/traces/")
    page.click(f"tr[data-trace='{trace_id}'] a")
    page.wait_for_selector(".wf-row .wf-bar.model")
    page.click(".wf-row:has-text('chat')")
    page.wait_for_selector("#span-detail .msg-turn.user")
    assert "why does the test fail?" in page.inner_text("#span-panel")
    page.screenshot(path=SHOTS / "30-trace.png")
    page.click(".wf-row[data-depth='0'] .wf-toggle")  # collapse the root: its children hide
    assert page.locator(".wf-row[data-depth='1']").first.is_hidden()


def test_a_trace_still_being_written_grows_on_its_page(page, server, team_token):
    """Spans exported while the page is open appear without a reload, each under its parent:
    the root, which ends (and is exported) last, takes its earlier children in."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    exporter = OTLPSpanExporter(
        endpoint=f"{server}/v1/traces", headers={"Authorization": f"Bearer {team_token}"}
    )
    provider = TracerProvider(resource=Resource.create({"service.name": "live-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    root = tracer.start_span("invoke_agent")
    inside = trace.set_span_in_context(root)
    tracer.start_span("first step", context=inside).end()
    trace_id = format(root.get_span_context().trace_id, "032x")
    sign_in(page)
    page.goto(f"/traces/{trace_id}/")
    page.wait_for_selector(".wf-row[data-depth='0']:has-text('first step')")

    with tracer.start_as_current_span(
        "execute_tool", context=inside, attributes={"gen_ai.tool.name": "bash"}
    ):
        pass
    page.wait_for_selector(".wf-row:has-text('execute_tool') .wf-bar.tool")
    root.end()
    page.wait_for_selector(".wf-row[data-depth='0']:has-text('invoke_agent') .wf-toggle")
    page.wait_for_selector(".wf-row[data-depth='1']:has-text('first step')")
    assert page.inner_text("#trace-span-count") == "3 spans"
    assert page.inner_text(".page-head h1") == "invoke_agent"
    page.screenshot(path=SHOTS / "31-trace-live.png")
    page.click(".wf-row:has-text('execute_tool')")  # a row that came over the socket opens its panel
    page.wait_for_selector("#span-detail:has-text('gen_ai.tool.name')")
    provider.shutdown()
