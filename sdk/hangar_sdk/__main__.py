"""``python -m hangar_sdk``: the ``hangar`` command."""

from .cli import run

run()
