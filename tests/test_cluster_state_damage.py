"""Issue #45: a cluster survives its own state. A value in etcd that no controller can restore (garbage at the
snapshot, the meta, a batch of the log) ends no daemon: the node elected holds its term degraded, restoring and
writing nothing, every node's /health says which key and the command, placements are refused naming them, and
`exod repair` moves the value aside, after which the controller resumes on its own. Real etcd, real daemons."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest
import trio
from etcd_harness import run_with_client
from reliability_report import cluster_fault
from test_cluster_nodes import TTL, instance_at, nodes, start, stop_all, until
from test_cluster_nodes import hf_home as hf_home  # a fixture: the tiny model in an HF cache

from daemon_harness import exod, runner_pids
from exod.cluster.damage import DAMAGED, Damage, Kind, Unrestorable, aside_key
from exod.cluster.election import campaign
from exod.cluster.etcd import Etcd
from exod.cluster.etcd_state import EtcdState, parse_batch, parse_meta, restorable
from exod.cluster.membership import DEFAULT_PREFIX
from exod.cluster.repair import CHECK_S, Guarded, RepairConflict, StateCheck, inspect, inspect_log, repair
from exod.state.journal import Journal
from exod.state.sqlite import Store
from exod.state.store import StateUnavailable
from fsm.cluster import Cluster, LogEntry

pytestmark = pytest.mark.usefixtures("no_runner_left_behind")

PREFIX = DEFAULT_PREFIX.encode()
SNAPSHOT, META = PREFIX + b"state/snapshot", PREFIX + b"state/meta"
GARBAGE = b"\x00 not a snapshot {"
TINY = {"model": "exod/tiny-qwen2", "ranks": 1}
EMPTY = Cluster().to_dict()  # a state as exod writes it
CHAT = {"model": "exod/tiny-qwen2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def entry(n: int) -> LogEntry:
    return LogEntry(1000.0 + n, "instance", f"i{n}", "start", "pending", "starting", cause=f"#{n}")


def batch(first: int, *seqs: int) -> bytes:
    return json.dumps({"first": first, "entries": [entry(n).as_record() for n in seqs]}).encode()


# -- the pure parts: what counts as a value exod wrote -------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (b"[1, 2", "not JSON"),
        (b"[" * 100_000, "not JSON"),  # deeper than the parser goes: RecursionError, once a crash
        (b"\xff\xfe", "not JSON"),
        (b"[]", "expected a JSON object, got list"),
        (b'{"instances": 7, "runners": {}, "downloads": {}}', "instances"),  # JSON, but no machine could be in it
    ],
)
def test_a_snapshot_no_controller_can_restore_is_said_so(value, said):
    assert said in restorable(value)


def test_a_snapshot_as_exod_writes_it_can_be_restored():
    assert restorable(json.dumps(Cluster().to_dict()).encode()) is None


@pytest.mark.parametrize(
    "value",
    [
        b"{",
        b"{}",  # exod always writes all three: an empty object would number the log from 1 again, over it
        b'{"last_seq": "5", "log_start": 1, "oldest_time": null}',
        b'{"last_seq": true, "log_start": 1, "oldest_time": null}',
        b'{"last_seq": 5, "log_start": 0, "oldest_time": null}',
        b'{"last_seq": 5, "log_start": 9, "oldest_time": null}',
        b'{"last_seq": 5, "log_start": 1, "oldest_time": "yesterday"}',
        b'{"last_seq": 5, "log_start": 1, "oldest_time": NaN}',
        b'{"last_seq": 5, "log_start": 1, "oldest_time": null, "extra": 1}',
    ],
)
def test_a_meta_that_is_not_exods_is_refused_with_what_is_wrong(value):
    with pytest.raises(ValueError) as refused:
        parse_meta(value)
    assert str(refused.value)


def test_a_meta_as_exod_writes_it_is_read():
    meta = parse_meta(b'{"last_seq": 5, "log_start": 2, "oldest_time": 1000.5}')
    assert (meta.last_seq, meta.log_start, meta.oldest_time) == (5, 2, 1000.5)


@pytest.mark.parametrize(
    "value",
    [b'{"first": "x"}', b'{"first": 1e999, "entries": []}', b'{"first": 1, "entries": [{}]}', b"[" * 100_000, b"7"],
)
def test_a_batch_that_is_not_exods_is_refused_never_raising_anything_else(value):
    with pytest.raises(ValueError):
        parse_batch(value)


def test_the_damage_says_the_key_the_command_and_keeps_a_copy_apart():
    damage = Damage(Kind.SNAPSHOT, SNAPSHOT, "not JSON: …", 41, "http://127.0.0.1:2379", PREFIX)
    said = str(damage)
    assert "/exod/state/snapshot" in said and "`exod repair --cluster http://127.0.0.1:2379`" in said
    assert "etcdctl del /exod/state/snapshot" in said and "/exod/damaged/" in said
    other = Damage(Kind.LOG, b"/x/log/7", "KeyError", 3, "http://e:2379", b"/x/")
    assert "--prefix /x/" in other.command and "every reader skips it" in str(other)
    aside = aside_key(damage, now=0.0)
    assert aside == PREFIX + DAMAGED + b"state/snapshot.19700101T000000Z.r41"
    assert not aside.startswith(PREFIX + b"log/") and not aside.startswith(PREFIX + b"state/")  # nobody reads it


# -- on a real etcd, without daemons ---------------------------------------------------------------------------


async def _term(client: Etcd, node_id: str = "node-1"):
    term = await campaign(client, PREFIX, node_id, await client.grant(30))
    assert term is not None
    return term


def test_a_take_over_on_a_value_it_cannot_restore_raises_unrestorable_naming_it(etcd):
    async def body(client: Etcd):
        await client.put(META, b'{"last_seq": "x"}')
        with pytest.raises(Unrestorable) as meta:
            await EtcdState(client, PREFIX, await _term(client)).load()
        await client.delete(META)
        await client.put(SNAPSHOT, GARBAGE)
        with pytest.raises(Unrestorable) as snapshot:
            await EtcdState(client, PREFIX, None).load()
        reader = EtcdState(client, PREFIX, None)
        await client.put(META, b"[]")
        with pytest.raises(StateUnavailable, match="state/meta"):  # a reader of the log: 503, never a 500
            await reader.log_start()
        return meta.value.damage, snapshot.value.damage, await client.get(SNAPSHOT)

    meta, snapshot, kept = run_with_client(etcd, body)
    assert (meta.kind, meta.key) == (Kind.META, META) and "last_seq" in meta.reason
    assert (snapshot.kind, snapshot.key, snapshot.revision) == (Kind.SNAPSHOT, SNAPSHOT, kept.mod_revision)
    assert kept.value == GARBAGE  # left untouched


def test_a_log_older_than_its_bound_all_through_is_pruned_by_the_next_save_never_refused(etcd):
    """A month idle, then a change: the prune that deleted the whole log took the new batch's key in too, and etcd
    refused the save (an EtcdError out of the journal's writer: each controller in turn exited)."""

    async def body(client: Etcd):
        state = EtcdState(client, PREFIX, await _term(client))
        await state.load()
        await state.save(EMPTY, [entry(1), entry(2)], 2000.0)
        later = entry(3 + 31 * 86_400)  # a month and a day on: past the 30 days of [retention]
        last = await state.save(EMPTY, [later], later.time)
        return last, await state.log_start(), await state.transitions()

    last, start, log = run_with_client(etcd, body)
    assert last == 3 and start == 3 and [seq for seq, _ in log] == [3]


def test_a_save_etcd_refuses_as_a_request_is_the_state_unavailable_never_a_crash(etcd):
    """A snapshot past etcd's request limit (1.5 MiB by default): degraded, saying why, as for etcd out of reach."""

    async def body(client: Etcd):
        state = EtcdState(client, PREFIX, await _term(client))
        await state.load()
        with pytest.raises(StateUnavailable, match="refuses the state's write"):
            await state.save({**EMPTY, "padding": "x" * (2 << 20)}, [entry(1)], 2000.0)
        return await state.save(EMPTY, [entry(1)], 2000.0)  # and the next save goes on, numbered as ever

    assert run_with_client(etcd, body) == 1


def test_repair_moves_each_bad_value_aside_rebuilds_the_meta_from_the_log_and_then_finds_nothing(etcd):
    async def body(client: Etcd):
        state = EtcdState(client, PREFIX, await _term(client))
        await state.save(EMPTY, [entry(1), entry(2)], 2000.0)
        await state.save(EMPTY, [entry(3)], 2000.0)
        await client.put(PREFIX + b"log/" + b"9" * 12, b'{"first": "x"}')
        await client.put(SNAPSHOT, GARBAGE)
        await client.put(META, b"garbage")
        before = [d.key for d in await inspect(client, PREFIX)], [d.key for d in await inspect_log(client, PREFIX)]
        moved = await repair(client, PREFIX, now=0.0)
        after = await inspect(client, PREFIX), await inspect_log(client, PREFIX), await repair(client, PREFIX)
        kept, _ = await client.get_prefix(PREFIX + DAMAGED)
        reader = EtcdState(client, PREFIX, None)
        return before, moved, after, kept, await reader.load(), await reader.log_start(), await reader.transitions()

    before, moved, after, kept, snapshot, start, log = run_with_client(etcd, body)
    assert before == ([SNAPSHOT, META], [PREFIX + b"log/" + b"9" * 12])
    assert [m.damage.kind for m in moved] == [Kind.LOG, Kind.SNAPSHOT, Kind.META] or [m.damage.kind for m in moved] == [
        Kind.LOG,
        Kind.META,
        Kind.SNAPSHOT,
    ]
    assert after == ([], [], [])  # repaired: a second run finds nothing and changes nothing
    assert sorted(kv.value for kv in kept) == sorted([GARBAGE, b"garbage", b'{"first": "x"}'])  # nothing lost
    rebuilt = next(m.rebuilt for m in moved if m.damage.kind is Kind.META)
    assert json.loads(rebuilt) == {"last_seq": 3, "log_start": 1, "oldest_time": entry(1).time}  # as the log says
    assert snapshot is None and start == 1 and [seq for seq, _ in log] == [1, 2, 3]


def test_repair_moves_nothing_of_a_value_that_changed_since_it_was_read(etcd):
    async def body(client: Etcd):
        await client.put(SNAPSHOT, GARBAGE)
        (damage,) = await inspect(client, PREFIX)
        await client.put(SNAPSHOT, b"other garbage")  # written again meanwhile
        from exod.cluster.repair import _move

        with pytest.raises(RepairConflict, match="run it again"):
            await _move(client, damage, None)
        return await client.get(SNAPSHOT), (await client.get_prefix(PREFIX + DAMAGED))[0]

    value, kept = run_with_client(etcd, body)
    assert value.value == b"other garbage" and kept == []


def test_the_controller_writes_back_over_a_value_no_successor_could_restore_keeping_a_copy(etcd):
    """The controller has the state: garbage at its snapshot is written back over by `heal`; garbage at its
    meta by its next save (it never crashes on it, nor numbers the log afresh)."""

    async def body(client: Etcd):
        state = EtcdState(client, PREFIX, await _term(client))
        await state.load()
        await state.save(EMPTY, [entry(1)], 2000.0)
        await client.put(SNAPSHOT, GARBAGE)
        healed = await state.heal(), await state.heal()  # the second finds nothing to do
        snapshot = (await client.get(SNAPSHOT)).value
        await client.put(META, b"{}")
        last = await state.save(EMPTY, [entry(2)], 2001.0)
        kept, _ = await client.get_prefix(PREFIX + DAMAGED)
        reader = EtcdState(client, PREFIX, None)
        return healed, snapshot, last, kept, await reader.load(), await reader.transitions()

    healed, snapshot, last, kept, after, log = run_with_client(etcd, body)
    assert healed == (True, False) and snapshot == json.dumps(EMPTY, sort_keys=True).encode()  # what it wrote
    assert last == 2 and after == EMPTY and [seq for seq, _ in log] == [1, 2]
    assert sorted(kv.value for kv in kept) == sorted([GARBAGE, b"{}"])


def test_a_guarded_state_restores_nothing_writes_nothing_and_degrades_the_journal_saying_why(etcd, tmp_path):
    async def body(client: Etcd):
        await client.put(SNAPSHOT, GARBAGE)
        check = StateCheck(client, PREFIX, every=0.05)
        guarded = Guarded(EtcdState(client, PREFIX, await _term(client)), lambda: check.why)
        journal = Journal(guarded, Store.open(tmp_path / "local.db"))
        async with trio.open_nursery() as nursery:
            await nursery.start(check.run)
            degraded, loaded = journal.degraded, await guarded.load()
            with pytest.raises(StateUnavailable, match="cannot be restored"):
                await guarded.save({"n": 1}, [entry(1)], 2000.0)
            written = (await client.get(SNAPSHOT)).value
            await repair(client, PREFIX)
            with trio.fail_after(5):
                await check.until(lambda found: not found)
            nursery.cancel_scope.cancel()
        return degraded, loaded, written, journal.degraded, await guarded.save({"n": 1}, [entry(1)], 2000.0)

    degraded, loaded, written, after, saved = run_with_client(etcd, body)
    assert "/exod/state/snapshot" in degraded and "exod repair --cluster" in degraded
    assert loaded is None and written == GARBAGE
    assert after is None and saved == 1


# -- real daemons ------------------------------------------------------------------------------------------------


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()


def _alive(daemons) -> list[bool]:
    """Each daemon's process, as the OS has it: running (not a zombie, not reaped)."""
    alive = []
    for daemon, _ in daemons:
        try:
            stat = Path(f"/proc/{daemon.pid}/stat").read_text()
            state = stat.rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "gone"
        alive.append(daemon.poll() is None and state not in ("Z", "X", "gone"))
    return alive


def _write(etcd: str, key: bytes, value: bytes) -> None:
    run_with_client(etcd, lambda client: client.put(key, value))


def test_garbage_at_the_snapshot_ends_no_node_every_one_says_why_and_exod_repair_lets_it_resume(
    tmp_path, etcd, hf_home
):
    """The adversary's run: one garbage value at /exod/state/snapshot, then the controller gone (SIGSTOP first,
    so that it cannot write its state back over it), then the next one elected gone too. Before #45 each node
    elected raised and exited: 3 of 3 dead within ~30 s. Now each holds its term degraded."""
    env = {**os.environ, "HF_HOME": str(hf_home)}
    daemons = [start(tmp_path, etcd, n, env) for n in (1, 2, 3)]
    urls = [url for _, url in daemons]

    def controller_of(view: dict) -> int:
        return int(view["controller"].removeprefix("node-")) - 1

    try:
        view = until(lambda: nodes(urls[0]), lambda v: len(v["nodes"]) == 3 and v["controller"], 30)
        placed = httpx.post(f"{urls[0]}/instances", json=TINY, timeout=30)
        assert placed.status_code == 201, placed.text
        iid = placed.json()["instance_id"]
        until(lambda: instance_at(urls[0], iid), lambda i: i["state"] == "ready", 90)
        assert len(runner_pids()) == 1

        first = controller_of(view)
        daemons[first][0].send_signal(signal.SIGSTOP)  # it has the state: stopped, it cannot write it back
        _write(etcd, SNAPSHOT, GARBAGE)
        daemons[first][0].send_signal(signal.SIGKILL)
        daemons[first][0].wait()
        survivor = urls[(first + 1) % 3]
        second_view = until(
            lambda: nodes(survivor), lambda v: v["controller"] not in (None, view["controller"]), 6 * TTL
        )
        second = controller_of(second_view)
        held = until(lambda: _health(urls[second]), lambda h: h["status"] == "degraded", 6 * TTL)
        daemons[second][0].send_signal(signal.SIGKILL)  # the next one elected goes too: a third term
        daemons[second][0].wait()
        third = 3 - first - second
        third_view = until(lambda: nodes(urls[third]), lambda v: v["controller"] == f"node-{third + 1}", 6 * TTL)
        until(runner_pids, lambda pids: pids == [], 6 * TTL)  # nothing of the bad state's is served
        again = tmp_path / "again"
        again.mkdir()
        shutil.copy(tmp_path / "cluster.token", again / "cluster.token")  # the cluster's, mode 600 kept
        for n in (first, second):  # both back, as followers
            daemons[n] = start(again, etcd, n + 1, env)
            urls[n] = daemons[n][1]
        until(lambda: nodes(urls[third]), lambda v: len(v["nodes"]) == 3, 6 * TTL)

        # several leases go by: before #45 each term lasted one take-over, the node then exited
        watch_from = time.monotonic()
        while time.monotonic() - watch_from < 4 * TTL:
            assert _alive(daemons) == [True, True, True], [d.poll() for d, _ in daemons]
            time.sleep(0.5)
        healths = [_health(url) for url in urls]
        still = nodes(urls[first])
        refused = httpx.post(f"{urls[first]}/instances", json=TINY, timeout=30)  # forwarded to the holder
        instances = httpx.get(f"{urls[third]}/instances", timeout=10).json()
        status = exod("status", "--url", urls[third], env=dict(os.environ))
        said = exod("status", "--url", urls[first], env=dict(os.environ), check=False)  # a follower: etcd's copy
        checked = exod("repair", "--cluster", etcd, "--check", env=dict(os.environ))
        kept = run_with_client(etcd, lambda client: client.get(SNAPSHOT))

        repaired = exod("repair", "--cluster", etcd, env=dict(os.environ))
        repaired_at = time.monotonic()
        for url in urls:
            until(lambda u=url: _health(u), lambda h: h["status"] == "ok", 6 * CHECK_S + TTL)
        resumed_within = time.monotonic() - repaired_at
        after = nodes(urls[first])
        again = httpx.post(f"{urls[second]}/instances", json=TINY, timeout=30)
        assert again.status_code == 201, again.text
        new = again.json()["instance_id"]
        until(lambda: instance_at(urls[second], new), lambda i: i["state"] == "ready", 90)
        chat = httpx.post(f"{urls[first]}/v1/chat/completions", json=CHAT, timeout=60)
        nothing = exod("repair", "--cluster", etcd, env=dict(os.environ))
        aside, _ = run_with_client(etcd, lambda client: client.get_prefix(PREFIX + DAMAGED))
    finally:
        codes = stop_all(daemons)

    assert held["status"] == "degraded" and "/exod/state/snapshot" in held["reason"]
    assert third_view["controller"] == f"node-{third + 1}" and still["controller"] == f"node-{third + 1}"  # held
    for health in healths:  # every node: degraded, the key, what is wrong and the command
        assert health["status"] == "degraded", health
        assert "/exod/state/snapshot" in health["reason"] and "not JSON" in health["reason"]
        assert f"exod repair --cluster {etcd}" in health["reason"]
    error = refused.json()["error"]["message"]
    assert refused.status_code == 503 and "/exod/state/snapshot" in error and "exod repair" in error
    assert refused.json()["error"].get("code") != "not_stored_yet"  # refused up front: nothing placed, in memory either
    assert instances["instances"] == [] and "/exod/state/snapshot" in instances["degraded"]  # no instance resumed
    assert "DEGRADED:" in status.stdout and "/exod/state/snapshot" in status.stdout
    assert said.returncode == 1 and "/exod/state/snapshot" in said.stderr and "exod repair" in said.stderr
    assert "Traceback" not in said.stderr
    assert "/exod/state/snapshot: not JSON" in checked.stdout and kept.value == GARBAGE  # --check moves nothing
    assert "moved /exod/state/snapshot" in repaired.stdout and "/exod/damaged/state/snapshot." in repaired.stdout
    assert f"the controller, node node-{third + 1}" in repaired.stdout and "empty state" in repaired.stdout
    assert after["controller"] == f"node-{third + 1}"  # resumed in the same term: no restart, no new election
    assert chat.status_code == 200, chat.text
    assert "nothing to repair, nothing changed" in nothing.stdout
    assert [kv.value for kv in aside] == [GARBAGE]
    assert set(codes) <= {0}, codes
    cluster_fault(
        "unrestorable snapshot in etcd",
        f"garbage at /exod/state/snapshot, the controller SIGKILLed, then the next one: node-{third + 1} elected "
        f"holds its term degraded; 3 of 3 daemons alive through {4 * TTL} s (lease TTL {TTL} s); /health of each "
        "degraded naming the key and `exod repair --cluster URL`; POST /instances 503 naming them; no instance "
        f"resumed, no runner left; `exod repair` moved it to /exod/damaged/, every node ok {resumed_within:.1f} s "
        "later in the same term; a new instance Ready, chat 200",
    )


def test_garbage_at_the_meta_and_a_log_batch_before_the_cluster_starts_ends_no_node(tmp_path, etcd):
    """Its first controller already finds them: held degraded from its first term; `exod repair` rebuilds the
    meta from the log and moves the batch aside, and the log goes on where it ended."""

    async def forge(client: Etcd):
        lease = await client.grant(30)
        state = EtcdState(client, PREFIX, await campaign(client, PREFIX, "node-0", lease))
        await state.save(EMPTY, [entry(1), entry(2)], 2000.0)
        await client.revoke(lease)  # an earlier controller, gone: its election key with it
        await client.put(META, b'{"last_seq": "lots"}')
        await client.put(PREFIX + b"log/" + b"9" * 12, b"\x00")

    run_with_client(etcd, forge)
    daemons = [start(tmp_path, etcd, n, dict(os.environ)) for n in (1, 2)]
    urls = [url for _, url in daemons]
    try:
        view = until(lambda: nodes(urls[0]), lambda v: len(v["nodes"]) == 2 and v["controller"], 30)
        healths = [until(lambda u=url: _health(u), lambda h: h["status"] == "degraded", 6 * CHECK_S) for url in urls]
        time.sleep(2 * TTL)
        alive = _alive(daemons)
        with httpx.stream("GET", f"{urls[0]}/events", timeout=10) as stream:  # said in the stream, never a 500
            events = stream.status_code, next(stream.iter_lines())
        checked = exod("repair", "--cluster", etcd, "--check", env=dict(os.environ))
        repaired = exod("repair", "--cluster", etcd, env=dict(os.environ))
        for url in urls:
            until(lambda u=url: _health(u), lambda h: h["status"] == "ok", 6 * CHECK_S + TTL)
        after = nodes(urls[1])
        log = run_with_client(etcd, lambda client: EtcdState(client, PREFIX, None).transitions())
        meta = run_with_client(etcd, lambda client: client.get(META))
    finally:
        codes = stop_all(daemons)
    assert alive == [True, True] and set(codes) <= {0}
    for health in healths:
        assert "/exod/state/meta" in health["reason"] and "last_seq" in health["reason"]
    assert events[0] == 200 and "/exod/state/meta" in events[1]
    assert "/exod/log/999999999999" in checked.stdout and "/exod/state/meta" in checked.stdout
    assert "rebuilt from the log" in repaired.stdout and "gap" in repaired.stdout
    assert after["controller"] == view["controller"]  # the same term, taken over afresh
    assert [seq for seq, _ in log] == [1, 2]  # the log as it was: the batch that was not exod's gone
    assert parse_meta(meta.value).last_seq == 2  # where it ends: the next entry is 3, not 1 again over the log


def test_a_running_controller_writes_its_state_back_over_garbage_keeping_a_copy_and_serves_on(tmp_path, etcd, hf_home):
    """The controller has the state in memory: garbage at its snapshot (or its meta) is written back over within
    a check or two, a copy kept under /exod/damaged/, and its instance serves on in the same generation."""
    env = {**os.environ, "HF_HOME": str(hf_home)}
    daemons = [start(tmp_path, etcd, n, env) for n in (1, 2)]
    urls = [url for _, url in daemons]
    try:
        until(lambda: nodes(urls[0]), lambda v: len(v["nodes"]) == 2 and v["controller"], 30)
        placed = httpx.post(f"{urls[1]}/instances", json=TINY, timeout=30)
        assert placed.status_code == 201, placed.text
        iid = placed.json()["instance_id"]
        before = until(lambda: instance_at(urls[0], iid), lambda i: i["state"] == "ready", 90)
        found = []
        for key in (SNAPSHOT, META):
            _write(etcd, key, GARBAGE)
            written_at = time.monotonic()
            until(lambda: run_with_client(etcd, lambda client: inspect(client, PREFIX)), lambda f: f == [], 6 * CHECK_S)
            found.append(time.monotonic() - written_at)
        chat = httpx.post(f"{urls[1]}/v1/chat/completions", json=CHAT, timeout=60)
        after = instance_at(urls[0], iid)
        healths = [until(lambda u=url: _health(u), lambda h: h["status"] == "ok", 6 * CHECK_S) for url in urls]
        aside, _ = run_with_client(etcd, lambda client: client.get_prefix(PREFIX + DAMAGED))
        log = run_with_client(etcd, lambda client: EtcdState(client, PREFIX, None).transitions())
    finally:
        codes = stop_all(daemons)
    assert chat.status_code == 200, chat.text
    assert (after["state"], after["generation"]) == ("ready", before["generation"])  # nothing restarted
    assert [kv.value for kv in aside] == [GARBAGE, GARBAGE]  # both kept
    assert sorted(kv.key.decode().split(".", 1)[0] for kv in aside) == [
        "/exod/damaged/state/meta",
        "/exod/damaged/state/snapshot",
    ]
    seqs = [seq for seq, _ in log]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # the log without a gap, never numbered afresh
    assert all(h["status"] == "ok" for h in healths) and set(codes) <= {0}
    assert max(found) < 6 * CHECK_S
