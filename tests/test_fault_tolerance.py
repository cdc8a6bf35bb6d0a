"""Beyond single faults: both ranks at once, non-retryable causes — real processes.

The time-driven rules (backoff, budget reset, stall watchdogs, give-up) are tested on a mock clock in
test_controller_clock.py.
"""

from __future__ import annotations

import pytest

from daemon_harness import (
    FAST_TIMEOUTS,
    assert_log_conforms,
    config,
    instance,
    wait_for,
    with_controller,
)
from exod.host.tiny_model import make_tiny_model
from exod.runner.faults import Fault, FaultKind, FaultPhase, FaultSpec

pytestmark = pytest.mark.usefixtures("no_runner_left_behind")


MODEL = "exod/tiny-qwen2"


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf")
    make_tiny_model(MODEL, layers=2, hf_home=home)
    return home


def ready_at(iid, generation):
    return lambda s: instance(s, iid)["state"] == "ready" and instance(s, iid)["generation"] == generation


def test_both_ranks_failing_at_once_cost_one_retry_and_do_not_deadlock(tmp_path, hf_home):
    both = FaultSpec(Fault(FaultPhase.LOADING, FaultKind.EXCEPTION), rank=None, generation=1)

    async def body(controller):
        iid = await controller.place(MODEL, 2)
        return instance(await wait_for(controller, ready_at(iid, 2)), iid)

    cfg = config(tmp_path, hf_home, faults=(both,))
    inst = with_controller(cfg, body)
    assert inst["attempts"] == 1 and "InjectedFault" in inst["last_failure"]
    assert_log_conforms(cfg.db_path)


@pytest.mark.parametrize("defect", ["bad config.json", "missing weights", "missing config.json"])
def test_non_retryable_causes_delete_with_zero_retries(tmp_path, hf_home, defect):
    home = tmp_path / "hf"
    snapshot = make_tiny_model("exod/tiny-broken", hf_home=home)
    if defect == "bad config.json":
        (snapshot / "config.json").write_text("{ this is not json")
    elif defect == "missing weights":
        (snapshot / "model.safetensors").unlink()
        (snapshot / "model.safetensors.index.json").unlink()
    else:
        (snapshot / "config.json").unlink()

    async def body(controller):
        iid = await controller.place("exod/tiny-broken", 1)
        status = await wait_for(controller, lambda s: instance(s, iid)["state"] == "deleted")
        await wait_for(controller, lambda s: all(r["state"] == "shutdown" for r in instance(s, iid)["runners"]))
        return instance(status, iid)

    inst = with_controller(config(tmp_path, home, timeouts=FAST_TIMEOUTS), body)
    assert inst["delete_reason"] == "non_retryable", inst
    assert inst["attempts"] == 0 and inst["generation"] == 1 and inst["last_failure"]
