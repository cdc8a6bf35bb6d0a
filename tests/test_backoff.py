"""Backoff (the policy) and KeyedBackoff (per-key attempt bookkeeping)."""

from __future__ import annotations

import json
import math
import random

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fsm import Backoff, InvalidConfig, KeyedBackoff

# -- Backoff: the schedule ------------------------------------------------------


def test_default_schedule_doubles_from_two_and_caps_at_thirty() -> None:
    assert [Backoff().delay(n) for n in range(1, 8)] == [2, 4, 8, 16, 30, 30, 30]


def test_defaults_are_documented_values() -> None:
    policy = Backoff()
    assert (policy.initial, policy.factor, policy.cap, policy.jitter) == (2.0, 2.0, 30.0, False)


@pytest.mark.parametrize(
    ("initial", "factor", "cap"),
    [(2.0, 2.0, 30.0), (0.5, 2.0, 10.0), (0.001, 3.0, 5.0), (7.0, 1.0, 7.0), (1.0, 1.5, 1.0)],
)
def test_first_retry_waits_initial_never_zero(initial: float, factor: float, cap: float) -> None:
    delay = Backoff(initial=initial, factor=factor, cap=cap).delay(1)
    assert delay == initial
    assert delay > 0


def test_custom_schedule_is_exact() -> None:
    policy = Backoff(initial=0.5, factor=3.0, cap=10.0)
    assert [policy.delay(n) for n in range(1, 6)] == [0.5, 1.5, 4.5, 10.0, 10.0]


def test_delay_equals_ceiling_without_jitter() -> None:
    policy = Backoff(initial=1.0, factor=2.0, cap=100.0)
    assert all(policy.delay(n) == policy.ceiling(n) for n in range(1, 20))


def test_delay_without_jitter_ignores_rng() -> None:
    policy = Backoff()
    assert policy.delay(3, random.Random(1)) == policy.delay(3) == 8


@pytest.mark.parametrize("attempt", [10**6, 10**100])
def test_huge_attempt_returns_cap_without_overflow(attempt: int) -> None:
    assert Backoff().delay(attempt) == 30
    assert Backoff(initial=0.001, factor=10.0, cap=1e6).ceiling(attempt) == 1e6


@pytest.mark.parametrize("attempt", [1, 2, 10, 10**6, 10**100])
def test_factor_one_gives_constant_delay(attempt: int) -> None:
    assert Backoff(initial=3.0, factor=1.0, cap=30.0).delay(attempt) == 3.0
    assert Backoff(initial=3, factor=1, cap=30).delay(attempt) == 3


def test_attempt_beyond_float_range_returns_cap() -> None:
    assert Backoff().ceiling(10**400) == 30


def test_extreme_but_valid_ratio_does_not_overflow() -> None:
    assert Backoff(initial=1e-300, factor=2.0, cap=1e300).ceiling(2000) == 1e300


# -- Backoff: validation --------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"initial": 5.0, "cap": 4.0}, id="cap-below-initial"),
        pytest.param({"initial": 0.0}, id="initial-zero"),
        pytest.param({"initial": -1.0}, id="initial-negative"),
        pytest.param({"cap": 0.0, "initial": 0.0}, id="cap-zero"),
        pytest.param({"cap": -3.0}, id="cap-negative"),
        pytest.param({"factor": 0.5}, id="factor-below-one"),
        pytest.param({"factor": 0.0}, id="factor-zero"),
        pytest.param({"factor": -2.0}, id="factor-negative"),
        pytest.param({"initial": math.nan}, id="initial-nan"),
        pytest.param({"initial": math.inf, "cap": math.inf}, id="initial-inf"),
        pytest.param({"cap": math.nan}, id="cap-nan"),
        pytest.param({"cap": math.inf}, id="cap-inf"),
        pytest.param({"factor": math.nan}, id="factor-nan"),
        pytest.param({"factor": math.inf}, id="factor-inf"),
        pytest.param({"initial": "2"}, id="initial-str"),
        pytest.param({"factor": None}, id="factor-none"),
        pytest.param({"jitter": 1}, id="jitter-not-bool"),
    ],
)
def test_invalid_policy_raises_invalid_config(kwargs: dict) -> None:
    with pytest.raises(InvalidConfig):
        Backoff(**kwargs)


