"""Images as the control plane sees them: names that point at digests held by nodes."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from django.db import transaction
from django.utils import timezone
from kombu.exceptions import OperationalError

from .. import enqueue, notify
from ..errors import BadRequest, Forbidden, InvalidValue, NotFound, ServiceError
from ..host.images.base import NAME_RE, ImageError, ImageInfo, validate_name
from ..host.images.build import MINIMAL_PACKAGES
from ..models import Image, ImageJob, Node
from ..node.local import image_store, local_node_name, node_queue

logger = logging.getLogger(__name__)


def image_resolve(ref: str) -> Image:
    """The image row for a name (or digest); a 400 naming the images there are otherwise (and,
    for one Hangar builds, how to build it)."""
    image = Image.objects.filter(name=ref).first() or Image.objects.filter(digest=ref).first()
    if image is None:
        names = sorted(Image.objects.values_list("name", flat=True))
        known = ", ".join(names) if names else "none yet (run `hangar image build busybox`)"
        how = f"; {image_build_hint(ref)}" if ref in BUILDABLE else ""
        raise BadRequest(f"unknown image {ref!r}; images available: {known}{how}", images=names)
    return image


def image_build_hint(kind: str) -> str:
    """How a missing image that Hangar builds itself comes to be, and how long it takes."""
    return (
        f"{kind} is not built on this Hangar yet: an administrator builds it with "
        f"`hangar image build {kind}` ({BUILD_TIMES[kind]}) or from the Images page"
    )


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
    elif kind == "minimal":
        info = store.build_base(name="minimal", progress=progress, packages_list=MINIMAL_PACKAGES)
    else:
        raise BadRequest(f"unknown image kind {kind!r}; buildable: {', '.join(BUILDABLE)}")
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


# -- jobs: builds and pulls with their progress -------------------------------------------------

JOB_LOG_BYTES = 64 * 1024  # the tail of a job's progress kept on its row
JOB_FLUSH_S = 0.3  # progress reaches the row (and the page) at most this often
BUILDABLE = ("busybox", "base", "minimal")
# How long each build takes (base: 73 s measured on a 2-CPU machine with a nearby Debian
# mirror, most of it installing packages; a distant mirror adds their download).
BUILD_TIMES = {"busybox": "seconds", "base": "a minute or two", "minimal": "under a minute"}


def image_job_start(
    *, kind: str, ref: str, user: Any, name: str = "", tls_verify: bool = True, node_name: str | None = None
) -> ImageJob:
    """Queue a build (``ref`` busybox or base) or a registry pull (``ref`` a reference) on a
    node: this one's by default. Images are shared by every team, so only staff may."""
    if not getattr(user, "is_staff", False):
        raise Forbidden("only Hangar's administrators (staff users) can build or pull images")
    ref = (ref or "").strip().removeprefix("docker://")
    name = (name or "").strip()
    if kind == ImageJob.Kind.BUILD:
        if ref not in BUILDABLE:
            raise InvalidValue(f"unknown image kind {ref!r}; buildable: {', '.join(BUILDABLE)}")
    elif kind == ImageJob.Kind.PULL:
        if not ref or ref.startswith("-") or any(c.isspace() for c in ref) or len(ref) > 300:
            raise InvalidValue(f"invalid image reference {ref!r}: e.g. registry.example.com/team/app:1.2")
        if not name and not NAME_RE.fullmatch(ref):
            raise InvalidValue(f"{ref!r} is not usable as an image name here; give it a name")
    else:
        raise InvalidValue(f"unknown job kind {kind!r}: build or pull")
    if name:
        try:
            validate_name(name)
        except ImageError as exc:
            raise InvalidValue(str(exc)) from None
    node = Node.objects.filter(name=node_name or local_node_name()).first()
    if node is None:
        raise NotFound(f"no node named {node_name or local_node_name()!r}")
    job = ImageJob.objects.create(
        kind=kind, ref=ref, name=name, tls_verify=tls_verify, node=node, created_by=user
    )
    transaction.on_commit(lambda: _enqueue_job(job.id, node.name))
    return job


def _enqueue_job(job_id: int, node_name: str) -> None:
    try:
        enqueue.send("image_job", [job_id], queue=node_queue(node_name), retry=True,
                     retry_policy=enqueue.RETRY_POLICY)  # fmt: skip
    except OperationalError as exc:
        _finish(job_id, error=f"the task queue is unreachable: {exc}")


def image_jobs_recent(*, limit: int = 20) -> list[ImageJob]:
    return list(ImageJob.objects.select_related("node", "image", "created_by")[:limit])


def image_build_in_progress(*, kind: str) -> ImageJob | None:
    """The newest build of ``kind`` still queued or running, if any."""
    return (
        ImageJob.objects.select_related("node", "image", "created_by")
        .filter(
            kind=ImageJob.Kind.BUILD, ref=kind, status__in=[ImageJob.Status.QUEUED, ImageJob.Status.RUNNING]
        )
        .first()
    )


def image_job_get(*, job_id: int) -> ImageJob:
    job = ImageJob.objects.select_related("node", "image", "created_by").filter(id=job_id).first()
    if job is None:
        raise NotFound(f"no image job {job_id}")
    return job


class _JobLog:
    """Collects a job's progress lines and writes the tail to its row now and then."""

    def __init__(self, job_id: int) -> None:
        self.job_id = job_id
        self.text = ""
        self.flushed_at = 0.0

    def __call__(self, line: str) -> None:
        self.text = (self.text + line.rstrip("\n") + "\n")[-JOB_LOG_BYTES:]
        if time.monotonic() - self.flushed_at >= JOB_FLUSH_S:
            self.flush()

    def flush(self) -> None:
        self.flushed_at = time.monotonic()
        ImageJob.objects.filter(id=self.job_id).update(log=self.text)
        notify.image_job_changed(self.job_id)


def image_job_run(*, job_id: int) -> None:
    """On the job's node: run it, writing progress to its row as it goes. Runs once: a
    duplicate delivery finds the job no longer queued."""
    now = timezone.now()
    if not ImageJob.objects.filter(id=job_id, status=ImageJob.Status.QUEUED).update(
        status=ImageJob.Status.RUNNING, started_at=now
    ):
        return
    job = ImageJob.objects.get(id=job_id)
    notify.image_job_changed(job_id)
    log = _JobLog(job_id)
    try:
        if job.kind == ImageJob.Kind.BUILD:
            image = image_build(kind=job.ref, progress=log)
        else:
            image = image_pull(ref=job.ref, name=job.name or None, tls_verify=job.tls_verify, progress=log)
    except (ImageError, ServiceError) as exc:
        log.flush()
        _finish(job_id, error=getattr(exc, "message", None) or str(exc))
    except Exception as exc:  # the row must always end
        logger.exception("image job %s failed", job_id)
        log.flush()
        _finish(job_id, error=f"internal error: {exc}")
    else:
        log.flush()
        _finish(job_id, image=image)


def _finish(job_id: int, *, error: str = "", image: Image | None = None) -> None:
    ImageJob.objects.filter(id=job_id, status__in=[ImageJob.Status.QUEUED, ImageJob.Status.RUNNING]).update(
        status=ImageJob.Status.FAILED if error else ImageJob.Status.SUCCEEDED,
        error=error, image=image, finished_at=timezone.now(),
    )  # fmt: skip
    notify.image_job_changed(job_id)
