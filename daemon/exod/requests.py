"""The request book: every chat request from the moment a caller submits it until its last token.

One book. It is the only place requests are kept: the planner sees the ones
still waiting for a runner (`pending`, passed into its view), the controller
tells the book what the planner decided (`forwarded`, `cancel`) and what
rank 0 said (`deliver`), and each caller reads its own `RequestStream`: what
rank 0 said, translated from the wire into `exod.generated`'s values.

The book reads the cluster (is the instance there, is it Ready, did its
leader fail) but never changes a machine; it calls ``wake`` when something
new needs planning.
"""

from __future__ import annotations

import collections
import hashlib
import math
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import attrs
import trio

import fsm
from exod import generated as g
from exod.config import DEFAULT, Default
from exod.host.models import validate_model_id
from exod.runner import grammar as grammars
from exod.runner import protocol as p
from fsm.cluster import Cluster

REQUIRED = p.REQUIRED  # `submit(tool_choice=REQUIRED)`: the model must call a tool, whichever


class InstanceNotFound(LookupError):
    """No such instance (or it was deleted)."""


class RequestFailed(Exception):
    """A generation request ended with an error (runner failed, instance deleted, bad request)."""


class InvalidRequest(ValueError):
    """A request the runner could not decode, or must not see (caught before it is sent); ``param`` names the
    field at fault, in the runner's words (``prompt_tokens``, ``logit_bias``; None: the request)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PoisonRequest(InvalidRequest):
    """A request that was in the batch at `POISON_AT` deaths of its instance's runners: refused from then on."""


class PromptRejected(RequestFailed):
    """The runner refused the request itself (its prompt is over the model's context): the caller's mistake.
    ``param``: the field at fault, as `InvalidRequest`'s (None: the prompt)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextExceeded(PromptRejected):
    """The prompt does not fit the model's context: each dialect says so in the words its clients look for."""

    def __init__(self, message: str, prompt_tokens: int, context: int) -> None:
        super().__init__(message)
        self.prompt_tokens, self.context = prompt_tokens, context


class ConstraintRejected(PromptRejected):
    """The output's constraint (a JSON schema, a pattern, a grammar) cannot be compiled: the caller's to fix."""


POISON_AT = 2  # deaths of its instance's runners a request may be present at: at this many it is a poison
_DEATHS_KEPT = 1024  # requests whose deaths are remembered, the oldest forgotten first


class QueueTimeout(RequestFailed):
    """No Ready runner took the request in time (HTTP 503)."""


class ShuttingDown(RequestFailed):
    """The daemon is shutting down: it ended the request, or refused it, before it finished (HTTP 503)."""


class Overloaded(Exception):
    """The instance's request queue is full."""


class ModelNotReady(Exception):
    """The model is placed but no instance of it is Ready yet."""

    def __init__(self, model_id: str, retry_after: int) -> None:
        self.model_id = model_id
        self.retry_after = retry_after
        super().__init__(f"model {model_id!r} has no Ready instance yet; retry in {retry_after} s")


@attrs.define
class _Request:
    instance_id: str
    command: p.Generate
    channel: trio.MemorySendChannel[Any]
    keep_alive: float | Default | None = DEFAULT  # how long its instance stays loaded after it (Ollama's field)
    leader: str = ""  # runner id of rank 0 once forwarded
    incarnation: int = -1
    runners: list[tuple[str, int]] = attrs.Factory(list)  # every rank it was sent to: (runner id, incarnation)
    forwarded: trio.Event = attrs.Factory(trio.Event)
    answered: trio.Event = attrs.Factory(trio.Event)  # forwarded, or failed: the caller's wait is over
    abandoned: bool = False  # the caller went away; still counted until the runners are done with it
    failed: bool = False  # ended with an error; its caller has been told
    done: bool = False  # rank 0 said it is done: no longer in any batch
    fingerprint: str = ""  # what it asks, whatever its id: the same request sent again has the same one


