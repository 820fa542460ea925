"""Agent presets: what Hangar knows about each coding agent, as data.

A preset says where the agent's CLI comes from (its npm package, the binary it installs), how
to run it headless with a prompt, which environment variables carry its credentials, and any
environment it wants. Adding an agent is adding an entry here, not code.

``headless`` is an argv template: ``{prompt}`` is replaced by the run's prompt (one argument,
never through a shell). Every agent also gets the prompt as ``$HANGAR_PROMPT`` and on stdin.

Stdlib only: the launchers and the SSH gateway may read it without Django.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WORKSPACE = "/workspace"
STATE_DIR = f"{WORKSPACE}/.hangar"  # Hangar's corner of the volume (excluded from git)
HOME = f"{STATE_DIR}/home"  # the agent's home: its config (~/.claude, ~/.codex…) persists
TOOLS = f"{STATE_DIR}/tools"  # npm --prefix for agent CLIs that the image lacks
TOOLS_BIN = f"{TOOLS}/bin"


@dataclass(frozen=True)
class Preset:
    name: str
    label: str
    package: str = ""  # npm package of the CLI ("" = none to install)
    binary: str = ""  # the command it provides
    headless: tuple[str, ...] = ()  # argv after the binary; "{prompt}" is the prompt
    credentials: tuple[str, ...] = ()  # env vars that can carry its API key (any one suffices)
    env: dict[str, str] = field(default_factory=dict)
    setup: str = ""  # shell run by each workspace setup once the CLI is there (idempotent)
    docs: str = ""

    def run_argv(self, prompt: str, command: list[str] | None = None) -> list[str]:
        """The headless command for ``prompt``; a custom preset runs ``command`` as given."""
        if self.name == "custom":
            if not command:
                raise ValueError("the custom preset needs a command")
            return list(command)
        return [self.binary, *(prompt if a == "{prompt}" else a for a in self.headless)]

    def interactive_argv(self, command: list[str] | None = None) -> list[str]:
        if self.name == "custom":
            return list(command or [])
        return [self.binary]


# Codex's telemetry: an [otel] section in its config.toml (CODEX_HOME is on the workspace volume)
# exporting its log events (API requests, tool results) and its spans over OTLP/HTTP to Hangar,
# rewritten by each setup between its markers; a section of the user's own is left alone.
# The token is not in it: every file of a sandbox can be read by the team's viewers (the files
# API), so it stays in the process environment, where Codex's OTLP exporter (opentelemetry-otlp)
# takes OTEL_EXPORTER_OTLP_HEADERS from and adds it to each request. Prompts are left out
# unless the harness's env opts in (OTEL_LOG_USER_PROMPTS=1, as for Claude Code).
CODEX_OTEL = """\
codex_home="${CODEX_HOME:-$HOME/.codex}"; f="$codex_home/config.toml"; e="${OTEL_EXPORTER_OTLP_ENDPOINT:-}"
mkdir -p "$codex_home" && touch "$f"
sed -i '/^# >>> hangar otel/,/^# <<< hangar otel/d' "$f"
if [ -z "$e" ]; then
  echo "Codex telemetry: off (no OTEL_EXPORTER_OTLP_ENDPOINT)"
elif grep -Eq '^[[:space:]]*(\\[+[[:space:]]*otel[[:space:]]*[].]|otel[[:space:]]*[.=])' "$f"; then
  echo "Codex telemetry: $f has an [otel] section of its own: kept"
else
  case "$e" in *'"'*|*'\\'*) echo "Codex telemetry: off (OTEL_EXPORTER_OTLP_ENDPOINT does not fit in config.toml)" >&2; exit 0;; esac
  e="${e%/}"; prompts=false; [ "${OTEL_LOG_USER_PROMPTS:-}" = 1 ] && prompts=true
  [ -s "$f" ] && [ -n "$(tail -c 1 "$f")" ] && echo >> "$f"
  printf '%s\\n' "# >>> hangar otel: written by Hangar at each start (the token comes from the environment)" \\
    "[otel]" "environment = \\"hangar\\"" "log_user_prompt = $prompts" \\
    "exporter = { otlp-http = { endpoint = \\"$e/v1/logs\\", protocol = \\"binary\\" } }" \\
    "trace_exporter = { otlp-http = { endpoint = \\"$e/v1/traces\\", protocol = \\"binary\\" } }" \\
    "# <<< hangar otel" >> "$f"
  echo "Codex telemetry: to $e (traces and log events; $f)"
