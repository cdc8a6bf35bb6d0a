"""The controller with real runner processes, real MLX and the generated tiny model."""

from __future__ import annotations

import os
import signal

import pytest
import trio

import fsm
from daemon_harness import (
    assert_log_conforms,
    config,
    instance,
    wait_for,
    with_controller,
)
from exod.host.tiny_model import make_tiny_model
from exod.requests import RequestFailed

pytestmark = pytest.mark.usefixtures("no_runner_left_behind")


MESSAGES = [{"role": "user", "content": "Hello! What is a state machine?"}]
SAMPLED = {"temperature": 1.0, "seed": 7}
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf")
    make_tiny_model("exod/tiny-qwen2", arch="qwen2", layers=4, hf_home=home)
    return home


def test_a_controller_deposed_before_it_shuts_down_stops_its_runners_and_ends_quietly(tmp_path, hf_home):
    """Found by the fault campaign (#26): a SIGTERM to a node whose term had just ended (etcd refused its last
    write) ended the daemon with a traceback and no `leave`, after its runners were stopped."""
    from daemon_harness import runner_pids
    from exod.cluster.election import Deposed

    async def deposed() -> bool:
        raise Deposed("node node-1 is no longer the controller: etcd refused its write")

    async def body(controller):
        iid = await controller.place("exod/tiny-qwen2", 1)
        await wait_for(controller, is_ready(iid))
        controller.journal.durable = deposed
        await controller.shutdown()  # no Deposed out of it
        return runner_pids()

    assert with_controller(config(tmp_path, hf_home), body) == []


@pytest.mark.parametrize("refused", ["place", "delete"])
def test_a_placement_or_a_delete_the_store_refuses_is_not_acknowledged(tmp_path, hf_home, refused):
    """Found by the fault campaign (#26): a controller cut from etcd answered 201 to a placement whose write
    had just failed, stepped down, and the placement was lost. Now the caller hears it is not stored; once the
    store is degraded, the next one is refused before anything changes."""
    from exod.api.instances import unstored
    from exod.controller import NotStoredYet, StoreUnavailable
    from exod.state.store import StateUnavailable

    async def refuse(*args, **kwargs) -> None:
        raise StateUnavailable("cannot reach etcd at http://127.0.0.1:2379")

    async def body(controller):
        placed = await controller.place("exod/tiny-qwen2", 1)
        controller.journal.state.save = refuse
        first, then = (
            (controller.place("exod/tiny-qwen2", 1), controller.delete(placed))
            if refused == "place"
            else (controller.delete(placed), controller.place("exod/tiny-qwen2", 1))
        )
        with pytest.raises(NotStoredYet, match="not stored yet") as made:  # made, not yet written: not undone
            await first
        assert unstored(made.value).code == "not_stored_yet"  # a client can tell it from a refusal

        def placements() -> dict[str, str | None]:
            return {i["instance_id"]: i["delete_reason"] for i in controller.status()["instances"]}

        before = placements()
        with pytest.raises(StoreUnavailable, match="wait until it can be written again") as refusal:
            await then
        assert placements() == before  # refused up front: nothing placed, nothing deleted
        assert not isinstance(refusal.value, NotStoredYet) and unstored(refusal.value).code is None

    with_controller(config(tmp_path, hf_home), body)


def reference_text(snapshot, **sampling) -> str:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = mlx_lm.load(str(snapshot))
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    mx.random.seed(sampling.get("seed", 0))
    sampler = make_sampler(temp=sampling.get("temperature", 0.0))
    return mlx_lm.generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS, sampler=sampler)


def is_ready(iid):
    return lambda s: instance(s, iid)["state"] == "ready"


async def chat(controller, iid, **sampling) -> str:
    text = ""
    async for item in controller.requests.generate(iid, MESSAGES, max_tokens=MAX_TOKENS, **sampling):
        text += getattr(item, "text", "")
    return text


