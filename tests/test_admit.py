"""fsm.admit: every up-front refusal of a placement, one pure function."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import fsm
from fsm import Limits, ModelFacts, Refusal, UnknownModel, admit
from fsm.admit import MIB
from fsm.view import ClusterView, InstanceView, RetryStatus, Slot

GIB = 1024 * MIB
QWEN = ModelFacts(layers=24, attention_heads=14, kv_heads=2, pipeline=True, weight_bytes=1 * GIB)
LLAMA = ModelFacts(layers=16, attention_heads=32, kv_heads=8, pipeline=False, weight_bytes=2 * GIB)
LIMITS = Limits(runners_per_node=8, ranks_per_instance=6, instances_per_model=2, runner_floor_bytes=512 * MIB)
ONE_NODE = {"local": 16 * GIB}


def placed(*instances: tuple[str, str, list[str]], deleted: tuple[str, ...] = ()) -> ClusterView:
    """A view of instances ``(instance_id, model_id, node of each rank)``."""
    views = []
    for iid, model_id, nodes in instances:
        slots = [Slot(rank, node, f"{iid}/{rank}") for rank, node in enumerate(nodes)]
        state = fsm.InstanceState.DELETED if iid in deleted else fsm.InstanceState.BACKING_OFF
        views.append(InstanceView(iid, model_id, slots, RetryStatus(state, generation=1, attempts=1)))
    return ClusterView.build(instances=views)


def ask(ranks: int, *, model=QWEN, view=None, nodes=ONE_NODE, limits=LIMITS, facts=None, model_id="org/qwen"):
    return admit(model_id, ranks, model=model, view=view or placed(), nodes=nodes, limits=limits, facts=facts)


def test_a_placement_that_fits_is_admitted_on_the_node():
    answer = ask(2)
    assert answer.admitted and answer.nodes == ("local", "local") and answer.refusal is None


def test_an_unknown_model_is_refused_saying_where_it_was_looked_for():
    answer = ask(1, model=UnknownModel("not in the cache at /hf/hub, and offline"))
    assert answer.refusal is Refusal.UNKNOWN_MODEL and not answer.nodes
    assert answer.message == "model 'org/qwen' is not available: not in the cache at /hf/hub, and offline"


def test_a_fetchable_model_is_admitted_on_the_limits_alone():
    assert ask(6, model=None).admitted  # its layers are unknown until downloaded; the runner floor is counted
    assert ask(7, model=None).refusal is Refusal.TOO_MANY_RANKS


@pytest.mark.parametrize(
    ("model", "ranks", "ok"),
    [
        (QWEN, 6, True),  # a pipeline splits into up to as many ranks as layers (capped here by the limit)
        (ModelFacts(layers=2, attention_heads=4, kv_heads=2, pipeline=True, weight_bytes=0), 2, True),
        (ModelFacts(layers=2, attention_heads=4, kv_heads=2, pipeline=True, weight_bytes=0), 3, False),
        (LLAMA, 4, True),  # tensor parallel: the rank count divides 32 heads and 8 key/value heads
        (LLAMA, 3, False),
        (LLAMA, 6, False),
        (ModelFacts(layers=4, attention_heads=6, kv_heads=3, pipeline=False, weight_bytes=0), 3, True),
        (ModelFacts(layers=4, attention_heads=6, kv_heads=3, pipeline=False, weight_bytes=0), 2, False),
    ],
)
def test_more_ranks_than_the_model_splits_into_is_refused(model, ranks, ok):
    answer = ask(ranks, model=model)
    assert answer.admitted is ok
    if not ok:
        assert answer.refusal is Refusal.TOO_MANY_RANKS and f"cannot be split into {ranks} ranks" in answer.message


def test_the_refusal_names_the_most_ranks_the_model_takes():
    assert "at most 2" in ask(3, model=ModelFacts(2, 4, 2, pipeline=True, weight_bytes=0)).message
    assert "at most 8, and the rank count must divide the heads" in ask(3, model=LLAMA).message


def test_more_ranks_than_the_limit_is_refused_whatever_the_model():
    answer = ask(7)
    assert answer.refusal is Refusal.TOO_MANY_RANKS
    assert "ranks_per_instance = 6" in answer.message and "[limits] ranks_per_instance" in answer.message


def test_the_refusal_names_the_limit_that_binds_runners_per_node_when_the_nodes_run_fewer():
    """Issue #25: 12 runners per node on one host, ranks_per_instance sized from memory (47): the 422 named 47."""
    limits = Limits(runners_per_node=12, ranks_per_instance=47, instances_per_model=2, runner_floor_bytes=512 * MIB)
    one, two = (
        ask(20, limits=limits, model=None),
        ask(20, limits=limits, model=None, nodes={"a": 64 * GIB, "b": 64 * GIB}),
    )
    assert one.refusal is Refusal.TOO_MANY_RANKS and "runners_per_node = 12" in one.message
    assert "12 runners 1 node(s) may run" in one.message and "ranks_per_instance" not in one.message
    assert two.admitted  # 24 runners on two nodes: 20 ranks fit


def test_instances_per_model_counts_every_live_instance_of_that_model():
    two = placed(("a", "org/qwen", ["local"]), ("b", "org/qwen", ["local"]))
    answer = ask(1, view=two)
    assert answer.refusal is Refusal.LIMIT_REACHED and "already has 2 instances" in answer.message
    assert ask(1, view=two, model_id="org/other").admitted  # another model is not counted
    assert ask(1, view=placed(*[("a", "org/qwen", ["local"]), ("b", "org/qwen", ["local"])], deleted=("b",))).admitted