class RequestStream:
    """What one request said (`exod.generated`: tokens, tool calls), then its `Done`; raises `RequestFailed`
    if it cannot finish."""

    def __init__(self, book: RequestBook, request_id: str, request: _Request, receive: Any) -> None:
        self.request_id = request_id
        self._book = book
        self._request = request
        self._receive = receive
        self._done = False
        self._last: Any = None
        self._first: Any = None  # what `started` read ahead, not yet given out

    def __aiter__(self) -> RequestStream:
        return self

    async def started(self) -> None:
        """Until the runners took the request and answered it: its first token, or the error it ended with
        (raised here, so that a refusal can still be an HTTP error before any byte of a stream is sent)."""
        if self._first is None and not self._done:
            self._first = await self.__anext__()

    @property
    def ready(self) -> bool:
        """Whether the next item (or the end) is here already. A response writes what it holds only when the
        next must be waited for: a token and its `Done`, or tokens that came together, go out in one write."""
        return self._first is not None or self._done or self._receive.statistics().current_buffer_used > 0

    async def __anext__(self) -> g.Said:
        if self._first is not None:
            item, self._first = self._first, None
            return item
        if self._done:
            raise StopAsyncIteration
        await self.wait_forwarded()
        try:  # what is here already is taken without a checkpoint: the caller's write is one
            item = self._receive.receive_nowait()
        except trio.WouldBlock:
            item = await self._receive.receive()
        self._last = item
        if isinstance(item, Exception):
            self._done = True
            raise item
        if isinstance(item, g.Done):
            self._done = True
        return item

    def close(self) -> None:
        """The caller is done. A request the runners are still working on stays counted until they finish:
        ranks generate in lockstep and cannot drop it one-sidedly, and the queue bound must hold."""
        finished = self._done and not isinstance(self._last, Exception)
        self._done = True
        if self._request.forwarded.is_set() and not finished and self._request.leader:
            self._request.abandoned = True
            self._book.drop(self.request_id)
        else:
            self._book.forget(self.request_id)

    async def wait_forwarded(self) -> None:
        """Until a Ready runner took the request; `QueueTimeout` after the configured wait."""
        if self._request.answered.is_set():
            return
        limit = self._book.queue_timeout
        with trio.move_on_after(limit):
            await self._request.answered.wait()
        if not self._request.answered.is_set():
            self._done = True
            raise QueueTimeout(f"no Ready runner took the request within {limit:g} s; retry later")


