"""The control plane's model (`fsm.fencing`): with the four fencing mechanisms, no state the adversary can
reach has two generations of runner processes alive; each mechanism switched off, and each of the three ways
the cluster broke by hand (issue #24), is found, with a shortest trace that shows the failure. After every
heal the instance can be Ready again; each of the two mechanisms that keep it so, switched off, is found."""

from __future__ import annotations

import pytest

from fsm.fencing import FAULTS, LIVENESS, MECHANISMS, SAFETY, Fault, FencingConfig, Mechanism, check_fencing

SMALL = {"nodes": 2, "ranks": 1, "max_faults": 1, "generations": 3, "horizon": 10}


def without(*mechanisms: Mechanism) -> frozenset[Mechanism]:
    return MECHANISMS - set(mechanisms)


def test_the_default_configuration_is_explored_exhaustively_and_never_runs_two_generations():
    result = check_fencing()
    assert result.ok and result.exhaustive, result.report()
    assert result.states > 100_000  # it explored something of size (3 nodes, every fault once, two generations)
    assert "Ready again after every heal" in result.report()


def test_two_nodes_with_three_generations_and_every_fault_are_safe_too():
    result = check_fencing(FencingConfig(**SMALL))
    assert result.ok and result.exhaustive, result.report()


@pytest.mark.parametrize(
    ("off", "faults", "shows"),
    [
        ({Mechanism.ONE_PATH}, FAULTS, "paused"),  # its own ranks had no key: the next controller cannot see them
        # a deposed term's command, obeyed late (the stream it names, over by then, refuses it too: both off)
        ({Mechanism.TERM, Mechanism.STREAM}, FAULTS, "deliver spawn g1 (term 1)"),
        ({Mechanism.DEADLINE}, FAULTS, "paused"),  # a paused daemon's runner runs on
        ({Mechanism.ONE_PATH, Mechanism.CLOCK}, {Fault.CUT}, "cut off"),  # the row of the controller cut off
        ({Mechanism.CLOCK, Mechanism.TERM, Mechanism.STREAM}, {Fault.CUT_ETCD}, "cut from etcd"),  # from etcd alone
        ({Mechanism.STREAM}, {Fault.CUT}, "finds its term 1 alive"),  # a spawn from before it took its term back
    ],
    ids=["one path", "term", "deadline", "controller cut off", "controller cut from etcd", "stream"],
)
def test_each_planted_bug_is_found_with_a_shortest_trace_that_shows_it(off, faults, shows):
    result = check_fencing(FencingConfig(**SMALL, faults=frozenset(faults), mechanisms=without(*off)))
    assert not result.ok and result.violation.invariant == SAFETY, result.report()
    trace = result.violation.trace
    assert any(shows in event for event in trace), result.report()
    assert len(trace) <= 13 and SAFETY in result.report()


@pytest.mark.parametrize(
    ("off", "shows"),
    [
        (Mechanism.TOMBSTONE, "deliver stop g1"),  # the stop came first; the spawn after it would run for ever
        (Mechanism.RESUME, "n0's daemon paused"),  # stepped down by its clock, its key alive: nobody may campaign
    ],
    ids=["tombstone", "resume"],
)
def test_each_mechanism_of_liveness_switched_off_leaves_a_heal_from_which_ready_never_comes(off, shows):
    paused = frozenset({Fault.PAUSE})  # the heal that shows it; any would do
    result = check_fencing(FencingConfig(**SMALL, faults=paused, mechanisms=without(off)))
    assert result.exhaustive and not result.ok and result.violation.invariant == LIVENESS, result.report()
    assert any(shows in event for event in result.violation.trace), result.report()
    assert "never Ready again after the heal" in result.report()


def test_an_agents_paused_daemon_breaks_it_without_the_deadline_on_three_nodes_too():
    config = FencingConfig(
        nodes=3, ranks=2, max_faults=1, faults=frozenset({Fault.PAUSE}), mechanisms=without(Mechanism.DEADLINE)
    )
    result = check_fencing(config)
    assert not result.ok and "paused" in " ".join(result.violation.trace)


def test_the_clock_is_what_saves_a_controller_cut_off_with_ranks_it_spawned_itself():
    """Without one path, a cut-off controller's own runners have no key; ending its term by the clock is then
    what kills them before its lease can expire. (With the other three mechanisms on, the model finds the
    clock redundant for this invariant: it also keeps a deposed controller from acting, which is not modelled.)"""
    cut = frozenset({Fault.CUT})
    with_clock = check_fencing(FencingConfig(**SMALL, faults=cut, mechanisms=without(Mechanism.ONE_PATH)))
    without_clock = check_fencing(
        FencingConfig(**SMALL, faults=cut, mechanisms=without(Mechanism.ONE_PATH, Mechanism.CLOCK))
    )
    assert with_clock.ok and with_clock.exhaustive, with_clock.report()
    assert not without_clock.ok


def test_a_state_limit_makes_the_result_bounded_not_exhaustive():
    result = check_fencing(FencingConfig(max_states=1_000))
    assert result.ok and not result.exhaustive and "bounded" in result.report()


def test_impossible_sizes_are_refused():
    with pytest.raises(ValueError, match="ranks"):
        FencingConfig(nodes=2, ranks=3)


def test_exod_check_fencing_says_what_it_found_and_exits_1_on_a_violation():
    from click.testing import CliRunner

    from exod.cli import main

    safe = CliRunner().invoke(main, ["check-fencing", "--nodes", "2"])
    broken = CliRunner().invoke(main, ["check-fencing", "--nodes", "2", "--without", "deadline"])
    assert (
        safe.exit_code == 0
        and "exhaustive" in safe.output
        and "never two generations, nor two processes of a rank, alive" in safe.output
    )
    assert broken.exit_code == 1 and "shortest trace" in broken.output and "paused" in broken.output


def test_two_processes_of_one_rank_are_a_violation_even_of_one_generation():
    """The invariant counts processes per rank, as the overlap bench and the campaign watch them from /proc: a
    set of generations alive would not see two processes of rank 0 of the same generation."""
    from fsm.fencing import NONE, _Model, _Proc

    model = _Model(FencingConfig(**SMALL))
    one = model.initial()._replace(procs=(frozenset({_Proc(1, NONE, False, 0)}), frozenset()))
    twice = one._replace(procs=(one.procs[0], frozenset({_Proc(1, NONE, False, 0)})))
    two_ranks = one._replace(procs=(one.procs[0], frozenset({_Proc(1, NONE, False, 1)})))
    assert model.violated(one) is None and model.violated(two_ranks) is None
    assert model.violated(twice) == "generation 1 rank 0 on n0, generation 1 rank 0 on n1"