def test_invalid_config_is_a_value_error_naming_the_bound() -> None:
    with pytest.raises(ValueError, match=r"cap \(1\.0\) must be >= initial \(2\.0\)"):
        Backoff(initial=2.0, cap=1.0)


def test_cap_equal_to_initial_is_allowed() -> None:
    assert Backoff(initial=4.0, cap=4.0).delay(5) == 4.0


@pytest.mark.parametrize("attempt", [0, -1, -(10**9), 1.0, 1.5, "1", None, True, False])
@pytest.mark.parametrize("method", ["ceiling", "delay"])
def test_invalid_attempt_raises_invalid_config(method: str, attempt: object) -> None:
    with pytest.raises(InvalidConfig, match="attempt"):
        getattr(Backoff(), method)(attempt)


def test_policy_is_frozen() -> None:
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        Backoff().initial = 1.0  # type: ignore[misc]


# -- Backoff: jitter ----------------------------------------------------------------


def test_jitter_requires_an_rng() -> None:
    with pytest.raises(InvalidConfig, match="jitter"):
        Backoff(jitter=True).delay(1)


def test_jitter_still_validates_the_attempt() -> None:
    with pytest.raises(InvalidConfig, match="attempt"):
        Backoff(jitter=True).delay(0, random.Random(0))


def test_jittered_delays_lie_between_zero_and_the_ceiling() -> None:
    policy = Backoff(jitter=True)
    rng = random.Random(1234)
    for attempt in range(1, 12):
        for _ in range(50):
            assert 0.0 <= policy.delay(attempt, rng) <= policy.ceiling(attempt)


def test_jitter_actually_varies() -> None:
    policy = Backoff(jitter=True)
    rng = random.Random(7)
    delays = {policy.delay(5, rng) for _ in range(20)}
    assert len(delays) > 1
    assert max(delays) <= 30


def test_same_seed_gives_same_jittered_sequence() -> None:
    policy = Backoff(initial=1.0, factor=2.0, cap=60.0, jitter=True)
    rng_a, rng_b, rng_c = random.Random(42), random.Random(42), random.Random(43)
    seq_a = [policy.delay(n, rng_a) for n in range(1, 10)]
    seq_b = [policy.delay(n, rng_b) for n in range(1, 10)]
    seq_c = [policy.delay(n, rng_c) for n in range(1, 10)]
    assert seq_a == seq_b
    assert seq_a != seq_c


# -- Backoff: properties ------------------------------------------------------------

valid_policies = st.builds(
    lambda initial, factor, extra: (initial, factor, initial * extra),
    st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False),
    st.floats(min_value=1.0, max_value=100.0, allow_nan=False, allow_infinity=False),
    st.floats(min_value=1.0, max_value=1e6, allow_nan=False, allow_infinity=False),
)
attempts = st.one_of(st.integers(min_value=1, max_value=200), st.integers(min_value=1, max_value=10**100))


@given(valid_policies, attempts)
def test_ceiling_lies_between_initial_and_cap(params: tuple[float, float, float], attempt: int) -> None:
    initial, factor, cap = params
    ceiling = Backoff(initial=initial, factor=factor, cap=cap).ceiling(attempt)
    assert min(initial, cap) <= ceiling <= cap
    assert math.isfinite(ceiling)


@given(valid_policies, attempts)
def test_ceiling_is_non_decreasing(params: tuple[float, float, float], attempt: int) -> None:
    initial, factor, cap = params
    policy = Backoff(initial=initial, factor=factor, cap=cap)
    assert policy.ceiling(attempt) <= policy.ceiling(attempt + 1)


@given(valid_policies, st.integers(min_value=1, max_value=60))
def test_ceiling_is_non_decreasing_along_a_whole_schedule(params: tuple[float, float, float], upto: int) -> None:
    initial, factor, cap = params
    policy = Backoff(initial=initial, factor=factor, cap=cap)
    schedule = [policy.ceiling(n) for n in range(1, upto + 1)]
    assert schedule == sorted(schedule)
    assert schedule[0] == initial


