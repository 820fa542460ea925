"""The dashboard page tests' teams (alpha, beta) and ann, a member of alpha signed in on the
test client."""

from __future__ import annotations

import pytest

from runtime.models import Team
from tests.pages.support import make_member


@pytest.fixture
def alpha(db) -> Team:
    return Team.objects.create(name="alpha")


@pytest.fixture
def beta(db) -> Team:
    return Team.objects.create(name="beta")


@pytest.fixture
def ann(client, alpha):
    user = make_member("ann", alpha)
    client.force_login(user)
    return user
