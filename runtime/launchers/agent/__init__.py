"""The guest agent and what every agent-based launcher shares.

``hangar-agent.c`` is a small static C program that runs as PID 1 in every sandbox, compiled
on the node by ``build.py``; ``protocol.py`` is its wire protocol, ``client.py`` the host's
client over a pluggable ``transport.py``; ``launcher.py`` implements exec, live processes
(``process.py``), files, tunnels and the CA install (``ca.py``) on top of it.
"""
