"""A joined node's own Redis user (runtime/services/node_redis.py): it does what a node's worker
and bridge do (queues, pub/sub, Lua) and none of Redis's dangerous commands; a new join gets a
new password; a removed node's user goes with its open connections; users Redis lost are given
back; where users cannot be made the join says so (``on``) or hands out the control plane's
own (``auto``). Against a Redis server of the test's own. The fleet tests
(tests/reliability/test_fleet.py) run real nodes on these users."""

from __future__ import annotations

import subprocess
import time
from urllib.parse import urlsplit

import pytest
import redis

from runtime.errors import Conflict
from runtime.models import Node, NodeRedisUser
from runtime.notify import redis_client
from runtime.services import fleet, node_redis
from tests.support import free_port, wait_until

pytestmark = pytest.mark.django_db


@pytest.fixture
def own_redis(settings, tmp_path):
    """A redis-server of the test's own, as the control plane's REDIS_URL."""
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/3"
    wait_until(lambda: _pings(url), timeout=10, what="redis-server")
    settings.REDIS_URL = settings.CELERY_BROKER_URL = settings.CELERY_RESULT_BACKEND = url
    settings.HANGAR_NODE_REDIS_USERS = "auto"
    redis_client.cache_clear()  # the control plane's client, made for REDIS_URL once
    yield url
    redis_client.cache_clear()
    proc.kill()
    proc.wait()


def _pings(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1).ping())
    except redis.RedisError:
        return False


def _join(name: str) -> dict:
    return fleet.node_join(raw=fleet.join_token_create(user=None).raw, name=name, labels={})


