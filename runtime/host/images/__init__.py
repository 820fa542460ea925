"""The image store: root filesystems for sandboxes, kept once per digest, with names.

``base`` (errors, names, digests of trees, shared helpers), ``layers`` (applying an untrusted layer
tar), ``oci`` (OCI layout / archive and docker-save sources, import), ``registry`` (pull),
``build`` (busybox and Debian rootfs builds), ``store`` (:class:`~.store.ImageStore`).

Stdlib only, no Django: a node uses it directly.
"""
