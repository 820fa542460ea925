"""Dashboard pages through Django's test client: the sandbox page's files tab (against a fake of
the file services), images, volumes, pause and resume, and warm pools. Rows are written with
the ORM; nothing here needs runsc, a worker or a server."""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth import get_user_model
from django.utils import timezone

from runtime.models import Image, ImageJob, Membership, Sandbox
from runtime.services.nodes import node_register
from tests.pages.support import S, make_member, make_sandbox
from tests.support import GVISOR

# -- files, against a fake of the file services (a running sandbox needs runsc) -------------------


class FakeSandboxFiles:
    """Stands in for the node side of the file services: a dict of path -> bytes."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.written: dict[str, bytes] = {}
        self.no_pseudo_fs: list[bool] = []  # what each read and listing asked for

    def entry(self, path: str):
        from runtime.launchers.base import FileEntry

        is_dir = path not in self.files
        size = 0 if is_dir else len(self.files[path])
        return FileEntry(
            path.rsplit("/", 1)[-1],
            path,
            "dir" if is_dir else "file",
            size,
            0o755 if is_dir else 0o644,
            1.7e9,
        )

    def list(self, *, sandbox, path, no_pseudo_fs=False):
        from runtime.errors import NotFound

        self.no_pseudo_fs.append(no_pseudo_fs)
        prefix = path.rstrip("/") + "/"
        names = {p[len(prefix) :].split("/")[0] for p in self.files if p.startswith(prefix)}
        if not names and path != "/":
            raise NotFound(f"{path}: No such file or directory")
        return [self.entry(prefix + n) for n in sorted(names)]

    def read(self, *, sandbox, path, no_pseudo_fs=False):
        from runtime.errors import NotFound

        self.no_pseudo_fs.append(no_pseudo_fs)
        if path not in self.files:
            raise NotFound(f"{path}: No such file or directory")
        data = self.files[path]
        return self.entry(path), iter([data[i : i + 65536] for i in range(0, len(data), 65536)])

    def write(self, *, sandbox, path, data, size=None):
        self.written[path] = data = b"".join(data)  # the upload's chunks, as the page streams them
        return len(data)


@pytest.fixture
def fake_files(monkeypatch):
    from runtime.services import sandbox_io as svc

    fake = FakeSandboxFiles(
        {
            "/etc/hostname": b"sandbox\n",
            "/etc/motd": "héllo wörld\n".encode(),
            "/bin/busybox": b"\x7fELF\x00\x01" * 100,
            "/var/log/big.log": b"line\n" * 100_000,
        }
    )
    monkeypatch.setattr(svc, "sandbox_file_list", fake.list)
    monkeypatch.setattr(svc, "sandbox_file_read", fake.read)
    monkeypatch.setattr(svc, "sandbox_file_write", fake.write)
    return fake


@pytest.mark.django_db
def test_files_tab_browses_directories_dirs_first_with_breadcrumbs(client, ann, alpha, fake_files):
    sandbox = make_sandbox(alpha)
    root = client.get(f"/sandboxes/{sandbox.id}/?tab=files", HTTP_HX_REQUEST="true").content.decode()
    assert 'id="file-list"' in root and 'data-path="/etc"' in root and 'id="upload-input"' in root
    etc = client.get(
        f"/sandboxes/{sandbox.id}/?tab=files&path=/etc/", HTTP_HX_REQUEST="true"
    ).content.decode()
    assert etc.index('data-path="/etc/hostname"') < etc.index('data-path="/etc/motd"')
    assert 'name="path" value="/etc"' in etc and ">etc</a>" in etc and "rw-r--r--" in etc
    assert f"/sandboxes/{sandbox.id}/files/download?path=/etc/hostname" in etc
    var = client.get(f"/sandboxes/{sandbox.id}/?tab=files&path=/var", HTTP_HX_REQUEST="true").content.decode()
    assert var.index('data-type="parent"') < var.index('data-path="/var/log"')
    missing = client.get(f"/sandboxes/{sandbox.id}/?tab=files&path=/nope", HTTP_HX_REQUEST="true")
    assert (
        missing.status_code == 200
        and "Could not list /nope: /nope: No such file or directory" in missing.content.decode()
    )


@pytest.mark.django_db
def test_files_tab_shows_text_inline_and_says_binary_or_truncated(client, ann, alpha, fake_files):
    sandbox = make_sandbox(alpha)
    url = f"/sandboxes/{sandbox.id}/?tab=files&path=/etc&file="
    text = client.get(url + "/etc/motd").content.decode()
    assert '<pre class="file-content" id="file-content">héllo wörld\n</pre>' in text
    binary = client.get(url + "/bin/busybox").content.decode()
    assert 'id="file-binary"' in binary and 'id="file-content"' not in binary
    big = client.get(url + "/var/log/big.log").content.decode()
    assert 'id="file-truncated"' in big and "256 KiB" in big
    gone = client.get(url + "/etc/gone").content.decode()
    assert "Could not open /etc/gone" in gone and 'id="file-list"' in gone


@pytest.mark.django_db
def test_download_streams_the_file_as_an_attachment(client, ann, alpha, fake_files):
    sandbox = make_sandbox(alpha)
    r = client.get(f"/sandboxes/{sandbox.id}/files/download?path=/var/log/big.log")
    assert r.status_code == 200 and r.streaming
    assert (
        r["Content-Length"] == str(500_000)
        and r["Content-Disposition"] == "attachment; filename*=UTF-8''big.log"
    )
    assert (
        async_to_sync(_collect)(r.streaming_content) == b"line\n" * 100_000
    )  # an async stream: not read whole


async def _collect(stream) -> bytes:
    return b"".join([chunk async for chunk in stream])


@pytest.mark.django_db
def test_a_viewers_file_reads_keep_out_of_proc_and_sys(client, alpha, fake_files):
    sandbox = make_sandbox(alpha)
    base = f"/sandboxes/{sandbox.id}"
    client.force_login(make_member("vic", alpha, Membership.Role.VIEWER))
    client.get(f"{base}/?tab=files&path=/etc&file=/etc/motd")
    client.get(f"{base}/files/download?path=/etc/motd")
    assert fake_files.no_pseudo_fs == [True, True, True]
    fake_files.no_pseudo_fs.clear()
    client.force_login(make_member("mo", alpha))
    client.get(f"{base}/?tab=files&path=/etc&file=/etc/motd")
    client.get(f"{base}/files/download?path=/etc/motd")
    assert fake_files.no_pseudo_fs == [False, False, False]


@pytest.mark.django_db
def test_upload_writes_into_the_current_directory(client, ann, alpha, fake_files):
    from django.core.files.uploadedfile import SimpleUploadedFile

    sandbox = make_sandbox(alpha)
    upload = SimpleUploadedFile("notes.txt", b"remember the milk\n")
    r = client.post(
        f"/sandboxes/{sandbox.id}/files/upload", {"path": "/tmp", "file": upload}, HTTP_HX_REQUEST="true"
    )
    assert r.status_code == 200 and "Uploaded /tmp/notes.txt (18 bytes)" in r.content.decode()
    assert r["HX-Push-Url"] == f"/sandboxes/{sandbox.id}/?tab=files&path=%2Ftmp"
    assert fake_files.written == {"/tmp/notes.txt": b"remember the milk\n"}


# -- images ---------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_images_page_lists_images_and_jobs_and_only_staff_get_the_forms(client, ann, alpha):
    node = node_register(name="node-a", launchers=GVISOR, cpu=4, memory_mb=8192)
    Image.objects.create(name="busybox", digest="sha256:" + "a" * 64, size_bytes=2_000_000).nodes.add(node)
    ImageJob.objects.create(kind="pull", ref="reg.example/app:1", name="app", node=node, status="failed",
                            error="skopeo: connection refused")  # fmt: skip
    page = client.get("/images/").content.decode()
    assert 'id="image-busybox"' not in page  # rows are keyed by id
    assert "busybox" in page and "node-a" in page and "reg.example/app:1" in page
    assert 'ws-connect="/ws/ui/images"' in page
    assert 'id="pull-form"' not in page and "administrators build and pull" in page
    r = client.post("/images/", {"action": "build", "kind": "busybox"})
    assert r.status_code == 403 and "administrators" in r.content.decode()


@pytest.mark.django_db
def test_staff_start_a_build_and_land_on_its_page(client, alpha, settings):
    get_user_model().objects.create_user("root", password="pw", is_staff=True)
    client.login(username="root", password="pw")
    node = settings.HANGAR_NODE_NAME  # where a build goes: this node, whatever a run calls it
    node_register(name=node, launchers=GVISOR, cpu=4, memory_mb=8192)
    page = client.get("/images/").content.decode()
    assert 'id="pull-form"' in page and 'id="build-form"' in page
    r = client.post("/images/", {"action": "pull", "ref": "has space"})
    assert r.status_code == 422 and "invalid image reference" in r.content.decode()
    assert 'value="has space"' in r.content.decode()  # what was typed stays
    r = client.post("/images/", {"action": "build", "kind": "busybox"})
    job = ImageJob.objects.get()
    assert r.status_code == 302 and r["Location"] == f"/images/jobs/{job.id}/"
    page = client.get(r["Location"]).content.decode()
    assert f'ws-connect="/ws/ui/images/jobs/{job.id}"' in page and f"Waiting for node {node}" in page
    assert client.get("/images/jobs/424242/").status_code == 404


# -- volumes --------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_volumes_page_lists_the_teams_volumes_with_their_holders(client, ann, alpha, beta):
    from runtime.models import SandboxVolume, Volume

    node = node_register(name="node-a", launchers=GVISOR, cpu=4, memory_mb=8192)
    mine = Volume.objects.create(team=alpha, name="workspace", size_mb=1024, node=node)
    Volume.objects.create(team=beta, name="secret-stuff", size_mb=64, node=node)
    holder = make_sandbox(alpha)
    SandboxVolume.objects.create(sandbox=holder, volume=mine, mount_path="/workspace")
    page = client.get("/volumes/").content.decode()
    assert f'id="vol-{mine.id}"' in page and "1024 MB" in page and holder.id in page
    assert "secret-stuff" not in page
    # Deleting a held volume is refused with the holders named, and nothing is lost.
    r = client.post("/volumes/", {"action": "delete", "volume": mine.id})
    assert r.status_code == 409 and holder.id in r.content.decode()
    assert Volume.objects.filter(id=mine.id).exists()
    r = client.post("/volumes/", {"action": "create", "name": "Bad Name", "size_mb": "64"})
    assert r.status_code == 422 and "invalid volume name" in r.content.decode()
    assert 'value="Bad Name"' in r.content.decode()
    # The sandbox page says what it has attached.
    detail = client.get(f"/sandboxes/{holder.id}/").content.decode()
    assert 'id="sb-volumes"' in detail and "/workspace" in detail


@pytest.mark.django_db
def test_viewers_cannot_create_or_delete_volumes(client, alpha):
    viewer = make_member("vic", alpha, role=Membership.Role.VIEWER)
    client.force_login(viewer)
    page = client.get("/volumes/").content.decode()
    assert 'id="volume-form"' not in page
    assert client.post("/volumes/", {"action": "create", "name": "x", "size_mb": "64"}).status_code == 403


@pytest.mark.django_db
def test_pause_and_resume_from_the_sandbox_page(client, ann, alpha):
    node = node_register(name="node-a", launchers=GVISOR, cpu=4, memory_mb=8192)
    Image.objects.create(name="busybox", digest="sha256:" + "b" * 64).nodes.add(node)
    sb = make_sandbox(alpha, node=node)
    page = client.get(f"/sandboxes/{sb.id}/").content.decode()
    assert 'id="pause-button"' in page and 'id="resume-button"' not in page
    r = client.post(f"/sandboxes/{sb.id}/pause/")
    assert r.status_code in (200, 302)
    assert Sandbox.objects.get(id=sb.id).status == S.PAUSING
    Sandbox.objects.filter(id=sb.id).update(status=S.PAUSED)  # what the node's task does
    page = client.get(f"/sandboxes/{sb.id}/").content.decode()
    assert 'id="resume-button"' in page and "its files are kept" in page
    client.post(f"/sandboxes/{sb.id}/resume/")
    assert Sandbox.objects.get(id=sb.id).status == S.RESUMING
    # Pausing what is not running is refused with the reason, not an error page.
    r = client.post(f"/sandboxes/{sb.id}/pause/", follow=True)
    assert "only a running sandbox can be paused" in r.content.decode()


@pytest.mark.django_db
def test_sandboxes_page_shows_warm_pools_and_hides_their_unclaimed_members(client, ann, alpha):
    from runtime.models import Pool

    node = node_register(name="node-a", launchers=GVISOR, cpu=4, memory_mb=8192)
    pool = Pool.objects.create(team=alpha, image="busybox", memory_mb=256, size=3)
    warm = [make_sandbox(alpha, node=node, pool=pool) for _ in range(2)]
    claimed = make_sandbox(alpha, node=node, pool=pool, claimed_at=timezone.now())
    page = client.get("/sandboxes/").content.decode()
    assert f'id="pool-{pool.id}" data-ready="2" data-size="3"' in page
    assert claimed.id in page and not any(w.id in page for w in warm)
