"""Pages: the overview requires sign-in and shows nodes and images."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from runtime.models import Image, Membership, Team
from runtime.services.nodes import node_register
from tests.support import GVISOR


@pytest.mark.django_db
def test_overview_requires_sign_in(client):
    r = client.get("/")
    assert r.status_code == 302 and r["Location"].startswith("/login/")


@pytest.mark.django_db
def test_overview_shows_nodes_and_images(client):
    user = get_user_model().objects.create_user("ann", password="pw")
    Membership.objects.create(user=user, team=Team.objects.create(name="core"))
    node = node_register(name="node-a", launchers=GVISOR, cpu=2, memory_mb=2048)
    Image.objects.create(name="busybox", digest="sha256:" + "a" * 64).nodes.add(node)
    client.force_login(user)
    page = client.get("/").content.decode()
    assert "node-a" in page and "busybox" in page and "core" in page
    assert "vendor/htmx/htmx.min.js" in page
    fragment = client.get("/", HTTP_HX_REQUEST="true").content.decode()
    assert "node-a" in fragment and "<html" not in fragment


@pytest.mark.django_db
def test_overview_empty_state_says_what_to_do(client):
    user = get_user_model().objects.create_user("ben", password="pw")
    client.force_login(user)
    page = client.get("/").content.decode()
    assert "hangar image build busybox" in page and "hangar up" in page
