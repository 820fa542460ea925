"""Who E2B's calls act as in a sandbox: the image's own user (its config's ``User``), as E2B's
templates run as theirs, unless a call names one. Commands run as that user; files written
through envd are handed to it, and relative paths are under its home."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from runtime.errors import ServiceError
from runtime.models import Image
from runtime.services import sandbox_io as io_svc

from .protocol import Caller

log = logging.getLogger(__name__)

ROOT_HOME = "/root"


@dataclass(frozen=True)
class Identity:
    name: str
    uid: int
    gid: int
    home: str


_IMAGE_USER: dict[tuple[str, str], str] = {}  # (image name, digest) -> its config's user ("": root)
_IDENTITY: dict[str, Identity | None] = {}  # sandbox id -> its image user's passwd entry (None: root)
# The image user's passwd entry, by name or uid: "name:uid:gid:home", or exit 3.
_LOOKUP = (
    "while IFS=: read -r n _ id g _ h _; do "
    'if [ "$n" = "$1" ] || [ "$id" = "$1" ]; then printf "%s:%s:%s:%s" "$n" "$id" "$g" "$h"; exit 0; fi; '
    "done < /etc/passwd; exit 3"
)


def image_user(caller: Caller) -> str:
    """The user the sandbox's image says it runs as (OCI ``config.User``: a name or uid, before
    any ``:group``), "" for root; read once per image name and digest (its config is the
    digest's: a name registered again at another digest is another key)."""
    sandbox = caller.sandbox
    key = (sandbox.image, sandbox.image_digest)
    if (user := _IMAGE_USER.get(key)) is None:
        config = (
            Image.objects.filter(name=sandbox.image, digest=sandbox.image_digest)
            .values_list("config", flat=True)
            .first()
            or Image.objects.filter(digest=sandbox.image_digest).values_list("config", flat=True).first()
            or {}
        )
        user = str(config.get("user") or "").split(":", 1)[0].strip() if isinstance(config, dict) else ""
        user = "" if user in ("root", "0") else user
        if len(_IMAGE_USER) > 10_000:
            _IMAGE_USER.clear()
        _IMAGE_USER[key] = user
    return user


def identity(caller: Caller) -> Identity | None:
    """The image user's entry in the sandbox's /etc/passwd (looked up once per sandbox), or None
    for root: an image that runs as root, or one whose user the sandbox does not have (a bare
    uid with no entry, as some images set), which then runs as root, as before it said."""
    user = image_user(caller)
    if not user:
        return None
    sid = caller.sandbox.id
    if sid in _IDENTITY:
        return _IDENTITY[sid]
    try:
        r = io_svc.sandbox_exec(
            sandbox=caller.sandbox, cmd=["/bin/sh", "-c", _LOOKUP, "sh", user], timeout_s=30
        ).result
    except ServiceError as exc:  # not an answer: asked again at the next call
        log.warning("sandbox %s: its image's user %r could not be looked up: %s", sid, user, exc.message)
        return None
    found: Identity | None = None
    if r.exit_code == 0:
        try:
            name, uid, gid, home = bytes(r.stdout).decode(errors="replace").split(":", 3)
            found = Identity(name, int(uid), int(gid), home or "/") if int(uid) != 0 else None
        except ValueError:
            log.warning("sandbox %s: the passwd entry of %r is not one: %r", sid, user, bytes(r.stdout)[:200])
    elif r.exit_code == 3:
        log.warning("sandbox %s: its image's user %r is not in its /etc/passwd; it runs as root", sid, user)
    else:
        return None
    if len(_IDENTITY) > 10_000:
        _IDENTITY.clear()
    _IDENTITY[sid] = found
    return found


def known_default_user(caller: Caller) -> str | None:
    """:func:`default_user` when it is known already (no query, no command: for the async path),
    else None."""
    sandbox = caller.sandbox
    user = _IMAGE_USER.get((sandbox.image, sandbox.image_digest))
    if user is None or not user:
        return user
    if sandbox.id not in _IDENTITY:
        return None
    found = _IDENTITY[sandbox.id]
    return found.name if found is not None else ""


def default_user(caller: Caller) -> str:
    """The user a call that names none acts as ("" for root)."""
    found = identity(caller)
    return found.name if found is not None else ""


def home(caller: Caller) -> str:
    """Where a relative path of a call that names no user is: the image user's home."""
    found = identity(caller) if not caller.user else None
    return found.home if found is not None else ROOT_HOME


def hand_over(caller: Caller, paths: list[str]) -> None:
    """Give what a call that names no user wrote (files, a directory) to the image's user, as
    E2B's envd writes them as it; root's when the image runs as root."""
    found = identity(caller) if not caller.user else None
    if found is None or not paths:
        return
    r = io_svc.sandbox_exec(sandbox=caller.sandbox, cmd=["chown", f"{found.uid}:{found.gid}", "--", *paths],
                            timeout_s=60).result  # fmt: skip
    if r.exit_code != 0:
        log.warning(
            "sandbox %s: chown to %s failed: %s", caller.sandbox.id, found.name, bytes(r.stderr)[:300]
        )
