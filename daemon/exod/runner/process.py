"""One runner process = one rank of a model instance: the thinnest layer over mlx-lm.

Run as::

    python -m exod.runner --runner-id ID --incarnation N --rank R --world-size W --control-fd FD [--hostfile PATH]

Theory of operation
-------------------
Two threads. A *reader* thread owns the control channel's input: it decodes
commands and queues them, and answers a ``Ping`` itself at once (the heartbeat:
a long prefill or ``mx.eval``, which releases the interpreter, never delays it;
a stopped or wedged process misses it); on ``Shutdown`` or end of file (the supervisor died)
it ends the process at once with ``os._exit(0)`` — even while the main thread
is stuck inside MLX (a ring init whose peer never comes blocks in C forever), so
an orphaned runner can never linger. The *main* thread owns MLX: it connects,
loads and warms up as told, then decodes every request in one continuous batch
(`exod.runner.batch`): requests join at the next step and leave when they finish.

Distributed mode: every rank receives every command in the same order, and all
ranks run the same batch at every step (a pipeline needs every stage for every
token): rank 0 says how many queued commands join at each step (`exod.runner.batch.Lockstep`).
Only rank 0 streams `Token` messages; every rank sends `Done`.

Any exception in the main thread becomes a `Failed` report (with traceback and a
retry classification) followed by exit code 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import queue
import re
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from exod.runner import protocol as p
from exod.runner import watchdog
from exod.runner.batch import Batch, BatchLimits, Lockstep, prompt_tokens
from exod.runner.faults import Fault, FaultPhase, Injector
from exod.runner.mlx_import import import_mlx_lm
from exod.runner.protocol import HOST_ERRNOS
from exod.runner.tool_prompt import JSON_TOOLS, takes_tools

log = logging.getLogger("exod.runner")

EXIT_FAILED = 1
OUTBOX = 1024  # tokens queued for the writer thread at most
READ_BYTES = 65536  # of commands at once (`exod.host.supervisor.WRITE_BYTES`)
STREAMED = (p.Token, p.Heartbeat, p.Pong)  # every token's reports, and the reader's: queued, not waited for
WARM_UP_TOKENS = 4


class RunnerProtocolError(p.ProtocolError):
    """A command arrived that the runner's current phase does not allow (a supervisor bug)."""


class UnsupportedModel(Exception):
    """The model cannot be split over this many ranks."""


# -- the channel ------------------------------------------------------------------


