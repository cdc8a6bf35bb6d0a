"""specs/reliability.md, written by the test run from what it observed (`make reliability`), never by hand.

Two sections, each rewritten only when every row of it was observed in the run, so that running one part
of the suite leaves the other as the last complete run wrote it: the fault-injection matrix
(tests/test_fault_matrix.py) and the attacks (the abuse tests of issue #10, each with real processes).
"""

from __future__ import annotations

import os
from pathlib import Path

from exod.chaos import report

SPEC = Path(__file__).resolve().parent.parent / "specs" / "reliability.md"
WRITE = os.environ.get("EXOD_WRITE_RELIABILITY") == "1"


# attack -> what must happen; the tests fill in what did
ATTACKS: dict[str, str] = {
    "admission flood": "refusals up front (404/409/422), nothing stored, runners within the limits; "
    "a restart restores what was admitted and nothing more",
    "fd exhaustion": "connections beyond max_connections wait unaccepted; the daemon keeps the fds to "
    "restart a runner; the API answers once the attacker lets go",
    "slow clients": "half-sent requests are closed after the header/body timeouts; nothing stays open",
    "disk full": "degraded, never a crash: serving goes on, placements 503, /health says why; "
    "the log is written once space returns, nothing lost",
    "port squatting": "a ring port taken is the host's failure: no retry spent, the backoff waited, "
    "new ports next generation, never deleted",
    "lock deleted": "a second daemon on the same state dir is refused even with daemon.lock deleted; "
    "the first one's runners are untouched",
    "state dir removed": "the daemon notices its directory is gone, stops its runners and exits saying why; "
    "a daemon started on the path afterwards runs alone",
    "SIGTERM under load": "requests in progress finish (streams end with [DONE]); new ones get 503; "
    "runners stopped and their shutdown logged; exit 0",
    "growth over a crash loop": "at least 20 generations of real processes; log rows, runner logs and "
    "hostfiles stay within the retention setting",
    # issue #45: no request can hurt a runner, nor anyone else's request
    "token ids outside the vocabulary": "prompt ids, embedding ids, logit_bias keys (huge and negative), with "
    "echo, through each dialect: 400 naming the field and the bound; no runner fails, no retry charged",
    "constraint bombs": "a recursive required $ref and a regex of 10^9 repetitions, through OpenAI's "
    "response_format, Ollama's format and Anthropic's tool_choice any: 400 at admission; no runner fails, "
    "no retry charged, the batch beside it goes on",
    "poison request": "a request present at two runner deaths is refused from then on, its error says why; "
    "those deaths are not charged to the instance",
    "DNS rebinding": "a request naming a Host the daemon is not reachable by (an attacker's name rebound to "
    "127.0.0.1) is refused before any route: nothing placed, deleted or generated",
    "unbounded durations": "keep_alive 1e18 or '99999999999999999h' per request, stop_grace = 1e308 or '5m5m' "
    "in the configuration: refused with the ceiling named; GET /api/ps never answers 500",
    "ranks beyond the layers": "the 422 names the limit that binds (the model's layers, not ranks_per_instance)",
    # issue #46: a stalled runner noticed in seconds (tests/test_runner_liveness.py)
    "runner stopped while idle": "a Ready runner with no request SIGSTOPped: within [timeouts] heartbeat "
    "/instances says it failed, naming the missed heartbeat, charged; the stopped process is killed and a new "
    "generation serves; never two runner processes alive",
    "runner stopped while busy": "the same mid-answer: the chat in flight ends with an error event and [DONE] "
    "within the heartbeat, never a hang",
}
OBSERVED: dict[str, str] = {}