def test_a_node_s_user_does_a_node_s_work_and_nothing_dangerous(own_redis):
    answer = _join("red-a")
    url = answer["redis_url"]
    assert urlsplit(url).username == node_redis.user_name("red-a") and urlsplit(url).password
    assert answer["celery_broker_url"] == answer["celery_result_backend"] == url
    assert url.endswith("/3") and urlsplit(url).hostname == "127.0.0.1"
    node = redis.Redis.from_url(url, socket_timeout=5)
    # What Celery's broker, Channels' layer and Hangar's own notices do.
    assert node.ping()
    node.lpush("node.red-a", b"task")
    assert node.brpop(["node.red-a"], timeout=1) == (b"node.red-a", b"task")
    node.hset("unacked", "tag", b"m")
    node.zadd("unacked_index", {"tag": time.time()})
    assert node.set("unacked_mutex", b"1", nx=True, ex=5)
    assert node.eval("return redis.call('incr', KEYS[1])", 1, "asgi:counter") == 1
    assert node.publish("hangar:db3:trace:1:x", b"1-2") == 0
    pubsub = node.pubsub()
    pubsub.subscribe("hangar:db3:sandbox:x")
    pubsub.close()
    # What a node taken over would reach for, refused.
    for command in (
        ("CONFIG", "SET", "dir", "/tmp"),
        ("CONFIG", "GET", "*"),
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("KEYS", "*"),
        ("INFO",),
        ("CLIENT", "LIST"),
        ("CLIENT", "KILL", "TYPE", "normal"),
        ("ACL", "LIST"),
        ("ACL", "SETUSER", "evil", "on", ">x", "+@all"),
        ("SHUTDOWN", "NOSAVE"),
        ("REPLICAOF", "127.0.0.1", "1"),
        ("MODULE", "LIST"),
        ("SAVE",),
        ("MONITOR",),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            node.execute_command(*command)
    assert redis.Redis.from_url(own_redis).dbsize() > 0  # nothing was flushed
    # The password is not kept anywhere the control plane writes: only its hash.
    row = NodeRedisUser.objects.get(node_name="red-a")
    assert row.username == node_redis.user_name("red-a") and urlsplit(url).password not in str(row.__dict__)


def test_a_new_join_gets_a_new_password_and_a_removed_node_is_cut_off(
    own_redis, django_capture_on_commit_callbacks
):
    first_url = _join("red-b")["redis_url"]
    assert redis.Redis.from_url(first_url, socket_timeout=5).ping()
    old = redis.Redis.from_url(first_url, socket_timeout=5).pubsub()  # its processes, still talking
    old.subscribe("hangar:db3:sandbox:x")
    assert old.get_message(timeout=2)["type"] == "subscribe"
    Node.objects.filter(name="red-b").update(state=Node.State.LOST)  # a lost node may join again
    second_url = _join("red-b")["redis_url"]
    with pytest.raises(redis.exceptions.ConnectionError):  # what talked as it before is cut off
        for _ in range(3):
            old.get_message(timeout=1)
    assert urlsplit(second_url).password != urlsplit(first_url).password
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(first_url, socket_timeout=5).ping()
    second = redis.Redis.from_url(second_url, socket_timeout=5)
    assert second.ping()
    held = second.pubsub()  # an open connection, as a node's bridge holds one
    held.subscribe("hangar:db3:sandbox:y")
    assert held.get_message(timeout=2)["type"] == "subscribe"

    Node.objects.filter(name="red-b").update(state=Node.State.READY)
    with django_capture_on_commit_callbacks(execute=True):
        fleet.node_remove(name="red-b")
    assert not NodeRedisUser.objects.filter(node_name="red-b").exists()
    with pytest.raises(redis.exceptions.ConnectionError):  # the server closed it
        for _ in range(3):
            held.get_message(timeout=1)
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(second_url, socket_timeout=5).ping()


def test_users_redis_lost_are_given_back_and_removed_nodes_users_taken_away(own_redis):
    url = _join("red-c")["redis_url"]
    gone = _join("red-d")["redis_url"]
    admin = redis.Redis.from_url(own_redis)
    # Redis restarted without an ACL file: both users gone. One node was removed meanwhile.
    admin.execute_command("ACL", "DELUSER", node_redis.user_name("red-c"), node_redis.user_name("red-d"))
    Node.objects.filter(name="red-d").update(state=Node.State.REMOVED)
    admin.execute_command(
        "ACL", "SETUSER", node_redis.user_name("red-d"), "on", ">whatever", "~*", "+@all"
    )  # as if it had come back
    assert node_redis.node_redis_users_restore() == 1
    assert redis.Redis.from_url(url, socket_timeout=5).ping()  # the same password works again
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(gone, socket_timeout=5).ping()
    users = {u.decode() for u in admin.execute_command("ACL", "USERS")}
    assert (
        node_redis.user_name("red-d") not in users
        and not NodeRedisUser.objects.filter(node_name="red-d").exists()
    )
    assert node_redis.node_redis_users_restore() == 0  # nothing lost: one ACL USERS, nothing more


def test_where_users_cannot_be_made_auto_hands_out_the_control_plane_s_own_and_on_refuses(
    own_redis, settings
):
    admin = redis.Redis.from_url(own_redis)
    admin.execute_command("ACL", "SETUSER", "plain", "on", ">pw", "~*", "&*", "+@all", "-@dangerous")
    settings.REDIS_URL = settings.CELERY_BROKER_URL = settings.CELERY_RESULT_BACKEND = own_redis.replace(
        "redis://", "redis://plain:pw@"
    )
    answer = _join("red-e")
    assert (
        answer["redis_url"] == settings.REDIS_URL
        and not NodeRedisUser.objects.filter(node_name="red-e").exists()
    )
    settings.HANGAR_NODE_REDIS_USERS = "on"
    issued = fleet.join_token_create(user=None)
    with pytest.raises(Conflict, match="HANGAR_NODE_REDIS_USERS=on"):
        fleet.node_join(raw=issued.raw, name="red-f", labels={})
    assert not Node.objects.filter(name="red-f").exists()
    settings.HANGAR_NODE_REDIS_USERS = "off"  # and the token was not spent
    assert fleet.node_join(raw=issued.raw, name="red-f", labels={})["redis_url"] == settings.REDIS_URL


def test_with_redis_s_default_user_closed_a_node_has_only_its_own(own_redis, settings, caplog):
    """Redis as docs/fleet.md says to run it for nodes: the control plane on a user of its own,
    ``default`` off. A node then has its user and nothing else; with ``default`` open, ``auto``
    warns and ``on`` refuses the join."""
    admin = redis.Redis.from_url(own_redis)
    with caplog.at_level("WARNING", logger="runtime.services.node_redis"):
        _join("red-g")
    assert "default user takes any password" in caplog.text
    settings.HANGAR_NODE_REDIS_USERS = "on"
    issued = fleet.join_token_create(user=None)
    with pytest.raises(Conflict, match="requirepass"):
        fleet.node_join(raw=issued.raw, name="red-h", labels={})

    admin.execute_command("ACL", "SETUSER", "control", "on", ">cp-secret", "~*", "&*", "+@all")
    settings.REDIS_URL = settings.CELERY_BROKER_URL = settings.CELERY_RESULT_BACKEND = own_redis.replace(
        "redis://", "redis://control:cp-secret@"
    )
    redis_client.cache_clear()
    redis.Redis.from_url(settings.REDIS_URL).execute_command("ACL", "SETUSER", "default", "off")
    url = fleet.node_join(raw=issued.raw, name="red-h", labels={})["redis_url"]
    assert redis.Redis.from_url(url, socket_timeout=5).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):  # no user: refused
        redis.Redis.from_url(own_redis, socket_timeout=5).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):  # default, whatever the password
        redis.Redis.from_url(own_redis.replace("redis://", "redis://default:x@"), socket_timeout=5).ping()
