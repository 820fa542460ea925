"""Team secrets: encrypted at rest, write-only, given to sandboxes as environment variables.

Values are encrypted with Fernet (``cryptography``: AES-128-CBC with an HMAC-SHA256, a
timestamp and a random IV per value) under the keys in ``HANGAR_SECRETS_KEYS``, newest first;
without that setting one key is generated once under the data directory (a single machine's
default: a cluster sets the same keys on every node). The database holds only ciphertext, and
no API, page, log line or event shows a value after it was written.

Key rotation: put a new key first in ``HANGAR_SECRETS_KEYS`` (keep the old one after it; both
decrypt), run ``hangar secrets rotate`` (every value re-encrypted under the new key), then drop
the old key.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import QuerySet

from ..errors import Conflict, InvalidValue, NotFound
from ..models import Harness, Sandbox, Secret, Team
from . import audit

log = logging.getLogger(__name__)
NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
MAX_VALUE_BYTES = 64 * 1024


def _key_file() -> Path:
    return Path(settings.DATA_DIR) / "secrets_key"


@functools.cache
def _fernet() -> MultiFernet:
    keys = list(settings.HANGAR_SECRETS_KEYS)
    if not keys:
        keys = [_generated_key(_key_file())]
    try:
        return MultiFernet([Fernet(k.encode()) for k in keys])
    except ValueError as exc:
        raise RuntimeError(f"HANGAR_SECRETS_KEYS holds a key that is not a Fernet key: {exc}") from None


def _generated_key(path: Path) -> str:
    """The key kept at ``path``, made on first use: created 0600 in one step, and by one
    process only (another that loses the race reads the winner's)."""
    for _ in range(50):
        try:
            key = path.read_text().strip()
            if key:
                return key
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                continue
            key = Fernet.generate_key().decode()
            with os.fdopen(fd, "w") as f:
                f.write(key)
            return key
        time.sleep(0.01)  # being written by the process that made it
    raise RuntimeError(f"{path} is empty: remove it, or set HANGAR_SECRETS_KEYS")


def encrypt(value: str) -> bytes:
    return _fernet().encrypt(value.encode())


def decrypt(ciphertext: bytes | memoryview) -> str:
    return _fernet().decrypt(bytes(ciphertext)).decode()


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise InvalidValue(
            f"invalid secret name {name!r}: it becomes an environment variable, so 1-128 of letters, "
            "digits and _, not starting with a digit"
        )
    return name


def _check_value(value: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidValue("a secret's value is a non-empty string")
    if "\0" in value:
        raise InvalidValue("a secret's value cannot contain a NUL byte (it becomes an environment variable)")
    if len(value.encode()) > MAX_VALUE_BYTES:
        raise InvalidValue(f"a secret's value is limited to {MAX_VALUE_BYTES} bytes")
    return value


def secrets_for_team(*, team: Team) -> QuerySet[Secret]:
    return Secret.objects.filter(team=team).select_related("created_by").order_by("name")


def secret_create(*, team: Team, name: str, value: str, user=None) -> Secret:
    _check_name(name)
    _check_value(value)
    try:
        with transaction.atomic():
            secret = Secret.objects.create(
                team=team, name=name, ciphertext=encrypt(value),
                created_by=user if user is not None and getattr(user, "is_authenticated", False) else None,
            )  # fmt: skip
            audit.record("secret.create", team=team, target=name)
            return secret
    except IntegrityError:
        raise Conflict(
            f"team {team.name} already has a secret named {name!r}; PUT a new value to replace it"
        ) from None


def secret_get(*, team: Team, name: str) -> Secret:
    secret = Secret.objects.filter(team=team, name=name).select_related("created_by").first()
    if secret is None:
        raise NotFound(f"team {team.name} has no secret named {name!r}")
    return secret


def secret_replace(*, team: Team, name: str, value: str) -> Secret:
    """A new value for an existing secret (sandboxes started from now on get it)."""
    _check_value(value)
    secret = secret_get(team=team, name=name)
    secret.ciphertext = encrypt(value)
    secret.save(update_fields=["ciphertext", "updated_at"])
    audit.record("secret.replace", team=team, target=name)
    return secret


def secret_delete(*, team: Team, name: str) -> None:
    secret_get(team=team, name=name).delete()
    audit.record("secret.delete", team=team, target=name)


def validate_names(*, team: Team, names: list[str], env: dict[str, str]) -> list[str]:
    """The secrets a new sandbox asks for: each must exist in the team and not clash with
    ``env``. Returns them sorted and without repeats."""
    if not isinstance(names, list):
        raise InvalidValue("secrets is a list of the team's secret names")
    names = sorted(set(names))
    for name in names:
        _check_name(name)
    clash = [n for n in names if n in env]
    if clash:
        raise InvalidValue(f"{', '.join(clash)} given both in env and in secrets: keep one")
    if names:
        known = set(Secret.objects.filter(team=team, name__in=names).values_list("name", flat=True))
        missing = [n for n in names if n not in known]
        if missing:
            raise InvalidValue(f"team {team.name} has no secret named {', '.join(map(repr, missing))}")
    return names


def env_for(sandbox: Sandbox) -> dict[str, str]:
    """The secret environment variables of a sandbox, decrypted (for its node, never stored).
    A secret deleted since the sandbox was created is left out."""
    out = harness_env(sandbox)
    if not sandbox.secrets:
        return out
    for name, ciphertext in Secret.objects.filter(
        team_id=sandbox.team_id, name__in=sandbox.secrets
    ).values_list("name", "ciphertext"):
        try:
            out[name] = decrypt(ciphertext)
        except InvalidToken:
            # Never the value, nor the ciphertext: only which secret and what to do.
            log.error("secret %s of team %s cannot be decrypted with the configured keys "
                      "(HANGAR_SECRETS_KEYS lost its key?)", name, sandbox.team_id)  # fmt: skip
    return out


def harness_env(sandbox: Sandbox) -> dict[str, str]:
    """The secret variables of a harness's sandbox (decrypted for its node, never stored in the
    clear): the harness's API token, and the same as OTLP's authorization header. Only the
    harness whose sandbox this is (``Harness.sandbox``), of its team, counts."""
    ct = (
        Harness.objects.filter(sandbox_id=sandbox.id, team_id=sandbox.team_id, deleted_at__isnull=True)
        .values_list("api_token_ciphertext", flat=True)
        .first()
    )
    if not ct:
        return {}
    try:
        raw = decrypt(bytes(ct))
    except Exception:
        log.error("the API token of the harness of sandbox %s cannot be decrypted with the configured keys",
                  sandbox.id)  # fmt: skip
        return {}
    return {"HANGAR_API_TOKEN": raw, "OTEL_EXPORTER_OTLP_HEADERS": f"Authorization=Bearer {raw}"}


def secrets_rotate() -> int:
    """Re-encrypt every value under the first key; returns how many were rewritten."""
    f = _fernet()
    n = 0
    for secret in Secret.objects.only("id", "ciphertext").iterator():
        rotated = f.rotate(bytes(secret.ciphertext))
        Secret.objects.filter(id=secret.id).update(ciphertext=rotated)
        n += 1
    for hid, ct in Harness.objects.filter(api_token_ciphertext__isnull=False).values_list(
        "id", "api_token_ciphertext"
    ):
        assert ct is not None  # filtered above
        Harness.objects.filter(id=hid).update(api_token_ciphertext=f.rotate(bytes(ct)))
        n += 1
    return n


# Values shorter than this are not masked out of output and telemetry: replacing every "a" or
# "42" would garble everything and hide nothing (such a value is guessed at once anyway).
MASK_MIN_CHARS = 4


def team_values(*, team_id: int) -> list[str]:
    """The team's secrets' values, decrypted: what is masked out of what the team's agents and
    sandboxes report (their telemetry). Never logged, never stored."""
    out = []
    for name, ciphertext in Secret.objects.filter(team_id=team_id).values_list("name", "ciphertext"):
        try:
            out.append(decrypt(ciphertext))
        except InvalidToken:
            log.error("secret %s of team %s cannot be decrypted with the configured keys", name, team_id)
    return out