@given(valid_policies, attempts, st.integers(min_value=0, max_value=2**32))
def test_jittered_delay_property(params: tuple[float, float, float], attempt: int, seed: int) -> None:
    initial, factor, cap = params
    policy = Backoff(initial=initial, factor=factor, cap=cap, jitter=True)
    delay = policy.delay(attempt, random.Random(seed))
    assert 0.0 <= delay <= policy.ceiling(attempt)
    assert delay == policy.delay(attempt, random.Random(seed))


# -- KeyedBackoff -----------------------------------------------------------------------


def test_unknown_key_is_free() -> None:
    keyed: KeyedBackoff[str] = KeyedBackoff()
    assert keyed.attempts("m") == 0
    assert keyed.deadline("m") is None
    assert keyed.should_proceed("m", now=0.0)
    assert keyed.should_proceed("m", now=-1e9)


def test_default_policy_is_the_default_backoff() -> None:
    assert KeyedBackoff().policy == Backoff()


def test_policy_must_be_a_backoff() -> None:
    with pytest.raises(TypeError):
        KeyedBackoff(policy="fast")  # type: ignore[arg-type]


def test_record_attempt_counts_and_sets_deadline() -> None:
    keyed = KeyedBackoff().record_attempt("m", now=100.0)
    assert keyed.attempts("m") == 1
    assert keyed.deadline("m") == 102.0
    assert not keyed.should_proceed("m", now=100.0)
    assert not keyed.should_proceed("m", now=101.999)
    assert keyed.should_proceed("m", now=102.0)
    assert keyed.should_proceed("m", now=500.0)


def test_consecutive_attempts_follow_the_policy() -> None:
    keyed: KeyedBackoff[str] = KeyedBackoff()
    deadlines = []
    for now in (0.0, 10.0, 20.0, 30.0, 40.0, 50.0):
        keyed = keyed.record_attempt("m", now=now)
        deadlines.append(keyed.deadline("m"))
    assert keyed.attempts("m") == 6
    assert deadlines == [2.0, 14.0, 28.0, 46.0, 70.0, 80.0]


def test_custom_policy_is_used() -> None:
    keyed = KeyedBackoff(Backoff(initial=1.0, factor=10.0, cap=50.0))
    keyed = keyed.record_attempt("k", now=0.0).record_attempt("k", now=1.0).record_attempt("k", now=11.0)
    assert keyed.attempts("k") == 3
    assert keyed.deadline("k") == 61.0


def test_record_attempt_with_jitter_needs_and_uses_an_rng() -> None:
    keyed = KeyedBackoff(Backoff(jitter=True))
    with pytest.raises(InvalidConfig):
        keyed.record_attempt("m", now=0.0)
    a = keyed.record_attempt("m", now=10.0, rng=random.Random(3))
    b = keyed.record_attempt("m", now=10.0, rng=random.Random(3))
    assert a == b
    deadline = a.deadline("m")
    assert deadline is not None
    assert 10.0 <= deadline <= 12.0


def test_record_attempt_is_immutable() -> None:
    before = KeyedBackoff().record_attempt("m", now=0.0)
    snapshot = attrs.evolve(before)
    after = before.record_attempt("m", now=5.0)
    assert after is not before
    assert before == snapshot
    assert before.attempts("m") == 1
    assert before.deadline("m") == 2.0
    assert after.attempts("m") == 2
    assert after.deadline("m") == 9.0


def test_keyed_backoff_is_frozen() -> None:
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        KeyedBackoff().policy = Backoff()  # type: ignore[misc]


def test_constructor_copies_the_mappings() -> None:
    attempts = {"m": 2}
    not_before = {"m": 50.0}
    keyed = KeyedBackoff(attempts_by_key=attempts, not_before_by_key=not_before)
    attempts["m"] = 99
    not_before["m"] = 0.0
    assert keyed.attempts("m") == 2
    assert keyed.deadline("m") == 50.0


