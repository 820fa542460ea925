"""What the E2B SDK's tests share: the SDK pointed at the test stack."""

from __future__ import annotations

import pytest


@pytest.fixture
def e2b(server, celery_worker, bridge, local_node, team_token, monkeypatch) -> str:
    """The SDK pointed at this Hangar by the environment, as a user does; the busybox image is
    also named ``base``, the template the SDK asks for when it names none. Returns the URL."""
    from runtime.models import Image
    from runtime.node.local import image_store
    from runtime.services.images import image_register

    image_register(info=image_store().get(Image.objects.get(name="busybox").digest), name="base")
    url = f"{server}/e2b"
    monkeypatch.setenv("E2B_API_URL", url)
    monkeypatch.setenv("E2B_SANDBOX_URL", f"{url}/envd")
    monkeypatch.setenv("E2B_API_KEY", team_token)
    monkeypatch.delenv("E2B_DOMAIN", raising=False)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    return url