fi
"""

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="claude-code",
            label="Claude Code",
            package="@anthropic-ai/claude-code",
            binary="claude",
            # Print mode; the sandbox is the boundary, so the agent is not asked for permission
            # per tool (IS_SANDBOX tells it that running as root in a sandbox is intended).
            headless=("-p", "{prompt}", "--dangerously-skip-permissions"),
            credentials=("ANTHROPIC_API_KEY", "CLAUDE_CODE_OAUTH_TOKEN"),
            # Its telemetry (OpenTelemetry, to Hangar's OTLP endpoint that every harness is given):
            # traces and log events land in the run's trace. Prompts and tool details stay out
            # unless the harness's env opts in (OTEL_LOG_USER_PROMPTS=1, OTEL_LOG_TOOL_DETAILS=1).
            env={
                "IS_SANDBOX": "1",
                "DISABLE_AUTOUPDATER": "1",
                "CLAUDE_CODE_ENABLE_TELEMETRY": "1",
                "CLAUDE_CODE_ENHANCED_TELEMETRY_BETA": "1",
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_LOGS_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            },  # fmt: skip
            docs="https://docs.anthropic.com/en/docs/claude-code",
        ),
        Preset(
            name="codex",
            label="Codex",
            package="@openai/codex",
            binary="codex",
            headless=(
                "exec",
                "--dangerously-bypass-approvals-and-sandbox",
                "--skip-git-repo-check",
                "{prompt}",
            ),
            credentials=("OPENAI_API_KEY", "CODEX_API_KEY"),
            env={"CODEX_HOME": f"{HOME}/.codex"},
            setup=CODEX_OTEL,
            docs="https://github.com/openai/codex",
        ),
        Preset(
            name="opencode",
            label="OpenCode",
            package="opencode-ai",
            binary="opencode",
            headless=("run", "{prompt}"),
            credentials=("ANTHROPIC_API_KEY", "OPENAI_API_KEY", "OPENROUTER_API_KEY"),
            docs="https://opencode.ai/docs",
        ),
        Preset(
            name="pi",
            label="Pi",
            package="@mariozechner/pi-coding-agent",
            binary="pi",
            headless=("-p", "{prompt}"),
            credentials=("ANTHROPIC_API_KEY", "OPENAI_API_KEY", "GEMINI_API_KEY"),
            docs="https://github.com/badlogic/pi-mono",
        ),
        Preset(
            name="custom",
            label="Custom command",
            docs="runs your command with the prompt in $HANGAR_PROMPT and on stdin",
        ),
    )
}


def preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown agent {name!r}; one of: {', '.join(PRESETS)}") from None


def _origin(url: str) -> str:
    """``https://host[:port]`` of an http(s) URL (what git matches a credential section on)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}"


def _q(value: str) -> str:
    return "'" + value.replace("'", "'\"'\"'") + "'"


