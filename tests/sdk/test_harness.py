"""Harnesses through the SDK, against the real stack: create one, give its agent a task, follow
the run to its end and read its diff."""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest

from hangar_sdk import AsyncHarness, ConflictError, HangarError, Harness, NotFoundError
from tests.api.test_harnesses_api import GIT_NET
from tests.support import requires_runsc

pytestmark = [requires_runsc, pytest.mark.timeout(300)]

# A scripted agent: writes the prompt into the workspace and says where it ran.
AGENT = 'echo "$HANGAR_PROMPT" >> TASK.md; echo "agent ran in $(pwd)"; echo to-stderr >&2'


def test_a_harness_runs_its_agent_and_the_run_is_followed_to_its_end(hangar):
    h = Harness.create(name="sdk", agent="custom", command=AGENT, image="busybox", memory_mb=256, disk_mb=32,
                       network={"egress": "none"})  # fmt: skip
    try:
        assert h.status == "running" and h.info.setup == "done" and h.info.sandbox
        assert Harness.get("sdk").id == h.id
        run = h.run("fix the test")
        assert run.status == "queued"
        out: list[str] = []
        assert run.wait(timeout=120, on_stdout=out.append) is run
        assert run.status == "succeeded" and run.exit_code == 0 and run.info.duration_ms
        assert "agent ran in /workspace" in "".join(out)
        assert run.diff == ""  # busybox has no git: nothing to diff against
        with pytest.raises(ConflictError):
            Harness.create(name="sdk", agent="custom", command="true", image="busybox", wait=False)

        async def again() -> str:
            ah = await AsyncHarness.get(h.id)
            r = await (await ah.run("again")).wait(timeout=120)
            return r.status

        assert asyncio.run(again()) == "succeeded"
    finally:
        h.delete(delete_volume=True)
    with pytest.raises(NotFoundError):
        Harness.get(h.id)


def test_a_harness_whose_agent_needs_npm_fails_with_the_reason(hangar):
    with pytest.raises(HangarError, match="npm"):
        Harness.create(name="needs-npm", agent="claude-code", image="busybox", memory_mb=256, disk_mb=32,
                       network={"egress": "none"}, timeout=120)  # fmt: skip
    Harness.get("needs-npm").delete(delete_volume=True)


def test_a_run_over_a_cloned_repository_has_its_diff(hangar, minimal_image, git_server):
    h = Harness.create(name="web", agent="custom", command=AGENT, image="minimal", repo={"url": git_server},
                       memory_mb=512, disk_mb=256, network=GIT_NET)  # fmt: skip
    try:
        run = h.run("add a usage section").wait(timeout=120)
        assert run.status == "succeeded", run.info
        assert "+add a usage section" in run.diff and "TASK.md" in run.diff
        # The CLI's `hangar run diff` prints that same diff.
        from tests.cli.conftest import HANGAR

        env = {k: v for k, v in os.environ.items() if not k.startswith("HANGAR_")}
        shown = subprocess.run([str(HANGAR), "run", "diff", run.id], capture_output=True, text=True, timeout=60,
                               env={**env, "HANGAR_URL": hangar, "HANGAR_TOKEN": os.environ["HANGAR_TOKEN"]})  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.strip() == run.diff.strip()
    finally:
        h.delete(delete_volume=True)
