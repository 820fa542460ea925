"""Data migrations, run forward on rows made with the models as they were before them."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

BEFORE_HARNESS_TOKENS = [("runtime", "0018_sandbox_disk_metered_at")]
HARNESS_TOKENS = [("runtime", "0019_token_harness_and_sandbox_created_by_token")]


@pytest.mark.django_db(transaction=True)
def test_existing_harness_tokens_are_bound_to_their_harness_and_narrowed():
    executor = MigrationExecutor(connection)
    executor.migrate(BEFORE_HARNESS_TOKENS)
    try:
        apps = executor.loader.project_state(BEFORE_HARNESS_TOKENS).apps
        user = apps.get_model("auth", "User").objects.create(username="old")
        team = apps.get_model("runtime", "Team").objects.create(name="old-team")
        ApiToken = apps.get_model("runtime", "ApiToken")
        wide = ApiToken.objects.create(user=user, team=team, prefix="hgr_a", token_hash="a" * 64,
                                       scopes=["sandboxes:*", "volumes:read", "images:read"])  # fmt: skip
        own = ApiToken.objects.create(user=user, team=team, prefix="hgr_b", token_hash="b" * 64)
        harness = apps.get_model("runtime", "Harness").objects.create(
            team=team, name="old", agent="custom", image="busybox", api_token=wide
        )
        executor = MigrationExecutor(connection)
        executor.migrate(HARNESS_TOKENS)
    finally:
        MigrationExecutor(connection).migrate(MigrationExecutor(connection).loader.graph.leaf_nodes())
    from runtime.models import ApiToken as Token

    wide_now, own_now = Token.objects.get(id=wide.id), Token.objects.get(id=own.id)
    assert wide_now.harness_id == harness.id and wide_now.scopes == ["sandboxes:write", "traces:write"]
    assert own_now.harness_id is None and own_now.scopes == []


BEFORE_NODE_LAUNCHERS = [("runtime", "0019_token_harness_and_sandbox_created_by_token")]
NODE_LAUNCHERS = [("runtime", "0020_node_launchers_and_default_runtime")]


@pytest.mark.django_db(transaction=True)
def test_a_nodes_runtimes_become_its_launchers_until_its_heartbeat_says_what_they_can_do():
    executor = MigrationExecutor(connection)
    executor.migrate(BEFORE_NODE_LAUNCHERS)
    try:
        apps = executor.loader.project_state(BEFORE_NODE_LAUNCHERS).apps
        old = apps.get_model("runtime", "Node").objects.create(name="old-node", runtimes=["gvisor"])
        executor = MigrationExecutor(connection)
        executor.migrate(NODE_LAUNCHERS)
    finally:
        MigrationExecutor(connection).migrate(MigrationExecutor(connection).loader.graph.leaf_nodes())
    from runtime.models import Node

    node = Node.objects.get(id=old.id)
    assert node.launchers == {"gvisor": {}} and node.runtimes == ["gvisor"]
    assert not node.can("gvisor", "network")  # until its next heartbeat says
