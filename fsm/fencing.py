"""A model of the cluster's control plane, checked exhaustively: never two generations of processes alive.

Theory of operation
-------------------
`fsm.check` drives the real machines of one controller that never fails. What broke the cluster was the
controller itself: cut off, cut from etcd alone, paused, deposed while its commands were still in flight.
This module models that control plane, abstractly and small enough to explore every state, with every
actor able to fail (the several hosts of exod's cluster on etcd):

* **etcd** holds the election key (its holder and the term, its create revision), one lease per node (time
  left by etcd's clock; the node's runner keys go with it), the runner keys, and the highest generation
  allocated by a controller's guarded write.
* **each node** runs one daemon, which may be paused; it renews its lease while it reaches etcd, and holds
  its *authority*, by its own clock, until one tick before its lease may expire. It may believe it is the
  controller of some term; as the controller it starts a generation (on the first live nodes, once no
  runner key is left), abandons it (a rank failed), and steps down. As an agent it obeys commands, runs
  runner processes, fences them and releases their keys.
* **commands** (spawn, stop) are in flight from a controller to each agent until delivered: a deposed
  controller's old commands can still arrive.
* **the adversary** pauses daemons, cuts nodes from everything, from etcd alone, or from one other node,
  up to ``max_faults`` times; heals come free. Time passes one tick at a time, for every clock at once
  (no skew: the premise of leases).

Five mechanisms keep two generations from running at once; each can be switched off, which plants the bug
it prevents (`Mechanism`):

1. ``ONE_PATH`` — the controller's own ranks are spawned by its node's agent, claimed in etcd first; off,
   it spawns them itself, with no key, and only its own step-down ends them.
2. ``CLOCK`` — a term ends by the controller's clock (its authority), whatever any watch says; off, it
   ends only once the controller reads etcd and sees the key gone or taken.
3. ``TERM`` — an agent obeys only the term etcd holds, never an older one than it obeyed, and ends the
   stream of a term that is over; off, any controller's command is obeyed, and the last one to connect
   takes the agent over.
4. ``DEADLINE`` — every runner holds a deadline its agent extends only while the node's authority lasts,
   and ends itself past it; off, a paused daemon's runners run on.
5. ``STREAM`` — a spawn names the report stream it was sent on, and an agent refuses one whose stream is
   over; off, a spawn sent before its controller stepped down and took its term back (``RESUME``) starts
   a runner beside the next generation, one that controller no longer knows of. (A spawn of a deposed
   term names a stream that is over too: with ``STREAM`` on, the model finds ``TERM`` redundant for
   spawns; ``TERM`` still keeps a deposed controller from taking an agent's stream over.)

Two more keep the cluster live (off, it can be stuck, never Ready again):

6. ``TOMBSTONE`` — a stop that reaches an agent before the spawn it follows (two requests, two
   connections) is remembered, and the spawn refused; off, the runner starts after its stop, its key
   stays, and no next generation can start (a controller starts one only once no key of an earlier
   generation is left).
7. ``RESUME`` — a controller that stepped down by its clock, and finds on its next campaign that the
   election key is still its own (its lease outlived its authority), takes that term back; off, the key
   lives on with no controller behind it for as long as the node renews its lease.

The invariant: the runner processes alive (not yet exited: killed, stopped, or past their deadline) are
all of one generation, and no rank has two of them (of one generation or two: a process is counted, not only
its generation, as `bench/overlap.py` and the chaos campaign watch them from /proc). It explores
breadth-first, so a violation comes with a shortest trace; `tests/test_model_replay.py` replays the trace of
each mechanism switched off against the daemon's real classes, so a model that drifts from the code is
noticed.

Liveness: after every heal that leaves no fault in force (and from the start), the instance can be Ready
again — a controller of the term etcd holds runs a generation whose every rank is alive — within
``2 * ttl`` ticks, with no more faults and no failure but one detected (a generation missing a rank is
abandoned). Time and generations are extended past the horizon for that search alone; a state from
which no such path exists is reported with the trace that reached it.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Iterator
from typing import NamedTuple

import attrs


class Mechanism(enum.Enum):
    ONE_PATH = "one path for every rank"
    CLOCK = "a term ends by the clock"
    TERM = "commands carry the term"
    DEADLINE = "a dead man's switch in every runner"
    STREAM = "a spawn names its report stream"
    TOMBSTONE = "a stop that overtakes its spawn cancels it"
    RESUME = "a controller that stepped down by its clock takes its live term back"


class Fault(enum.Enum):
    PAUSE = "pause"  # the daemon stops (SIGSTOP); its runners run on
    CUT = "cut"  # the node is cut off from etcd and every other node
    CUT_ETCD = "cut-etcd"  # the node loses etcd alone
    CUT_LINK = "cut-link"  # two nodes lose each other


MECHANISMS = frozenset(Mechanism)
FAULTS = frozenset(Fault)
NONE = -1  # no node; no deadline


@attrs.frozen
class FencingConfig:
    # The defaults are what CI explores exhaustively (README: the bounds); every other size is an option.
    nodes: int = attrs.field(default=3, validator=attrs.validators.in_(range(2, 5)))
    ranks: int = 1
    ttl: int = attrs.field(default=3, validator=attrs.validators.ge(2))  # ticks; authority: ttl - 1
    max_faults: int = 1
    generations: int = 2  # generations the controllers may allocate, all terms together
    horizon: int = 8  # ticks: time stops here
    faults: frozenset[Fault] = FAULTS
    mechanisms: frozenset[Mechanism] = MECHANISMS
    max_states: int = 2_000_000

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.ranks <= self.nodes:
            raise ValueError(f"ranks must be 1..nodes ({self.nodes}), got {self.ranks}")


class _Proc(NamedTuple):
    gen: int
    deadline: int  # ticks left (NONE: it holds none)
    direct: bool  # spawned by the controller itself, not by its node's agent (ONE_PATH off)
    rank: int  # its rank in its generation: two processes of one rank are a violation too


class _Msg(NamedTuple):
    src: int
    dst: int
    spawn: bool  # else stop
    gen: int
    term: int
    stream: int  # the sender's report stream in that term
    rank: int = 0  # the rank a spawn starts (a stop's: 0, unused)


class _State(NamedTuple):
    t: int
    holder: int
    term: int  # the last election's term (the key's create revision)
    lease: tuple[int, ...]  # etcd's clock: ticks left per node (0: expired)
    keys: frozenset[tuple[int, int]]  # (node, generation): runners claimed under the node's lease
    allocated: int  # the highest generation a guarded write allocated
    authority: tuple[int, ...]  # each node's own clock: ticks of authority left
    paused: frozenset[int]
    off_etcd: frozenset[int]
    cut: frozenset[tuple[int, int]]  # node pairs that cannot reach each other
    believes: tuple[int, ...]  # the term each node believes it holds as the controller (0: none)
    running: tuple[int, ...]  # the generation each controller runs (0: none)
    stream: tuple[int, ...]  # each controller's report stream in its term: one more each time it takes it back
    session: tuple[tuple[int, int, int] | None, ...]  # each agent's controller's stream: (node, term, stream)
    obeyed: tuple[int, ...]  # the newest term each agent obeyed
    procs: tuple[frozenset[_Proc], ...]
    msgs: frozenset[_Msg]
    faults: int


SAFETY = "two generations, or two processes of a rank, alive at once"
LIVENESS = "never Ready again after the heal"


@attrs.frozen
class FencingViolation:
    message: str
    trace: tuple[str, ...]
    invariant: str = SAFETY

    def report(self) -> str:
        steps = "\n".join(f"  {i + 1:3}. {event}" for i, event in enumerate(self.trace))
        return f"{self.invariant}: {self.message}\nshortest trace ({len(self.trace)} events):\n{steps}"


@attrs.frozen
class FencingResult:
    states: int
    transitions: int
    exhaustive: bool
    seconds: float  # 0.0 unless the caller passed a timer (fsm reads no clock)
    violation: FencingViolation | None = None

    @property
    def ok(self) -> bool:
        return self.violation is None

    def report(self) -> str:
        scope = "exhaustive" if self.exhaustive else "stopped at the first violation"
        if self.ok and not self.exhaustive:
            scope = "bounded (state limit reached)"
        rate = f", {self.seconds:.1f} s ({self.states / self.seconds:,.0f} states/s)" if self.seconds else ""
        head = f"{self.states} states, {self.transitions} transitions, {scope}{rate}"
        if not self.ok:
            return f"{head}\n{self.violation.report()}"  # type: ignore[union-attr]
        live = "; Ready again after every heal" if self.exhaustive else ""
        return f"{head}\nnever two generations, nor two processes of a rank, alive{live}"


def check_fencing(config: FencingConfig | None = None, *, timer: Callable[[], float] | None = None) -> FencingResult:
    """Explore every state of the control plane up to the horizon; the first violation, with a shortest trace.
    Once every state is known safe, check that each heal (in the order found: the shortest first) can lead to
    Ready again."""
    config = config or FencingConfig()
    model, recovery = _Model(config), _Model(config, recovering=True)
    started = timer() if timer else 0.0

    def result(exhaustive: bool, violation: FencingViolation | None = None) -> FencingResult:
        return FencingResult(len(parents), transitions, exhaustive, (timer() - started) if timer else 0.0, violation)

    def trace(at: _State) -> tuple[str, ...]:
        events = []
        while (step := parents[at]) is not None:
            at, event = step
            events.append(event)
        return tuple(reversed(events))

    start = model.initial()
    parents: dict[_State, tuple[_State, str] | None] = {start: None}
    healed = [start]  # states with no fault in force, each just after a heal
    queue = deque([start])
    transitions = 0
    while queue:
        state = queue.popleft()
        for event, after in model.successors(state):
            transitions += 1
            if after in parents:
                continue
            parents[after] = (state, event)
            if (message := model.violated(after)) is not None:
                return result(False, FencingViolation(message, trace(after)))
            if len(parents) >= config.max_states:
                return result(False)
            if _faultless(after) and not _faultless(state):
                healed.append(after)
            queue.append(after)
    recovers: dict[_State, bool] = {}
    for state in healed:
        if not recovery.recovers(state, recovers):
            message = f"no path to Ready within {recovery.horizon - config.horizon} ticks past the horizon"
            return result(True, FencingViolation(message, trace(state), LIVENESS))
    return result(True)


def _faultless(s: _State) -> bool:
    return not (s.paused or s.off_etcd or s.cut)


class _Model:
    def __init__(self, config: FencingConfig, *, recovering: bool = False) -> None:
        """``recovering``: the model after a heal, for liveness — no adversary, a generation abandoned only once
        it misses a rank, and time and generations extended past the bounds of the exploration."""
        self.config = config
        self.nodes = range(config.nodes)
        self.on = config.mechanisms
        self.recovering = recovering
        self.horizon = config.horizon + (2 * config.ttl if recovering else 0)
        self.generations = config.generations + (2 if recovering else 0)

    def initial(self) -> _State:
        n, ttl = self.config.nodes, self.config.ttl
        return _State(
            t=0,
            holder=NONE,
            term=0,
            lease=(ttl,) * n,
            keys=frozenset(),
            allocated=0,
            authority=(ttl - 1,) * n,
            paused=frozenset(),
            off_etcd=frozenset(),
            cut=frozenset(),
            believes=(0,) * n,
            running=(0,) * n,
            stream=(0,) * n,
            session=(None,) * n,
            obeyed=(0,) * n,
            procs=(frozenset(),) * n,
            msgs=frozenset(),
            faults=0,
        )

    @staticmethod
    def violated(s: _State) -> str | None:
        """Two generations alive, or two processes of one rank (counted as processes: a set of generations
        would hide two of one generation)."""
        alive = sorted((p.rank, p.gen, node, p.direct) for node, procs in enumerate(s.procs) for p in procs)
        ranks = [rank for rank, *_ in alive]
        if len({gen for _, gen, _, _ in alive}) > 1 or len(set(ranks)) < len(ranks):
            return ", ".join(
                f"generation {gen} rank {rank} on n{node}{' (direct)' if direct else ''}"
                for rank, gen, node, direct in alive
            )
        return None

    def ready(self, s: _State) -> bool:
        """A controller of the term etcd holds runs a generation with every rank alive."""
        n = s.holder
        if n == NONE or s.believes[n] != s.term or not s.running[n]:
            return False
        alive = sum(any(p.gen == s.running[n] for p in procs) for procs in s.procs)
        return alive == self.config.ranks

    def recovers(self, root: _State, known: dict[_State, bool]) -> bool:
        """Whether some path from ``root`` reaches `ready`; ``known`` remembers every state settled, across
        calls. Depth-first and iterative: a state is settled once its successors are."""
        on_path: set[_State] = set()
        stack: list[tuple[_State, Iterator[tuple[str, _State]], _State | None]] = []

        def enter(s: _State) -> None:
            if s in known:
                return
            if self.ready(s):
                known[s] = True
                return
            on_path.add(s)
            stack.append((s, self.successors(s), None))

        enter(root)
        while stack:
            s, moves, child = stack.pop()
            if child is not None and known[child]:
                known[s] = True
                on_path.discard(s)
                continue
            for _, after in moves:
                if after in on_path:  # a cycle leads nowhere new
                    continue
                if after not in known:
                    stack.append((s, moves, after))
                    enter(after)
                    break
                if known[after]:
                    known[s] = True
                    on_path.discard(s)
                    break
            else:
                known[s] = False
                on_path.discard(s)
        return known[root]

    # -- the events ------------------------------------------------------------------------------------

    def successors(self, s: _State) -> Iterator[tuple[str, _State]]:
        urgent = False
        for n in self.nodes:
            if n in s.paused:
                continue
            for event, after, due in self._node(s, n):
                urgent = urgent or due
                yield event, after
        if s.t < self.horizon and not urgent:  # a running daemon does what is due before time passes
            yield "tick", self._tick(s)
        for m in s.msgs:
            if m.dst not in s.paused and self._reach(s, m.src, m.dst):
                yield (
                    f"deliver {'spawn' if m.spawn else 'stop'} g{m.gen} (term {m.term}) n{m.src}→n{m.dst}",
                    (self._deliver(s, m)),
                )
        if not self.recovering:
            yield from self._adversary(s)

    def _reach(self, s: _State, a: int, b: int) -> bool:
        return a == b or (min(a, b), max(a, b)) not in s.cut

    def _node(self, s: _State, n: int) -> Iterator[tuple[str, _State, bool]]:
        """What a running daemon can do now, each with whether it is due (it happens before time passes):
        renewals are part of time passing (`_tick`); starting and abandoning a generation, never due."""
        etcd = n not in s.off_etcd
        campaigns = etcd and s.lease[n] > 0 and (Mechanism.CLOCK not in self.on or s.authority[n] > 0)
        if campaigns and s.holder == NONE:
            term = s.term + 1
            yield (
                f"n{n} elected (term {term})",
                s._replace(holder=n, term=term, believes=_set(s.believes, n, term), stream=_set(s.stream, n, 0)),
                True,
            )
        elif campaigns and s.holder == n and not s.believes[n] and Mechanism.RESUME in self.on:  # the key lived on
            resumed = s._replace(believes=_set(s.believes, n, s.term), stream=_set(s.stream, n, s.stream[n] + 1))
            yield f"n{n} finds its term {s.term} alive", resumed, True
        if s.believes[n] and self._term_over(s, n):
            yield f"n{n} steps down", self._step_down(s, n), True
        if s.believes[n] and (Mechanism.CLOCK not in self.on or s.authority[n] > 0):  # it acts as the controller
            if s.running[n] and (not self.recovering or self._broken(s, n)):
                yield f"n{n} abandons g{s.running[n]} (a rank failed)", self._abandon(s, n), False
            elif etcd and self._may_start(s, n) and (placed := self._placement(s)):
                where = ",".join(f"n{m}" for m in placed)
                yield f"n{n} starts g{s.allocated + 1} on {where}", self._start(s, n, placed), False
        session = s.session[n]
        if session is not None and self._session_over(s, n, session):
            yield f"n{n}'s agent ends the stream of term {session[1]}", self._end_session(s, n), True
        if s.authority[n] == 0 and any(not p.direct for p in s.procs[n]):
            fenced = frozenset(p for p in s.procs[n] if p.direct)
            yield f"n{n} fences its runners", s._replace(procs=_set(s.procs, n, fenced)), True
        released = frozenset(k for k in s.keys if k[0] == n and not any(p.gen == k[1] for p in s.procs[n]))
        if etcd and released:
            yield f"n{n} releases {len(released)} key(s)", s._replace(keys=s.keys - released), True

    def _may_start(self, s: _State, n: int) -> bool:
        """Its guarded write would pass, no runner key of an earlier generation is left in etcd, and none of the
        spawns it sent on its stream is still on its way (it awaits each: a generation is over once each of its
        ranks is). What it sent before it stepped down, it forgot."""
        own_spawns = any(m.src == n and m.spawn and (m.term, m.stream) == (s.believes[n], s.stream[n]) for m in s.msgs)
        holds = s.holder == n and s.term == s.believes[n]
        return holds and not s.keys and not own_spawns and s.allocated < self.generations

    def _broken(self, s: _State, n: int) -> bool:
        """Its generation misses a rank that no spawn of its own is still bringing: a failure it detects."""
        gen = s.running[n]
        alive = sum(any(p.gen == gen for p in procs) for procs in s.procs)
        coming = any(m.src == n and m.spawn and m.gen == gen for m in s.msgs)
        return alive < self.config.ranks and not coming

    def _term_over(self, s: _State, n: int) -> bool:
        """What ends a controller's term: its clock, or (always) etcd read saying the key is not its own."""
        by_clock = Mechanism.CLOCK in self.on and s.authority[n] == 0
        by_etcd = n not in s.off_etcd and (s.holder != n or s.term != s.believes[n])
        return by_clock or by_etcd

    def _session_over(self, s: _State, n: int, session: tuple[int, int, int]) -> bool:
        """An agent ends a stream whose controller is gone or out of reach (the stream breaks or goes silent),
        or, with TERM, whose term etcd no longer holds."""
        src, term, stream = session
        gone = s.believes[src] != term or s.stream[src] != stream or not self._reach(s, src, n) or src in s.paused
        over = Mechanism.TERM in self.on and n not in s.off_etcd and s.term != term
        return gone or over

    def _placement(self, s: _State) -> tuple[int, ...]:
        live = tuple(m for m in self.nodes if s.lease[m] > 0)
        return live[: self.config.ranks] if len(live) >= self.config.ranks else ()

    def _start(self, s: _State, n: int, placed: tuple[int, ...]) -> _State:
        gen, term = s.allocated + 1, s.believes[n]
        msgs, procs = set(s.msgs), s.procs
        for rank, m in enumerate(placed):
            if m == n and Mechanism.ONE_PATH not in self.on:
                procs = _set(procs, n, procs[n] | {_Proc(gen, NONE, True, rank)})
            else:
                msgs.add(_Msg(n, m, True, gen, term, s.stream[n], rank))
        return s._replace(allocated=gen, running=_set(s.running, n, gen), msgs=frozenset(msgs), procs=procs)

    def _abandon(self, s: _State, n: int) -> _State:
        gen, term = s.running[n], s.believes[n]
        stops = {_Msg(n, m, False, gen, term, s.stream[n]) for m in self.nodes}
        procs = _set(s.procs, n, frozenset(p for p in s.procs[n] if not (p.direct and p.gen == gen)))
        return s._replace(running=_set(s.running, n, 0), msgs=s.msgs | stops, procs=procs)

    def _step_down(self, s: _State, n: int) -> _State:
        """Its controller's nursery is cancelled: the runners it spawned itself die with it."""
        procs = _set(s.procs, n, frozenset(p for p in s.procs[n] if not p.direct))
        return s._replace(believes=_set(s.believes, n, 0), running=_set(s.running, n, 0), procs=procs)

    def _end_session(self, s: _State, n: int) -> _State:
        """The runners of that controller stop (crash-only: a controller that goes takes its runners)."""
        kept = frozenset(p for p in s.procs[n] if p.direct)
        return s._replace(session=_set(s.session, n, None), procs=_set(s.procs, n, kept))

    def _deliver(self, s: _State, m: _Msg) -> _State:
        s = s._replace(msgs=s.msgs - {m})
        d = m.dst
        if not m.spawn:  # and a spawn of that runner still on its way is refused when it comes (a tombstone)
            tombstone = Mechanism.TOMBSTONE in self.on
            overtaken = frozenset(o for o in s.msgs if tombstone and o.spawn and o.dst == d and o.gen == m.gen)
            procs = _set(s.procs, d, frozenset(p for p in s.procs[d] if p.gen != m.gen))
            return s._replace(procs=procs, msgs=s.msgs - overtaken)
        refused = d in s.off_etcd or s.term != m.term or s.holder != m.src or m.term < s.obeyed[d]
        if Mechanism.TERM in self.on and refused:  # the agent checks the term against etcd and what it obeyed
            return s
        named, open_ = (m.src, m.term, m.stream), s.session[d]
        if Mechanism.STREAM in self.on:
            if open_ != named and (s.believes[m.src], s.stream[m.src]) != (m.term, m.stream):
                return s  # it names a stream that is over: refused
        elif open_ is not None and open_[:2] == named[:2]:
            named = open_  # any stream of its controller's term will do: it joins the one open
        if open_ != named:  # a new controller's stream: the previous one's runners stop
            kept = frozenset(p for p in s.procs[d] if p.direct)
            s = s._replace(
                session=_set(s.session, d, named),
                obeyed=_set(s.obeyed, d, max(s.obeyed[d], m.term)),
                procs=_set(s.procs, d, kept),
            )
        if d in s.off_etcd or s.authority[d] == 0:  # the claim: under the node's lease, while it surely lives
            return s
        proc = _Proc(m.gen, s.authority[d] if Mechanism.DEADLINE in self.on else NONE, False, m.rank)
        return s._replace(keys=s.keys | {(d, m.gen)}, procs=_set(s.procs, d, s.procs[d] | {proc}))

    def _tick(self, s: _State) -> _State:
        """One tick for every clock. A daemon that runs and reaches etcd renews its lease (its authority and its
        runners' deadlines move on with it); every other node's lease, authority and deadlines run down."""
        ttl = self.config.ttl
        lease, authority, procs = list(s.lease), list(s.authority), list(s.procs)
        for n in self.nodes:
            if n not in s.paused and n not in s.off_etcd:
                lease[n], authority[n] = ttl, ttl - 1
                procs[n] = frozenset(p if p.deadline == NONE else p._replace(deadline=ttl - 1) for p in procs[n])
                continue
            lease[n], authority[n] = max(0, lease[n] - 1), max(0, authority[n] - 1)
            procs[n] = frozenset(
                p if p.deadline == NONE else p._replace(deadline=p.deadline - 1)
                for p in procs[n]
                if p.deadline == NONE or p.deadline > 1
            )
        expired = {n for n in self.nodes if s.lease[n] > 0 and lease[n] == 0}
        return s._replace(
            t=s.t + 1,
            lease=tuple(lease),
            authority=tuple(authority),
            procs=tuple(procs),
            keys=frozenset(k for k in s.keys if k[0] not in expired),
            holder=NONE if s.holder in expired else s.holder,
        )

    def _adversary(self, s: _State) -> Iterator[tuple[str, _State]]:
        for n in sorted(s.paused):
            yield f"n{n} continues", s._replace(paused=s.paused - {n})
        for n in sorted(s.off_etcd):
            yield f"n{n} reaches etcd again", s._replace(off_etcd=s.off_etcd - {n})
        for pair in sorted(s.cut):
            yield f"n{pair[0]}↔n{pair[1]} healed", s._replace(cut=s.cut - {pair})
        if s.faults >= self.config.max_faults:
            return
        hit = s._replace(faults=s.faults + 1)
        allowed = self.config.faults
        for n in self.nodes:
            if Fault.PAUSE in allowed and n not in s.paused:
                yield f"n{n}'s daemon paused", hit._replace(paused=s.paused | {n})
            if Fault.CUT_ETCD in allowed and n not in s.off_etcd:
                yield f"n{n} cut from etcd", hit._replace(off_etcd=s.off_etcd | {n})
            links = frozenset((min(n, m), max(n, m)) for m in self.nodes if m != n)
            if Fault.CUT in allowed and not (n in s.off_etcd and links <= s.cut):
                yield f"n{n} cut off", hit._replace(off_etcd=s.off_etcd | {n}, cut=s.cut | links)
        if Fault.CUT_LINK in allowed:
            for a in self.nodes:
                for b in range(a + 1, self.config.nodes):
                    if (a, b) not in s.cut:
                        yield f"n{a}↔n{b} cut", hit._replace(cut=s.cut | {(a, b)})


def _set(values: tuple, index: int, value: object) -> tuple:
    return (*values[:index], value, *values[index + 1 :])
