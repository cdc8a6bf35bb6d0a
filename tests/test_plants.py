"""The planted regressions (`tools/plants.py`, `make plants`) kept from rotting: every plant still applies to the
code as it is (a plant that matches nowhere is a mechanism moved, and its plant must follow), a scratch copy's
packages are what its tests and their processes import, a plant the tests let through is said to survive, and
a short subset of the plants (``ci=True``) is caught here by the fast tests named for it, as in `make plants`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_plants():
    spec = importlib.util.spec_from_file_location("exod_plants", ROOT / "tools" / "plants.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # attrs resolves the classes' module by name
    spec.loader.exec_module(module)
    return module


plants = _load_plants()
CI = [plant for plant in plants.PLANTS if plant.ci]


def test_every_plant_applies_to_the_code_as_it_is_now():
    drifted = {plant.name: why for plant in plants.PLANTS if (why := plants.does_not_apply(plant))}
    assert not drifted, f"these plants no longer match the code (move them with it, in tools/plants.py): {drifted}"


def test_plant_names_are_unique_and_each_names_its_tests():
    names = [plant.name for plant in plants.PLANTS]
    assert len(names) == len(set(names))
    assert all(plant.tests and plant.edits for plant in plants.PLANTS)
    assert 2 <= len(CI) <= 3  # a minute or two of `make test`, no more


def test_an_edit_that_matches_nowhere_or_twice_is_refused_and_nothing_is_written(tmp_path):
    (tmp_path / "m.py").write_text("a = 1\na = 1\nb = 2\n")
    for old in ("c = 3\n", "a = 1\n"):
        with pytest.raises(plants.PlantDoesNotApply, match="not once: the code drifted"):
            plants.Edit("m.py", old, "x = 0\n").apply(tmp_path)
    with pytest.raises(plants.PlantDoesNotApply, match="does not exist"):
        plants.Edit("gone.py", "a", "b").apply(tmp_path)
    assert (tmp_path / "m.py").read_text() == "a = 1\na = 1\nb = 2\n"
    plants.Edit("m.py", "b = 2\n", "b = 3\n").apply(tmp_path)
    assert (tmp_path / "m.py").read_text() == "a = 1\na = 1\nb = 3\n"


def test_the_copy_shadows_the_installed_packages_in_pytest_and_its_processes(tmp_path):
    plants.copy_tree(tmp_path, plants.tree_files())
    plants.check_shadowing(tmp_path)  # raises, saying what was imported from where, unless it does
    (elsewhere := tmp_path / "elsewhere").mkdir()
    with pytest.raises(RuntimeError, match="does not shadow"):
        plants.check_shadowing(elsewhere)  # no packages there: the editable install's are imported, and said


def test_a_plant_the_tests_let_through_survives_and_fails_the_report():
    harmless = plants.Plant(
        "comment-only",
        "a comment changed: nothing for a test to see",
        (plants.Edit("fsm/backoff.py", '"""Exponential backoff', '"""Planted. Exponential backoff'),),
        ("tests/test_backoff.py::test_default_schedule_doubles_from_two_and_caps_at_thirty",),
    )
    caught = plants.Plant(
        "backoff-starts-at-three",
        "the copy's fsm is the one tested: a changed default is seen",
        (
            plants.Edit(
                "fsm/backoff.py",
                "initial: float = attrs.field(default=2.0,",
                "initial: float = attrs.field(default=3.0,",
            ),
        ),
        ("tests/test_backoff.py::test_default_schedule_doubles_from_two_and_caps_at_thirty",),
    )
    files = plants.tree_files()
    survived, seen = plants.run_plant(harmless, files), plants.run_plant(caught, files)
    assert survived.verdict == "survived", survived
    assert (seen.verdict, seen.caught_by) == ("caught", caught.tests[0]), seen
    text = plants.report([survived, seen], [], 1.0)
    assert "| `comment-only` |" in text and "**survived**" in text and "1 of 2 plants caught" in text


@pytest.mark.parametrize("plant", CI, ids=[plant.name for plant in CI])
def test_a_planted_regression_is_caught_by_the_tests_named_for_it(plant):
    outcome = plants.run_plant(plant, plants.tree_files())
    assert outcome.verdict == "caught", f"{plant.name} ({plant.what}): {outcome.verdict} {outcome.detail}"
    assert outcome.caught_by.split("::")[0] in {test.split("::")[0] for test in plant.tests}
