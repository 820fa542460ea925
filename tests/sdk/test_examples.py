"""The SDK's examples (sdk/examples/), each run as a user runs it: a separate Python process
configured by HANGAR_URL and HANGAR_TOKEN, against the real stack."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support import requires_runsc

pytestmark = [requires_runsc]
EXAMPLES = Path(__file__).resolve().parents[2] / "sdk" / "examples"


def run_example(name: str, *args: str) -> str:
    out = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ))  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_llm_code_runs_in_a_sandbox(hangar):
    out = run_example("run_llm_code.py", "--image", "busybox")
    assert "2 3 5 7 11 13 17 19 23 29" in out and "exit code 0" in out


def test_a_web_app_is_reached_through_its_preview_url(hangar):
    out = run_example("web_preview.py")
    assert "preview URL: http://8000-sb" in out
    assert "200 <h1>hello from a sandbox</h1>" in out


def test_a_harness_run_prints_its_output_and_diff(hangar):
    out = run_example("harness_run.py", "--agent", "custom", "--command", 'echo "on it: $HANGAR_PROMPT"',
                      "--image", "busybox", "--disk-mb", "32", "--network", '{"egress": "none"}', "fix the test")  # fmt: skip
    assert "on it: fix the test" in out and ": succeeded (exit code 0)" in out