def test_runners_per_node_counts_reserved_ranks_of_backing_off_instances():
    busy = placed(("a", "org/x", ["local"] * 5), ("b", "org/y", ["local"] * 2))  # 7 of 8 reserved
    assert ask(1, view=busy).admitted
    answer = ask(2, view=busy)
    assert answer.refusal is Refusal.LIMIT_REACHED
    assert "runners_per_node = 8" in answer.message and "reserved: 7" in answer.message


def test_memory_counts_each_rank_share_of_the_weights_plus_the_runner_floor():
    small = {"local": 3 * GIB}
    big = ModelFacts(layers=24, attention_heads=14, kv_heads=2, pipeline=True, weight_bytes=4 * GIB)
    assert ask(2, model=big, nodes=small).refusal is Refusal.NO_MEMORY  # 2 GiB + 0.5 each: 5 GiB > 3
    answer = ask(6, model=big, nodes={"local": 8 * GIB})  # 683 MiB + 512 each: 7 GiB
    assert answer.admitted
    refused = ask(1, model=big, nodes=small)
    assert refused.refusal is Refusal.NO_MEMORY and "4608 MiB" in refused.message and "3072 MiB" in refused.message


def test_memory_reserved_by_placed_instances_uses_their_facts():
    view = placed(("a", "org/llama", ["local", "local"]))
    nodes = {"local": 4 * GIB}
    assert ask(1, view=view, nodes=nodes).admitted  # without facts, org/llama reserves 2 floors: 1 GiB
    answer = ask(1, view=view, nodes=nodes, facts={"org/llama": LLAMA})  # 2 x (1 GiB + 0.5) = 3 GiB, + 1.5
    assert answer.refusal is Refusal.NO_MEMORY


def test_ranks_go_to_distinct_nodes_first_the_most_room_first():
    nodes = {"a": 2 * GIB, "b": 3 * GIB, "c": 2 * GIB}
    answer = ask(4, model=None, nodes=nodes)  # a rank needs the 0.5 GiB floor
    assert answer.nodes == ("b", "a", "c", "b")  # one each (b has the most room; a, c tie: by id), then b again


@pytest.mark.parametrize("ranks", [0, -1, True, 2.0, "2"])
def test_ranks_that_are_no_positive_int_are_a_config_error(ranks):
    with pytest.raises(fsm.InvalidConfig, match="ranks must be an int >= 1"):
        ask(ranks)


def test_limits_for_memory_are_sized_by_the_runner_floor_not_the_cores():
    limits = Limits.for_memory(24 * GIB)
    assert (limits.runners_per_node, limits.ranks_per_instance, limits.instances_per_model) == (48, 48, 8)
    assert Limits.for_memory(256 * MIB).runners_per_node == 1
    assert Limits.for_memory(1024 * GIB).ranks_per_instance == 64
    with pytest.raises(fsm.InvalidConfig):
        Limits(runners_per_node=0, ranks_per_instance=1, instances_per_model=1)


MODELS = ("org/a", "org/b", "org/c")


@given(
    st.lists(st.tuples(st.sampled_from(MODELS), st.integers(1, 8)), max_size=20),
    st.tuples(*(st.sampled_from([QWEN, LLAMA, None]) for _ in MODELS)),
    st.lists(st.integers(1, 12), min_size=1, max_size=3),
)
def test_whatever_is_asked_the_admitted_placements_stay_within_every_limit(asks, known, memory_gib):
    nodes = {f"n{i}": gib * GIB for i, gib in enumerate(memory_gib)}
    facts = {m: f for m, f in zip(MODELS, known, strict=True) if f is not None}  # None: not downloaded yet
    instances: list[tuple[str, str, list[str]]] = []
    for number, (model_id, ranks) in enumerate(asks):
        view = placed(*instances)
        answer = admit(model_id, ranks, model=facts.get(model_id), view=view, nodes=nodes, limits=LIMITS, facts=facts)
        if not answer.admitted:
            assert answer.message and not answer.nodes
            continue
        assert len(answer.nodes) == ranks and set(answer.nodes) <= set(nodes)
        instances.append((f"i{number}", model_id, list(answer.nodes)))
    for model_id in {m for _, m, _ in instances}:
        assert sum(1 for _, m, _ in instances if m == model_id) <= LIMITS.instances_per_model
    for node, memory in nodes.items():
        here = [(m, len(ns)) for _, m, ns in instances for n in ns if n == node]
        assert len(here) <= LIMITS.runners_per_node
        share = {m: -(-f.weight_bytes // 1) for m, f in facts.items()}
        assert sum(LIMITS.runner_floor_bytes + (-(-share[m] // w) if m in share else 0) for m, w in here) <= memory


def test_place_again_moves_only_off_a_node_that_is_gone():
    view = placed(("a", "org/qwen", ["n1", "n2"]), ("b", "org/qwen", ["n3"]))
    live = {"n1": 4 * GIB, "n2": 4 * GIB, "n3": 4 * GIB}
    assert fsm.place_again("a", model=QWEN, view=view, nodes=live, limits=LIMITS) is None  # where it is
    gone = {"n1": 4 * GIB, "n3": 4 * GIB}
    assert fsm.place_again("a", model=QWEN, view=view, nodes=gone, limits=LIMITS) == ("n1", "n3")
    tiny = {"n1": GIB // 4}
    assert fsm.place_again("a", model=QWEN, view=view, nodes=tiny, limits=LIMITS) is None  # nothing fits: stays
