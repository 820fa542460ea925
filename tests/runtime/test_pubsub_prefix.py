"""Redis pub/sub ignores the database number: Hangar's channels carry it, so two Hangars on one
Redis server in databases of their own (or the test suite's workers) never hear each other's
team, image-job and trace events, whose ids repeat from one database to the next."""

from __future__ import annotations

import pytest

from runtime import notify
from runtime.services.trace_live import trace_channel


@pytest.mark.parametrize(
    ("url", "prefix"),
    [
        ("redis://127.0.0.1:6379/0", "hangar:"),
        ("redis://127.0.0.1:6379", "hangar:"),
        ("redis://127.0.0.1:6379/7", "hangar:db7:"),
        ("rediss://user:pw@redis.example:6380/12", "hangar:db12:"),
        ("unix:///var/run/redis.sock?db=3", "hangar:db3:"),
        ("unix:///home/h/.local/share/hangar/redis.sock", "hangar:"),
    ],
)
def test_the_prefix_names_the_database(url, prefix):
    assert notify._prefix_for(url) == prefix


def test_every_channel_carries_it(settings):
    settings.REDIS_URL = "redis://127.0.0.1:6379/8"
    assert notify.team_channel(5) == "hangar:db8:team:5"
    assert notify.sandbox_channel("sb-1") == "hangar:db8:sandbox:sb-1"
    assert notify.images_channel() == "hangar:db8:images"
    assert notify.image_job_channel(3) == "hangar:db8:image-job:3"
    assert trace_channel(5, "ab" * 16) == f"hangar:db8:trace:5:{'ab' * 16}"
    settings.REDIS_URL = "redis://127.0.0.1:6379/9"
    assert notify.team_channel(5) != "hangar:db8:team:5"