def test_keys_are_independent() -> None:
    keyed = KeyedBackoff().record_attempt("a", now=0.0).record_attempt("a", now=3.0).record_attempt("b", now=1.0)
    assert keyed.attempts("a") == 2
    assert keyed.attempts("b") == 1
    assert keyed.attempts("c") == 0
    assert keyed.deadline("a") == 7.0
    assert keyed.deadline("b") == 3.0
    assert keyed.should_proceed("b", now=3.0)
    assert not keyed.should_proceed("a", now=3.0)
    assert keyed.should_proceed("c", now=0.0)


def test_reset_forgets_only_that_key() -> None:
    keyed = KeyedBackoff().record_attempt("a", now=0.0).record_attempt("b", now=0.0)
    reset = keyed.reset("a")
    assert reset.attempts("a") == 0
    assert reset.deadline("a") is None
    assert reset.should_proceed("a", now=0.0)
    assert reset.attempts("b") == 1
    assert reset.deadline("b") == 2.0
    # the original is untouched
    assert keyed.attempts("a") == 1
    assert keyed.deadline("a") == 2.0


def test_reset_then_record_starts_over_at_initial() -> None:
    keyed = KeyedBackoff().record_attempt("a", now=0.0).record_attempt("a", now=2.0).reset("a")
    keyed = keyed.record_attempt("a", now=10.0)
    assert keyed.attempts("a") == 1
    assert keyed.deadline("a") == 12.0


def test_reset_of_unknown_key_is_a_no_op() -> None:
    keyed = KeyedBackoff().record_attempt("a", now=0.0)
    reset = keyed.reset("zzz")
    assert reset == keyed
    assert reset.attempts("a") == 1
    assert reset.deadline("a") == 2.0
    assert KeyedBackoff().reset("x") == KeyedBackoff()


def test_reset_equals_fresh_after_all_keys_reset() -> None:
    keyed = KeyedBackoff().record_attempt("a", now=0.0).record_attempt("b", now=0.0)
    assert keyed.reset("a").reset("b") == KeyedBackoff()
    assert keyed != KeyedBackoff()


@given(st.lists(st.sampled_from("abc"), max_size=30), st.floats(min_value=0, max_value=1e6))
def test_attempts_count_records_per_key(keys: list[str], now: float) -> None:
    keyed: KeyedBackoff[str] = KeyedBackoff()
    for key in keys:
        keyed = keyed.record_attempt(key, now=now)
    for key in "abc":
        assert keyed.attempts(key) == keys.count(key)
        assert keyed.should_proceed(key, now=now) == (key not in keys)
        assert keyed.should_proceed(key, now=now + 30.0)


@pytest.mark.parametrize("now", [math.nan, math.inf, -math.inf, "5", None, True])
def test_record_attempt_refuses_a_now_that_is_not_a_finite_number(now: object) -> None:
    keyed = KeyedBackoff().record_attempt("a", now=0.0)
    before = attrs.evolve(keyed)
    with pytest.raises(InvalidConfig, match="now"):
        keyed.record_attempt("a", now=now)  # type: ignore[arg-type]
    with pytest.raises(InvalidConfig, match="now"):
        keyed.record_attempt("b", now=now)  # type: ignore[arg-type]
    assert keyed == before
    assert (keyed.attempts("a"), keyed.deadline("a"), keyed.attempts("b"), keyed.deadline("b")) == (1, 2.0, 0, None)
    assert keyed.should_proceed("a", now=2.0)  # the key is not blocked forever


def test_record_attempt_accepts_an_int_now() -> None:
    assert KeyedBackoff().record_attempt("a", now=10).deadline("a") == 12.0


def test_keyed_backoff_is_hashable_and_equal_values_hash_equal() -> None:
    a = KeyedBackoff().record_attempt("x", now=0.0).record_attempt("y", now=1.0)
    b = KeyedBackoff().record_attempt("y", now=1.0).record_attempt("x", now=0.0)
    assert a == b
    assert hash(a) == hash(b)
    assert hash(KeyedBackoff()) == hash(KeyedBackoff().record_attempt("x", now=0.0).reset("x"))
    assert len({a, b, KeyedBackoff()}) == 2
    c = KeyedBackoff(attempts_by_key={"x": 1}, not_before_by_key={"x": 2.0})
    assert c == KeyedBackoff().record_attempt("x", now=0.0)
    assert hash(c) == hash(KeyedBackoff().record_attempt("x", now=0.0))


