"""Node-level isolation runtimes: what a node runs sandboxes with.

``base.py`` is the interface every launcher implements; ``registry.py`` finds launchers by
name (the ``hangar.launchers`` entry points); ``agent/`` is the guest agent and the code every
agent-based launcher shares; ``gvisor/`` is the gVisor launcher. A new runtime is a new
package beside it. Nothing here imports Django or the layers above.
"""
