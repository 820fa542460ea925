"""Placement: spread or pack, node_selector, capabilities, overcommit ratios, the reason per
node when none fits, and the reservation that concurrent creates cannot both take (real
Postgres transactions in threads)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test import Client
from django.utils import timezone

from runtime.errors import InvalidValue, NoCapacity
from runtime.models import Image, Node, Sandbox, Team
from runtime.services.nodes import node_pick, node_register
from tests.support import GVISOR

S = Sandbox.Status
MICROVM = {
    "microvm": {"network": True, "checkpoint": False, "kvm": True, "gpu": False, "max_command_bytes": 1 << 20}
}
NO_KVM = {"microvm": {**MICROVM["microvm"], "kvm": False}}


@pytest.fixture
def team(transactional_db):
    return Team.objects.create(name="t")


def _node(name: str, *, launchers=GVISOR, cpu: float = 4, memory_mb: int = 4096, labels=None) -> Node:
    node = node_register(name=name, launchers=launchers, cpu=cpu, memory_mb=memory_mb)
    if labels:
        Node.objects.filter(id=node.id).update(labels=labels)
        node.labels = labels
    return node


def _image(*nodes: Node, name: str = "img") -> Image:
    image, _ = Image.objects.get_or_create(name=name, defaults={"digest": "sha256:abc"})
    image.nodes.add(*nodes)
    return image


def _run(team: Team, node: Node, *, cpu: float = 1, memory_mb: int = 512) -> Sandbox:
    return Sandbox.objects.create(
        team=team,
        image="img",
        image_digest="sha256:abc",
        node=node,
        cpu=cpu,
        memory_mb=memory_mb,
        status=S.RUNNING,
    )


def test_spread_takes_the_emptiest_node_and_pack_the_fullest_that_fits(team, settings):
    a, b, c = _node("a"), _node("b"), _node("c")
    image = _image(a, b, c)
    _run(team, a, memory_mb=3000)  # a: 1096 MB free
    _run(team, b, memory_mb=1000)  # b: 3096 MB free; c: 4096
    settings.HANGAR_PLACEMENT = "spread"
    assert node_pick(runtime="gvisor", cpu=1, memory_mb=512, image=image) == c
    settings.HANGAR_PLACEMENT = "pack"
    assert node_pick(runtime="gvisor", cpu=1, memory_mb=512, image=image) == a
    # Pack takes the fullest node that still fits: a has no room for 2 GB, b has.
    assert node_pick(runtime="gvisor", cpu=1, memory_mb=2048, image=image) == b


def test_spread_fills_nodes_evenly_as_sandboxes_are_placed(team, settings):
    settings.HANGAR_PLACEMENT = "spread"
    nodes = [_node(f"n{i}") for i in range(3)]
    image = _image(*nodes)
    for _ in range(6):
        _run(team, node_pick(runtime="gvisor", cpu=1, memory_mb=512, image=image))
    counts = sorted(Sandbox.objects.filter(node=n).count() for n in nodes)
    assert counts == [2, 2, 2]


def test_node_selector_pins_a_node_and_one_no_node_matches_is_refused_with_the_reason(team):
    a = _node("a", labels={"zone": "a", "disk": "ssd"})
    b = _node("b", memory_mb=65536, labels={"zone": "b", "disk": "hdd"})  # the roomier one
    image = _image(a, b)
    assert node_pick(runtime="gvisor", cpu=1, memory_mb=512, image=image) == b
    assert node_pick(runtime="gvisor", cpu=1, memory_mb=512, image=image, node_selector={"zone": "a"}) == a
    assert node_pick(runtime="gvisor", cpu=1, memory_mb=512, image=image,
                     node_selector={"zone": "a", "disk": "ssd"}) == a  # fmt: skip
    # Labels no node of the fleet carries: the request must change (422), waiting would not help.
    with pytest.raises(InvalidValue, match=r"^node_selector: no node carries the labels zone=c "
                       r"\(no node: 2 lack label zone=c\)$") as exc:  # fmt: skip
        node_pick(runtime="gvisor", cpu=1, memory_mb=512, image=image, node_selector={"zone": "c"})
    assert exc.value.status_code == 422
    # All must match: a has zone=a but not disk=hdd.
    with pytest.raises(InvalidValue, match=r"\(no node: 1 lack label disk=hdd, 1 lack label zone=a\)$"):
        node_pick(
            runtime="gvisor", cpu=1, memory_mb=512, image=image, node_selector={"zone": "a", "disk": "hdd"}
        )
    # The node that carries them cannot take it now (cordoned): a 503, as for any full fleet.
    Node.objects.filter(id=a.id).update(state=Node.State.CORDONED)
    with pytest.raises(NoCapacity, match="^no node: 1 cordoned, 1 lack label zone=a$") as exc:
        node_pick(runtime="gvisor", cpu=1, memory_mb=512, image=image, node_selector={"zone": "a"})
    assert exc.value.status_code == 503


def test_a_refusal_counts_each_nodes_reason_in_one_line(team):
    lacking = [_node(f"nokvm{i}", launchers=NO_KVM) for i in range(2)]
    draining = _node("draining", launchers=MICROVM)
    Node.objects.filter(id=draining.id).update(state=Node.State.DRAINING)
    silent = _node("silent", launchers=MICROVM)
    Node.objects.filter(id=silent.id).update(heartbeat_at=timezone.now() - timedelta(hours=1))
    full = [_node(f"full{i}", launchers=MICROVM, memory_mb=1024) for i in range(3)]
    image = _image(*lacking, draining, silent, *full)
    for n in full:
        _run(team, n, memory_mb=1000)
    with pytest.raises(NoCapacity) as exc:
        node_pick(runtime="microvm", cpu=1, memory_mb=512, image=image, needs=["kvm"])
    assert exc.value.message == "no node: 1 draining, 3 full on memory, 2 lack kvm, 1 offline"


def test_a_capability_no_ready_node_of_the_runtime_has_is_a_422_with_the_reasons(team):
    a = _node("a", launchers={"gvisor": {**GVISOR["gvisor"], "network": False}})
    image = _image(a)
    with pytest.raises(InvalidValue, match=r"^network: the gvisor runtime gives sandboxes no network \(no node: 1 lack network\)$"):  # fmt: skip
        node_pick(runtime="gvisor", cpu=1, memory_mb=256, image=image, needs=["network"])


def test_overcommit_ratios_bound_cpu_and_memory_exactly(team, settings):
    settings.HANGAR_CPU_OVERCOMMIT = 2.0
    settings.HANGAR_MEMORY_OVERCOMMIT = 1.5
    node = _node("n", cpu=2, memory_mb=1000)  # room: 4 cpu, 1500 MB
    image = _image(node)
    for _ in range(4):
        _run(team, node_pick(runtime="gvisor", cpu=1, memory_mb=100, image=image), cpu=1, memory_mb=100)
    with pytest.raises(NoCapacity, match="^no node: 1 full on cpu$"):
        node_pick(runtime="gvisor", cpu=0.1, memory_mb=100, image=image)
    Sandbox.objects.filter(node=node).update(status=S.PAUSED)  # a paused sandbox holds no cpu or memory
    # Memory: 1500 MB to the MB.
    _run(team, node, cpu=0.5, memory_mb=1000)
    assert node_pick(runtime="gvisor", cpu=1, memory_mb=500, image=image) == node
    with pytest.raises(NoCapacity, match="^no node: 1 full on memory$"):
        node_pick(runtime="gvisor", cpu=1, memory_mb=501, image=image)
    with pytest.raises(NoCapacity, match="^no node: 1 full on cpu and memory$"):
        node_pick(runtime="gvisor", cpu=3.6, memory_mb=501, image=image)
    settings.HANGAR_MEMORY_OVERCOMMIT = 2.0
    assert node_pick(runtime="gvisor", cpu=3.5, memory_mb=1000, image=image) == node


def race(workers: int, place: Callable[[], object]) -> list:
    """``place()`` in ``workers`` threads released together, each with its own connection (and
    so its own transactions): what each returned, or the refusal's message."""
    barrier = threading.Barrier(workers)
    outcomes: list = []

    def one() -> None:
        try:
            barrier.wait()
            outcomes.append(place())
        except NoCapacity as exc:
            outcomes.append(exc.message)
        finally:
            connection.close()

    threads = [threading.Thread(target=one) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def _race(image: Image, team: Team, workers: int, memory_mb: int) -> list[str]:
    """``workers`` placements of one sandbox at once, each in its own transaction that holds the
    reservation a while before writing its row."""

    def place() -> str:
        with transaction.atomic():
            node = node_pick(runtime="gvisor", cpu=1, memory_mb=memory_mb, image=image)
            time.sleep(0.05)  # the others pick meanwhile
            _run(team, node, memory_mb=memory_mb)
        return "placed"

    return race(workers, place)


def test_two_concurrent_placements_on_the_last_unit_of_room_never_both_succeed(team):
    node = _node("n", cpu=4, memory_mb=1024)
    image = _image(node)
    _run(team, node, memory_mb=400)  # room for one more of 600
    outcomes = _race(image, team, workers=2, memory_mb=600)
    assert sorted(outcomes) == ["no node: 1 full on memory", "placed"]
    assert Sandbox.objects.filter(node=node, status=S.RUNNING).count() == 2


def test_many_concurrent_placements_fill_the_fleet_to_its_ratio_and_no_further(team, settings):
    settings.HANGAR_MEMORY_OVERCOMMIT = 1.5
    nodes = [_node(f"n{i}", cpu=16, memory_mb=1000) for i in range(2)]  # 1500 MB each: 3 of 500
    image = _image(*nodes)
    outcomes = _race(image, team, workers=10, memory_mb=500)
    assert outcomes.count("placed") == 6
    assert set(outcomes) - {"placed"} == {"no node: 2 full on memory"}
    for node in nodes:
        assert Sandbox.objects.filter(node=node).count() == 3


# -- the API ----------------------------------------------------------------------------------


def _post(raw: str, body: dict):
    r = Client().post("/api/v1/sandboxes", data=json.dumps(body), content_type="application/json",
                      HTTP_AUTHORIZATION=f"Bearer {raw}")  # fmt: skip
    return r.status_code, r.json()


@pytest.mark.parametrize(
    ("selector", "says"),
    [
        ({"zone": 1}, "node_selector"),
        ({"zone": ["a"]}, "node_selector"),
        ("zone=a", "node_selector"),
        ({"": "a"}, "label name '' must be 1-63"),
        ({"zone a": "x"}, "label name 'zone a' must be 1-63"),
        ({"z" * 64: "a"}, "must be 1-63"),
        ({"zone": "a" * 64}, "the value of 'zone' must be up to 63"),
        ({"zone": "a b"}, "the value of 'zone' must be up to 63"),
        ({f"k{i}": "v" for i in range(17)}, "node_selector"),
    ],
)
def test_a_bad_node_selector_is_a_422_that_says_why(team_token, selector, says):
    a = _node("a", labels={"zone": "a"})
    _image(a, name="busybox")
    status, body = _post(team_token, {"image": "busybox", "node_selector": selector, "wait": False})
    assert status == 422, body
    assert says in json.dumps(body)
    assert not Sandbox.objects.exists()


def test_node_selector_on_create_is_stored_used_and_echoed_and_an_unmatched_one_is_422(team_token):
    a = _node("a", labels={"zone": "a"})
    b = _node("b", memory_mb=65536, labels={"zone": "b"})
    _image(a, b, name="busybox")
    status, body = _post(team_token, {"image": "busybox", "memory_mb": 256, "node_selector": {"zone": "a"},
                                      "wait": False})  # fmt: skip
    assert status == 201, body
    assert body["node"] == "a" and body["node_selector"] == {"zone": "a"}
    assert Sandbox.objects.get(id=body["id"]).node_selector == {"zone": "a"}
    status, body = _post(team_token, {"image": "busybox", "node_selector": {"zone": "c"}, "wait": False})
    assert status == 422, body
    assert body["detail"] == "node_selector: no node carries the labels zone=c (no node: 2 lack label zone=c)"
    assert Sandbox.objects.count() == 1
