"""Hangar's MCP server: ``/mcp`` over streamable HTTP (``server.py``), its tools (``tools.py``),
and ``hangar mcp``, a stdio server that forwards to a remote Hangar's ``/mcp`` (``stdio.py``)."""
