"""Images as the control plane sees them: names that point at digests held by nodes."""

from __future__ import annotations

from collections.abc import Callable

from ..errors import BadRequest
from ..launchers.images import ImageInfo
from ..models import Image, Node
from ..node import image_store, local_node_name


def image_resolve(ref: str) -> Image:
    """The image row for a name (or digest); a 400 naming the images there are otherwise."""
    image = Image.objects.filter(name=ref).first() or Image.objects.filter(digest=ref).first()
    if image is None:
        names = sorted(Image.objects.values_list("name", flat=True))
        known = ", ".join(names) if names else "none yet (run `hangar image build busybox`)"
        raise BadRequest(f"unknown image {ref!r}; images available: {known}", images=names)
    return image


def image_register(*, info: ImageInfo, name: str, node_name: str | None = None) -> Image:
    """Record that ``node_name`` (default: this node) holds ``info`` under ``name``."""
    node = Node.objects.filter(name=node_name or local_node_name()).first()
    image, _ = Image.objects.update_or_create(
        name=name,
        defaults={
            "digest": info.digest,
            "size_bytes": info.size_bytes,
            "source": info.source[:300],
            "config": info.config,
        },
    )
    if node is not None:
        image.nodes.add(node)
    return image


def images_sync_local() -> list[Image]:
    """Register every named image of this node's store (run at node start)."""
    rows = []
    node = Node.objects.filter(name=local_node_name()).first()
    for info in image_store().list():
        if info.name:
            rows.append(image_register(info=info, name=info.name))
    if node is not None:
        # A name this node no longer holds (or holds at another digest) is not served from it.
        names = {i.name: i.digest for i in image_store().list() if i.name}
        for image in node.images.all():
            if names.get(image.name) != image.digest:
                image.nodes.remove(node)
    return rows


def image_build(*, kind: str, progress: Callable[[str], None] | None = None) -> Image:
    store = image_store()
    if kind == "busybox":
        info = store.build_busybox(progress=progress)
    elif kind == "base":
        info = store.build_base(progress=progress)
    else:
        raise BadRequest(f"unknown image kind {kind!r}; buildable: busybox, base")
    return image_register(info=info, name=info.name or kind)


def image_import(
    *, path: str, name: str | None = None, progress: Callable[[str], None] | None = None
) -> Image:
    info = image_store().import_archive(path, name=name, progress=progress)
    return image_register(info=info, name=info.name or info.digest)


def image_pull(*, ref: str, name: str | None = None, tls_verify: bool = True,
               progress: Callable[[str], None] | None = None) -> Image:  # fmt: skip
    info = image_store().pull(ref, name=name, tls_verify=tls_verify, progress=progress)
    return image_register(info=info, name=info.name or ref)
