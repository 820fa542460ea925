"""A node's host-global names and address pool: its own, kept, and never another node's."""

from __future__ import annotations

import ipaddress
import json

import pytest

from runtime.host.hostnames import LEGACY_POOL, HostNames, address_pool, node_id, release_pool
from runtime.launchers.base import LauncherError


def test_a_node_id_is_made_once_and_kept(tmp_path):
    first = node_id(tmp_path)
    assert len(first) == 6 and int(first, 16) >= 0
    assert node_id(tmp_path) == first
    assert node_id(tmp_path / "other") != first  # (1 in 16M to fail)
    (tmp_path / "node-id").write_text("../../etc\n")
    with pytest.raises(LauncherError, match="not a node id"):
        node_id(tmp_path)


def test_every_host_global_name_carries_the_id_and_fits_the_kernel():
    names = HostNames("0a1b2c")
    assert names.table == "hangar_0a1b2c"
    assert names.cgroup_parent == "hangar-0a1b2c"
    assert names.netns_prefix == "hangar-0a1b2c-"
    assert names.iface_prefix == "h0a1b2c" and len(names.iface_prefix) + 8 == 15  # IFNAMSIZ - 1
    # Hex ids cannot make the legacy prefix "hg", nor be a prefix of another id's prefix.
    assert not names.iface_prefix.startswith("hg")


def test_two_nodes_take_different_pools_and_each_keeps_its_own(tmp_path):
    claims = tmp_path / "claims"
    a = address_pool(tmp_path / "a", claims_dir=claims)
    b = address_pool(tmp_path / "b", claims_dir=claims)
    assert not a.overlaps(b)
    assert address_pool(tmp_path / "a", claims_dir=claims) == a  # kept, whatever else happens
    assert (tmp_path / "a" / "network" / "pool").read_text().strip() == str(a)


def test_a_configured_pool_that_another_node_holds_is_refused_with_the_way_out(tmp_path):
    claims = tmp_path / "claims"
    a = address_pool(tmp_path / "a", claims_dir=claims)
    inside = str(next(a.subnets(new_prefix=24)))
    with pytest.raises(LauncherError, match=f"overlaps {a}.*HANGAR_NETWORK_POOL"):
        address_pool(tmp_path / "b", inside, claims_dir=claims)
    # Its own configured pool, elsewhere, is fine and claimed.
    assert str(address_pool(tmp_path / "b", "10.200.0.0/24", claims_dir=claims)) == "10.200.0.0/24"
    assert json.loads((claims / "10.200.0.0_24").read_text())["owner"] == str((tmp_path / "b").resolve())


def test_a_claim_whose_node_is_gone_is_taken_over(tmp_path):
    claims = tmp_path / "claims"
    a = address_pool(tmp_path / "a", claims_dir=claims)
    release_pool(tmp_path / "a", claims_dir=claims)
    assert not (claims / str(a).replace("/", "_")).exists()
    address_pool(tmp_path / "c", claims_dir=claims)  # now c's
    # A node whose state was removed without releasing: its claim no longer counts.
    c_pool = (tmp_path / "c" / "network" / "pool").read_text().strip()
    (tmp_path / "c" / "network" / "pool").unlink()
    assert str(address_pool(tmp_path / "d", claims_dir=claims)) == c_pool


def test_a_node_with_leases_from_before_pools_were_chosen_keeps_the_old_pool(tmp_path):
    leases = tmp_path / "n" / "network" / "leases"
    leases.mkdir(parents=True)
    (leases / "sbold.json").write_text("{}")
    assert str(address_pool(tmp_path / "n", claims_dir=tmp_path / "claims")) == LEGACY_POOL


def test_a_pool_never_overlaps_a_route_of_the_host(tmp_path, monkeypatch):
    from runtime.host import hostnames

    monkeypatch.setattr(hostnames, "_routed", lambda: [ipaddress.IPv4Network("10.88.4.0/24")])
    assert str(address_pool(tmp_path / "a", claims_dir=tmp_path / "claims")) != "10.88.0.0/16"
