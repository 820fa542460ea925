"""API tokens of the caller's team: list (with last use), create (shown once), revoke."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from ninja import Field, Router, Schema

from runtime.models import ApiToken
from runtime.services import auth as auth_svc

from .auth import AuthedRequest
from .blocking import blocking
from .schemas import StrictIn

router = Router(tags=["tokens"])


class TokenIn(StrictIn):
    name: str = Field("", max_length=100)
    role: Literal[tuple(auth_svc.ROLES)] | None = Field(  # type: ignore[valid-type]
        None, description="at most this token's (default: this token's)"
    )
    scopes: list[Literal[tuple(auth_svc.SCOPES)]] = Field(  # type: ignore[valid-type]
        [], description="none: all of them; within this token's"
    )
    expires_in_s: int | None = Field(
        None, ge=1, le=10 * 365 * 86400, description="the token stops working this long from now"
    )


class TokenOut(Schema):
    id: int
    name: str
    prefix: str = Field(description="its first characters, to tell tokens apart")
    user: str
    role: str
    scopes: list[str]
    created_at: datetime
    last_used_at: datetime | None
    expires_at: datetime | None
    revoked_at: datetime | None

    @staticmethod
    def resolve_user(obj: ApiToken | dict) -> str:
        user = obj["user"] if isinstance(obj, dict) else obj.user
        return user if isinstance(user, str) else user.get_username()


class TokenCreatedOut(TokenOut):
    token: str = Field(description="the token itself: shown this once, stored only hashed")


class CurrentTokenOut(TokenOut):
    team: str = Field(description="the team the token acts in")
    team_id: int
    effective_role: str = Field(description="the role it acts with now: the lower of its own and its user's")


@router.get("/current", response=CurrentTokenOut)
async def current_token(request: AuthedRequest):
    """The token this request carries: whose it is, its team, the role it acts with and its
    scopes. Any valid token may ask (`hangar login` checks a token with it)."""
    t = request.auth
    return {
        "id": t.id, "name": t.name, "prefix": t.prefix, "user": t.user.get_username(), "role": t.role,
        "scopes": t.scopes, "created_at": t.created_at, "last_used_at": t.last_used_at,
        "expires_at": t.expires_at, "revoked_at": t.revoked_at, "team": t.team.name, "team_id": t.team_id,
        "effective_role": t.effective_role,
    }  # fmt: skip


@router.get("", response=list[TokenOut])
async def list_tokens(request: AuthedRequest):
    """Your tokens in this team, newest first (an admin sees every token of the team)."""
    return await blocking(lambda: list(auth_svc.tokens_visible(caller=request.auth)))()


@router.post("", response={201: TokenCreatedOut})
async def create_token(request: AuthedRequest, payload: TokenIn):
    """A new token for you in this team, no stronger than the token that asks: its role, scopes
    and expiry (taken by default) at most this token's; more is a 403."""

    def create() -> dict:
        caller = request.auth
        issued = auth_svc.token_create(
            user=caller.user, team=caller.team, name=payload.name, expires_in_s=payload.expires_in_s,
            role=payload.role or caller.effective_role, scopes=payload.scopes, caller=caller,
        )  # fmt: skip
        t = issued.token
        return {
            "id": t.id, "name": t.name, "prefix": t.prefix, "user": t.user.get_username(), "role": t.role,
            "scopes": t.scopes, "created_at": t.created_at, "last_used_at": t.last_used_at,
            "expires_at": t.expires_at, "revoked_at": t.revoked_at, "token": issued.raw,
        }  # fmt: skip

    return 201, await blocking(create)()


@router.delete("/{token_id}", response={204: None})
async def revoke_token(request: AuthedRequest, token_id: int):
    """Revoke one of your tokens (an admin: any of the team's). It stops working at once."""
    await blocking(lambda: auth_svc.token_revoke(caller=request.auth, token_id=token_id))()
    return 204, None
