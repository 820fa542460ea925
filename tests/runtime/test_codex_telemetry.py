"""Agents' telemetry (Claude Code's environment, below) and Codex's: the workspace setup writes an ``[otel]`` section into Codex's
``config.toml`` that exports its log events and spans to Hangar's OTLP endpoint, as Codex reads
it (parsed with tomllib here); the token never goes in (every file of a sandbox is readable by
the team's viewers: it stays in the environment, where Codex's exporter takes
``OTEL_EXPORTER_OTLP_HEADERS`` from). Rewritten at each start, the user's own settings kept, a
section of the user's own left alone. The step is run here with /bin/sh as the setup runs it
(the whole harness path, in a gVisor sandbox, is tests/api/test_harness_agents.py)."""

from __future__ import annotations

import os
import subprocess
import tomllib
from pathlib import Path

import pytest

from runtime import presets

TOKEN = "hgr_codex_never_in_a_file_" + "x" * 20
ENDPOINT = "http://hangar.internal:8719"


def _setup(home: Path, **env: str) -> str:
    script = presets.preset("codex").setup
    full = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home / ".codex"),
            "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT,
            "OTEL_EXPORTER_OTLP_HEADERS": f"Authorization=Bearer {TOKEN}", "HANGAR_API_TOKEN": TOKEN, **env}  # fmt: skip
    done = subprocess.run(["/bin/sh", "-c", "set -eu\n(\n" + script + ")"], env=full, capture_output=True,
                          text=True, timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_codex_config_exports_to_hangar_without_the_token(tmp_path):
    said = _setup(tmp_path)
    path = tmp_path / ".codex" / "config.toml"
    text = path.read_text()
    assert f"Codex telemetry: to {ENDPOINT}" in said
    assert TOKEN not in text and "Bearer" not in text and "Authorization" not in text
    otel = tomllib.loads(text)["otel"]
    assert otel == {
        "environment": "hangar",
        "log_user_prompt": False,
        "exporter": {"otlp-http": {"endpoint": f"{ENDPOINT}/v1/logs", "protocol": "binary"}},
        "trace_exporter": {"otlp-http": {"endpoint": f"{ENDPOINT}/v1/traces", "protocol": "binary"}},
    }
    # Nothing the setup wrote anywhere under the home holds the token.
    for f in tmp_path.rglob("*"):
        if f.is_file():
            assert TOKEN not in f.read_text(errors="replace"), f


def test_codex_config_is_rewritten_at_each_start_and_keeps_the_users_settings(tmp_path):
    path = tmp_path / ".codex" / "config.toml"
    path.parent.mkdir()
    path.write_text('model = "gpt-5"\n[profiles.fast]\nmodel = "gpt-5-mini"')  # no final newline
    _setup(tmp_path)
    _setup(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT="http://elsewhere:9/", OTEL_LOG_USER_PROMPTS="1")
    config = tomllib.loads(path.read_text())
    assert config["model"] == "gpt-5" and config["profiles"]["fast"] == {"model": "gpt-5-mini"}
    assert path.read_text().count("[otel]") == 1
    assert config["otel"]["trace_exporter"]["otlp-http"]["endpoint"] == "http://elsewhere:9/v1/traces"
    assert config["otel"]["log_user_prompt"] is True


@pytest.mark.parametrize("own", ['[otel]\nexporter = "none"\n', 'otel.exporter = "none"\n'])
def test_an_otel_section_of_the_users_own_is_left_alone(tmp_path, own):
    path = tmp_path / ".codex" / "config.toml"
    path.parent.mkdir()
    path.write_text(own)
    assert "of its own: kept" in _setup(tmp_path)
    assert path.read_text() == own


def test_without_an_endpoint_or_with_one_that_does_not_fit_nothing_is_written(tmp_path):
    assert "off (no OTEL_EXPORTER_OTLP_ENDPOINT)" in _setup(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT="")
    _setup(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT='http://x/"] evil = "1')
    assert "[otel]" not in (tmp_path / ".codex" / "config.toml").read_text()


def test_the_codex_preset_setup_runs_the_step_and_a_failure_fails_no_setup():
    script = presets.setup_script(p=presets.preset("codex"))
    assert presets.CODEX_OTEL.strip() in script
    assert script.index("codex --version") < script.index("hangar otel") < script.index("workspace ready")
    assert ") || echo 'Codex: its setup step failed' >&2" in script
    assert presets.preset("claude-code").setup == ""


def test_claude_code_exports_its_traces_and_logs_to_hangar_without_prompts(settings):
    """Claude Code's preset turns its OpenTelemetry on (traces and log events, OTLP over HTTP)
    towards the endpoint every harness has, with the harness's ties as resource attributes;
    prompts and tool details stay out unless the harness's own env opts in."""
    from runtime.models import Harness
    from runtime.services.harnesses import _sandbox_env

    settings.HANGAR_SANDBOX_OTLP_ENDPOINT = ENDPOINT
    h = Harness(id="hclaude", name="claude", agent="claude-code", team_id=7, env={})
    env = _sandbox_env(h, "/usr/bin:/bin")
    assert env["CLAUDE_CODE_ENABLE_TELEMETRY"] == env["CLAUDE_CODE_ENHANCED_TELEMETRY_BETA"] == "1"
    assert env["OTEL_TRACES_EXPORTER"] == env["OTEL_LOGS_EXPORTER"] == "otlp"
    assert (
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] == ENDPOINT
        and env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"
    )
    assert env["OTEL_RESOURCE_ATTRIBUTES"] == "hangar.team=7,hangar.harness.id=hclaude"
    assert "OTEL_LOG_USER_PROMPTS" not in env and "OTEL_LOG_TOOL_DETAILS" not in env
    # No token in the harness's env: it comes with each process, as a secret, never in a file.
    assert not any(TOKEN in v or "hgr_" in v for v in env.values())
    h.env = {"OTEL_LOG_USER_PROMPTS": "1"}
    assert _sandbox_env(h, "/usr/bin:/bin")["OTEL_LOG_USER_PROMPTS"] == "1"  # the harness opts in