# several hosts (tests/test_cluster_nodes.py): fault -> what must happen
CLUSTER: dict[str, str] = {
    "controller death": "SIGKILL of the controller's daemon: another node is elected once its lease expired "
    "and resumes every instance from etcd's state, no retry charged, the log continued",
    "host death": "SIGKILL of a node holding a rank: its ranks lost as the host's failure (uncharged); "
    "the next generation placed on the nodes left, and Ready",
    "election key taken": "a controller whose term ended stops its runners and writes nothing more",
    "partition of a node": "an agent holding a rank, in its own network namespace, its link cut: it kills "
    "its runner before its lease can expire; the next generation runs on the nodes left; healed, the node "
    "rejoins and the instance is left alone",
    "partition of the controller": "the same for the controller: it steps down and kills its runner; the next "
    "controller first stops the runner the old one had on an agent and waits for its key to go, then starts "
    "the next generation: never two alive",
    "partition of the controller holding every rank": "no peer's loss ends its runner and no watch tells it: "
    "the controller steps down by its own clock before its lease can expire and kills its runner; the next "
    "generation runs on a node left: never two alive",
    "controller cut from etcd alone": "the controller loses etcd but still reaches the other nodes: by its own "
    "clock it steps down before its lease can expire, kills its runner and answers nothing as the controller; "
    "its old term is refused by every agent; the new controller resumes: never two alive, nothing charged",
    "paused agent daemon": "an agent's daemon SIGSTOPped past its lease, its runner not: the runner's deadline "
    "is no longer moved on and its watchdog process ends it before the lease can expire; the next generation "
    "starts once the runner's key is gone: never two alive, nothing charged",
    "controller paused 2× TTL, every rank on the controller": "the controller's daemon SIGSTOPped for two leases, "
    "its runner not: its deadline ends it before its lease can expire; another node is elected only once "
    "it has, and runs the next generation; continued, the old controller steps down and spawns nothing: never "
    "two generations nor two processes of a rank alive, nothing charged",
    "controller paused 2× TTL, ranks on the controller and an agent": "the same with a rank on an agent too: the "
    "new controller starts the next generation only once the agent's runner is gone; never two generations nor "
    "two processes of a rank alive, nothing charged",
    "etcd member loss": "a 3-member etcd loses the member every node talks to first: nothing is disrupted",
    "etcd leader killed": "a 3-member etcd whose leader (the member every node talks to first) is SIGKILLed: "
    "no controller steps down, no runner ends, every request is answered",
    "etcd member hangs": "the etcd member a node renews its lease through (the leader) is SIGSTOPped: the "
    "renewal gives up on it within the authority left and goes on through another; the authority never lapses",
    "renewal under load": "busy processes take the CPU from before the daemons start: the lease renewals "
    "start late but leave authority to spare; no controller steps down, no runner ends",
    "node back": "a node that died comes back: the instance's next generation spreads its ranks over it "
    "again rather than staying packed on the nodes that were left",
    "etcd outage shorter than the lease": "degraded, the instance serves throughout, no new generation",
    "etcd outage longer than the lease": "every node fences itself (its runners stop before a lease could "
    "expire); all converges when etcd returns, no retry charged",
    # issue #45: no record can kill a cluster, no stale command can start a generation
    "unrestorable snapshot in etcd": "garbage at the snapshot key: every node stays up, degraded (/health and "
    "`exod status` say why and what to do), serving nothing it cannot vouch for; `exod repair` moves the "
    "value aside and the cluster resumes",
    "replayed spawn": "a spawn of an earlier generation replayed with the cluster token (the term and stream "
    "of a 409): refused by the agent itself while etcd holds a key of an earlier generation or the term is "
    "not etcd's now; refusals reveal no term or stream; never two generations alive, watched from outside",
    # issue #46: failover as clients see it (tests/test_cluster_failover_clients.py)
    "controller silent mid-answer (dropped)": "a streamed and a plain chat forwarded by another node, alive but "
    "silent past [cluster] forward_idle (keep-alives, the controller's /health), then its host drops every "
    "packet: within forward_idle the stream ends with the dialect's error event and [DONE], the plain one is "
    "504 with Retry-After; never a hang",
    "controller silent mid-answer (paused)": "the same with the controller's daemon SIGSTOPped (its kernel still "
    "answers TCP): within forward_idle, the error event and [DONE], and 504 with Retry-After",
    "forwarded request at a node that is not the controller": "the cluster token is the cluster's at every "
    "node: 503 with Retry-After in each dialect, never 401; a wrong token is 401",
    "placement racing a step-down": "etcd refuses the placement's write (the turn ended): 503 with Retry-After, "
    "nothing stored; asked again, the next turn places it",
    "node cut from etcd alone": "it forwards to the controller it last knew: chats answered throughout the cut; "
    "cut from that controller too, 503 naming both",
    "runner stopped on another node": "a runner SIGSTOPped on a node that is not the controller: its agent's "
    "pings go unanswered, the controller fails it within [timeouts] heartbeat (charged), the agent kills it, "
    "a new generation serves; never two runner processes alive (tests/test_runner_liveness.py)",
    "agent paused, heartbeat shorter than a lost node": "an agent's daemon SIGSTOPped, its runner not, with "
    "[timeouts] heartbeat below the stream's silence bound: its runners are lost as the node's failure "
    "(uncharged), never failed as a missed heartbeat",
    # issue #47: the wiring of the fence, and refusals (tests/test_wiring.py)
    "frozen agent daemon, its runner's watchdog": "an agent's event loop frozen: its runner (a real process, "
    "its real Supervisor) is killed by its own watchdog at the node's authority, before the lease can expire",
    "placement, park or delete meeting a deposition": "etcd refuses the change's write (the term ended): 503 "
    "with Retry-After and the reason, never a 500; nothing of it stored",
}
CLUSTER_OBSERVED: dict[str, str] = {}


