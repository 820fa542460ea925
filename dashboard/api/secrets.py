"""Team secrets: names come back, values never do (write-only, encrypted at rest)."""

from __future__ import annotations

from datetime import datetime

from ninja import Field, Router, Schema

from runtime.models import Secret
from runtime.services import secrets as secret_svc

from .auth import AuthedRequest
from .blocking import blocking
from .schemas import StrictIn, errors

router = Router(tags=["secrets"])


class SecretIn(StrictIn):
    name: str = Field(
        min_length=1,
        max_length=128,
        description="becomes the environment variable's name in sandboxes that ask for it: letters, digits "
        "and _, not starting with a digit",
    )
    value: str = Field(min_length=1, description="stored encrypted; never shown again (at most 64 KiB)")


class SecretValueIn(StrictIn):
    value: str = Field(min_length=1, description="at most 64 KiB")


class SecretOut(Schema):
    name: str
    created_by: str | None
    created_at: datetime
    updated_at: datetime

    @staticmethod
    def resolve_created_by(obj: Secret) -> str | None:
        return obj.created_by.get_username() if obj.created_by else None


@router.get("", response=list[SecretOut])
async def list_secrets(request: AuthedRequest):
    """The team's secrets: names and dates only."""
    return await blocking(lambda: list(secret_svc.secrets_for_team(team=request.auth.team)))()


@router.post("", response={201: SecretOut, **errors(409)})
async def create_secret(request: AuthedRequest, payload: SecretIn):
    """Admins: a new secret. Give it to a sandbox with `"secrets": ["NAME"]` at create."""
    return 201, await blocking(
        lambda: secret_svc.secret_create(team=request.auth.team, name=payload.name, value=payload.value,
                                         user=request.auth.user)
    )()  # fmt: skip


@router.put("/{name}", response=SecretOut)
async def replace_secret(request: AuthedRequest, name: str, payload: SecretValueIn):
    """Admins: a new value (sandboxes started from now on get it)."""
    return await blocking(
        lambda: secret_svc.secret_replace(team=request.auth.team, name=name, value=payload.value)
    )()


@router.delete("/{name}", response={204: None})
async def delete_secret(request: AuthedRequest, name: str):
    """Admins: delete it (running sandboxes keep what they were given at start)."""
    await blocking(lambda: secret_svc.secret_delete(team=request.auth.team, name=name))()
    return 204, None
