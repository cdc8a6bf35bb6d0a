"""fsm.placement.place: which node hosts each rank. Properties over any nodes, and the rules by example."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given
from hypothesis import strategies as st

import fsm
from fsm.placement import MIB, NodeRoom, NoFit, place

GIB = 1024 * MIB
MODEL = "org/model"

rooms = st.lists(
    st.builds(
        NodeRoom,
        node_id=st.sampled_from(["a", "b", "c", "d", "e"]),
        memory_free=st.integers(0, 8).map(lambda g: g * GIB // 2),
        runners_free=st.integers(0, 4),
        models=st.sets(st.sampled_from([MODEL, "org/other"])),
    ),
    max_size=5,
    unique_by=lambda r: r.node_id,
)
needs = st.integers(1, 6).map(lambda half_gib: half_gib * GIB // 2)


@given(rooms, st.integers(1, 10), needs)
def test_never_over_a_nodes_room_and_a_fit_whenever_one_exists(nodes, ranks, need):
    answer = place(MODEL, ranks, need, nodes)
    exists = sum(room.capacity(need) for room in nodes) >= ranks  # ranks are alike: room for them is a fit
    assert isinstance(answer, tuple) == exists
    if isinstance(answer, NoFit):
        assert answer.message
        return
    by_id = {room.node_id: room for room in nodes}
    for node, count in collections.Counter(answer).items():
        assert count * need <= by_id[node].memory_free and count <= by_id[node].runners_free


@given(rooms, st.integers(1, 10), needs, st.randoms(use_true_random=False))
def test_deterministic_whatever_the_order_the_nodes_come_in(nodes, ranks, need, rng):
    shuffled = list(nodes)
    rng.shuffle(shuffled)
    assert place(MODEL, ranks, need, nodes) == place(MODEL, ranks, need, shuffled)


@given(rooms, st.integers(1, 10), needs)
def test_distinct_nodes_for_distinct_ranks_as_far_as_they_go(nodes, ranks, need):
    answer = place(MODEL, ranks, need, nodes)
    if isinstance(answer, NoFit):
        return
    usable = sum(1 for room in nodes if room.capacity(need) > 0)
    assert len(set(answer)) == min(ranks, usable)


@given(rooms, needs)
def test_a_node_that_holds_the_model_takes_rank_0_when_one_can(nodes, need):
    answer = place(MODEL, 1, need, nodes)
    if any(MODEL in room.models and room.capacity(need) for room in nodes):
        assert isinstance(answer, tuple)
        assert MODEL in next(room.models for room in nodes if room.node_id == answer[0])


def test_the_rules_by_example():
    nodes = [
        NodeRoom("mac-a", 4 * GIB, 8),
        NodeRoom("mac-b", 6 * GIB, 8),
        NodeRoom("mac-c", 2 * GIB, 8, models={MODEL}),
        NodeRoom("mac-d", 6 * GIB, 8),
    ]
    # the holder first; then the most room, ties by id; one rank each before any gets a second
    assert place(MODEL, 5, GIB, nodes) == ("mac-c", "mac-b", "mac-d", "mac-a", "mac-c")
    assert place(MODEL, 2, GIB, nodes, pin=["mac-d", "mac-a", "mac-d"]) == ("mac-d", "mac-a")


def test_nothing_fits_says_what_each_node_lacks():
    nodes = [NodeRoom("a", 3 * GIB // 2, 4), NodeRoom("b", GIB // 2, 4), NodeRoom("c", 8 * GIB, 0)]
    answer = place(MODEL, 2, GIB, nodes)
    assert isinstance(answer, NoFit) and not answer.too_few_runners
    assert answer.message == (
        "2 ranks of 1024 MiB each do not fit (1 do): a takes 1; "
        "b has 512 MiB free, 512 MiB short of a rank; c is at runners_per_node"
    )
    limited = place(MODEL, 3, GIB, [NodeRoom("a", 8 * GIB, 1), NodeRoom("b", 8 * GIB, 1)])
    assert isinstance(limited, NoFit) and limited.too_few_runners


@pytest.mark.parametrize("pin", [["mac-z"], []])
def test_a_pin_to_no_live_node_is_a_config_error(pin):
    with pytest.raises(fsm.InvalidConfig, match="not among the live nodes"):
        place(MODEL, 1, GIB, [NodeRoom("mac-a", GIB, 1)], pin=pin)