class Channel:
    """The runner's end of the control socket: reports written in order by a writer thread, commands read by a
    reader thread.

    The model's loop only queues a token (`STREAMED`): writing it wakes the daemon, a system call that would
    otherwise hold up the next decoding step at every token. A request's first token is written at once (the
    writer thread, waiting for a core while the model computes, would add a millisecond to the time to first
    token), and so is every other report, after those queued before it, by the time `send` returns: what
    follows may hold the GIL for long (joining a ring, loading) or end the process (`Failed`). The queue is
    bounded, so a daemon that stops reading stalls the runner (as a full socket did) instead of filling its
    memory."""

    def __init__(
        self,
        fd: int,
        runner_id: str,
        incarnation: int,
        injector: Injector | None = None,
        *,
        closed: Callable[[], object] | None = None,
    ) -> None:
        """``closed``: what a closed socket, written or read, does (by default: the process ends, its supervisor
        gone)."""
        self.injector = injector or Injector(None, fail=lambda exc: None, exit_now=exit_now)
        self._closed = closed or (lambda: exit_now(0))
        self._sock = socket.socket(fileno=fd)
        self.runner_id = runner_id
        self.incarnation = incarnation
        self.commands: queue.Queue[p.Command] = queue.Queue()
        self.arriving = threading.Lock()  # held while one read's commands are queued: they are taken together
        self._outbox: queue.Queue[tuple[str, bytes]] = queue.Queue(maxsize=OUTBOX)
        self._writing = threading.Lock()  # one writer of the socket at a time: this thread's or a sender's
        self._speaking: set[Any] = set()  # requests whose first token is written: the next ones are queued
        threading.Thread(target=self._write_forever, name="control-writer", daemon=True).start()

    def send(self, cls: type[p.Report], **fields: Any) -> None:
        line = cls(runner_id=self.runner_id, incarnation=self.incarnation, **fields).to_line()
        request_id = fields.get("request_id")
        first = cls is p.Token and request_id not in self._speaking
        if first:
            self._speaking.add(request_id)
        elif cls in (p.Done, p.RequestError):
            self._speaking.discard(request_id)
        if not first and cls in STREAMED:
            self._outbox.put((cls.type, line))
            return
        with self._writing:
            if not self._outbox.unfinished_tasks:  # nothing queued before it: written here and now
                self._write(cls.type, line)
                return
        self._outbox.put((cls.type, line))
        self.flush()

    def flush(self) -> None:
        """Until every report sent so far is written (or the socket is gone, and the process ends)."""
        self._outbox.join()

    def _write(self, kind: str, line: bytes) -> bool:
        try:
            self._sock.sendall(line)
        except OSError:
            log.warning("control channel closed while sending %s: exiting", kind)
            self._closed()
            return False
        return True

    def _write_forever(self) -> None:
        while True:
            kind, line = self._outbox.get()
            with self._writing:
                if not self._write(kind, line):
                    return
            self._outbox.task_done()

    def _refuse_request(self, line: bytes, exc: p.ProtocolError) -> bool:
        """Answer an undecodable ``generate`` that names its request with a `RequestError`."""
        try:
            doc = json.loads(line)
        except ValueError:
            return False
        if not isinstance(doc, dict) or doc.get("type") != "generate" or not isinstance(doc.get("request_id"), str):
            return False
        self.send(p.RequestError, request_id=doc["request_id"], message=f"invalid request: {exc}")
        return True

    def start_reader(self) -> None:
        threading.Thread(target=self._read_forever, name="control-reader", daemon=True).start()

    def _read_forever(self) -> None:
        reader = p.LineReader()
        try:
            while data := self._sock.recv(READ_BYTES):
                arrived: list[p.Command] = []
                for line in reader.feed(data):
                    try:
                        command = p.from_json(line)
                    except p.ProtocolError as exc:
                        if self._refuse_request(line, exc):
                            continue  # one bad request is that request's error, not the runner's
                        raise
                    if not isinstance(command, p.Command):
                        raise p.ProtocolError(f"runner received a {command.type} report")
                    if isinstance(command, p.Ping):  # answered here: a busy main thread does not delay it
                        self.send(p.Pong)
                        continue
                    if isinstance(command, p.Shutdown):
                        self.injector.at(FaultPhase.STOPPING, main_thread=False)
                        if self.injector.hung.is_set():
                            continue  # a hung runner does not answer: the supervisor escalates
                        log.info("shutdown requested: exiting")
                        self.flush()  # what the batch said before it
                        exit_now(0)
                    arrived.append(command)
                with self.arriving:  # what the supervisor wrote at once is taken in one step (`Lockstep.take`)
                    for command in arrived:
                        self.commands.put(command)
        except p.ProtocolError as exc:
            self.send(p.Failed, **_failure_fields(exc))
            exit_now(EXIT_FAILED)
        except OSError as exc:
            log.warning("control channel error: %s", exc)
        log.info("control channel closed (supervisor gone): exiting")
        self._closed()


def exit_now(code: int) -> NoReturn:
    """End the process without joining threads or running MLX teardown, which can block on a dead peer."""
    watchdog.stop()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


# -- failure classification -------------------------------------------------------

# Errors from the model's own files: retrying the same files cannot help.
_NON_RETRYABLE_TYPES: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    json.JSONDecodeError,
    UnsupportedModel,
)  # a ProtocolError is the daemon's bug, not the model's: retryable (the budget still bounds it)
_NON_RETRYABLE_MARKERS = ("safetensors", "corrupt", "incomplete download")


def is_retryable(exc: BaseException, *, loading: bool = False) -> bool:
    """False for defects of the model or of the protocol; True for what may pass (OOM, a peer, the network)."""
    if isinstance(exc, _NON_RETRYABLE_TYPES):
        return False
    if any(marker in str(exc).lower() for marker in _NON_RETRYABLE_MARKERS):
        return False
    # while loading, ValueError/KeyError/TypeError come from config.json (unknown model_type, missing field)
    return not (loading and isinstance(exc, ValueError | KeyError | TypeError))


# MLX's ring reports a port it cannot bind as "[ring] Couldn't bind socket (error: 98)", errno in the text
_RING_BIND = re.compile(r"\[ring\] Couldn't bind socket \(error: ?(\d+)\)")


def is_host_failure(exc: BaseException) -> bool:
    """No fds, no disk, a ring port another process took: the host's doing, whatever the model."""
    if isinstance(exc, OSError) and exc.errno in HOST_ERRNOS:
        return True
    match = _RING_BIND.search(str(exc))
    return match is not None and int(match.group(1)) in HOST_ERRNOS


# MLX's ring, when another rank died: "[ring] connection to a peer was lost" (after "closed by the peer")
_PEER_LOST = ("connection to a peer was lost", "was closed by the peer")


