"""Hand-made OCI / docker-save images for image tests, and the local registry they push to
(the ``registry`` fixture lives in ``tests/host/conftest.py``).

Images are written with tarfile + json + hashlib, so tests need no container tooling::

    digest = make_oci_layout(tmp_path / "img", [[F("etc/motd", b"hi\\n"), S("bin/sh", "busybox")]])
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"


@dataclass(frozen=True)
class Entry:
    """One tar member of a test layer. ``type``: file, dir, symlink, hardlink, chr, fifo."""

    name: str
    type: str = "file"
    data: bytes = b""
    mode: int | None = None
    linkname: str = ""
    uid: int = 0
    gid: int = 0
    mtime: int = 1_700_000_000


def F(name: str, data: bytes | str = b"", mode: int = 0o644, uid: int = 0, gid: int = 0) -> Entry:
    return Entry(name, "file", data.encode() if isinstance(data, str) else data, mode, uid=uid, gid=gid)


def D(name: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> Entry:
    return Entry(name, "dir", mode=mode, uid=uid, gid=gid)


def S(name: str, target: str) -> Entry:
    return Entry(name, "symlink", linkname=target, mode=0o777)


def H(name: str, target: str) -> Entry:
    return Entry(name, "hardlink", linkname=target, mode=0o644)


_TYPES = {
    "file": tarfile.REGTYPE,
    "dir": tarfile.DIRTYPE,
    "symlink": tarfile.SYMTYPE,
    "hardlink": tarfile.LNKTYPE,
    "chr": tarfile.CHRTYPE,
    "fifo": tarfile.FIFOTYPE,
}


def layer_tar(entries: Sequence[Entry | tarfile.TarInfo]) -> bytes:
    """An uncompressed layer tar holding ``entries`` in order (names are used verbatim)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            if isinstance(e, tarfile.TarInfo):
                tar.addfile(e)
                continue
            info = tarfile.TarInfo(e.name)
            info.type = _TYPES[e.type]
            info.mode = e.mode if e.mode is not None else (0o755 if e.type == "dir" else 0o644)
            info.uid, info.gid, info.mtime = e.uid, e.gid, e.mtime
            info.linkname = e.linkname
            if e.type == "chr":
                info.devmajor, info.devminor = 1, 3
            if e.type == "file":
                info.size = len(e.data)
                tar.addfile(info, io.BytesIO(e.data))
            else:
                tar.addfile(info)
    return buf.getvalue()


def _compress(data: bytes, compression: str | None) -> bytes:
    if compression in (None, "none", ""):
        return data
    if compression == "gzip":
        return gzip.compress(data, mtime=0)
    if compression == "zstd":  # only the frame magic matters: the importer must refuse it
        return b"\x28\xb5\x2f\xfd" + data
    raise ValueError(compression)


def _per_layer(compression: str | None | Sequence[str | None], n: int) -> list[str | None]:
    if isinstance(compression, str) or compression is None:
        return [compression] * n
    assert len(compression) == n
    return list(compression)


