"""Where ``hangar login`` keeps the server's URL and the token: ``$XDG_CONFIG_HOME/hangar/
config.json`` (by default ``~/.config/hangar/config.json``), readable by its owner alone. The
SDK and the CLI read it after ``HANGAR_URL`` and ``HANGAR_TOKEN``; ``hangar mcp`` reads the
same file."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ._errors import HangarError


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "hangar" / "config.json"


def load_stored() -> dict[str, Any]:
    """What ``hangar login`` stored (``url``, ``token``), or ``{}`` when it never ran."""
    path = config_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise HangarError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise HangarError(f"{path} is not JSON ({exc}); run `hangar login` again") from exc
    return data if isinstance(data, dict) else {}


def store(url: str, token: str) -> Path:
    """Write the URL and token, replacing the file atomically, mode 0600 from its first byte
    (in a directory of mode 0700)."""
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".config-", suffix=".json")  # 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"url": url, "token": token}, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def forget() -> bool:
    """Remove the stored token (``hangar logout``); whether there was one."""
    path = config_path()
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True
