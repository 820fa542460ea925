"""The image store: builds, imports (OCI layout / archive, docker save), pulls, names, safety."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import stat
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from runtime.host.images.base import ImageError, ImageInfo, ImageNotFound, tree_digest
from runtime.host.images.store import ImageStore
from runtime.launchers.gvisor.runsc import default_runsc
from tests.oci_images import (
    D,
    Entry,
    F,
    H,
    Registry,
    S,
    make_docker_save,
    make_oci_archive,
    make_oci_layout,
)

IS_ROOT = os.geteuid() == 0

BASE_LAYER = [
    D("etc"),
    F("etc/os-release", "ID=test\n"),
    F("etc/a", "a"),
    F("etc/b", "b"),
    D("bin"),
    F("bin/tool", "#!/bin/sh\necho tool\n", mode=0o4755),
    H("bin/tool-link", "bin/tool"),
    S("bin/sh", "busybox"),
    D("home/user", mode=0o750, uid=1000, gid=1000),
    F("home/user/.profile", "export X=1\n", mode=0o600, uid=1000, gid=1000),
    Entry("dev/null", "chr", mode=0o666),
    D("data"),
    F("data/old1", "1"),
    D("data/sub"),
    F("data/sub/old2", "2"),
]
CONFIG = {
    "Env": ["PATH=/usr/bin:/bin", "LANG=C.UTF-8"],
    "Cmd": ["/bin/sh", "-l"],
    "Entrypoint": ["/bin/tini", "--"],
    "WorkingDir": "/home/user",
    "User": "1000:1000",
}


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "images")


def leftovers(store: ImageStore) -> list[str]:
    """Temporary / half-deleted entries the store left behind."""
    blobs = store.root / "sha256"
    found = [p.name for p in blobs.iterdir() if p.name.startswith(".")] if blobs.exists() else []
    found += [p.name for p in store.root.iterdir() if p.name.startswith((".pull-", ".names.json.tmp"))]
    return found


def snapshot(directory: Path) -> dict[str, tuple[int, int, int, bytes | str | None]]:
    """Every entry under ``directory`` with mode, link count, mtime and content / link target."""
    result: dict[str, tuple[int, int, int, bytes | str | None]] = {}
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            content: bytes | str | None = None
            if stat.S_ISREG(st.st_mode):
                content = p.read_bytes()
            elif stat.S_ISLNK(st.st_mode):
                content = os.readlink(p)
            result[str(p.relative_to(directory))] = (st.st_mode, st.st_nlink, st.st_mtime_ns, content)
    return result


# --------------------------------------------------------------------------- busybox


def test_build_busybox_is_fast_complete_and_idempotent(store: ImageStore) -> None:
    lines: list[str] = []
    started = time.monotonic()
    info = store.build_busybox(progress=lines.append)
    elapsed = time.monotonic() - started
    assert elapsed < 5, f"busybox build took {elapsed:.1f}s"
    assert lines, "progress was never called"

    assert info.name == "busybox"
    assert info.digest.startswith("sha256:") and len(info.digest) == 71
    assert info.source.startswith("busybox-static ")
    assert info.size_bytes > 1_000_000
    assert info.config["cmd"] == ["/bin/sh"]
    root = info.rootfs
    assert root == store.root / "sha256" / info.digest.split(":")[1] / "rootfs"
    assert (root / "bin/busybox").is_file() and os.access(root / "bin/busybox", os.X_OK)
    assert os.readlink(root / "bin/sh") == "busybox"
    assert os.readlink(root / "bin/ls") == "busybox"
    assert os.readlink(root / "usr/bin/env") == "../../bin/busybox"
    assert (root / "usr/bin/env").resolve() == (root / "bin/busybox").resolve()
    applets = subprocess.run([root / "bin/busybox", "--list"], capture_output=True, text=True).stdout.split()
    assert len(applets) > 100
    assert all(os.path.lexists(root / "bin" / a) for a in applets if a != "busybox")
    for d in ("proc", "sys", "dev", "etc", "root", "home", "usr/bin", "usr/sbin", "sbin", "var/tmp", "run"):
        assert (root / d).is_dir(), d
    assert stat.S_IMODE((root / "tmp").stat().st_mode) == 0o1777
    passwd = (root / "etc/passwd").read_text()
    assert passwd.startswith("root:x:0:0:") and "\nnobody:x:65534:" in passwd
    assert (root / "etc/group").read_text().startswith("root:x:0:")
    assert (root / "etc/hostname").read_text().strip()
    assert "localhost" in (root / "etc/hosts").read_text()
    if IS_ROOT:
        assert (root / "bin/busybox").stat().st_uid == 0
    # The applets really work from the tree.
    out = subprocess.run(
        [root / "bin/busybox", "sh", "-c", "echo $((6 * 7))"], capture_output=True, text=True
    )
    assert out.stdout.strip() == "42"

    meta = json.loads((root.parent / "image.json").read_text())
    assert meta["digest"] == info.digest and meta["size_bytes"] == info.size_bytes
    assert meta["source"] == info.source and meta["config"] == info.config and meta["created_at"]
    assert tree_digest(root) == info.digest

    again = store.build_busybox()
    assert again.digest == info.digest
    assert again.created_at == info.created_at  # the existing image was kept
    assert store.names() == ["busybox"]
    other = store.build_busybox(name="bb")
    assert other.digest == info.digest
    assert store.names() == ["bb", "busybox"]
    assert len([p for p in (store.root / "sha256").iterdir()]) == 1
    assert leftovers(store) == []


def test_build_busybox_reports_missing_package(store: ImageStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("runtime.host.images.build.BUSYBOX_PATH", "/nonexistent/busybox")
    with pytest.raises(ImageError, match="apt-get install busybox-static"):
        store.build_busybox()


def test_tree_digest_covers_content_modes_and_links_not_times(tmp_path: Path) -> None:
    root = tmp_path / "t"
    (root / "d").mkdir(parents=True)
    (root / "d/f").write_text("x")
    os.symlink("d/f", root / "l")
    first = tree_digest(root)
    os.utime(root / "d/f", (1, 1))
    assert tree_digest(root) == first
    os.chmod(root / "d/f", 0o4755)
    assert tree_digest(root) != first
    os.chmod(root / "d/f", 0o644)
    baseline = tree_digest(root)
    (root / "d/f").write_text("y")
    assert tree_digest(root) != baseline
    (root / "d/f").write_text("x")
    assert tree_digest(root) == baseline
    os.unlink(root / "l")
    os.symlink("d", root / "l")
    assert tree_digest(root) != baseline


# --------------------------------------------------------------------------- names and lookups


def test_get_by_name_and_digest_and_unknown(store: ImageStore) -> None:
    with pytest.raises(ImageNotFound, match="store is empty"):
        store.get("busybox")
    info = store.build_busybox()
    assert store.get("busybox") == info
    by_digest = store.get(info.digest)
    assert by_digest.digest == info.digest and by_digest.rootfs == info.rootfs
    assert by_digest.name == "busybox"
    with pytest.raises(ImageNotFound) as excinfo:
        store.get("alpine")
    assert "'alpine'" in str(excinfo.value) and "busybox" in str(excinfo.value)
    with pytest.raises(ImageNotFound):
        store.get("sha256:" + "0" * 64)
    assert isinstance(excinfo.value, ImageError)


@pytest.mark.parametrize(
    "name",
    ["", "Busybox", "-x", ".x", "/x", "a b", "a\nb", "x" * 129, "ü", "a@sha256", "a;rm"],
)
def test_invalid_names_are_refused(store: ImageStore, name: str, tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="invalid image name"):
        store.build_busybox(name=name)
    info = store.build_busybox()
    with pytest.raises(ImageError, match="invalid image name"):
        store.tag(name, info.digest)
    layout = tmp_path / "layout"
    make_oci_layout(layout, [[F("x", "1")]])
    with pytest.raises(ImageError, match="invalid image name"):
        store.import_archive(layout, name=name)
    assert store.names() == ["busybox"]


@pytest.mark.parametrize("name", ["a", "0", "base", "ghcr.io/org/img:1.2-rc_3", "x" * 128, "a:b/c"])
def test_valid_names(store: ImageStore, name: str) -> None:
    info = store.build_busybox(name=name)
    assert store.get(name) == info


def test_tag_list_and_remove_prunes_unreferenced_digests(store: ImageStore, tmp_path: Path) -> None:
    bb = store.build_busybox()
    alias = store.tag("alias", "busybox")  # a name works as the source too
    assert alias.digest == bb.digest
    make_oci_layout(tmp_path / "layout", [[F("hello", "world")]])
    unnamed = store.import_archive(tmp_path / "layout")
    assert unnamed.name is None

    listed = store.list()
    assert all(isinstance(i, ImageInfo) for i in listed)
    assert [(i.name, i.digest) for i in listed] == [
        ("alias", bb.digest),
        ("busybox", bb.digest),
        (None, unnamed.digest),
    ]
    assert store.names() == ["alias", "busybox"]
    names_file = json.loads((store.root / "names.json").read_text())
    assert names_file == {"alias": bb.digest, "busybox": bb.digest}

    store.remove("busybox")
    assert bb.rootfs.is_dir(), "still named 'alias'"
    assert store.names() == ["alias"]
    store.remove("alias")
    assert not bb.rootfs.parent.exists(), "no name points to it any more: pruned"
    assert [i.digest for i in store.list()] == [unnamed.digest]
    with pytest.raises(ImageNotFound):
        store.remove("alias")
    with pytest.raises(ImageNotFound):
        store.tag("again", bb.digest)

    # By digest: the image goes, with every name pointing at it.
    store.tag("one", unnamed.digest)
    store.tag("two", unnamed.digest)
    store.remove(unnamed.digest)
    assert store.list() == [] and store.names() == []
    assert leftovers(store) == []


@pytest.mark.skipif(not IS_ROOT, reason="mounting an overlayfs needs root")
def test_remove_refuses_an_image_mounted_as_an_overlay_lower_dir(store: ImageStore, tmp_path: Path) -> None:
    info = store.build_busybox()
    for d in ("upper", "work", "merged"):
        (tmp_path / d).mkdir()
    opts = f"lowerdir={info.rootfs},upperdir={tmp_path / 'upper'},workdir={tmp_path / 'work'}"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(tmp_path / "merged")], check=True)
    try:
        with pytest.raises(ImageError, match="in use by 1 mounted sandbox"):
            store.remove("busybox")
        assert store.get("busybox") == info and info.rootfs.is_dir()
        store.tag("other", "busybox")
        store.remove("busybox")  # another name still points at it: nothing to prune
    finally:
        subprocess.run(["umount", str(tmp_path / "merged")], check=True)
    store.remove("other")
    assert store.list() == [] and not info.rootfs.exists()


def test_retagging_keeps_the_old_image_unnamed(store: ImageStore, tmp_path: Path) -> None:
    make_oci_layout(tmp_path / "v1", [[F("v", "1")]])
    make_oci_layout(tmp_path / "v2", [[F("v", "2")]])
    v1 = store.import_archive(tmp_path / "v1", name="app")
    v2 = store.import_archive(tmp_path / "v2", name="app")
    assert store.get("app").digest == v2.digest
    assert (v2.rootfs / "v").read_text() == "2"
    assert [(i.name, i.digest) for i in store.list()] == [("app", v2.digest), (None, v1.digest)]


def _tag_many(root: str, prefix: str, digest: str) -> None:
    s = ImageStore(root)
    for i in range(15):
        s.tag(f"{prefix}-{i}", digest)


def test_concurrent_writers_do_not_lose_names(store: ImageStore) -> None:
    digest = store.build_busybox().digest
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_tag_many, args=(str(store.root), p, digest)) for p in ("a", "b", "c")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len(store.names()) == 1 + 3 * 15


# --------------------------------------------------------------------------- imports


def _check_base_tree(root: Path) -> None:
    assert (root / "etc/os-release").read_text() == "ID=test\n"
    tool = root / "bin/tool"
    assert stat.S_IMODE(tool.stat().st_mode) == 0o4755, "setuid bit kept"
    assert tool.stat().st_ino == (root / "bin/tool-link").stat().st_ino, "hardlink kept"
    assert os.readlink(root / "bin/sh") == "busybox", "symlink kept as a symlink"
    assert not os.path.lexists(root / "dev/null"), "device nodes skipped"
    assert stat.S_IMODE((root / "home/user").stat().st_mode) == 0o750
    assert stat.S_IMODE((root / "home/user/.profile").stat().st_mode) == 0o600
    if IS_ROOT:
        assert (root / "home/user/.profile").stat().st_uid == 1000
        assert (root / "home/user").stat().st_gid == 1000
        assert tool.stat().st_uid == 0


def _expected_config() -> dict[str, object]:
    return {
        "env": CONFIG["Env"],
        "cmd": CONFIG["Cmd"],
        "entrypoint": CONFIG["Entrypoint"],
        "working_dir": CONFIG["WorkingDir"],
        "user": CONFIG["User"],
    }


@pytest.mark.parametrize("compression", ["gzip", None, ["gzip", None]], ids=["gzip", "plain", "mixed"])
def test_import_oci_layout_directory(store: ImageStore, tmp_path: Path, compression: object) -> None:
    layout = tmp_path / "layout"
    layer2 = [F("etc/motd", "welcome\n")]
    digest = make_oci_layout(layout, [BASE_LAYER, layer2], CONFIG, compression=compression)
    lines: list[str] = []
    info = store.import_archive(layout, name="test/oci:1", progress=lines.append)
    assert info.digest == digest, "digest is the manifest digest"
    assert info.name == "test/oci:1" and store.get("test/oci:1") == info
    assert info.source == f"oci-layout:{layout}"
    assert info.config == _expected_config()
    _check_base_tree(info.rootfs)
    assert (info.rootfs / "etc/motd").read_text() == "welcome\n"
    assert any("layer 2/2" in line for line in lines)
    assert info.size_bytes == sum(
        (info.rootfs / p).stat().st_size for p in ("etc/os-release", "etc/a", "etc/b", "bin/tool", "etc/motd")
    ) + len("export X=1\n") + len("1") + len("2")
    assert leftovers(store) == []


def test_import_oci_archive_tar(store: ImageStore, tmp_path: Path) -> None:
    archive = tmp_path / "image.tar"
    digest = make_oci_archive(archive, [BASE_LAYER], CONFIG)
    info = store.import_archive(archive, name="archived")
    assert info.digest == digest
    assert info.source == f"oci-archive:{archive}"
    assert info.config == _expected_config()
    _check_base_tree(info.rootfs)


@pytest.mark.parametrize("compression", [None, "gzip"], ids=["plain", "gzip"])
def test_import_docker_save(store: ImageStore, tmp_path: Path, compression: str | None) -> None:
    archive = tmp_path / "docker.tar"
    layer2 = [F("etc/.wh.a", ""), F("etc/c", "c")]
    config_digest = make_docker_save(archive, [BASE_LAYER, layer2], CONFIG, compression=compression)
    info = store.import_archive(archive)
    assert info.digest == config_digest, "digest is the config digest"
    assert info.name == "test/docker:1", "named after RepoTags when no name is given"
    assert info.source == f"docker-archive:{archive}"
    assert info.config == _expected_config()
    _check_base_tree(info.rootfs)
    assert not (info.rootfs / "etc/a").exists() and (info.rootfs / "etc/c").read_text() == "c"


def test_whiteouts_and_opaque_directories(store: ImageStore, tmp_path: Path) -> None:
    layer2 = [
        F("etc/.wh.a", ""),  # delete a file from below
        F("bin/.wh.sh", ""),  # delete a symlink from below (not what it points at)
        F("home/.wh.user", ""),  # delete a whole directory from below
        D("data"),
        F("data/new", "new"),  # added before the opaque marker: must survive it
        D("data/sub"),
        F("data/sub/newer", "newer"),
        F("data/.wh..wh..opq", ""),  # everything data/ had below is hidden
        F("etc/.wh.never-existed", ""),
        F("nothere/.wh.x", ""),
    ]
    layer3 = [F("etc/a", "back")]
    make_oci_layout(tmp_path / "layout", [BASE_LAYER, layer2, layer3])
    root = store.import_archive(tmp_path / "layout", name="wh").rootfs
    assert (root / "etc/a").read_text() == "back", "recreated by a later layer"
    assert (root / "etc/b").read_text() == "b"
    assert not os.path.lexists(root / "bin/sh")
    assert (root / "bin/tool").exists()
    assert not (root / "home/user").exists() and (root / "home").is_dir()
    assert sorted(p.name for p in (root / "data").iterdir()) == ["new", "sub"]
    assert sorted(p.name for p in (root / "data/sub").iterdir()) == ["newer"]
    assert not (root / "nothere").exists(), "a whiteout creates nothing"
    assert not list(root.rglob(".wh.*")), "whiteout markers are never materialised"


def test_later_layer_replaces_types(store: ImageStore, tmp_path: Path) -> None:
    layer1 = [D("x"), F("x/inner", "1"), F("y", "file"), S("z", "y"), D("keep", mode=0o700)]
    layer2 = [F("x", "now a file"), D("y"), F("y/in", "2"), F("z", "real"), D("keep", mode=0o755)]
    make_oci_layout(tmp_path / "layout", [layer1, layer2])
    root = store.import_archive(tmp_path / "layout", name="types").rootfs
    assert (root / "x").read_text() == "now a file"
    assert (root / "y/in").read_text() == "2"
    assert not (root / "z").is_symlink() and (root / "z").read_text() == "real"
    assert stat.S_IMODE((root / "keep").stat().st_mode) == 0o755


def test_multi_platform_index_picks_amd64(store: ImageStore, tmp_path: Path) -> None:
    digest = make_oci_layout(tmp_path / "layout", [[F("hello", "x")]], platforms=["arm64", "amd64", "s390x"])
    info = store.import_archive(tmp_path / "layout")
    assert info.digest == digest
    assert (info.rootfs / "arch").read_text() == "amd64"


def test_ambiguous_indexes_are_refused(store: ImageStore, tmp_path: Path) -> None:
    make_oci_layout(tmp_path / "foreign", [[F("hello", "x")]], platforms=["arm64", "s390x"])
    with pytest.raises(ImageError, match="none of its images is for linux/amd64"):
        store.import_archive(tmp_path / "foreign")
    layout = tmp_path / "two"
    make_oci_layout(layout, [[F("v", "1")]], ref_name="one")
    first = json.loads((layout / "index.json").read_text())["manifests"]
    make_oci_layout(layout, [[F("v", "2")]], ref_name="two")
    index = json.loads((layout / "index.json").read_text())
    index["manifests"] = first + index["manifests"]
    (layout / "index.json").write_text(json.dumps(index))
    with pytest.raises(ImageError, match="2 different images"):
        store.import_archive(layout)
    # The same manifest under two refs is one image.
    index["manifests"] = first + [{**first[0], "annotations": {"org.opencontainers.image.ref.name": "x"}}]
    (layout / "index.json").write_text(json.dumps(index))
    assert (store.import_archive(layout, name="same").rootfs / "v").read_text() == "1"
    assert store.names() == ["same"] and leftovers(store) == []


def test_importing_an_existing_digest_just_names_it(store: ImageStore, tmp_path: Path) -> None:
    make_oci_layout(tmp_path / "layout", [BASE_LAYER])
    first = store.import_archive(tmp_path / "layout", name="one")
    second = store.import_archive(tmp_path / "layout", name="two")
    assert first.digest == second.digest and first.rootfs == second.rootfs
    assert store.names() == ["one", "two"]
    assert len(list((store.root / "sha256").iterdir())) == 1
    assert leftovers(store) == []


def test_zstd_layers_are_refused_clearly(store: ImageStore, tmp_path: Path) -> None:
    make_oci_layout(tmp_path / "layout", [[F("a", "1")]], compression="zstd")
    with pytest.raises(ImageError, match="zstd layers are not supported"):
        store.import_archive(tmp_path / "layout", name="z")
    # Found from the content too, whatever the media type says.
    archive = tmp_path / "docker.tar"
    make_docker_save(archive, [[F("a", "1")]], compression="zstd")
    with pytest.raises(ImageError, match="zstd layers are not supported"):
        store.import_archive(archive, name="z")
    assert store.names() == [] and leftovers(store) == []


def test_corrupt_blob_is_refused(store: ImageStore, tmp_path: Path) -> None:
    layout = tmp_path / "layout"
    make_oci_layout(layout, [[F("a", "1" * 1000)]], compression=None)
    index = json.loads((layout / "index.json").read_text())
    manifest = json.loads((layout / "blobs/sha256" / index["manifests"][0]["digest"][7:]).read_text())
    blob = layout / "blobs/sha256" / manifest["layers"][0]["digest"][7:]
    data = bytearray(blob.read_bytes())
    data[600] ^= 1  # inside the file's content: the tar still parses
    blob.write_bytes(bytes(data))
    with pytest.raises(ImageError, match="does not match"):
        store.import_archive(layout, name="bad")
    assert store.names() == [] and store.list() == [] and leftovers(store) == []


@pytest.mark.parametrize(
    "contents",
    [b"not a tar at all", None],
    ids=["garbage-file", "empty-dir"],
)
def test_not_an_image(store: ImageStore, tmp_path: Path, contents: bytes | None) -> None:
    path = tmp_path / "thing"
    if contents is None:
        path.mkdir()
    else:
        path.write_bytes(contents)
    with pytest.raises(ImageError, match="not an OCI layout"):
        store.import_archive(path)
    with pytest.raises(ImageError, match="does not exist"):
        store.import_archive(tmp_path / "missing")


# --------------------------------------------------------------------------- untrusted layers


def _symlink_cases(outside: Path) -> dict[str, tuple[list[list[object]], str | None]]:
    """name -> (layers, expected ImageError match or None when the import must succeed contained)."""
    rel_up = "../" * 12 + str(outside).lstrip("/")
    return {
        "dotdot": ([[F("../../etc/x", "pwned")]], "leaves the image root"),
        "dotdot-deep": ([[D("a"), F("a/../../../x", "pwned")]], "leaves the image root"),
        "absolute": ([[F(str(outside / "x"), "pwned")]], "absolute path"),
        "absolute-tmp": ([[F("/tmp/x-hangar-test", "pwned")]], "absolute path"),
        "symlink-abs-then-file": ([[S("evil", str(outside)), F("evil/pwned", "pwned")]], None),
        "symlink-rel-then-file": ([[S("evil", rel_up), F("evil/pwned", "pwned")]], None),
        "symlink-then-dir-then-file": (
            [[S("evil", str(outside)), D("evil/sub"), F("evil/sub/pwned", "x")]],
            None,
        ),
        "symlink-in-lower-layer": ([[S("evil", str(outside))], [F("evil/pwned", "pwned")]], None),
        "symlink-chain": ([[S("a", "b"), S("b", str(outside)), F("a/pwned", "pwned")]], None),
        "symlink-overwrite-target": ([[S("victim", str(outside / "secret"))], [F("victim", "pwned")]], None),
        "hardlink-via-symlink": ([[S("s", str(outside / "secret")), H("h", "s")]], None),
        "hardlink-through-dir-symlink": ([[S("d", str(outside)), H("h", "d/secret")]], "missing"),
        "hardlink-dotdot": (
            [[H("h", "../../" + str(outside / "secret").lstrip("/"))]],
            "leaves the image root",
        ),
        "hardlink-absolute": ([[H("h", str(outside / "secret"))]], "absolute path"),
        "whiteout-through-symlink": ([[S("evil", str(outside))], [F("evil/.wh.secret", "")]], None),
        "opaque-through-symlink": ([[S("evil", str(outside))], [F("evil/.wh..wh..opq", "")]], None),
        "whiteout-dotdot": ([[F("../.wh.secret", "")]], "leaves the image root"),
        "symlink-loop": ([[S("l1", "l2"), S("l2", "l1"), F("l1/x", "x")]], "symbolic links"),
        # A directory's mode and time are set after the whole layer: by then a later member
        # may have made it, or a directory above it, a symlink out of the rootfs.
        "dir-mode-then-symlink": ([[D("x", mode=0o6777), S("x", str(outside / "keep"))]], None),
        "parent-dir-mode-then-symlink": (
            [[D("p"), D("p/keep", mode=0o777), D("p/keep/file", mode=0o777), S("p", str(outside))]],
            None,
        ),
        "whiteout-of-dot": ([[D("d"), F("d/.wh..", "")]], "invalid whiteout"),
        "whiteout-of-dotdot": ([[D("d"), F("d/.wh...", "")]], "invalid whiteout"),
    }


CASE_NAMES = list(_symlink_cases(Path("/x")))


@pytest.mark.parametrize("case", CASE_NAMES)
def test_malicious_layers_cannot_write_outside_the_rootfs(
    store: ImageStore, tmp_path: Path, case: str
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("host secret")
    (outside / "keep").mkdir()
    (outside / "keep/file").write_text("keep me")
    before = snapshot(tmp_path)
    layers, error = _symlink_cases(outside)[case]

    layout = tmp_path / "layout"
    make_oci_layout(layout, layers, compression=None)  # type: ignore[arg-type]
    if error is not None:
        with pytest.raises(ImageError, match=error):
            store.import_archive(layout, name="evil")
        assert store.list() == []
    else:
        info = store.import_archive(layout, name="evil")
        root = info.rootfs
        # Whatever the layer said, it landed inside the rootfs.
        if case.startswith("symlink-") and "overwrite" not in case and "loop" not in case:
            landed = list(root.rglob("pwned"))
            assert landed and all(p.resolve().is_relative_to(root.resolve()) for p in landed), landed
            assert (root / str(outside).lstrip("/")).is_dir()
        if case == "symlink-overwrite-target":
            assert not (root / "victim").is_symlink() and (root / "victim").read_text() == "pwned"
        if case == "hardlink-via-symlink":
            assert (root / "h").is_symlink(), "the link entry itself was linked, not what it points at"

    after = snapshot(tmp_path)
    outside_after = {k: v for k, v in after.items() if k.startswith("outside")}
    outside_before = {k: v for k, v in before.items() if k.startswith("outside")}
    assert outside_after == outside_before, "something outside the rootfs changed"
    assert (outside / "secret").stat().st_nlink == 1
    assert not os.path.lexists("/tmp/x-hangar-test")
    assert leftovers(store) == []


def test_non_directory_parent_is_refused(store: ImageStore, tmp_path: Path) -> None:
    make_oci_layout(tmp_path / "layout", [[F("file", "x"), F("file/child", "y")]])
    with pytest.raises(ImageError, match="is not a directory"):
        store.import_archive(tmp_path / "layout", name="bad")
    assert store.list() == [] and leftovers(store) == []


def test_tar_members_with_odd_types_are_contained(store: ImageStore, tmp_path: Path) -> None:
    fifo = Entry("run/fifo", "fifo", mode=0o600)
    dev = tarfile.TarInfo("dev/sda")
    dev.type = tarfile.BLKTYPE
    dev.devmajor, dev.devminor = 8, 0
    make_oci_layout(tmp_path / "layout", [[fifo, dev, F("./dot/slash", "ok"), F("a//b", "ok")]])
    root = store.import_archive(tmp_path / "layout", name="odd").rootfs
    assert stat.S_ISFIFO((root / "run/fifo").lstat().st_mode)
    assert not os.path.lexists(root / "dev/sda")
    assert (root / "dot/slash").read_text() == "ok" and (root / "a/b").read_text() == "ok"


# --------------------------------------------------------------------------- registry


def test_pull_from_a_real_local_registry(store: ImageStore, tmp_path: Path, registry: Registry) -> None:
    layout = tmp_path / "layout"
    layer2 = [F("etc/.wh.a", ""), F("etc/motd", "pulled\n")]
    make_oci_layout(layout, [BASE_LAYER, layer2], CONFIG, ref_name="v1")
    reference = registry.push(layout, "test/img:1", ref_name="v1")
    assert reference == f"{registry.host}/test/img:1"

    lines: list[str] = []
    info = store.pull(reference, name="pulled", tls_verify=False, progress=lines.append)
    assert info.name == "pulled" and store.get("pulled") == info
    assert info.source == f"registry:{reference}"
    assert info.config == _expected_config()
    root = info.rootfs
    _check_base_tree(root)
    assert (root / "etc/motd").read_text() == "pulled\n"
    assert not (root / "etc/a").exists() and (root / "etc/b").read_text() == "b"
    assert any("skopeo" in line for line in lines)
    assert leftovers(store) == []

    # Pulling again gives the same image; with no name the reference is the name.
    again = store.pull(f"docker://{reference}", tls_verify=False)
    assert again.digest == info.digest and again.name == reference
    assert store.names() == sorted(["pulled", reference])


def test_pull_failure_reports_skopeo_stderr(store: ImageStore, registry: Registry) -> None:
    with pytest.raises(ImageError) as excinfo:
        store.pull(f"{registry.host}/no/such:image", name="x", tls_verify=False)
    message = str(excinfo.value)
    assert "skopeo" in message and ("manifest unknown" in message or "name unknown" in message), message
    assert store.names() == [] and leftovers(store) == []


def test_pull_with_tls_verify_refuses_a_plain_http_registry(store: ImageStore, registry: Registry) -> None:
    with pytest.raises(ImageError, match="skopeo"):
        store.pull(f"{registry.host}/test/img:1", name="x")
    assert leftovers(store) == []


def test_pull_needs_skopeo(store: ImageStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ImageError, match="apt-get install skopeo"):
        store.pull("127.0.0.1:1/x:1", name="x")
    with pytest.raises(ImageError, match="pass a name"):
        store.pull("127.0.0.1:1/Upper:1")


# --------------------------------------------------------------------------- full Debian base


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("HANGAR_TEST_BASE_IMAGE"),
    reason="builds a full Debian rootfs from the mirror (minutes); CI sets HANGAR_TEST_BASE_IMAGE=1",
)
def test_build_base_debian_image(base_image_info, agent_cache_dir, tmp_path) -> None:
    # Built by the shared fixture (once per machine: the harness tests run on it too).
    info, lines = base_image_info
    assert info.name == "base" and (not lines or len(lines) > 5)
    root = info.rootfs
    for tool in ("bash", "git", "curl", "python3", "node", "npm", "ps", "less", "ssh", "xz"):
        assert (root / "usr/bin" / tool).exists(), tool
    assert not list((root / "var/lib/apt/lists").glob("*_Packages")), "apt lists cleaned"
    assert not list((root / "var/cache/apt/archives").glob("*.deb")), "apt cache cleaned"
    devices = [
        p
        for p in (root / "dev").rglob("*")
        if stat.S_ISCHR(p.lstat().st_mode) or stat.S_ISBLK(p.lstat().st_mode)
    ]
    assert not devices, "device nodes are not kept in the store"
    assert info.config["cmd"] == ["/bin/bash"]
    if IS_ROOT:
        out = subprocess.run(
            ["chroot", str(root), "python3", "-c", "print(6 * 7)"], capture_output=True, text=True
        )
        assert out.stdout.strip() == "42", out.stderr
    if IS_ROOT and shutil.which(default_runsc()):
        # And it is what harnesses will run: python3, node, git and bash inside a real gVisor sandbox.
        from runtime.launchers.base import ExecRequest, SandboxSpec
        from runtime.launchers.gvisor.launcher import GVisorLauncher

        launcher = GVisorLauncher(
            state_dir=tmp_path / "gvisor", agent_cache_dir=agent_cache_dir, spare_disks=0
        )
        handle = launcher.create(SandboxSpec(id="base" + os.urandom(4).hex(), rootfs=root, memory_mb=512))
        try:
            script = "python3 -c 'print(6*7)'; node -e 'console.log(6*7)'; git --version; bash -c 'echo $BASH_VERSION'"
            r = launcher.exec(handle, ExecRequest(argv=["/bin/sh", "-c", script], timeout=60))
            lines_out = r.stdout.decode().splitlines()
            assert r.exit_code == 0, r.stderr
            assert lines_out[:2] == ["42", "42"] and lines_out[2].startswith("git version") and lines_out[3]
        finally:
            launcher.destroy(handle)
