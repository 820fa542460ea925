"""Harness runs through MCP: ``start_run`` gives a real harness (a scripted agent in the
``minimal`` image, on runsc) a prompt, ``get_run`` follows it to its end with the tail of the
agent's output and the diff it left in the workspace."""

from __future__ import annotations

import time

import anyio
import pytest

from tests.support import requires_runsc, wait_until

from .conftest import connect, ok, text

# Writes the prompt into a file of the workspace and says so on stdout and stderr.
AGENT = 'echo "$HANGAR_PROMPT" > notes.txt; echo "agent wrote notes"; echo "agent warns" >&2'


@requires_runsc
@pytest.mark.timeout(300)
def test_a_run_is_started_and_followed_to_its_diff(sandboxes, api, minimal_image, team_token):
    body = {"name": "scribe", "agent": "custom", "command": AGENT, "image": minimal_image, "disk_mb": 256,
            "memory_mb": 512, "network": {"egress": "none"}}  # fmt: skip
    r = api.post("/harnesses", json=body)
    assert r.status_code == 201, r.text
    hid = r.json()["id"]
    seen: dict = {}

    def running() -> bool:
        seen.update(api.get(f"/harnesses/{hid}").json())
        assert seen["status"] != "failed", seen
        return seen["status"] == "running"

    wait_until(running, 120, what="the harness to run")
    others = api.post("/sandboxes", json={"image": "busybox", "memory_mb": 256}).json()["id"]

    async def main():
        async with connect(sandboxes, team_token) as s:
            # A repository in the workspace, so that the run's diff has a tree to start from.
            init = (
                "cd /workspace && git init -q && printf '/.hangar/\\n/lost+found/\\n' >> .git/info/exclude && "
                "git -c user.name=t -c user.email=t@t commit -q --allow-empty -m init"
            )
            made = await ok(s, "run_command", sandbox_id=seen["sandbox"], command=init)
            assert made["exit_code"] == 0, made
            # The harness's own token (the agent's) reaches its own sandbox, not the team's others.
            env = await ok(s, "run_command", sandbox_id=seen["sandbox"], command="printenv HANGAR_API_TOKEN")
            async with connect(sandboxes, env["stdout"].strip()) as agent:
                listed = await ok(agent, "list_sandboxes")
                assert [sb["id"] for sb in listed["sandboxes"]] == [seen["sandbox"]]
                other = await agent.call_tool("run_command", {"sandbox_id": others, "command": "id"})
                assert other.isError and "no sandbox" in text(other)
            started = await ok(s, "start_run", harness="scribe", prompt="remember the milk")
            assert started["status"] == "queued" and started["harness_name"] == "scribe"
            deadline = time.monotonic() + 120
            while True:
                result = await s.call_tool("get_run", {"run_id": started["id"]})
                assert not result.isError, text(result)
                run = result.structuredContent
                if run["status"] not in ("queued", "running") or time.monotonic() > deadline:
                    return run, text(result)
                await anyio.sleep(0.5)

    run, said = anyio.run(main)
    assert run["status"] == "succeeded" and run["exit_code"] == 0, run
    assert "agent wrote notes" in run["output"] and "agent warns" in run["output"]
    assert "+remember the milk" in run["diff"] and "notes.txt" in run["diff"]
    assert "succeeded" in said and "agent wrote notes" in said and "+remember the milk" in said
