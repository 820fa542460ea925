"""The gVisor launcher: one ``runsc`` sandbox per Hangar sandbox, driven through OCI bundles.

``launcher.py`` is the launcher; ``bundle.py`` the sandbox's directory and OCI spec;
``runsc.py`` invoking runsc; ``cgroups.py`` the sandbox's cgroups; ``checkpoint.py``
checkpoint and restore. Each sandbox gets, under ``<state_dir>/sandboxes/<id>/``:

- ``rootfs/``: an overlayfs whose lower dir is the cached image, so the image is shared
  copy-on-write and never written by a sandbox; its ``upper/`` and ``work/`` dirs are on:
- ``disk/``: the sandbox's own ext4 filesystem of ``disk_mb`` (see host/disks.py), mounted at
  ``disk/fs``, so what it writes can never fill the node's disk (a sandbox created with no
  disk of its own, ``disk_mb=0``, has them in its directory instead);
- ``run/``: bind-mounted at ``/.hangar/run``; the guest agent (PID 1, bind-mounted read-only
  at ``/.hangar/agent``) listens on ``run/agent.sock``. runsc runs with ``--host-uds=create``
  so that socket is a real host socket: exec and file calls are one unix-socket round trip
  instead of a ``runsc exec`` process each (~45 ms here);
- ``log/console.log``: runsc's and the agent's stdout and stderr (a 1 MB tmpfs, as ``run/`` is);
- ``bundle/config.json`` and ``handle.json`` (the persisted handle, for re-adoption);
- ``checkpoint/``: while paused in checkpoint mode, the saved sandbox (``runsc checkpoint``).

runsc is started in its own session, so stopping Hangar's processes never stops sandboxes.
"""