def is_peer_lost(exc: BaseException) -> bool:
    """The ring lost a peer: this rank fails because another one did."""
    return any(marker in str(exc) for marker in _PEER_LOST)


def _failure_fields(exc: BaseException, *, loading: bool = False) -> dict[str, Any]:
    host = is_host_failure(exc)
    peer = is_peer_lost(exc)
    return {
        "exception_type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
        "retryable": host or peer or is_retryable(exc, loading=loading),
        "host": host,
        "peer": peer,
    }


# -- the runner -------------------------------------------------------------------


class Runner:
    """Executes commands on the main thread; holds the group, the model and the tokenizer."""

    def __init__(
        self,
        channel: Channel,
        *,
        rank: int,
        world_size: int,
        script: str | None = None,
        limits: BatchLimits | None = None,
    ) -> None:
        self.channel = channel
        self.faults = channel.injector
        self.rank = rank
        self.world_size = world_size
        self.script = script  # tests only: every generation emits this text (its log-probabilities are real)
        self.limits = limits or BatchLimits()
        self.group: Any = None
        self.model: Any = None
        self.tokenizer: Any = None
        self.batch: Batch | None = None  # once warm: every request in flight
        self.loading = False

    @property
    def ready(self) -> bool:
        return self.batch is not None

    def serve(self) -> NoReturn:
        try:
            while True:
                if self.batch is None:  # connecting, loading, warming up: one command at a time
                    self._hang_if_told()
                    self.handle(self.channel.commands.get())
                    continue
                lockstep = self.batch.lockstep
                for command in lockstep.take(idle=self.batch.idle):
                    self._hang_if_told()
                    self.handle(command)
                self.batch.step()
        except BaseException as exc:
            log.exception("runner failed")
            self.channel.send(p.Failed, **_failure_fields(exc, loading=self.loading))
            exit_now(EXIT_FAILED)

    def _hang_if_told(self) -> None:
        if self.faults.hung.is_set():  # a fault made this runner stop answering
            threading.Event().wait()

    def handle(self, command: p.Command) -> None:
        match command:
            case p.Connect():
                self.connect()
            case p.Load():
                self.load(Path(command.model_path))
            case p.WarmUp():
                self.warm_up()
            case p.Generate():
                self.generate(command)
            case p.Cancel(request_id=request_id):
                if self.batch is not None:
                    self.batch.cancel(request_id)
            case _:
                raise RunnerProtocolError(f"unexpected command {command.type}")

    # -- phases -----------------------------------------------------------------

    def connect(self) -> None:
        import mlx.core as mx

        if self.group is not None:
            raise RunnerProtocolError("connect received twice")
        self.channel.send(p.Status, phase=p.Phase.JOINING)
        self.faults.at(FaultPhase.CONNECTING)
        if self.world_size > 1:
            self.group = mx.distributed.init(backend="ring", strict=True)
            if (self.group.rank(), self.group.size()) != (self.rank, self.world_size):
                raise RunnerProtocolError(
                    f"ring group says rank {self.group.rank()}/{self.group.size()}, "
                    f"argv says {self.rank}/{self.world_size}: hostfile and MLX_RANK disagree"
                )
        self.channel.send(p.Status, phase=p.Phase.JOINED)

    def load(self, model_path: Path) -> None:
        import mlx.core as mx

        import_mlx_lm()
        from mlx_lm.utils import load_model, load_tokenizer

        if self.world_size > 1 and self.group is None:
            raise RunnerProtocolError("load before connect on a multi-rank runner")
        if self.model is not None:
            raise RunnerProtocolError("load received twice")
        self.loading = True
        self.channel.send(p.Status, phase=p.Phase.WEIGHTS)
        # lazy: nothing is read until evaluated, so each rank reads only its shard, layer by layer
        model, config = load_model(model_path, lazy=True, strict=True)
        tokenizer = load_tokenizer(model_path, eos_token_ids=config.get("eos_token_id"))
        if not tokenizer.has_tool_calling and not takes_tools(tokenizer.chat_template):  # exod writes the tools
            tokenizer = load_tokenizer(model_path, JSON_TOOLS, eos_token_ids=config.get("eos_token_id"))
        layers = self._shard(model)
        for index, layer in enumerate(layers, start=1):
            mx.eval(layer.parameters())
            self.channel.send(p.Progress, layers_loaded=index, layers_total=len(layers))
            self.faults.at(FaultPhase.LOADING)
        mx.eval(model.parameters())  # embeddings, final norm, head
        if not layers:
            self.channel.send(p.Progress, layers_loaded=1, layers_total=1)
        self.model, self.tokenizer = model, tokenizer
        self.loading = False
        self.channel.send(p.Status, phase=p.Phase.LOADED)
        if self.group is not None:
            # every rank is loaded once this returns (the barrier mlx_lm.sharded_load ends with)
            mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu, group=self.group))

    def _shard(self, model: Any) -> list[Any]:
        """Pipeline where the model has it (qwen2…), tensor parallel otherwise; returns this rank's layers."""
        if self.group is None:
            return [layer for layer in getattr(model, "layers", []) if layer is not None]
        inner = getattr(model, "model", None)
        if inner is not None and hasattr(inner, "pipeline"):
            inner.pipeline(self.group)
            log.info("pipeline parallel: layers [%d, %d)", inner.start_idx, inner.end_idx)
            return list(inner.pipeline_layers)
        if hasattr(model, "shard"):
            model.shard(self.group)
            log.info("tensor parallel over %d ranks", self.world_size)
            return list(getattr(model, "layers", []))
        raise UnsupportedModel(f"{type(model).__module__} supports neither pipeline nor tensor parallelism")

    def warm_up(self) -> None:
        if self.model is None:
            raise RunnerProtocolError("warm_up before load")
        self.channel.send(p.Status, phase=p.Phase.WARMING_UP)
        self.faults.at(FaultPhase.WARMING_UP)
        lockstep = Lockstep(self.channel.commands, self.group, self.rank, arriving=self.channel.arriving)
        batch = Batch(
            self.model,
            self.tokenizer,
            limits=self.limits,
            send=self._quiet,
            rank=self.rank,
            lockstep=lockstep,
        )
        prompt = self.tokenizer.encode("warm up", add_special_tokens=False) or [0]
        batch.run_alone(p.Generate(request_id="warm-up", prompt_tokens=prompt, max_tokens=WARM_UP_TOKENS), prompt)
        batch.send, batch.script = self.channel.send, self.script  # from now on, for the callers
        batch.on_token = lambda: self.faults.at(FaultPhase.BUSY)
        self.batch = batch
        self.channel.send(
            p.Batching, max_sequences=batch.limits.max_sequences, why=batch.sizing, vocabulary=batch.vocabulary
        )
        self.channel.send(p.Status, phase=p.Phase.READY)
        self.faults.at_ready_soon()

    def _quiet(self, cls: type[p.Report], **fields: Any) -> None:
        """The warm-up's reports: nobody asked for them, the daemon hears none."""

    def generate(self, request: p.Generate) -> None:
        if self.batch is None:
            self.channel.send(p.RequestError, request_id=request.request_id, message="runner is not ready")
            return
        if outside := request.outside(self.batch.vocabulary):  # read out of bounds, an id beyond would kill us
            self.channel.send(p.RequestError, request_id=request.request_id, message=outside[1], invalid=True)
            return
        try:
            prompt = prompt_tokens(self.tokenizer, request)
            text = self.tokenizer.decode(prompt) if request.echo_prompt and self.rank == 0 else ""
        except Exception as exc:  # a bad request is refused; the runner stays Ready
            message = f"{type(exc).__name__}: {exc}"
            self.channel.send(p.RequestError, request_id=request.request_id, message=message, invalid=True)
            return
        scoring = request.echo_prompt and request.prompt_logprobs is not None
        if (scoring or request.embed) and not self.batch.fits(request, prompt, room=0):  # a pass over the prompt
            return
        scored: dict[str, Any] = {}
        if scoring:  # every rank: a pipeline needs them all
            scored = score(self.model, self.tokenizer, prompt, request.prompt_logprobs)
        if request.echo_prompt and self.rank == 0:
            self.channel.send(p.Prompt, request_id=request.request_id, tokens=prompt, text=text, **scored)
        if request.embed:  # with the others taken, at the next step: one pass on every rank (`Batch.embed`)
            self.batch.embed(request, prompt)
            return
        if request.max_tokens == 0:  # the prompt only: every rank skips the batch alike, and says it is done
            done = {"finish_reason": p.FinishReason.LENGTH, "prompt_tokens": len(prompt), "completion_tokens": 0}
            self.channel.send(p.Done, request_id=request.request_id, **done)
            return
        self.batch.join(request, prompt)