class RequestBook:
    def __init__(
        self,
        cluster: Cluster,
        *,
        wake: Callable[[], None],
        now: Callable[[], float],
        max_per_instance: int,
        queue_timeout: float,
        post: Callable[[str, int, p.Command], None] = lambda _runner_id, _incarnation, _command: None,
        place: Callable[[str], Awaitable[str]] | None = None,
    ) -> None:
        """``place``: models are placed on demand (`serving`) by it, and a request for a model whose instance is
        still loading waits for it instead of being told to retry (`ModelNotReady`)."""
        self.cluster = cluster
        self.queue_timeout = queue_timeout
        self._place = place
        self._placing = trio.Lock()  # two first requests for a model place it once
        self._wake = wake
        self._now = now
        self._post = post
        self._max_per_instance = max_per_instance
        self._requests: dict[str, _Request] = {}
        self._closed: str | None = None  # why, once `fail_all` ended the book: every later submit is refused
        self._vocabulary: dict[str, int] = {}  # by model: its embedding rows, as its runners said (`learned`)
        self._vetting = trio.CapacityLimiter(1)  # constraints sized one at a time, off the event loop (`vet`)
        # crash attribution: by fingerprint and instance, the generations that died with the request in their
        # batch; a fingerprint at `POISON_AT` of them is a poison, and why
        self._deaths: collections.OrderedDict[tuple[str, str], set[int]] = collections.OrderedDict()
        self._poison: collections.OrderedDict[str, str] = collections.OrderedDict()

    # -- callers -----------------------------------------------------------------------------

    def pick(self, model_id: str) -> str:
        """The Ready instance of ``model_id`` with the fewest requests; else one on its way back from being parked
        (its requests wait for it, bounded by the queue timeout); `ModelNotReady` says when to retry."""
        live = [
            (iid, pl)
            for iid, pl in self.cluster.instances.items()
            if pl.model_id == model_id and not pl.machine.is_deleted
        ]
        if not live:
            raise InstanceNotFound(self._not_placed(model_id))
        ready = [iid for iid, pl in live if pl.machine.instance_state is fsm.InstanceState.READY]
        if ready:
            return min(ready, key=lambda iid: (self.load(iid), iid))
        coming = [iid for iid, pl in live if self._coming(pl.machine)]
        if coming:
            return min(coming, key=lambda iid: (self.load(iid), iid))
        now = self._now()
        waits = [pl.machine.deadline - now for _, pl in live if pl.machine.deadline is not None]
        raise ModelNotReady(model_id, max(1, math.ceil(min(waits, default=1.0))))

    async def serving(self, model_id: str) -> str:
        """The instance a request for ``model_id`` goes to (`pick`); placed on demand, if the book places models
        and this is one that can be (refused as `place` refuses), the request then waiting for it."""
        try:
            return self.pick(model_id)
        except InstanceNotFound:
            if self._place is None or not _is_model_id(model_id):  # `pick` said what is served instead
                raise
        async with self._placing:
            try:
                return self.pick(model_id)
            except InstanceNotFound:
                return await self._place(model_id)

    def _coming(self, machine: fsm.InstanceRetry) -> bool:
        """Parked, or on its way to Ready after an unpark (or, placed on demand, at all)."""
        parked = machine.instance_state in (fsm.InstanceState.PARKING, fsm.InstanceState.PARKED)
        loading = machine.instance_state in (fsm.InstanceState.PENDING, fsm.InstanceState.STARTING)
        return parked or machine.waking or (self._place is not None and loading)

    def _not_placed(self, model_id: str) -> str:
        """Why ``model_id`` cannot be served, and what to do: place it, where it can be a model's id at all;
        else the ids that are served (a client's default such as gpt-3.5-turbo is not a model here)."""
        try:
            validate_model_id(model_id)
        except ValueError:
            served = sorted({pl.model_id for pl in self.cluster.instances.values() if not pl.machine.is_deleted})
            names = ", ".join(served) if served else "none yet (`exod place org/name`)"
            return f"model {model_id!r} is not served here; the models served: {names} (GET /v1/models)"
        return f"model {model_id!r} is not placed; place it with `exod place {model_id}`"

    def load(self, instance_id: str) -> int:
        """Requests of the instance, queued or in flight."""
        return sum(1 for r in self._requests.values() if r.instance_id == instance_id)

    def submit(
        self,
        instance_id: str,
        messages: list[dict[str, Any]] | None = None,
        *,
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: list[str] | None = None,
        keep_alive: float | Default | None = DEFAULT,
        **options: Any,
    ) -> RequestStream:
        """Queue a generation on an instance: chat ``messages``, or a prompt (``prompt_text``,
        ``prompt_tokens``); ``options`` are `exod.runner.protocol.Generate`'s others (tools, logprobs, penalties).
        ``keep_alive``: seconds its instance stays loaded after it (None: forever; by default, the instance's
        own). Refuses at once (not later) when it cannot take it."""
        if self._closed is not None:
            raise ShuttingDown(self._closed)
        placement = self.cluster.instances.get(instance_id)
        if placement is None or placement.machine.is_deleted:
            raise InstanceNotFound(f"no live instance {instance_id!r}")
        if self.load(instance_id) >= self._max_per_instance:
            raise Overloaded(
                f"instance {instance_id} already has {self._max_per_instance} requests queued; retry shortly"
            )
        request_id = f"req-{secrets.token_hex(6)}"
        command = p.Generate(
            request_id=request_id,
            prompt_messages=messages,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=stop or [],
            **options,
        )
        try:
            p.from_json(command.to_line())  # what the runner will decode: refuse it here, not there
        except p.ProtocolError as exc:
            raise InvalidRequest(f"invalid request: {exc}") from exc
        vocabulary = self._vocabulary.get(placement.model_id)
        if vocabulary is not None and (outside := command.outside(vocabulary)):
            raise InvalidRequest(outside[1], param=outside[0])
        fingerprint = _fingerprint(command)
        if fingerprint in self._poison:
            raise PoisonRequest(self._poison[fingerprint])
        send, receive = trio.open_memory_channel[Any](math.inf)
        request = _Request(instance_id, command, send, keep_alive, fingerprint=fingerprint)
        self._requests[request_id] = request
        self._wake()
        return RequestStream(self, request_id, request, receive)

    async def vet(self, grammar: dict[str, Any] | None, tools: list[dict[str, Any]] | None, tool_choice: Any) -> None:
        """Size a request's constraints before it is submitted (`exod.runner.grammar.vet`), on a worker thread: a
        pattern built to be slow stalls no one else. `ConstraintRejected` for one beyond what runners decode."""
        if grammar is None and not (tools and tool_choice):
            return
        command = p.Generate(request_id="", prompt_text="", grammar=grammar, tools=tools, tool_choice=tool_choice)
        try:
            await trio.to_thread.run_sync(grammars.vet, command, limiter=self._vetting)
        except grammars.GrammarError as exc:
            raise ConstraintRejected(str(exc)) from None

    async def generate(self, instance_id: str, messages: list[dict[str, str]], **params: Any) -> AsyncIterator[Any]:
        """`submit`, then iterate: tokens, then one `Done`; `RequestFailed` on error."""
        stream = self.submit(instance_id, messages, **params)
        try:
            async for item in stream:
                yield item
        finally:
            stream.close()

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    # -- the controller ------------------------------------------------------------------------

    def pending(self) -> Iterator[fsm.PendingRequest]:
        """Requests no runner has taken yet: the planner's input."""
        for request_id, request in self._requests.items():
            if not request.forwarded.is_set() and not request.failed:
                yield fsm.PendingRequest(request_id, request.instance_id)

    def forwarded(self, action: fsm.ForwardRequest, rank: int) -> p.Generate | None:
        """The planner sent the request to a runner: the command to post, or None if the book forgot it."""
        request = self._requests.get(action.request_id)
        if request is None:
            return None
        request.runners.append((action.runner_id, action.incarnation))
        if rank == 0:  # rank 0 speaks for the request
            request.leader, request.incarnation = action.runner_id, action.incarnation
        request.forwarded.set()
        request.answered.set()
        return request.command

    def learned(self, runner_id: str, vocabulary: int) -> None:
        """A runner said its model's vocabulary (before Ready: before any request reaches it). Requests of that
        model naming a token id beyond it are refused from now on, and those queued already end now."""
        entry = self.cluster.runners.get(runner_id)
        placement = None if entry is None else self.cluster.instances.get(entry.instance_id)
        if placement is None or vocabulary <= 0:
            return
        self._vocabulary[placement.model_id] = vocabulary
        for request_id, request in list(self._requests.items()):
            model = self.cluster.instances.get(request.instance_id)
            queued = model is not None and model.model_id == placement.model_id and not request.forwarded.is_set()
            if queued and (outside := request.command.outside(vocabulary)):
                self._fail(request_id, PromptRejected(outside[1], param=outside[0]))

    def died(self, runner_id: str, incarnation: int) -> str | None:
        """A runner died (not stopped): every request in its batch was there. Returns why this death is a poison
        request's, if one of them has now been in the batch at `POISON_AT` deaths of its instance (that request
        is refused from then on); else None. The ranks of one generation are one death, said by the first of
        their reports: the others return None."""
        poison = None
        for request in self._requests.values():
            if (runner_id, incarnation) not in request.runners or request.done or not request.fingerprint:
                continue
            key = (request.fingerprint, request.instance_id)
            deaths = self._deaths.setdefault(key, set())
            self._deaths.move_to_end(key)
            if incarnation in deaths:  # another rank of a death counted already
                continue
            deaths.add(incarnation)
            if len(deaths) >= POISON_AT:
                poison = (
                    f"this request was in the batch each time runners of instance {request.instance_id} died, "
                    f"{len(deaths)} times (generations {', '.join(map(str, sorted(deaths)))}): it is refused from "
                    "now on, so that it cannot take the instance down again; change it, or report it as a bug"
                )
                self._poison[request.fingerprint] = poison
                self._poison.move_to_end(request.fingerprint)
        for kept in (self._deaths, self._poison):
            while len(kept) > _DEATHS_KEPT:
                kept.popitem(last=False)
        return poison

    def keep_alive(self, request_id: str) -> float | Default | None:
        """The keep-alive the request asked for its instance (`DEFAULT`: none of its own)."""
        request = self._requests.get(request_id)
        return DEFAULT if request is None else request.keep_alive

    def drop(self, request_id: str) -> None:
        """Its caller went away: every rank drops it from its batch, at the same step (`exod.runner.protocol.Cancel`).
        It stays counted until rank 0 says it is done, so the bound on requests holds."""
        request = self._requests.get(request_id)
        for runner_id, incarnation in [] if request is None else request.runners:
            self._post(runner_id, incarnation, p.Cancel(request_id))

    def cancel(self, request_id: str, reason: str) -> None:
        """End a request with an error (its caller sees `RequestFailed`), never a hang."""
        self._fail(request_id, RequestFailed(reason))

    def refuse(
        self,
        request_id: str,
        reason: str,
        *,
        prompt_tokens: int | None = None,
        context: int | None = None,
        grammar: bool = False,
    ) -> None:
        """The runner refused the request as asked (`PromptRejected`; `ContextExceeded` when its prompt did not
        fit): the caller has to change it."""
        if grammar:
            self._fail(request_id, ConstraintRejected(reason))
        elif prompt_tokens is None or context is None:
            self._fail(request_id, PromptRejected(reason))
        else:
            self._fail(request_id, ContextExceeded(reason, prompt_tokens, context))

    def fail_all(self, reason: str) -> None:
        """The daemon is going away: end every request, queued or in flight, with `ShuttingDown`, and refuse
        new ones. A caller gets what was generated so far, then the error: its stream is never cut silently."""
        self._closed = reason
        for request_id in list(self._requests):
            self._fail(request_id, ShuttingDown(reason))

    def _fail(self, request_id: str, error: RequestFailed) -> None:
        request = self._requests.get(request_id)
        if request is None:
            return
        if request.abandoned:
            self.forget(request_id)
        elif not request.failed:
            request.failed = True
            request.channel.send_nowait(error)
            request.answered.set()  # a queued request learns it at once, not at its queue timeout

    def deliver(self, runner_id: str, report: p.Token | p.ToolCall | p.Done | p.Prompt | p.Embedding) -> None:
        """A token, or the end, from a runner; only the request's rank 0 is heard."""
        request = self._requests.get(report.request_id)
        if request is None or request.leader != runner_id:
            return
        if isinstance(report, p.Done):
            request.done = True
        if request.abandoned:
            if isinstance(report, p.Done):
                self.forget(report.request_id)
        else:
            request.channel.send_nowait(_said(report))

    def fail_orphaned(self) -> None:
        """A forwarded request whose rank 0 is no longer Ready will never finish: end it now, never hang."""
        for request_id, request in list(self._requests.items()):
            if not request.leader:
                continue
            entry = self.cluster.runners.get(request.leader)
            machine = None if entry is None else entry.machine
            if (
                machine is None
                or machine.incarnation != request.incarnation
                or machine.runner_state is not fsm.RunnerState.READY
            ):
                self.cancel(request_id, self._why_orphaned(request, machine))
                request.leader = ""

    def _why_orphaned(self, request: _Request, machine: fsm.RunnerLifecycle | None) -> str:
        placement = self.cluster.instances.get(request.instance_id)
        if placement is None or placement.machine.is_deleted:
            reason = placement.machine.delete_reason if placement is not None else None
            return f"instance was deleted ({reason.value if reason else 'gone'})"
        cause = machine.failure.message if machine is not None and machine.failure else "runner stopped"
        return f"the runner serving this request failed: {cause}"


