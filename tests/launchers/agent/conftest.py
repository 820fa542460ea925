"""The agent's fixtures: its binary (built once, or HANGAR_TEST_AGENT_BIN), one agent per
module, and its client."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime.launchers.agent.build import agent_binary
from runtime.launchers.agent.client import AgentClient
from tests.launchers.agent.support import RunningAgent, start_agent, stop_agent


@pytest.fixture(scope="module")
def agent_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # HANGAR_TEST_AGENT_BIN runs the suite against another build, e.g. one with sanitizers.
    override = os.environ.get("HANGAR_TEST_AGENT_BIN")
    return Path(override) if override else agent_binary(tmp_path_factory.mktemp("agent-bin"))


@pytest.fixture(scope="module")
def agent(agent_bin: Path, tmp_path_factory: pytest.TempPathFactory):
    running = start_agent(agent_bin, tmp_path_factory.mktemp("agent-run"))
    yield running
    stop_agent(running)


@pytest.fixture
def client(agent: RunningAgent) -> AgentClient:
    return agent.client
