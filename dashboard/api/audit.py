"""The audit log: admins read and export their team's; site administrators anyone's."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.http import HttpRequest, StreamingHttpResponse
from ninja import Field, Query, Router, Schema

from runtime.errors import Forbidden, InvalidValue
from runtime.services import audit as audit_svc
from runtime.services import auth as auth_svc
from runtime.services.usage import parse_range

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
    outcome: str = Field("", description="ok, refused or error")
    target: str = Field("", description="part of the target")
    via: str = Field("", description="api, dashboard, cli or system")
    from_: str | None = Field(None, alias="from")
    to: str | None = None
    team_id: int | None = Field(None, description="site administrators: another team; 0 for every team")
    before_id: int | None = Field(None, description="the next page: the last id of this one")
    limit: int = Field(100, ge=1, le=1000)
    format: str = Field("json", description="json or csv (csv: every matching event, streamed)")


@router.get("", response=list[AuditOut])
async def list_audit(request: HttpRequest, q: Query[AuditQuery]):
    """Admins: the team's audit events, newest first, filtered; `format=csv` exports them."""

    def read() -> Any:
        caller = request.auth  # type: ignore[attr-defined]
        team = caller.team
        if q.team_id is not None and q.team_id != caller.team_id:
            if not caller.user.is_staff:
                raise Forbidden("only site administrators read another team's audit log")
            team = None if q.team_id == 0 else auth_svc.team_for_caller(caller=caller, team_id=q.team_id)
        since = until = None
        if q.from_ or q.to:
            since, until = parse_range(q.from_, q.to)
        if q.format not in ("json", "csv"):
            raise InvalidValue(f"format is json or csv, got {q.format!r}")
        rows = audit_svc.events(team=team, action=q.action, actor=q.actor, outcome=q.outcome, target=q.target,
                                via=q.via, since=since, until=until, before_id=q.before_id)  # fmt: skip
        return rows if q.format == "csv" else list(rows[: q.limit])

    rows = await blocking(read)()
    if q.format == "csv":
        response = StreamingHttpResponse(audit_svc.as_csv(rows), content_type="text/csv; charset=utf-8")
        response["Content-Disposition"] = 'attachment; filename="hangar-audit.csv"'
        return response
    return rows
