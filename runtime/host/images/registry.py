"""Pulling an image from a registry: skopeo copies it into an OCI layout, which is imported."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from .base import NAME_RE, ImageError, ImageInfo, Progress, Store, emit, rmtree, run_streaming, validate_name
from .oci import Source, import_source


def pull(
    store: Store,
    ref: str,
    name: str | None = None,
    *,
    tls_verify: bool = True,
    progress: Progress = None,
) -> ImageInfo:
    """Pull ``ref`` from a registry with skopeo and import it; named ``ref`` unless ``name``."""
    ref = ref.removeprefix("docker://")
    if not ref or ref.startswith("-") or any(c.isspace() for c in ref):
        raise ImageError(f"invalid image reference {ref!r}")
    if name is None:
        if not NAME_RE.fullmatch(ref):
            raise ImageError(f"{ref!r} is not usable as an image name; pass a name")
        name = ref
    validate_name(name)
    if shutil.which("skopeo") is None:
        raise ImageError("skopeo is not installed: apt-get install skopeo")
    store.ensure()
    workdir = Path(tempfile.mkdtemp(prefix=".pull-", dir=store.root))
    try:
        layout = workdir / "layout"
        cmd = ["skopeo", "copy"]
        if not tls_verify:
            cmd.append("--src-tls-verify=false")
        cmd += [f"docker://{ref}", f"oci:{layout}:img"]
        emit(progress, "$ " + " ".join(cmd))
        run_streaming(cmd, progress, f"skopeo copy of {ref}", "apt-get install skopeo")
        src = Source(layout)
        try:
            return import_source(store, src, name, progress, f"registry:{ref}")
        finally:
            src.close()
    finally:
        rmtree(workdir)