def _image_config(config: dict[str, Any] | None, diff_ids: list[str], arch: str = "amd64") -> bytes:
    doc = {
        "architecture": arch,
        "os": "linux",
        "config": config if config is not None else {"Env": ["PATH=/usr/bin:/bin"], "Cmd": ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": [],
    }
    return json.dumps(doc, sort_keys=True).encode()


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _write_blob(layout: Path, data: bytes) -> str:
    digest = _sha(data)
    path = layout / "blobs" / "sha256" / digest.split(":", 1)[1]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return digest


def _add_image(
    layout: Path,
    layers: Sequence[Sequence[Entry | tarfile.TarInfo]],
    config: dict[str, Any] | None,
    compression: str | None | Sequence[str | None],
    arch: str = "amd64",
) -> tuple[str, int]:
    """Write an image's blobs; return (manifest digest, manifest size)."""
    raw = [layer_tar(entries) for entries in layers]
    descriptors = []
    for data, comp in zip(raw, _per_layer(compression, len(raw)), strict=True):
        blob = _compress(data, comp)
        media = OCI_LAYER + {"gzip": "+gzip", "zstd": "+zstd"}.get(comp or "", "")
        descriptors.append({"mediaType": media, "digest": _write_blob(layout, blob), "size": len(blob)})
    config_bytes = _image_config(config, [_sha(d) for d in raw], arch)
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {
            "mediaType": OCI_CONFIG,
            "digest": _write_blob(layout, config_bytes),
            "size": len(config_bytes),
        },
        "layers": descriptors,
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
    return _write_blob(layout, manifest_bytes), len(manifest_bytes)


def make_oci_layout(
    directory: str | os.PathLike,
    layers: Sequence[Sequence[Entry | tarfile.TarInfo]],
    config: dict[str, Any] | None = None,
    *,
    compression: str | None | Sequence[str | None] = "gzip",
    ref_name: str = "latest",
    platforms: Sequence[str] = (),
) -> str:
    """Write an OCI image layout at ``directory``; return the manifest digest.

    ``layers``: one list of :class:`Entry` per layer, bottom first. ``config``: the image config's
    ``config`` object (Env, Cmd, Entrypoint, WorkingDir, User). ``platforms`` (e.g.
    ``["arm64", "amd64"]``): also write an image per architecture and point index.json at all of
    them (each arch's image gets an extra ``/arch`` file); the returned digest is then amd64's.
    """
    layout = Path(directory)
    layout.mkdir(parents=True, exist_ok=True)
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    annotations = {"org.opencontainers.image.ref.name": ref_name}
    if not platforms:
        digest, size = _add_image(layout, layers, config, compression)
        manifests = [{"mediaType": OCI_MANIFEST, "digest": digest, "size": size, "annotations": annotations}]
        result = digest
    else:
        manifests, result = [], ""
        for arch in platforms:
            arch_layers = [*layers[:-1], [*layers[-1], F("arch", arch)]]
            digest, size = _add_image(layout, arch_layers, config, compression, arch)
            manifests.append(
                {
                    "mediaType": OCI_MANIFEST,
                    "digest": digest,
                    "size": size,
                    "platform": {"os": "linux", "architecture": arch},
                    "annotations": annotations,
                }
            )
            if arch == "amd64":
                result = digest
    index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests}
    (layout / "index.json").write_text(json.dumps(index))
    return result


def make_oci_archive(
    path: str | os.PathLike,
    layers: Sequence[Sequence[Entry | tarfile.TarInfo]],
    config: dict[str, Any] | None = None,
    **kwargs: Any,
) -> str:
    """An OCI archive (a tar of an OCI layout, as ``skopeo copy ... oci-archive:``)."""
    path = Path(path)
    staging = path.with_name(path.name + ".layout")
    digest = make_oci_layout(staging, layers, config, **kwargs)
    with tarfile.open(path, "w") as tar:
        for child in sorted(staging.iterdir()):
            tar.add(child, arcname=child.name)
    shutil.rmtree(staging)
    return digest


def make_docker_save(
    path: str | os.PathLike,
    layers: Sequence[Sequence[Entry | tarfile.TarInfo]],
    config: dict[str, Any] | None = None,
    *,
    compression: str | None | Sequence[str | None] = None,
    repo_tags: Sequence[str] = ("test/docker:1",),
) -> str:
    """A ``docker save`` tarball (legacy layout: ``<id>/layer.tar``); return the config digest."""
    raw = [layer_tar(entries) for entries in layers]
    config_bytes = _image_config(config, [_sha(d) for d in raw])
    config_hex = hashlib.sha256(config_bytes).hexdigest()
    files: dict[str, bytes] = {f"{config_hex}.json": config_bytes}
    layer_paths = []
    for i, (data, comp) in enumerate(zip(raw, _per_layer(compression, len(raw)), strict=True)):
        layer_id = hashlib.sha256(f"{i}:{_sha(data)}".encode()).hexdigest()
        files[f"{layer_id}/VERSION"] = b"1.0"
        files[f"{layer_id}/layer.tar"] = _compress(data, comp)
        layer_paths.append(f"{layer_id}/layer.tar")
    manifest = [{"Config": f"{config_hex}.json", "RepoTags": list(repo_tags), "Layers": layer_paths}]
    files["manifest.json"] = json.dumps(manifest).encode()
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return "sha256:" + config_hex


# --------------------------------------------------------------------------- local registry


@dataclass
class Registry:
    """A Debian ``docker-registry`` serving plain HTTP on 127.0.0.1."""

    host: str  # "127.0.0.1:<port>"
    process: subprocess.Popen[bytes]
    log: Path

    def push(self, layout: str | os.PathLike, repo: str, *, ref_name: str = "latest") -> str:
        """Push the OCI layout's ``ref_name`` image to ``<host>/<repo>``; return the reference."""
        reference = f"{self.host}/{repo}"
        result = subprocess.run(
            [
                "skopeo",
                "copy",
                "--dest-tls-verify=false",
                f"oci:{layout}:{ref_name}",
                f"docker://{reference}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, f"skopeo push failed: {result.stderr}"
        return reference