def setup_script(
    *, p: Preset, repo_url: str = "", repo_branch: str = "", repo_secret: str = "", repo_auth: str = ""
) -> str:
    """The shell script that prepares a workspace, run once its sandbox is up (and again on
    each later start: every step is skipped when already done). It clones the repository into
    ``/workspace`` (a volume's root holds ``lost+found``, so the clone is made beside it and its
    ``.git`` moved in), keeps Hangar's own files out of git, sets git up to read the repository's
    credential from the environment (never from a file), and installs the agent's CLI from npm
    into the workspace's tool directory if the image lacks it. Values never appear in it:
    only the names of the variables that hold them."""
    lines = [
        "set -eu",
        f"mkdir -p {HOME} {TOOLS_BIN}",
        f"cd {WORKSPACE}",
    ]
    if repo_secret and repo_auth == "token":
        # A credential helper that answers with the variable's value at the moment git asks,
        # for the repository's own host only (a submodule elsewhere never gets the token).
        helper = f'!f() {{ test "$1" = get && echo username=x-access-token && echo "password=${{{repo_secret}}}"; }}; f'
        lines.append(f"git config --global {_q(f'credential.{_origin(repo_url)}.helper')} {_q(helper)}")
    elif repo_secret and repo_auth == "ssh-key":
        # A deploy key: held by a throwaway ssh-agent for one connection, never written out.
        ssh = (
            "#!/bin/sh\neval \"$(ssh-agent -s)\" >/dev/null\ntrap 'ssh-agent -k >/dev/null' EXIT\n"
            f"printf '%s\\n' \"${repo_secret}\" | ssh-add -q - 2>/dev/null\n"
            'ssh -o StrictHostKeyChecking=accept-new "$@"\n'
        )
        lines += [
            f"printf %s {_q(ssh)} > {STATE_DIR}/git-ssh && chmod 755 {STATE_DIR}/git-ssh",
            f"git config --global core.sshCommand {STATE_DIR}/git-ssh",
        ]
    if repo_url:
        branch = f"--branch {_q(repo_branch)} " if repo_branch else ""
        lines += [
            "if [ ! -d .git ]; then",
            f"  echo {_q('cloning ' + repo_url + (' (' + repo_branch + ')' if repo_branch else ''))}",
            f"  rm -rf {STATE_DIR}/clone",
            f"  git clone --progress --no-checkout {branch}-- {_q(repo_url)} {STATE_DIR}/clone",
            f"  mv {STATE_DIR}/clone/.git .git && rmdir {STATE_DIR}/clone",
            "  git reset -q --hard",
            '  echo "checked out $(git rev-parse --abbrev-ref HEAD) at $(git rev-parse --short HEAD)"',
            "fi",
        ]
    lines += [
        "if [ -d .git ]; then",
        "  for p in /.hangar/ /lost+found/; do",
        '    grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude',
        "  done",
        "fi",
    ]
    if p.package:
        lines += [
            f"if ! command -v {p.binary} >/dev/null 2>&1; then",
            f"  if ! command -v npm >/dev/null 2>&1; then echo {_q(f'{p.label} is not in the image and npm is not there to install it ({p.package}): use an image with Node.js, such as base')} >&2; exit 3; fi",  # noqa: E501
            f"  echo {_q(f'installing {p.package} into {TOOLS}')}",
            f"  npm install --global --no-fund --no-audit --prefix {TOOLS} {_q(p.package)}",
            "fi",
            f'echo "{p.binary}: $({p.binary} --version 2>&1 | head -n 1)"',
        ]
    if p.setup:
        # A subshell: its exit ends only itself, and its failure is said but fails no setup.
        lines += ["(", p.setup.rstrip("\n"), f") || echo {_q(f'{p.label}: its setup step failed')} >&2"]
    lines.append("echo workspace ready")
    return "\n".join(lines) + "\n"


# How a run's diff is taken: the whole working tree (untracked files included, ignored ones
# not) written as a tree object through a scratch index, so the real index is never touched.
# Before and after a run; the diff is between the two trees, whatever the agent committed.
TREE_SCRIPT = (
    f"cd {WORKSPACE} && [ -d .git ] || exit 0; "
    "i=$(mktemp); trap 'rm -f \"$i\"' EXIT; "
    'cp .git/index "$i" 2>/dev/null || true; '
    'GIT_INDEX_FILE="$i" git add -A . >/dev/null 2>&1 && GIT_INDEX_FILE="$i" git write-tree'
)


def diff_script(before: str, after: str) -> str:
    return f"cd {WORKSPACE} && git -c core.quotepath=off diff --no-color --no-ext-diff {before} {after}"