def test_keyed_backoff_mappings_cannot_be_changed_in_place() -> None:
    keyed = KeyedBackoff().record_attempt("x", now=0.0)
    with pytest.raises(TypeError):
        keyed._attempts["x"] = 5  # type: ignore[index]
    assert keyed.attempts("x") == 1


@pytest.mark.parametrize(
    ("initial", "factor", "cap", "schedule"),
    [(0.3, 3.0, 0.9, [0.3, 0.9, 0.9]), (1.0, 1.7, 2.89, [1.0, 1.7, 2.89, 2.89]), (0.6, 6.0, 3.6, [0.6, 3.6, 3.6])],
)
def test_a_schedule_that_reaches_the_cap_gives_the_cap_exactly(
    initial: float, factor: float, cap: float, schedule: list[float]
) -> None:
    # initial * factor**n rounds just below cap here; the retry that reaches the cap must wait cap, not a hair less
    policy = Backoff(initial=initial, factor=factor, cap=cap)
    assert [policy.ceiling(n) for n in range(1, len(schedule) + 1)] == schedule


@pytest.mark.parametrize("cap", [0.0, -3.0, -1.0, -0.5])
def test_a_cap_not_above_zero_is_refused_naming_its_own_bound(cap: float) -> None:
    with pytest.raises(InvalidConfig, match=r"cap must be a finite number > 0"):
        Backoff(initial=1.0, cap=cap)


def test_reset_keeps_every_other_key_whatever_their_order() -> None:
    keyed = KeyedBackoff().record_attempt("a", now=0.0).record_attempt("b", now=0.0).record_attempt("c", now=0.0)
    reset = keyed.reset("b")
    assert [(k, reset.attempts(k), reset.deadline(k)) for k in "abc"] == [("a", 1, 2.0), ("b", 0, None), ("c", 1, 2.0)]


@pytest.mark.parametrize(
    ("attempts", "not_before"),
    [({"a": 2}, {}), ({}, {"a": 50.0}), ({"a": 2, "b": 1}, {"b": 9.0}), ({"b": 1}, {"a": 50.0, "b": 9.0})],
)
def test_reset_forgets_a_key_known_to_only_one_of_the_mappings(attempts: dict, not_before: dict) -> None:
    keyed = KeyedBackoff(attempts_by_key=attempts, not_before_by_key=not_before)
    reset = keyed.reset("a")
    assert (reset.attempts("a"), reset.deadline("a"), reset.should_proceed("a", now=0.0)) == (0, None, True)
    assert (reset.attempts("b"), reset.deadline("b")) == (keyed.attempts("b"), keyed.deadline("b"))


def test_a_keyed_backoff_as_a_dict_compares_equal_to_plain_dicts() -> None:
    keyed = KeyedBackoff().record_attempt("x", now=0.0)
    plain = {
        "policy": {"initial": 2.0, "factor": 2.0, "cap": 30.0, "jitter": False},
        "_attempts": {"x": 1},
        "_not_before": {"x": 2.0},
    }
    assert attrs.asdict(keyed) == plain
    assert attrs.asdict(keyed) != {**plain, "_attempts": {"x": 2}}
    assert attrs.asdict(keyed) != {**plain, "_attempts": {}}
    assert attrs.asdict(keyed) != {**plain, "_not_before": {"x": 2.0, "y": 1.0}}
    assert attrs.asdict(keyed) != {**plain, "_attempts": [("x", 1)]}


@pytest.mark.parametrize("factor", [2.0, 1.5, 1.0])
def test_the_first_delay_is_initial_exactly_as_given_even_an_int(factor: float) -> None:
    policy = Backoff(initial=3, factor=factor, cap=30)
    assert json.dumps([policy.delay(1), policy.ceiling(1)]) == "[3, 3]"  # not 3.0: a snapshot writes what it got