def attack(name: str, observed: str) -> None:
    """What the test of ``name`` observed, in one line, for the attacks table."""
    _observe(ATTACKS, OBSERVED, name, observed)


def cluster_fault(name: str, observed: str) -> None:
    """What the test of cluster fault ``name`` observed, in one line, for the cluster table."""
    _observe(CLUSTER, CLUSTER_OBSERVED, name, observed)


def _observe(expected: dict[str, str], observed: dict[str, str], name: str, text: str) -> None:
    assert name in expected, f"unknown row {name!r}: add it to the table's expectations"
    observed[name] = text.replace("|", "/").replace("\n", " ")


def write_cluster() -> bool:
    """The cluster table, if every cluster fault was observed in this run; True if written."""
    intro = (
        "## Several hosts\n\nReal daemons on 127.0.0.1–3 (or a veth pair into a network namespace, for the "
        "partition) and a real etcd (tests/test_cluster_nodes.py), lease "
        "TTL 5 s unless the row says otherwise."
    )
    return _write_table("cluster", intro, "fault", CLUSTER, CLUSTER_OBSERVED)


def _write_table(section: str, intro: str, what: str, expected: dict[str, str], observed: dict[str, str]) -> bool:
    """Section ``section`` as a table of what each row expected and observed, if every row was; True if so."""
    if set(observed) != set(expected):
        return False
    rows = [f"| {what} | expected | observed |", "|---|---|---|"]
    rows += [f"| {name} | {text} | {observed[name]} |" for name, text in expected.items()]
    write_section(section, intro + "\n\n" + "\n".join(rows))
    return True


def write_section(name: str, body: str) -> None:
    """Replace section ``name`` of the spec, keeping the others (as the fault campaign writes its own)."""
    report.write_section(SPEC, name, body)


def write_attacks() -> bool:
    """The attacks table, if every attack was observed in this run; True if written."""
    intro = (
        "## Attacks\n\nAs an adversary on this machine would (a local client, no special rights): each row a "
        "test with real processes (tests/test_attacks.py and the tests it names)."
    )
    return _write_table("attacks", intro, "attack", ATTACKS, OBSERVED)