def _fingerprint(command: p.Generate) -> str:
    """What a request asks, whatever its id: a client that sends it again sends the same one."""
    return hashlib.sha256(attrs.evolve(command, request_id="").to_line()).hexdigest()


def _is_model_id(text: str) -> bool:
    try:
        validate_model_id(text)
    except ValueError:
        return False
    return True


def _alternative(alt: p.Alternative) -> g.Alternative:
    return g.Alternative(alt.token_id, alt.text, alt.logprob)


def _said(report: p.Token | p.ToolCall | p.Done | p.Prompt | p.Embedding) -> g.Said:
    """Rank 0's report as the front end hears it: the wire's envelope (runner, incarnation, request) dropped."""
    match report:
        case p.Token():
            chosen = None if report.chosen is None else _alternative(report.chosen)
            top = None if report.top_logprobs is None else [_alternative(a) for a in report.top_logprobs]
            return g.Token(report.text, report.token_id, chosen, top)
        case p.ToolCall():
            return g.ToolCall(report.name, report.arguments)
        case p.Prompt():
            logprobs = None if report.logprobs is None else [a and _alternative(a) for a in report.logprobs]
            top = None if report.top_logprobs is None else [[_alternative(a) for a in r] for r in report.top_logprobs]
            return g.Prompt(report.tokens, report.text, logprobs, top)
        case p.Embedding():
            return g.Embedding(report.vector)
        case p.Done():
            return g.Done(
                g.FinishReason(report.finish_reason.value),
                report.prompt_tokens,
                report.completion_tokens,
                stop_sequence=report.stop_sequence,
                cached_tokens=report.cached_tokens,
                batch_size=report.batch_size,
                prompt_cache_bytes=report.prompt_cache_bytes,
            )
