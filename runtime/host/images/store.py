"""The image store: root filesystems for sandboxes, kept once per digest, with names.

A sandbox's root filesystem is an overlayfs whose lower dir is an image's ``rootfs`` from this
store; sandboxes never write to it. Layout under the store's root::

    sha256/<hex>/rootfs/      the unpacked tree (owned by root, numeric ids and modes kept,
                              device nodes skipped)
    sha256/<hex>/image.json   {"digest", "size_bytes", "created_at", "source", "config"}
    names.json                {name: "sha256:<hex>"}, replaced atomically
    .lock                     fcntl lock taken by every writer, so processes can share a store

Images are built or unpacked under ``sha256/.tmp-<random>/`` and renamed into place when
complete, so a half-built image is never visible.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..locks import file_lock
from . import build, oci, registry
from .base import (
    DIGEST_RE,
    ImageError,
    ImageInfo,
    ImageNotFound,
    Progress,
    empty_config,
    overlay_users,
    rmtree,
    tree_size,
    validate_name,
)
from .build import BASE_PACKAGES


class ImageStore:
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.blobs = self.root / "sha256"
        self._names_path = self.root / "names.json"
        self._lock_path = self.root / ".lock"

    # ---- bookkeeping

    def ensure(self) -> None:
        """Create the store's directories if missing."""
        self.blobs.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.ensure()
        with file_lock(self._lock_path):
            yield

    def _read_names(self) -> dict[str, str]:
        try:
            data = json.loads(self._names_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except ValueError as exc:
            raise ImageError(f"{self._names_path} is corrupt: {exc}") from exc
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def _write_names(self, names: dict[str, str]) -> None:
        tmp = self.root / f".names.json.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(dict(sorted(names.items())), f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._names_path)

    def digest_dir(self, digest: str) -> Path:
        """Where the image ``digest`` lives (or would); ImageError for a malformed digest."""
        match = DIGEST_RE.fullmatch(digest)
        if not match:
            raise ImageError(f"malformed digest {digest!r} (expected sha256:<64 hex digits>)")
        return self.blobs / match.group(1)

    def info(self, digest: str, name: str | None) -> ImageInfo:
        """The stored image ``digest``, reported under ``name``; ImageNotFound if it is gone."""
        directory = self.digest_dir(digest)
        try:
            meta = json.loads((directory / "image.json").read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            what = f"image {name!r} ({digest})" if name else f"image {digest}"
            raise ImageNotFound(f"{what} is missing from the store") from exc
        except ValueError as exc:
            raise ImageError(f"{directory / 'image.json'} is corrupt: {exc}") from exc
        return ImageInfo(
            name=name,
            digest=digest,
            rootfs=directory / "rootfs",
            size_bytes=int(meta.get("size_bytes", 0)),
            created_at=str(meta.get("created_at", "")),
            source=str(meta.get("source", "")),
            config=dict(meta.get("config") or empty_config()),
        )

    def _digests(self) -> list[str]:
        try:
            entries = sorted(os.listdir(self.blobs))
        except FileNotFoundError:
            return []
        return [
            f"sha256:{e}"
            for e in entries
            if DIGEST_RE.fullmatch(f"sha256:{e}") and (self.blobs / e / "image.json").is_file()
        ]

    # ---- queries

    def names(self) -> list[str]:
        return sorted(self._read_names())

    def list(self) -> list[ImageInfo]:
        names = self._read_names()
        result: list[ImageInfo] = []
        for name in sorted(names):
            with contextlib.suppress(ImageNotFound):
                result.append(self.info(names[name], name))
        referenced = set(names.values())
        for digest in self._digests():
            if digest not in referenced:
                with contextlib.suppress(ImageNotFound):
                    result.append(self.info(digest, None))
        return result

    def get(self, ref: str) -> ImageInfo:
        names = self._read_names()
        if DIGEST_RE.fullmatch(ref or ""):
            if not (self.digest_dir(ref) / "image.json").is_file():
                raise ImageNotFound(f"no image with digest {ref} in the store")
            named = sorted(n for n, d in names.items() if d == ref)
            return self.info(ref, named[0] if named else None)
        digest = names.get(ref)
        if digest is None:
            available = ", ".join(sorted(names)) or "none (the store is empty)"
            raise ImageNotFound(f"no image named {ref!r}; images available: {available}")
        return self.info(digest, ref)

    # ---- names

    def tag(self, name: str, digest: str) -> ImageInfo:
        """Point ``name`` at an image, given by digest (or by another name)."""
        validate_name(name)
        if not DIGEST_RE.fullmatch(digest or ""):
            digest = self.get(digest).digest
        with self._locked():
            if not (self.digest_dir(digest) / "image.json").is_file():
                raise ImageNotFound(f"no image with digest {digest} in the store")
            names = self._read_names()
            if names.get(name) != digest:
                names[name] = digest
                self._write_names(names)
        return self.info(digest, name)

    def remove(self, name: str) -> None:
        """Remove a name; the image itself goes when no name points to it any more.

        Given a digest, removes that image and every name pointing to it.
        """
        doomed: Path | None = None
        with self._locked():
            names = self._read_names()
            if DIGEST_RE.fullmatch(name or ""):
                digest = name
                if not (self.digest_dir(digest) / "image.json").is_file():
                    raise ImageNotFound(f"no image with digest {digest} in the store")
                names = {n: d for n, d in names.items() if d != digest}
            else:
                if name not in names:
                    available = ", ".join(sorted(names)) or "none (the store is empty)"
                    raise ImageNotFound(f"no image named {name!r}; images available: {available}")
                digest = names.pop(name)
            directory = self.digest_dir(digest)
            if digest not in names.values() and directory.exists():
                users = overlay_users(directory / "rootfs")
                if users:
                    raise ImageError(
                        f"image {name} ({digest}) is in use by {len(users)} mounted sandbox root "
                        f"filesystem(s), e.g. {users[0]}; stop those sandboxes first"
                    )
            self._write_names(names)
            if digest not in names.values() and directory.exists():
                doomed = self.blobs / f".del-{secrets.token_hex(8)}"
                os.rename(directory, doomed)
        if doomed is not None:
            rmtree(doomed)

    # ---- adding images

    def _new_tmp(self) -> Path:
        self.ensure()
        tmp = self.blobs / f".tmp-{secrets.token_hex(8)}"
        tmp.mkdir(mode=0o755)
        return tmp

    def commit(
        self, tmp: Path, digest: str, source: str, config: dict[str, Any], name: str | None
    ) -> ImageInfo:
        """Move a finished ``tmp`` (holding ``rootfs/``) into place as ``digest``; set ``name``."""
        rootfs = tmp / "rootfs"
        meta = {
            "digest": digest,
            "size_bytes": tree_size(rootfs),
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "source": source,
            "config": config,
        }
        with open(tmp / "image.json", "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")
        discard = False
        tmp_stale: Path | None = None
        with self._locked():
            final = self.digest_dir(digest)
            if (final / "image.json").is_file():
                discard = True
            else:
                if final.exists():  # a leftover without image.json: not a valid image
                    tmp_stale = self.blobs / f".del-{secrets.token_hex(8)}"
                    os.rename(final, tmp_stale)
                os.rename(tmp, final)
            if name is not None:
                names = self._read_names()
                if names.get(name) != digest:
                    names[name] = digest
                    self._write_names(names)
        if discard:
            rmtree(tmp)
        elif tmp_stale is not None:
            rmtree(tmp_stale)
        return self.info(digest, name)

    @contextlib.contextmanager
    def building(self) -> Iterator[Path]:
        """A fresh directory to build an image in (then :meth:`commit`); removed if left behind."""
        tmp = self._new_tmp()
        try:
            yield tmp
        finally:
            if tmp.exists():
                rmtree(tmp)

    # ---- the ways in (each in its own module)

    def build_busybox(self, name: str = "busybox", progress: Progress = None) -> ImageInfo:
        """A tiny image from Debian's static busybox: /bin/busybox plus a link per applet."""
        return build.build_busybox(self, name, progress)

    def build_base(
        self,
        name: str = "base",
        progress: Progress = None,
        suite: str = "bookworm",
        mirror: str | None = None,
        packages_list: tuple[str, ...] = BASE_PACKAGES,
    ) -> ImageInfo:
        """A Debian image (minbase + a dev toolset) via mmdebstrap; needs the mirror, takes minutes."""
        return build.build_base(self, name, progress, suite, mirror, packages_list)

    def import_archive(
        self, path: str | os.PathLike, name: str | None = None, progress: Progress = None
    ) -> ImageInfo:
        """Import an OCI layout directory, an OCI archive (tar of one) or a ``docker save`` tar;
        see :func:`.oci.import_archive`."""
        return oci.import_archive(self, path, name, progress)

    def pull(
        self,
        ref: str,
        name: str | None = None,
        *,
        tls_verify: bool = True,
        progress: Progress = None,
    ) -> ImageInfo:
        """Pull ``ref`` from a registry with skopeo and import it; named ``ref`` unless ``name``."""
        return registry.pull(self, ref, name, tls_verify=tls_verify, progress=progress)
