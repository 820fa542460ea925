"""Importing images from files: an OCI layout directory, an OCI archive (a tar of one) or a
``docker save`` tarball; which manifest of an index to take, the image config, the plan."""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import platform
import posixpath
import re
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .base import (
    NAME_RE,
    ImageError,
    ImageInfo,
    ImageNotFound,
    Progress,
    Store,
    emit,
    empty_config,
    validate_name,
)
from .layers import apply_layer, normalize_member

_BLOB_DIGEST_RE = re.compile(r"(sha256):([0-9a-f]{64})|(sha512):([0-9a-f]{128})")
_OCI_INDEX_TYPES = {
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
}
_MAX_JSON = 32 * 1024 * 1024


class Source:
    """Files of an OCI layout / docker save, read from a directory or a tar file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tar: tarfile.TarFile | None = None
        self._members: dict[str, tarfile.TarInfo] = {}
        if path.is_dir():
            self.kind = "dir"
            self._real = os.path.realpath(path)
        elif path.is_file():
            self.kind = "tar"
            try:
                self._tar = tarfile.open(path, "r:*")
                for m in self._tar.getmembers():
                    norm = posixpath.normpath(m.name.lstrip("/"))
                    self._members[norm] = m
            except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError) as exc:
                self.close()
                raise ImageError(
                    f"{path} is not an OCI layout, OCI archive or docker save tarball ({exc})"
                ) from exc
        elif not path.exists():
            raise ImageError(f"{path} does not exist")
        else:
            raise ImageError(f"{path} is not a directory or a tar file")

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None

    def exists(self, rel: str) -> bool:
        if self.kind == "dir":
            return os.path.isfile(os.path.join(self.path, rel))
        return posixpath.normpath(rel) in self._members

    def open(self, rel: str) -> IO[bytes]:
        parts = normalize_member(rel, f"{self.path}")
        rel = "/".join(parts)
        if self.kind == "dir":
            full = os.path.realpath(os.path.join(self.path, rel))
            if not full.startswith(self._real.rstrip("/") + "/"):
                raise ImageError(f"{self.path}: {rel!r} points outside the archive")
            try:
                return open(full, "rb")
            except FileNotFoundError as exc:
                raise ImageError(f"{self.path}: missing {rel}") from exc
        assert self._tar is not None
        member = self._members.get(rel)
        if member is None:
            raise ImageError(f"{self.path}: missing {rel}")
        try:
            f = self._tar.extractfile(member)
        except (tarfile.TarError, KeyError) as exc:
            raise ImageError(f"{self.path}: cannot read {rel}: {exc}") from exc
        if f is None:
            raise ImageError(f"{self.path}: {rel} is not a file")
        return f

    def read(self, rel: str) -> bytes:
        with self.open(rel) as f:
            data = f.read(_MAX_JSON + 1)
        if len(data) > _MAX_JSON:
            raise ImageError(f"{self.path}: {rel} is implausibly large")
        return data

    @staticmethod
    def blob_path(digest: str) -> str:
        match = _BLOB_DIGEST_RE.fullmatch(digest or "")
        if not match:
            raise ImageError(f"unsupported or malformed digest {digest!r}")
        algorithm, hexdigest = (match.group(1), match.group(2)) if match.group(1) else match.groups()[2:]
        return f"blobs/{algorithm}/{hexdigest}"

    def read_blob(self, digest: str) -> bytes:
        data = self.read(self.blob_path(digest))
        algorithm, _, hexdigest = digest.partition(":")
        if hashlib.new(algorithm, data).hexdigest() != hexdigest:
            raise ImageError(f"{self.path}: blob {digest} is corrupt (digest mismatch)")
        return data

    def read_json(self, data: bytes, what: str) -> Any:
        try:
            return json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ImageError(f"{self.path}: {what} is not valid JSON ({exc})") from exc


def _host_arch() -> str:
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "i686": "386"}.get(machine, machine)


def _is_attestation(desc: dict[str, Any]) -> bool:
    annotations = desc.get("annotations") or {}
    plat = desc.get("platform") or {}
    return (
        annotations.get("vnd.docker.reference.type") == "attestation-manifest" or plat.get("os") == "unknown"
    )


def _describe(desc: dict[str, Any]) -> str:
    plat = desc.get("platform") or {}
    ref = (desc.get("annotations") or {}).get("org.opencontainers.image.ref.name")
    where = f"{plat.get('os', '?')}/{plat.get('architecture', '?')}" if plat else "no platform"
    return f"{ref} ({where})" if ref else where


def _image_config(config_json: Any) -> dict[str, Any]:
    cfg = config_json.get("config") if isinstance(config_json, dict) else None
    if not isinstance(cfg, dict):
        cfg = {}

    def strings(value: Any) -> list[str]:
        return [str(v) for v in value] if isinstance(value, list) else []

    return empty_config(
        env=strings(cfg.get("Env")),
        cmd=strings(cfg.get("Cmd")),
        entrypoint=strings(cfg.get("Entrypoint")),
        working_dir=str(cfg.get("WorkingDir") or ""),
        user=str(cfg.get("User") or ""),
    )


@dataclass
class Plan:
    digest: str
    config: dict[str, Any]
    layers: list[tuple[str, str | None]]  # (path in source, expected blob digest or None)
    default_name: str | None
    source: str


def plan_import(src: Source, source_label: str | None) -> Plan:
    """What importing ``src`` takes (digest, config, layers, name); ImageError if malformed."""
    try:
        return _plan(src, source_label)
    except ImageError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError, OSError, tarfile.TarError) as exc:
        raise ImageError(f"{src.path}: malformed image archive ({type(exc).__name__}: {exc})") from exc


def _plan(src: Source, source_label: str | None) -> Plan:
    path = src.path
    if src.exists("index.json"):
        index = src.read_json(src.read("index.json"), "index.json")
        desc = _pick_manifest(src, index, 0)
        manifest_bytes = src.read_blob(desc["digest"])
        manifest = src.read_json(manifest_bytes, f"manifest {desc['digest']}")
        if not isinstance(manifest, dict) or not isinstance(manifest.get("layers"), list):
            raise ImageError(f"{path}: manifest {desc['digest']} is not an image manifest")
        config_desc = manifest.get("config") or {}
        config_json = src.read_json(src.read_blob(config_desc.get("digest", "")), "image config")
        layers: list[tuple[str, str | None]] = []
        for layer in manifest["layers"]:
            media = str(layer.get("mediaType", ""))
            if "zstd" in media:
                raise ImageError(
                    f"{path}: zstd layers are not supported ({layer.get('digest')}); re-export the "
                    "image with gzip layers (e.g. skopeo copy --dest-compress-format=gzip ...)"
                )
            layers.append((src.blob_path(layer.get("digest", "")), layer["digest"]))
        annotations = desc.get("annotations") or {}
        default = annotations.get("io.containerd.image.name")
        kind = "oci-archive" if src.kind == "tar" else "oci-layout"
        return Plan(
            digest="sha256:" + hashlib.sha256(manifest_bytes).hexdigest(),
            config=_image_config(config_json),
            layers=layers,
            default_name=default,
            source=source_label or f"{kind}:{path}",
        )
    if src.exists("manifest.json"):
        entries = src.read_json(src.read("manifest.json"), "manifest.json")
        if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
            raise ImageError(f"{path}: manifest.json lists no images")
        if len(entries) > 1:
            held = ", ".join(",".join(e.get("RepoTags") or ["<untagged>"]) for e in entries)
            raise ImageError(f"{path}: the archive holds {len(entries)} images ({held}); save one at a time")
        entry = entries[0]
        if not isinstance(entry.get("Config"), str) or not isinstance(entry.get("Layers"), list):
            raise ImageError(f"{path}: manifest.json has no Config/Layers")
        config_bytes = src.read(entry["Config"])
        tags = entry.get("RepoTags") or []
        return Plan(
            digest="sha256:" + hashlib.sha256(config_bytes).hexdigest(),
            config=_image_config(src.read_json(config_bytes, "image config")),
            layers=[(str(layer), None) for layer in entry["Layers"]],
            default_name=tags[0] if tags and isinstance(tags[0], str) else None,
            source=source_label or f"docker-archive:{path}",
        )
    raise ImageError(
        f"{path} is not an OCI layout, OCI archive or docker save tarball (no index.json or manifest.json)"
    )


def _pick_manifest(src: Source, index: Any, depth: int) -> dict[str, Any]:
    if depth > 4:
        raise ImageError(f"{src.path}: image indexes nested too deeply")
    manifests = index.get("manifests") if isinstance(index, dict) else None
    candidates = [m for m in manifests or [] if isinstance(m, dict) and not _is_attestation(m)]
    if not candidates:
        raise ImageError(f"{src.path}: the index lists no image manifests")
    if len({m.get("digest") for m in candidates}) > 1:
        arch = _host_arch()
        matching = [
            m
            for m in candidates
            if (m.get("platform") or {}).get("os", "linux") == "linux"
            and (m.get("platform") or {}).get("architecture") == arch
        ]
        if len({m.get("digest") for m in matching}) != 1:
            listed = ", ".join(_describe(m) for m in candidates)
            if any(m.get("platform") for m in candidates) and not matching:
                raise ImageError(f"{src.path}: none of its images is for linux/{arch}: {listed}")
            raise ImageError(
                f"{src.path} holds {len(candidates)} different images ({listed}); "
                "cannot tell which one to import"
            )
        candidates = matching
    desc = candidates[0]
    if desc.get("mediaType") in _OCI_INDEX_TYPES:
        nested = src.read_json(src.read_blob(desc.get("digest", "")), "image index")
        inner = _pick_manifest(src, nested, depth + 1)
        annotations = {**(desc.get("annotations") or {}), **(inner.get("annotations") or {})}
        return {**inner, "annotations": annotations}
    return desc


# --------------------------------------------------------------------------- import


def import_archive(
    store: Store, path: str | os.PathLike, name: str | None = None, progress: Progress = None
) -> ImageInfo:
    """Import an OCI layout directory, an OCI archive (tar of one) or a ``docker save`` tar.

    Without ``name`` the image is named after the reference recorded in the archive
    (``io.containerd.image.name`` or docker's ``RepoTags``) when there is a valid one, and
    otherwise stays unnamed (reachable by digest).
    """
    if name is not None:
        validate_name(name)
    path = Path(path).absolute()
    src = Source(path)
    try:
        return import_source(store, src, name, progress, None)
    finally:
        src.close()


def import_source(
    store: Store, src: Source, name: str | None, progress: Progress, source_label: str | None
) -> ImageInfo:
    plan = plan_import(src, source_label)
    if name is None and plan.default_name and NAME_RE.fullmatch(plan.default_name):
        name = plan.default_name
    if (store.digest_dir(plan.digest) / "image.json").is_file():
        emit(progress, f"{plan.digest} is already in the store")
        try:
            return store.tag(name, plan.digest) if name else store.info(plan.digest, None)
        except ImageNotFound:
            pass  # removed meanwhile: unpack it again
    with store.building() as tmp:
        rootfs = tmp / "rootfs"
        rootfs.mkdir(mode=0o755)
        total = len(plan.layers)
        for i, (rel, expected) in enumerate(plan.layers, 1):
            label = f"layer {i}/{total} ({expected or rel})"
            emit(progress, f"applying {label}")
            with src.open(rel) as blob:
                apply_layer(str(rootfs), blob, label, expected)
        os.chmod(rootfs, 0o755)
        info = store.commit(tmp, plan.digest, plan.source, plan.config, name)
    emit(progress, f"imported {plan.digest} ({info.size_bytes / 1e6:.1f} MB)")
    return info
