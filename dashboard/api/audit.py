"""The audit log: admins read and export their team's; site administrators anyone's."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from ninja import Field, Query, Router, Schema

from runtime.errors import Forbidden
from runtime.models import Team
from runtime.services import audit as audit_svc
from runtime.services import auth as auth_svc
from runtime.services.usage import parse_range

from ..streaming import audit_csv_response
from .auth import AuthedRequest
from .blocking import blocking

router = Router(tags=["audit"])


class AuditOut(Schema):
    id: int
    created_at: datetime
    team: str = Field(alias="team_name")
    actor: str
    via: str
    token: str
    session: str
    ip: str
    action: str
    target: str
    outcome: str
    message: str
    data: dict[str, Any]


class AuditQuery(Schema):
    action: str = Field("", description="a prefix: sandbox. for every sandbox change")
    actor: str = ""
    outcome: Literal["", "ok", "refused", "error"] = ""
    target: str = Field("", description="part of the target")
    via: Literal["", "api", "dashboard", "cli", "ssh", "system"] = ""
    from_: str | None = Field(None, alias="from")
    to: str | None = None
    team_id: int | None = Field(None, ge=0, description="site administrators: another team; 0 for every team")
    before_id: int | None = Field(None, ge=1, description="the next page: the last id of this one")
    limit: int = Field(100, ge=1, le=1000)
    format: Literal["json", "csv"] = Field("json", description="csv: every matching event, streamed")


@router.get(
    "",
    response=list[AuditOut],
    openapi_extra={"responses": {200: {"content": {"text/csv": {"schema": {"type": "string"}}}}}},
)
async def list_audit(request: AuthedRequest, q: Query[AuditQuery]):
    """Admins: the team's audit events, newest first, filtered; `format=csv` exports them."""

    def read() -> Any:
        caller = request.auth
        team: Team | None = caller.team
        if q.team_id is not None and q.team_id != caller.team_id:
            if not caller.user.is_staff:
                raise Forbidden("only site administrators read another team's audit log")
            team = None if q.team_id == 0 else auth_svc.team_for_caller(caller=caller, team_id=q.team_id)
        since = until = None
        if q.from_ or q.to:
            since, until = parse_range(q.from_, q.to)
        rows = audit_svc.events(team=team, action=q.action, actor=q.actor, outcome=q.outcome, target=q.target,
                                via=q.via, since=since, until=until, before_id=q.before_id)  # fmt: skip
        return (rows, audit_svc.csv_page(rows)) if q.format == "csv" else list(rows[: q.limit])

    got = await blocking(read)()
    if q.format == "csv":
        return audit_csv_response(*got)
    return got
