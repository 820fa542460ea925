from __future__ import annotations

from datetime import datetime
from typing import Literal

from django.http import HttpRequest
from ninja import Router, Schema
from pydantic import Field

from runtime.models import Image, ImageJob
from runtime.services import images as image_svc

from .auth import AuthedRequest
from .schemas import StrictIn, errors

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


class BuildIn(StrictIn):
    kind: Literal["busybox", "base"]


class PullIn(StrictIn):
    ref: str = Field(
        min_length=1, max_length=300, description="registry reference, e.g. registry.example.com/team/app:1.2"
    )
    name: str = Field("", max_length=128, description="the image's name in Hangar (default: the reference)")
    insecure: bool = Field(False, description="plain HTTP or an unverified certificate")
    node: str | None = Field(
        None, min_length=1, max_length=100, description="the node to pull on (default: the API's own)"
    )


class ImageJobOut(Schema):
    id: int
    kind: str
    ref: str
    name: str
    node: str | None
    status: str
    log: str
    error: str
    image: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None

    @staticmethod
    def of(job: ImageJob) -> ImageJobOut:
        return ImageJobOut(
            id=job.id, kind=job.kind, ref=job.ref, name=job.name, node=job.node.name if job.node else None,
            status=job.status, log=job.log, error=job.error, image=job.image.name if job.image else None,
            created_at=job.created_at, started_at=job.started_at, finished_at=job.finished_at,
        )  # fmt: skip


@router.post("/build", response={202: ImageJobOut})
def build_image(request: AuthedRequest, payload: BuildIn):
    """Build busybox (seconds) or base (minutes) on this node; follow it at /images/jobs/{id}.
    Staff users only: images are shared by every team."""
    job = image_svc.image_job_start(kind=ImageJob.Kind.BUILD, ref=payload.kind, user=request.auth.user)
    return 202, ImageJobOut.of(job)


@router.post("/pull", response={202: ImageJobOut, **errors(404)})
def pull_image(request: AuthedRequest, payload: PullIn):
    """Pull an image from a registry onto a node; follow it at /images/jobs/{id}. Staff only."""
    job = image_svc.image_job_start(
        kind=ImageJob.Kind.PULL, ref=payload.ref, name=payload.name, tls_verify=not payload.insecure,
        node_name=payload.node, user=request.auth.user,
    )  # fmt: skip
    return 202, ImageJobOut.of(job)


@router.get("/jobs", response=list[ImageJobOut])
def list_image_jobs(request: HttpRequest):
    """The latest builds and pulls, newest first."""
    return [ImageJobOut.of(j) for j in image_svc.image_jobs_recent(limit=50)]


@router.get("/jobs/{job_id}", response=ImageJobOut)
def get_image_job(request: HttpRequest, job_id: int):
    """One build or pull: its status and the tail of its progress log."""
    return ImageJobOut.of(image_svc.image_job_get(job_id=job_id))
