"""A test launcher that is not gVisor as the node knows it: the gVisor launcher registered a
second time (as ``gvisor-reduced``, through HANGAR_LAUNCHER_CLASSES in tests/settings.py) with
network and checkpoints off. Its sandboxes are real gVisor sandboxes; what it lacks it really
lacks (a create with a network and a checkpoint raise), and the node advertises it so, which
the scheduler, the API, the create form and the pages must follow."""

from __future__ import annotations

from runtime.launchers.base import Capabilities
from runtime.launchers.gvisor.launcher import GVisorLauncher

NAME = "gvisor-reduced"


class ReducedGVisorLauncher(GVisorLauncher):
    name = NAME
    CAPABILITIES = Capabilities(network=False, checkpoint=False)
