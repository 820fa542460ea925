"""Who may call which API endpoint: one rule per (method, path), checked for every request.

A rule names the scope a token needs (``sandboxes:read``…; a token without scopes has all) and
the least team role that may call it (``viewer`` < ``member`` < ``admin`` < ``owner``); the
caller's role is the lower of their role in the team and the role their token was issued
with. Site staff may call ``staff`` endpoints (images are shared by every team). An endpoint
with no rule is refused, and ``tests/reliability/test_authorization.py`` fails for it: adding an
endpoint means adding its rule here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from runtime.errors import Forbidden
from runtime.services.auth import ROLES, role_at_least, token_allows


@dataclass(frozen=True)
class Rule:
    scope: str
    role: str = "viewer"
    staff: bool = False  # site staff only, whatever the team role
    public: bool = False  # no token needed (the endpoint says auth=None)


def _read(resource: str) -> Rule:
    return Rule(f"{resource}:read", "viewer")


def _read_as(resource: str, role: str) -> Rule:
    return Rule(f"{resource}:read", role)


def _write(resource: str, role: str = "member") -> Rule:
    return Rule(f"{resource}:write", role)


# The scope of the few endpoints any valid token may call, whatever its scopes.
ANY_SCOPE = ""
SB = "/sandboxes/{sandbox_id}"
RULES: dict[tuple[str, str], Rule] = {
    ("POST", "/sandboxes"): _write("sandboxes"),
    ("GET", "/sandboxes"): _read("sandboxes"),
    ("GET", SB): _read("sandboxes"),
    ("DELETE", SB): _write("sandboxes"),
    ("POST", f"{SB}/exec"): _write("sandboxes"),
    ("POST", f"{SB}/keepalive"): _write("sandboxes"),
    ("POST", f"{SB}/pause"): _write("sandboxes"),
    ("POST", f"{SB}/resume"): _write("sandboxes"),
    ("POST", f"{SB}/stop"): _write("sandboxes"),
    ("PUT", f"{SB}/network"): _write("sandboxes"),
    ("GET", f"{SB}/ports"): _read("sandboxes"),
    ("POST", f"{SB}/ports"): _write("sandboxes"),
    ("DELETE", f"{SB}/ports/{{port}}"): _write("sandboxes"),
    ("PUT", f"{SB}/files"): _write("sandboxes"),
    ("GET", f"{SB}/files"): _read("sandboxes"),
    ("GET", f"{SB}/files/list"): _read("sandboxes"),
    ("GET", f"{SB}/stats"): _read("sandboxes"),
    ("GET", f"{SB}/events"): _read("sandboxes"),
    ("GET", f"{SB}/processes"): _read("sandboxes"),
    ("GET", f"{SB}/processes/{{process_id}}"): _read("sandboxes"),
    ("GET", f"{SB}/processes/{{process_id}}/output"): _read("sandboxes"),
    ("POST", f"{SB}/processes/{{process_id}}/stdin"): _write("sandboxes"),
    ("POST", f"{SB}/processes/{{process_id}}/signal"): _write("sandboxes"),
    ("POST", f"{SB}/terminals"): _write("sandboxes"),
    ("GET", f"{SB}/terminals"): _read("sandboxes"),
    ("DELETE", f"{SB}/terminals/{{terminal_id}}"): _write("sandboxes"),
    ("GET", "/images"): _read("images"),
    ("POST", "/images/build"): Rule("images:write", "member", staff=True),
    ("POST", "/images/pull"): Rule("images:write", "member", staff=True),
    ("GET", "/images/jobs"): _read("images"),
    ("GET", "/images/jobs/{job_id}"): _read("images"),
    ("POST", "/volumes"): _write("volumes"),
    ("GET", "/volumes"): _read("volumes"),
    ("GET", "/volumes/{volume}"): _read("volumes"),
    ("DELETE", "/volumes/{volume}"): _write("volumes"),
    ("POST", "/pools"): _write("pools"),
    ("GET", "/pools"): _read("pools"),
    ("GET", "/pools/{pool_id}"): _read("pools"),
    ("PATCH", "/pools/{pool_id}"): _write("pools"),
    ("DELETE", "/pools/{pool_id}"): _write("pools"),
    ("GET", "/tokens"): _read("tokens"),
    ("GET", "/tokens/current"): Rule(ANY_SCOPE),  # any valid token may say whose it is
    ("POST", "/tokens"): _write("tokens", "viewer"),  # a token of one's own, at most one's role
    ("DELETE", "/tokens/{token_id}"): _write("tokens", "viewer"),  # one's own; admins: any
    ("GET", "/health"): Rule("system:read", public=True),
    ("GET", "/teams"): _read("teams"),
    ("POST", "/teams"): Rule("teams:write", "viewer", staff=True),
    ("GET", "/teams/{team_id}/members"): _read("teams"),
    # Admins manage members; anyone may leave (the service tells them apart).
    ("POST", "/teams/{team_id}/members"): _write("teams", "admin"),
    ("PATCH", "/teams/{team_id}/members/{username}"): _write("teams", "admin"),
    ("DELETE", "/teams/{team_id}/members/{username}"): _write("teams", "viewer"),
    ("GET", "/teams/{team_id}/invitations"): _read_as("teams", "admin"),
    ("POST", "/teams/{team_id}/invitations"): _write("teams", "admin"),
    ("DELETE", "/teams/{team_id}/invitations/{invitation_id}"): _write("teams", "admin"),
    ("GET", "/teams/{team_id}/quotas"): _read("teams"),
    ("PUT", "/teams/{team_id}/quotas"): _write("teams", "admin"),
    ("PUT", "/teams/{team_id}/quotas/ceilings"): Rule("teams:write", "viewer", staff=True),
    # What a team spends is for its admins.
    ("GET", "/teams/{team_id}/usage"): _read_as("teams", "admin"),
    ("GET", "/teams/{team_id}/budget"): _read_as("teams", "admin"),
    ("PUT", "/teams/{team_id}/budget"): _write("teams", "admin"),
    ("GET", "/teams/{team_id}/rates"): _read("teams"),
    ("PUT", "/teams/{team_id}/rates"): Rule("teams:write", "viewer", staff=True),
    # Secrets: anyone in the team sees the names (to give them to sandboxes); admins manage them.
    ("GET", "/secrets"): _read("secrets"),
    ("POST", "/secrets"): _write("secrets", "admin"),
    ("PUT", "/secrets/{name}"): _write("secrets", "admin"),
    ("DELETE", "/secrets/{name}"): _write("secrets", "admin"),
    ("GET", "/audit"): _read_as("audit", "admin"),
    ("GET", "/traces"): _read("traces"),
    ("GET", "/traces/{trace_id}"): _read("traces"),
    ("GET", "/traces/{trace_id}/values/{value_id}"): _read("traces"),
    # Harnesses: members create and use them (a shell is a member's right); viewers look.
    ("POST", "/harnesses"): _write("harnesses"),
    ("GET", "/harnesses"): _read("harnesses"),
    ("GET", "/harnesses/{harness_id}"): _read("harnesses"),
    ("DELETE", "/harnesses/{harness_id}"): _write("harnesses"),
    ("POST", "/harnesses/{harness_id}/pause"): _write("harnesses"),
    ("POST", "/harnesses/{harness_id}/resume"): _write("harnesses"),
    ("GET", "/harnesses/{harness_id}/logs"): _read("harnesses"),
    ("POST", "/harnesses/{harness_id}/runs"): _write("harnesses"),
    ("GET", "/harnesses/{harness_id}/runs"): _read("harnesses"),
    ("GET", "/runs/{run_id}"): _read("harnesses"),
    ("GET", "/runs/{run_id}/logs"): _read("harnesses"),
    ("POST", "/runs/{run_id}/cancel"): _write("harnesses"),
    # SSH keys are each user's own, whatever their role.
    ("GET", "/ssh-keys"): _read("ssh_keys"),
    ("POST", "/ssh-keys"): _write("ssh_keys", "viewer"),
    ("DELETE", "/ssh-keys/{key_id}"): _write("ssh_keys", "viewer"),
    # Nodes: anyone sees their names and states (the list shows staff the rest); staff run them.
    ("GET", "/nodes"): _read("system"),
    ("POST", "/nodes/{name}/cordon"): Rule("system:write", "viewer", staff=True),
    ("POST", "/nodes/{name}/uncordon"): Rule("system:write", "viewer", staff=True),
    ("POST", "/nodes/{name}/drain"): Rule("system:write", "viewer", staff=True),
    ("DELETE", "/nodes/{name}"): Rule("system:write", "viewer", staff=True),
    ("GET", "/nodes/tokens"): Rule("system:read", "viewer", staff=True),
    ("POST", "/nodes/tokens"): Rule("system:write", "viewer", staff=True),
    ("DELETE", "/nodes/tokens/{token_id}"): Rule("system:write", "viewer", staff=True),
    # A joining node has a join token, not an API token (the service checks it: 401 if bad).
    ("POST", "/nodes/join"): Rule("system:write", public=True),
    ("GET", "/site/quotas"): Rule("system:read", "viewer", staff=True),
    ("PUT", "/site/quotas"): Rule("system:write", "viewer", staff=True),
    ("GET", "/site/rates"): Rule("system:read", "viewer", staff=True),
    ("PUT", "/site/rates"): Rule("system:write", "viewer", staff=True),
}

_CONVERTER = re.compile(r"<(?:\w+:)?(\w+)>")


def route_key(request: Any, prefix: str = "api/v1") -> tuple[str, str] | None:
    """``("POST", "/sandboxes/{sandbox_id}/exec")`` for a request to the API mounted at ``prefix``."""
    match = getattr(request, "resolver_match", None)
    if match is None or not match.route:
        return None
    route = _CONVERTER.sub(r"{\1}", match.route)
    if not route.startswith(prefix):
        return None
    return request.method, route[len(prefix) :] or "/"


def check(
    request: Any, token: Any, rules: dict[tuple[str, str], Rule] = RULES, prefix: str = "api/v1"
) -> None:
    """Raise :class:`Forbidden` unless ``token`` may make this request (to the API mounted at
    ``prefix``, whose rules are ``rules``: the E2B API has its own, ``dashboard.e2b.auth``)."""
    key = route_key(request, prefix)
    rule = rules.get(key) if key else None
    if rule is None:
        raise Forbidden(f"{key[0] if key else request.method} {key[1] if key else request.path} has no "
                        "permission rule; refusing")  # fmt: skip
    check_rule(token, rule)


def check_rule(token: Any, rule: Rule) -> None:
    """Raise :class:`Forbidden` unless ``token`` meets ``rule`` (its scope, staff, least role):
    what :func:`check` does once it has found the request's rule, and what the MCP tools do
    with the rule of the API call each one stands for (``dashboard.mcp.tools``)."""
    if rule.scope != ANY_SCOPE and not token_allows(token, rule.scope):
        raise Forbidden(f"this token lacks the scope {rule.scope!r} (it has: {', '.join(token.scopes)})",
                        scope=rule.scope)  # fmt: skip
    if rule.staff and not token.user.is_staff:
        raise Forbidden("only site administrators may do this (images are shared by every team)")
    if not role_at_least(token.effective_role, rule.role):
        raise Forbidden(
            f"your role in team {token.team.name} is {token.effective_role}; this needs {rule.role} or above",
            role=token.effective_role, needs=rule.role,
        )  # fmt: skip


def sees_pseudo_fs(role: str) -> bool:
    """Whether a caller of ``role`` may read a sandbox's /proc and /sys through its file API:
    those who may exec could ``cat`` them anyway; below that, what /proc shows (every process's
    environment, the sandbox's secrets included) is out of reach."""
    return role_at_least(role, RULES[("POST", f"{SB}/exec")].role)


__all__ = ["ANY_SCOPE", "RULES", "ROLES", "Rule", "check", "check_rule", "route_key", "sees_pseudo_fs"]
