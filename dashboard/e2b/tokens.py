"""What the E2B SDK is told about a sandbox's envd (the API inside an E2B sandbox): the
protocol release Hangar answers for, and the sandbox's access token."""

from __future__ import annotations

from typing import Any

from django.utils.crypto import constant_time_compare, salted_hmac

from runtime.services.auth import role_at_least, token_allows

from ..api.permissions import RULES, SB

# The envd release whose protocol Hangar implements. The SDK switches features on it (from
# 0.5.7 it uploads files as octet-stream; below 0.1.0 it refuses the sandbox), so it names the
# release Hangar's envd surface speaks, never a newer one. The messages are those of E2B's
# published protos (Apache-2.0): spec/envd/process/process.proto and
# spec/envd/filesystem/filesystem.proto of github.com/e2b-dev/E2B at commit b8029973 (August
# 2026), where every call of envd 0.5.7 keeps its messages; see docs/e2b.md.
ENVD_VERSION = "0.5.7"

_SALT = "hangar.e2b.envd-access-token"


def _mac(sandbox_id: str, token_id: int) -> str:
    return salted_hmac(_SALT, f"{sandbox_id}:{token_id}", algorithm="sha256").hexdigest()


def may_use_envd(api_token: Any) -> bool:
    """Whether the caller may run commands in the team's sandboxes (what envd does): the same
    scope and role as Hangar's own exec."""
    rule = RULES[("POST", f"{SB}/exec")]
    return token_allows(api_token, rule.scope) and role_at_least(api_token.effective_role, rule.role)


def envd_access_token(sandbox_id: str, api_token: Any) -> str | None:
    """The sandbox's envd access token for this caller, which the SDK sends as
    ``X-Access-Token`` to the in-sandbox API (those calls carry no API key, so it is what opens
    them): ``<API token id>.<HMAC-SHA256 of the sandbox id and that id under SECRET_KEY>``.
    Bound to the API token that asked, so the in-sandbox API can check that token is still
    valid, of the sandbox's team and allowed to exec at each call: revoking it, or lowering its
    user's role, closes envd too. None for a caller who may not exec (a viewer, a read-only
    token): the SDK then has no way in. Derived, never stored, never logged."""
    if not may_use_envd(api_token):
        return None
    return f"{api_token.pk}.{_mac(sandbox_id, api_token.pk)}"


def envd_access_token_owner(sandbox_id: str, token: str) -> int | None:
    """The id of the API token ``token`` was made for, if it is this sandbox's envd access
    token (checked in constant time); the caller then checks that API token's rights."""
    token_id, _, mac = (token or "").partition(".")
    if not token_id.isdigit() or not mac:
        return None
    return int(token_id) if constant_time_compare(_mac(sandbox_id, int(token_id)), mac) else None
