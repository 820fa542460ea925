from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja.security import HttpBearer

from runtime.services.auth import token_authenticate


class TokenAuth(HttpBearer):
    """``Authorization: Bearer hgr_…``; ``request.auth`` becomes the ApiToken (user and team)."""

    def authenticate(self, request: HttpRequest, token: str) -> Any:
        return token_authenticate(token)
