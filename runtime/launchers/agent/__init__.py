"""The guest agent: a small static C program that runs as PID 1 in every sandbox.

``build.agent_binary()`` compiles it on first use; ``runtime.launchers.agent_client`` talks to it.
"""