SCORE_CHUNK = 256  # prompt tokens per forward pass when scoring: their logits over the vocabulary, not all


def score(model: Any, tokenizer: Any, prompt: list[int], k: int) -> dict[str, Any]:
    """Each prompt token's log-probability given the tokens before it, and the ``k`` likeliest there (the
    first token has none: nothing precedes it): what evaluation harnesses read to score a continuation
    (``echo`` with ``logprobs``). The prompt goes through in chunks over a KV cache, so that no more than a
    chunk's logits (``SCORE_CHUNK`` × the vocabulary) are held at once; every rank chunks alike."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    decode = lambda t: tokenizer.decode([t])  # noqa: E731
    logprobs: list[p.Alternative | None] = [None]
    top: list[list[p.Alternative]] = [[]]
    cache = make_prompt_cache(model)
    for start in range(0, len(prompt), SCORE_CHUNK):
        logits = model(mx.array([prompt[start : start + SCORE_CHUNK]]), cache=cache)[0].astype(mx.float32)
        following = prompt[start + 1 : start + SCORE_CHUNK + 1]  # what each row predicted (the last: nothing)
        if not following:
            break
        rows = (logits - mx.logsumexp(logits, axis=-1, keepdims=True))[: len(following)]
        chosen = mx.take_along_axis(rows, mx.array(following)[:, None], axis=-1)[:, 0].tolist()
        logprobs += [p.Alternative(t, decode(t), lp) for t, lp in zip(following, chosen, strict=True)]
        if not k:
            top += [[] for _ in following]
            continue
        best = mx.argpartition(-rows, kth=k - 1, axis=-1)[:, :k]
        values = mx.take_along_axis(rows, best, axis=-1).tolist()
        for ids, row in zip(best.tolist(), values, strict=True):
            alternatives = (p.Alternative(i, decode(i), v) for i, v in zip(ids, row, strict=True))
            top.append(sorted(alternatives, key=lambda a: -a.logprob))
    return {"logprobs": logprobs, "top_logprobs": top}


# -- entry point ------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m exod.runner", description=__doc__.splitlines()[0])
    parser.add_argument("--runner-id", required=True)
    parser.add_argument("--incarnation", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--control-fd", type=int, required=True, help="inherited end of a Unix socketpair")
    parser.add_argument("--hostfile", type=Path, help="ring hostfile; sets MLX_HOSTFILE (default: from the env)")
    parser.add_argument(
        "--fault", type=Fault.parse, help="PHASE:KIND fault to inject (tests only; see exod.runner.faults)"
    )
    parser.add_argument("--script", help="text every generation emits instead of sampling (tests only)")
    parser.add_argument(
        "--deadline-fd",
        type=int,
        help="inherited read end of the deadline pipe (a cluster's fence; exod.runner.watchdog)",
    )
    defaults = BatchLimits()
    parser.add_argument(
        "--max-sequences",
        type=_sequences,
        default=defaults.max_sequences,
        help="decoded at once; auto: sized from --kv-bytes and the model (exod.runner.batch.BatchLimits.sized)",
    )
    parser.add_argument("--kv-bytes", type=int, default=defaults.kv_bytes, help="KV cache reserved by them")
    parser.add_argument("--prompt-cache-bytes", type=int, default=defaults.prompt_cache_bytes)
    parser.add_argument("--prefill-step", type=int, default=defaults.prefill_step, help="prompt tokens per chunk")
    args = parser.parse_args(argv)
    if not 0 <= args.rank < args.world_size:
        parser.error(f"rank {args.rank} out of range for world size {args.world_size}")
    return args


def _sequences(text: str) -> int | None:
    if text == "auto":
        return None
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"--max-sequences must be auto or >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> NoReturn:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank{args.rank} %(name)s %(levelname)s %(message)s", stream=sys.stderr
    )
    if args.hostfile is not None:
        os.environ["MLX_HOSTFILE"] = str(args.hostfile)
    os.environ["MLX_RANK"] = str(args.rank)
    watchdog.start(args.control_fd, args.deadline_fd)  # before any thread, before MLX
    channel = Channel(args.control_fd, args.runner_id, args.incarnation)

    def fail(exc: BaseException) -> None:  # a fault on a thread that is not the main one
        channel.send(p.Failed, **_failure_fields(exc))
        exit_now(EXIT_FAILED)

    channel.injector = Injector(args.fault, fail=fail, exit_now=exit_now)
    if args.fault is not None:
        log.warning("fault injection armed: %s", args.fault)
    channel.start_reader()  # before importing mlx: EOF must end the process even during a slow import
    if args.script is not None:
        log.warning("scripted output armed: every generation emits %r", args.script[:80])
    limits = BatchLimits(args.max_sequences, args.kv_bytes, args.prompt_cache_bytes, args.prefill_step)
    Runner(channel, rank=args.rank, world_size=args.world_size, script=args.script, limits=limits).serve()


if __name__ == "__main__":
    main()
