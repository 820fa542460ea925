"""What the SDK's tests share: the SDK pointed at the real test stack by the environment."""

from __future__ import annotations

import pytest


@pytest.fixture
def hangar(server, celery_worker, bridge, local_node, team_token, monkeypatch) -> str:
    """HANGAR_URL and HANGAR_TOKEN set as a user sets them (the server's base URL, without
    /api/v1); the harness fallbacks cleared. Returns the URL."""
    monkeypatch.setenv("HANGAR_URL", server)
    monkeypatch.setenv("HANGAR_TOKEN", team_token)
    monkeypatch.delenv("HANGAR_API_URL", raising=False)
    monkeypatch.delenv("HANGAR_API_TOKEN", raising=False)
    return server
