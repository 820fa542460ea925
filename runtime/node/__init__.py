"""What runs on a node: the node's launchers and stores (:mod:`.local`), its stream bridge
(:mod:`.bridge`), tunnels to sandbox ports for other machines (:mod:`.tunnels`) and the
``hangar.internal`` door (:mod:`.door`). Imports none of them, so importing one costs only it.
"""