@pytest.mark.parametrize("ranks", [1, 2])
def test_instance_reaches_ready_and_generates_like_mlx_lm(tmp_path, hf_home, ranks):
    from exod.host.models import resolve_model

    snapshot = resolve_model("exod/tiny-qwen2", hf_home=hf_home, offline=True)

    async def body(controller):
        iid = await controller.place("exod/tiny-qwen2", ranks)
        status = await wait_for(controller, is_ready(iid))
        assert [r["state"] for r in instance(status, iid)["runners"]] == ["ready"] * ranks
        return await chat(controller, iid), await chat(controller, iid, **SAMPLED)

    greedy, sampled = with_controller(config(tmp_path, hf_home), body)
    assert greedy == reference_text(snapshot)
    assert sampled == reference_text(snapshot, **SAMPLED)
    assert len(sampled) > 0


def test_concurrent_seeded_requests_share_a_batch_and_each_matches_its_lone_reference(tmp_path, hf_home):
    from exod.host.models import resolve_model

    snapshot = resolve_model("exod/tiny-qwen2", hf_home=hf_home, offline=True)
    seeds = [1, 2, 3, 4]

    async def body(controller):
        iid = await controller.place("exod/tiny-qwen2", 2)
        await wait_for(controller, is_ready(iid))
        results: dict[int, str] = {}

        async def one(seed):
            results[seed] = await chat(controller, iid, temperature=1.0, seed=seed)

        async with trio.open_nursery() as nursery:
            for seed in seeds:
                nursery.start_soon(one, seed)
        return results

    results = with_controller(config(tmp_path, hf_home), body)
    for seed in seeds:
        assert results[seed] == reference_text(snapshot, temperature=1.0, seed=seed)
    assert len(set(results.values())) > 1  # different seeds, different texts: the check has teeth


def test_sigkill_while_ready_recovers_with_backoff_after_reaping_the_generation(tmp_path, hf_home):
    async def body(controller):
        iid = await controller.place("exod/tiny-qwen2", 2)
        await wait_for(controller, is_ready(iid))
        victim = controller.processes.pid(f"{iid}/1", 1)
        os.kill(victim, signal.SIGKILL)
        status = await wait_for(controller, lambda s: instance(s, iid)["generation"] == 2 and is_ready(iid)(s))
        assert await chat(controller, iid)  # serves again
        return iid, instance(status, iid)

    cfg = config(tmp_path, hf_home)
    iid, inst = with_controller(cfg, body)
    assert inst["attempts"] == 1
    from exod.state.sqlite import Store

    store = Store.open(cfg.db_path)
    log = [e for _, e in store.transitions()]
    store.close()
    assert_log_conforms(cfg.db_path)
    moves = [(e.machine, e.key, e.source, e.target) for e in log]
    assert ("runner", f"{iid}/1", "failed", "stopped") in moves
    recovering = moves.index(("instance", iid, "ready", "recovering"))
    backing_off = moves.index(("instance", iid, "recovering", "backing_off"))
    restart = moves.index(("instance", iid, "backing_off", "starting"))
    assert recovering < backing_off < restart
    # the dead generation was fully reaped before the new one started
    gen1_stops = [i for i, m in enumerate(moves) if m[0] == "runner" and m[3] == "stopped" and i < restart]
    assert len(gen1_stops) == 2
    creates = [i for i, e in enumerate(log) if e.event == "create"]
    assert len(creates) == 4 and all(i > restart for i in creates[2:])
    # how long the backoff lasts, exactly, is test_controller_clock's (on a mock clock)
    assert "SIGKILL" in log[moves.index(("runner", f"{iid}/1", "available", "failed"))].cause


def test_a_local_model_directory_from_the_config_is_placed_and_served(tmp_path, hf_home):
    import shutil

    from exod.host.models import resolve_model

    directory = tmp_path / "my model"
    shutil.copytree(resolve_model("exod/tiny-qwen2", hf_home=hf_home, offline=True), directory)

    async def body(controller):
        model_id = controller.register_local_model(directory)
        iid = await controller.place(model_id, 1)
        await wait_for(controller, is_ready(iid))
        return model_id, await chat(controller, iid)

    model_id, text = with_controller(config(tmp_path, tmp_path / "empty-hf"), body)
    assert model_id == "local/my-model"
    assert text == reference_text(directory)


