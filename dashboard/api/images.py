from __future__ import annotations

from datetime import datetime

from django.http import HttpRequest
from ninja import Router, Schema

from runtime.models import Image

router = Router(tags=["images"])


class ImageOut(Schema):
    name: str
    digest: str
    size_bytes: int
    source: str
    nodes: list[str]
    created_at: datetime
    updated_at: datetime


@router.get("", response=list[ImageOut])
def list_images(request: HttpRequest):
    """Images sandboxes can start from, and the nodes that hold each."""
    return [
        ImageOut(
            name=i.name,
            digest=i.digest,
            size_bytes=i.size_bytes,
            source=i.source,
            nodes=sorted(n.name for n in i.nodes.all()),
            created_at=i.created_at,
            updated_at=i.updated_at,
        )  # fmt: skip
        for i in Image.objects.prefetch_related("nodes").order_by("name")
    ]
