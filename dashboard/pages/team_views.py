"""Team pages: members and invitations, API tokens, secrets, quotas and budget (the Team
page), usage with charts and CSV, the audit log, and accepting an invitation.

Each action goes through the same services as the API, with the signed-in user's role in the
current team standing where a token's would (:class:`SessionCaller`), so the rules are the same
ones; what a role may not do is refused by the service, and the page says why.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import get_user_model, login
from django.contrib.auth.decorators import login_required
from django.contrib.auth.models import User
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBase, HttpResponseForbidden
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods

from runtime.errors import Forbidden, InvalidValue, ServiceError
from runtime.models import Membership, Team
from runtime.services import audit as audit_svc
from runtime.services import auth as auth_svc
from runtime.services import quotas as quota_svc
from runtime.services import secrets as secret_svc
from runtime.services import usage as usage_svc

from ..streaming import audit_csv_response
from .charts import Series, bar_chart
from .teams import SESSION_KEY, SignedInRequest
from .views import TeamContext, render_page, team_context

log = logging.getLogger(__name__)
RANGES = [(7, "7 days"), (30, "30 days"), (90, "90 days")]
AUDIT_PAGE = 100


@dataclass
class SessionCaller:
    """The signed-in user in their current team, shaped like an API token for the services."""

    user: User
    team: Team
    effective_role: str

    @property
    def team_id(self) -> int:
        return self.team.id

    @property
    def user_id(self) -> int:
        return self.user.pk


def _caller(tc: TeamContext, request: SignedInRequest) -> SessionCaller:
    if tc.membership is None:
        raise Http404("you are not in a team")
    return SessionCaller(user=request.user, team=tc.membership.team, effective_role=tc.membership.role)


def _is_admin(tc: TeamContext) -> bool:
    return tc.membership is not None and auth_svc.role_at_least(tc.membership.role, "admin")


def _int(value: str, name: str) -> int:
    if not ((value or "").strip().isascii() and (value or "").strip().isdigit()):
        raise InvalidValue(f"{name} must be a whole number, got {value!r}")
    return int(value)


def _number(value: str, name: str) -> float | None:
    value = (value or "").strip()
    if not value:
        return None
    try:
        number = float(value)
    except ValueError:
        raise InvalidValue(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(number) or number > 1e12:
        raise InvalidValue(f"{name} must be a finite number, got {value!r}")
    return number


# -- the Team page ----------------------------------------------------------------------------


def _team_action(request: SignedInRequest, tc: TeamContext, caller: SessionCaller) -> str:
    """Do the posted action; returns the message to show (a ServiceError says what failed)."""
    team, post, action = caller.team, request.POST, request.POST.get("action", "")
    if action == "member_add":
        m = auth_svc.member_add(caller=caller, team=team, username=post.get("username", "").strip(),
                                role=post.get("role", "member"))  # fmt: skip
        return f"{m.user.get_username()} added as {m.role}."
    if action == "member_role":
        m = auth_svc.member_set_role(caller=caller, team=team, username=post.get("username", ""),
                                     role=post.get("role", ""))  # fmt: skip
        return f"{post.get('username')} is now {m.role}."
    if action == "member_remove":
        username = post.get("username", "")
        auth_svc.member_remove(caller=caller, team=team, username=username)
        return "You left the team." if username == request.user.get_username() else f"{username} removed."
    if action == "invite":
        days = _number(post.get("days", ""), "days") or 7
        issued = auth_svc.invitation_create(inviter_role=caller.effective_role, user=request.user, team=team,
                                            role=post.get("role", "member"), expires_in_s=int(days * 86400))  # fmt: skip
        # Shown once, on the next page (kept in the session only until then).
        request.session["hangar_new_invite"] = request.build_absolute_uri(
            reverse("invitation", args=[issued.raw])
        )
        return (
            f"Invitation created for a new {issued.invitation.role}: copy the link below, it is shown once."
        )
    if action == "token_create":
        life_days = _number(post.get("days", ""), "days")
        scopes = [s.strip() for s in post.get("scopes", "").replace(",", " ").split() if s.strip()]
        minted = auth_svc.token_create(user=request.user, team=team, name=post.get("name", "").strip(),
                                       role=post.get("role") or caller.effective_role, scopes=scopes,
                                       expires_in_s=int(life_days * 86400) if life_days else None)  # fmt: skip
        request.session["hangar_new_token"] = minted.raw
        return "Token created: copy it now, it is shown once."
    if action == "token_revoke":
        auth_svc.token_revoke(caller=caller, token_id=_int(post.get("token", ""), "token"))
        return "Token revoked."
    if not _is_admin(tc):
        raise Forbidden(f"only admins and owners change this; you are {caller.effective_role}")
    if action == "invite_revoke":
        auth_svc.invitation_revoke(team=team, invitation_id=_int(post.get("invitation", ""), "invitation"))
        return "Invitation revoked."
    if action == "secret_create":
        secret = secret_svc.secret_create(team=team, name=post.get("name", "").strip(), value=post.get("value", ""),
                                          user=request.user)  # fmt: skip
        return f"Secret {secret.name} saved. Its value will not be shown again."
    if action == "secret_replace":
        secret = secret_svc.secret_replace(team=team, name=post.get("name", ""), value=post.get("value", ""))
        return f"Secret {secret.name} has a new value."
    if action == "secret_delete":
        secret_svc.secret_delete(team=team, name=post.get("name", ""))
        return f"Secret {post.get('name')} deleted."
    if action == "quotas":
        values = {key: _number(post.get(key, ""), key) for key in quota_svc.QUOTAS}
        quota_svc.limits_set(
            team=team, values=values, role=caller.effective_role, staff=request.user.is_staff
        )
        return "Quotas saved."
    if action == "budget":
        usage_svc.budget_set(team=team, amount=_number(post.get("amount", ""), "budget"),
                             enforced=post.get("enforced") == "on")  # fmt: skip
        return "Budget saved."
    raise InvalidValue(f"unknown action {action!r}")


@login_required
@require_http_methods(["GET", "POST"])
def team_page(request: SignedInRequest) -> HttpResponse:
    """The current team: members, invitations, your tokens, secrets, quotas and budget."""
    tc = team_context(request)
    if tc.membership is None:
        raise Http404("you are not in a team")
    caller = _caller(tc, request)
    error, status = "", 200
    if request.method == "POST":
        try:
            messages.success(request, _team_action(request, tc, caller))
        except ServiceError as exc:
            error, status = exc.message, exc.status_code
        else:
            return redirect(reverse("team") + "#" + request.POST.get("section", ""))
        tc = team_context(request)  # the role may have changed (left the team…)
        if tc.membership is None:
            return redirect("overview")
        caller = _caller(tc, request)
    team = caller.team
    admin = _is_admin(tc)
    context = {
        "section": "team",
        "error": error,
        "admin": admin,
        "roles": auth_svc.ROLES,
        "scopes": auth_svc.SCOPES,
        "members": Membership.objects.filter(team=team).select_related("user").order_by("user__username"),
        "invitations": auth_svc.invitations_open(team=team) if admin else [],
        "new_invite": request.session.pop("hangar_new_invite", None),
        "tokens": auth_svc.tokens_visible(caller=caller),
        "new_token": request.session.pop("hangar_new_token", None),
        "secrets": secret_svc.secrets_for_team(team=team),
        "quotas": quota_svc.report(team),
        "budget": usage_svc.budget_of(team),
        "now": timezone.now(),
    }
    return render_page(request, "hangar/team.html", context, tc, status=status)


# -- usage ------------------------------------------------------------------------------------


def _usage_teams(request: HttpRequest, tc: TeamContext) -> list[Team]:
    if request.user.is_staff:
        return list(Team.objects.order_by("name"))
    if _is_admin(tc):
        return [tc.membership.team]  # type: ignore[union-attr]
    return []


@login_required
@require_GET
def usage_page(request: HttpRequest) -> HttpResponse:
    """A chart per team (a site administrator sees every team; a team admin, theirs)."""
    tc = team_context(request)
    teams = _usage_teams(request, tc)
    if not teams:
        return HttpResponseForbidden("Usage is for a team's admins and owners.")
    try:
        days = int(request.GET.get("days", "30"))
    except ValueError:
        days = 30
    days = days if days in dict(RANGES) else 30
    end = timezone.now()
    start = (end - timedelta(days=days - 1)).replace(hour=0, minute=0, second=0, microsecond=0)
    charts = []
    for team in teams:
        rows = usage_svc.daily(team, start, end)
        day_list = [r["day"] for r in rows]
        totals = {m: sum(r[m] for r in rows) for m in (*usage_svc.METRICS, "cost")}
        compute = bar_chart(day_list, [
            Series("vCPU-hours", "", [r["vcpu_seconds"] / 3600 for r in rows], "s-cpu"),
            Series("memory GB-hours", "", [r["memory_gb_seconds"] / 3600 for r in rows], "s-mem"),
        ], title=f"{team.name}: compute per day")  # fmt: skip
        storage = bar_chart(day_list, [Series("storage GB-hours", "", [r["storage_gb_hours"] for r in rows], "s-disk")],
                            title=f"{team.name}: storage per day", height=120)  # fmt: skip
        charts.append({"team": team, "compute": compute, "storage": storage, "totals": totals,
                       "budget": usage_svc.budget_of(team)})  # fmt: skip
    context = {"section": "usage", "charts": charts, "days": days, "ranges": RANGES, "start": start, "end": end,
               "currency": settings.HANGAR_CURRENCY}  # fmt: skip
    return render_page(request, "hangar/usage.html", context, tc)


@login_required
@require_GET
def usage_csv(request: HttpRequest, team_id: int) -> HttpResponse:
    tc = team_context(request)
    team = next((t for t in _usage_teams(request, tc) if t.id == team_id), None)
    if team is None:
        raise Http404("no such team that you can see")
    try:
        start, end = usage_svc.parse_range(request.GET.get("from"), request.GET.get("to"))
    except ServiceError as exc:
        return HttpResponse(exc.message, status=exc.status_code, content_type="text/plain")
    response = HttpResponse(usage_svc.report_csv(usage_svc.report(team, start, end)), content_type="text/csv")
    response["Content-Disposition"] = f'attachment; filename="hangar-usage-{team.name}.csv"'
    return response


# -- the audit log ----------------------------------------------------------------------------


def _audit_rows(request: HttpRequest, tc: TeamContext) -> Any:
    """The filtered events the user may read: a site administrator's, every team's (or one
    team's with ``team``); a team admin's, their team's."""
    q = request.GET
    team: Team | None
    if request.user.is_staff:
        team = (
            Team.objects.filter(id=q.get("team", "")).first()
            if q.get("team", "").isascii() and q.get("team", "").isdigit()
            else None
        )
    elif _is_admin(tc):
        team = tc.membership.team  # type: ignore[union-attr]
    else:
        raise PermissionError
    since = until = None
    if q.get("from") or q.get("to"):
        since, until = usage_svc.parse_range(q.get("from") or None, q.get("to") or None)
    before = q.get("before", "")
    return audit_svc.events(team=team, action=q.get("action", "").strip(), actor=q.get("actor", "").strip(),
                            outcome=q.get("outcome", ""), target=q.get("target", "").strip(), via=q.get("via", ""),
                            since=since, until=until, before_id=int(before) if before.isascii() and before.isdigit() else None)  # fmt: skip


@login_required
@require_GET
def audit_page(request: HttpRequest) -> HttpResponse:
    tc = team_context(request)
    error = ""
    try:
        rows = _audit_rows(request, tc)
        page = list(rows[: AUDIT_PAGE + 1])
    except PermissionError:
        return HttpResponseForbidden("The audit log is for a team's admins and owners.")
    except ServiceError as exc:
        error, page = exc.message, []
    more = len(page) > AUDIT_PAGE
    page = page[:AUDIT_PAGE]
    query = request.GET.copy()
    query.pop("before", None)
    next_query = None
    if more:
        query["before"] = str(page[-1].id)
        next_query = query.urlencode()
    export = request.GET.copy()
    export.pop("before", None)
    context = {"section": "audit", "events": page, "error": error, "next_query": next_query,
               "export_query": export.urlencode(), "f": request.GET,
               "teams": Team.objects.order_by("name") if request.user.is_staff else []}  # fmt: skip
    return render_page(request, "hangar/audit.html", context, tc)


@login_required
@require_GET
def audit_csv(request: HttpRequest) -> HttpResponseBase:
    tc = team_context(request)
    try:
        rows = _audit_rows(request, tc)
        first = audit_svc.csv_page(rows)
    except PermissionError:
        return HttpResponseForbidden("The audit log is for a team's admins and owners.")
    except ServiceError as exc:
        return HttpResponse(exc.message, status=exc.status_code, content_type="text/plain")
    return audit_csv_response(rows, first)


# -- invitations ------------------------------------------------------------------------------


@require_http_methods(["GET", "POST"])
def invitation(request: HttpRequest, code: str) -> HttpResponse:
    """Accept an invitation: signed in, join with one click; not signed in, sign in first (the
    link comes back here) or make an account here and join at once."""
    try:
        inv = auth_svc.invitation_lookup(code)
    except ServiceError as exc:
        return render(request, "hangar/invitation.html", {"invalid": exc.message}, status=404)
    error = ""
    if request.method == "POST":
        try:
            if request.user.is_authenticated:
                user = request.user
            else:
                password = request.POST.get("password", "")
                if len(password) < 8:
                    raise InvalidValue("choose a password of at least 8 characters")
                if password != request.POST.get("password2", ""):
                    raise InvalidValue("the two passwords differ")
                user, _ = auth_svc.user_create(
                    username=request.POST.get("username", "").strip(), password=password
                )
                login(request, user, backend="django.contrib.auth.backends.ModelBackend")
            m = auth_svc.invitation_accept(raw=code, user=user)
        except ServiceError as exc:
            error = exc.message
        else:
            request.session[SESSION_KEY] = m.team_id
            messages.success(request, f"You joined team {m.team.name} as {m.role}.")
            return redirect("sandboxes")
    already = (
        request.user.is_authenticated and Membership.objects.filter(user=request.user, team=inv.team).exists()
    )
    return render(request, "hangar/invitation.html", {
        "inv": inv, "error": error, "already": already, "login_url": f"{reverse('login')}?next={request.path}",
        "users_exist": get_user_model().objects.exists(),
    }, status=422 if error else 200)  # fmt: skip