def test_corrupt_model_is_deleted_as_non_retryable_with_zero_retries(tmp_path):
    home = tmp_path / "hf"
    snapshot = make_tiny_model("exod/tiny-broken", hf_home=home)
    weights = snapshot / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

    async def body(controller):
        iid = await controller.place("exod/tiny-broken", 1)
        status = await wait_for(controller, lambda s: instance(s, iid)["state"] == "deleted")
        await wait_for(controller, lambda s: all(r["state"] == "shutdown" for r in instance(s, iid)["runners"]))
        return instance(status, iid)

    cfg = config(tmp_path, home)
    inst = with_controller(cfg, body)
    assert_log_conforms(cfg.db_path)
    assert inst["delete_reason"] == "non_retryable"
    assert inst["attempts"] == 0 and inst["generation"] == 1
    assert "safetensors" in inst["last_failure"].lower() or "corrupt" in inst["last_failure"].lower()


def test_an_unknown_model_offline_is_refused_up_front_and_says_what_to_do(tmp_path, hf_home):
    from exod.placer import PlacementRefused

    async def body(controller):  # a fetchable model that fails to download: test_controller_clock
        with pytest.raises(PlacementRefused) as refused:
            await controller.place("exod/not-there", 1)
        return refused.value, controller.status(), list(await controller.transitions())

    refused, status, log = with_controller(config(tmp_path, hf_home), body, limit=30)
    assert refused.refusal is fsm.Refusal.UNKNOWN_MODEL
    assert "offline" in str(refused) and "exod model make-tiny" in str(refused)  # the cause, and what to do
    assert status["instances"] == [] and log == []  # nothing stored


def test_delete_ends_in_flight_requests_with_an_error(tmp_path, hf_home):
    async def body(controller):
        iid = await controller.place("exod/tiny-qwen2", 1)
        await wait_for(controller, is_ready(iid))
        with pytest.raises(RequestFailed):
            async for _ in controller.requests.generate(iid, MESSAGES, max_tokens=100_000):
                await controller.delete(iid)
        return instance(controller.status(), iid)

    assert with_controller(config(tmp_path, hf_home), body)["delete_reason"] == "requested"


def test_a_model_gone_from_the_cache_after_a_restart_is_fetched_again_not_a_crash(tmp_path):
    import shutil

    home = tmp_path / "hf"
    make_tiny_model("exod/tiny-qwen2", hf_home=home)
    cfg = config(tmp_path, home)

    async def first(controller):
        iid = await controller.place("exod/tiny-qwen2", 1)
        await wait_for(controller, is_ready(iid))
        return iid

    iid = with_controller(cfg, first)
    shutil.rmtree(home)

    async def second(controller):
        return await wait_for(controller, lambda s: (instance(s, iid)["download"] or {}).get("attempts", 0) >= 1)

    inst = instance(with_controller(cfg, second), iid)
    assert inst["state"] == "starting" and "neither cached" in inst["download"]["last_error"]
    assert inst["attempts"] == 0  # the daemon's restart and the lost cache charge no retry


def test_download_progress_from_foreign_threads_reaches_the_machine(tmp_path, hf_home, monkeypatch):
    import threading

    import exod.host.models
    from exod.host.models import resolve_model

    snapshot = resolve_model("exod/tiny-qwen2", hf_home=hf_home, offline=True)

    def fake_resolve(model_id, *, progress=None, **kwargs):  # like huggingface_hub: progress from its own threads
        if progress is None:  # admission looking for the model's files: not downloaded yet
            raise exod.host.models.ModelNotFound(model_id)
        worker = threading.Thread(target=lambda: [progress(n, 300) for n in (100, 200, 300)])
        worker.start()
        worker.join()
        return snapshot

    monkeypatch.setattr(exod.host.models, "resolve_model", fake_resolve)
    seen = []

    async def body(controller):
        original = controller._downloads._bytes
        controller._downloads._bytes = lambda n, m, d, t: (seen.append((d, t)), original(n, m, d, t))
        iid = await controller.place("exod/tiny-qwen2", 1)
        await wait_for(controller, is_ready(iid))
        return instance(controller.status(), iid)

    inst = with_controller(config(tmp_path, hf_home, offline=False), body)
    assert seen == [(100, 300), (200, 300), (300, 300)]
    assert inst["download"]["bytes"] == [300, 300]


