"""What every launcher whose sandboxes take a network from the node's :class:`Network` shares
(runtime/host/network.py): a policy changed live, the resolution files written through the
sandbox's agent, and reconciliation of what is left behind. A launcher built on
:class:`NetworkedMixin` holds ``network`` and ``sandboxes_dir`` and says whether a sandbox may
still be running (:meth:`_may_be_running`); the rules themselves are the same for every runtime."""

from __future__ import annotations

import abc
import contextlib
import os
from pathlib import Path
from typing import Any

from ...host.locks import file_lock
from ...host.network import Network, Policy, validate_policy
from ..base import Handle, LauncherError
from .client import AgentClient
from .protocol import AgentError


class NetworkedMixin(abc.ABC):
    name: str
    network: Network
    sandboxes_dir: Path

    @abc.abstractmethod
    def agent(self, handle: Handle) -> AgentClient: ...

    @abc.abstractmethod
    def handle_for(self, sandbox_id: str) -> Handle: ...

    @abc.abstractmethod
    def _network_available(self) -> bool:
        """Whether this node can give the launcher's sandboxes networks."""

    @abc.abstractmethod
    def _may_be_running(self, sandbox_id: str) -> bool:
        """Whether the sandbox runs, or may (its runtime cannot tell): its network stays."""

    def address_pool(self) -> str | None:
        return str(self.network.pool) if self._network_available() else None

    def _policy(self, spec_network: dict[str, Any] | None) -> Policy:
        policy = validate_policy(spec_network)
        # A network of its own when its policy lets anything out, or when it is asked for
        # with egress none (a warm pool's member, whose claim sets the policy).
        if (policy.enabled or spec_network) and not self._network_available():
            raise LauncherError(f"the {self.name} runtime gives sandboxes no network")
        return policy

    def set_network(self, handle: Handle, policy: dict[str, Any]) -> None:
        sandbox_id = handle["id"]
        parsed = validate_policy(policy)
        with file_lock(self.sandboxes_dir / f".{sandbox_id}.lock"):
            if self.network.lease_of(sandbox_id) is None:
                if parsed.enabled and not self._network_available():
                    raise LauncherError(f"the {self.name} runtime gives sandboxes no network")
                if parsed.enabled:
                    raise LauncherError(
                        "this sandbox was started without a network: its egress can change only from "
                        "its next start (pause and resume it), or create it with a network"
                    )
                return
            names = self.network.apply(sandbox_id, parsed)
            self._write_resolution(sandbox_id, parsed, names)

    def _write_resolution(self, sandbox_id: str, policy: Policy, names: dict[str, list[str]]) -> None:
        # Through the agent, inside the sandbox: a write from the host into its root would
        # follow a symlinked /etc out of it (and gVisor caches the root filesystem anyway).
        client = self.agent(self.handle_for(sandbox_id))
        lease = self.network.lease_of(sandbox_id)
        gateway = lease.host_ip if lease is not None else None
        for path, text in self.network.resolution_files(policy, names, gateway).items():
            with contextlib.suppress(AgentError):
                client.write_file(path, text.encode())

    def network_reconcile(self, live: dict[str, dict[str, Any]]) -> list[str]:
        if not self.network.dir.exists():
            return []  # no sandbox of this launcher ever had a network
        cleaned = []
        for sandbox_id in self.network.leftovers(set(live)):
            with file_lock(self.sandboxes_dir / f".{sandbox_id}.lock"):
                if self._may_be_running(sandbox_id):
                    continue  # not in the snapshot of live ones, but running (or maybe): leave it
                self.network.cleanup(sandbox_id)
                cleaned.append(sandbox_id)
        for sandbox_id in live:
            lease = self.network.lease_of(sandbox_id)
            if lease is None or not os.path.exists(lease.netns_path):
                continue  # no network, or paused: its rules are made again when it starts
            # Under the sandbox's lock, with the policy in force on the node (not the database's
            # snapshot): a change applied meanwhile is never undone here.
            with file_lock(self.sandboxes_dir / f".{sandbox_id}.lock"), contextlib.suppress(LauncherError):
                names = self.network.refresh(sandbox_id)
                policy = self.network.applied(sandbox_id)
                if names is not None and policy is not None:
                    self._write_resolution(sandbox_id, policy, names)
        return cleaned
