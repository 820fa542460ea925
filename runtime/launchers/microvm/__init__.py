"""The microVM launcher: one QEMU ``microvm`` machine per Hangar sandbox, with a kernel of its own.

``launcher.py`` is the launcher; ``boot.py`` what a VM boots from (the guest kernel, the
initramfs built from ``guest/hangar-mux.c`` and the guest agent, the image's root disk, the
sandbox's disk), the KVM probe and QEMU's command line. Each sandbox gets, under
``<state_dir>/sandboxes/<id>/``:

- ``disk.img``: the sandbox's own ext4 disk of ``disk_mb``, the upper layer of an overlay whose
  lower layer is the image's read-only root disk (``<state_dir>/boot/root-<key>.ext4``, built
  once per image and shared by every VM of it);
- ``vm.sock``: QEMU's end of the virtio-serial port named ``hangar``; ``agent.sock``: where the
  node-side ``hangar-mux host`` accepts the agent's client, one stream over the port per
  connection (the guest's /init is the other end, connecting each to the agent);
- ``config``: what the guest takes at boot (its environment, secrets included: root's only);
- ``console.log``: the guest kernel's console; ``mux.log``: the node-side mux's;
- ``handle.json``: the persisted handle (QEMU's and the mux's pids, for re-adoption).

QEMU and the mux are started in sessions of their own, so stopping Hangar's processes never
stops sandboxes.
"""