def test_requests_the_runner_could_not_decode_and_unregistered_local_models_are_refused(tmp_path, hf_home):
    from exod.requests import InvalidRequest

    async def body(controller):
        iid = await controller.place("exod/tiny-qwen2", 1)
        await wait_for(controller, is_ready(iid))
        with pytest.raises(InvalidRequest):  # a stop that is not text: the runner would refuse the line
            controller.requests.submit(iid, [{"role": "user", "content": "hi"}], stop=[3])
        with pytest.raises(fsm.InvalidConfig, match="local model"):
            await controller.place("local/anything", 1)
        assert await chat(controller, iid)  # nothing else was disturbed
        return instance(controller.status(), iid)

    assert with_controller(config(tmp_path, hf_home), body)["attempts"] == 0


def test_only_the_newest_deleted_instances_are_kept(tmp_path, hf_home, monkeypatch):
    import exod.controller

    monkeypatch.setattr(exod.controller, "KEEP_DELETED", 2)

    async def body(controller):
        ids = [await controller.place("exod/tiny-qwen2", 1) for _ in range(4)]
        for iid in ids:
            await controller.delete(iid)
        await wait_for(controller, lambda s: len(s["instances"]) == 2)
        return ids, [i["instance_id"] for i in controller.status()["instances"]]

    ids, kept = with_controller(config(tmp_path, hf_home), body, limit=30)
    assert kept == ids[2:]


def test_a_model_removed_from_the_cache_while_it_runs_is_fetched_again_not_deleted(tmp_path):
    """README: a model that vanished is resolved again. The runner that dies of it is not the model's defect."""
    import shutil

    from daemon_harness import runner_pids

    home = tmp_path / "hf"
    make_tiny_model("exod/tiny-qwen2", hf_home=home)
    cfg = config(tmp_path, home)

    async def body(controller):
        iid = await controller.place("exod/tiny-qwen2", 1)
        await wait_for(controller, is_ready(iid))
        shutil.rmtree(home / "hub")  # `huggingface-cli delete-cache` while it serves
        (pid,) = runner_pids()
        os.kill(pid, signal.SIGKILL)
        waiting = await wait_for(
            controller, lambda s: (instance(s, iid)["download"] or {}).get("last_error", "") and True
        )
        make_tiny_model("exod/tiny-qwen2", hf_home=home)  # the model comes back (offline: into the cache)
        ready = await wait_for(controller, lambda s: instance(s, iid)["state"] == "ready", timeout=90)
        return instance(waiting, iid), instance(ready, iid)

    waiting, ready = with_controller(cfg, body, limit=120)
    assert waiting["state"] == "starting" and waiting["waiting_for"] == "download"
    assert "neither cached" in waiting["download"]["last_error"]
    assert ready["delete_reason"] is None and ready["generation"] >= 2


def test_a_rank_killed_mid_generation_is_blamed_not_the_peer_that_lost_it(tmp_path, hf_home):
    """Rank 0 sees '[ring] connection to a peer was lost', maybe before rank 1's exit is seen: the cause wins."""
    from daemon_harness import runner_pid

    async def body(controller):
        iid = await controller.place("exod/tiny-qwen2", 2)
        await wait_for(controller, is_ready(iid))
        victim = runner_pid(1)
        with pytest.raises(RequestFailed):
            async for _ in controller.requests.generate(iid, MESSAGES, max_tokens=100_000):
                if victim is not None:
                    os.kill(victim, signal.SIGKILL)  # at the first token: both ranks are in the ring's collectives
                    victim = None
        status = await wait_for(controller, lambda s: instance(s, iid)["state"] in ("backing_off", "starting", "ready"))
        return instance(status, iid), [e for _, e in await controller.transitions() if e.machine == "runner"]

    inst, runner_log = with_controller(config(tmp_path, hf_home), body)
    assert inst["attempts"] == 1 and inst["last_failure"] == "runner killed by SIGKILL"
    causes = {e.key.rsplit("/", 1)[1]: e.cause for e in runner_log if e.target == "failed"}
    assert "SIGKILL" in causes["1"]
