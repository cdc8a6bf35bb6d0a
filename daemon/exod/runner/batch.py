"""The runner's continuous batch: every request in flight on this rank, decoded together a token at a time.

mlx-lm's `BatchGenerator` does the batching: newcomers are prefilled in chunks between decode steps, finished
sequences leave. This module keeps what is exod's around it:

* each request's own sampler, with its own random key, so a seeded request gives the same tokens alone or in
  a batch, and on every rank;
* its `Output` (stop strings, tool calls, log-probabilities) and its `Done`;
* the limits: sequences at once, KV bytes reserved, the model's context;
* the prompt cache (mlx-lm's `LRUPromptCache`): a finished conversation's KV cache, reused by the next
  request that extends it;
* the lockstep of ranks (`Lockstep`): a pipeline needs every rank to run the same batch at every step;
* embeddings (`Generate.embed`): those queued are computed together, one forward pass per step over as many as
  a pass may hold (`Batch._embed_pass`, `embeddings`), beside the decoding;
* a request alone on a single rank is decoded *solo* (`_Solo`), with mlx-lm's plain per-layer caches, as
  `mlx_lm.stream_generate` decodes it: the generator's bookkeeping for a batch of one costs about 5% of each
  token on a CPU (bench/README.md). A newcomer moves it into the generator's batch, where it goes on from the
  token it was computing, so its tokens are the same either way.

Every decision here depends only on the commands taken, in order, and on the tokens sampled (the same on
every rank), never on this rank's memory or timing, so every rank decides the same. The one exception, a
prompt cache whose entries differ between ranks, is settled by the group (`Lockstep.agree`).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import zlib
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs

from exod.runner import protocol as p
from exod.runner.grammar import ConstraintFailed, GrammarError, Grammars
from exod.runner.output import Output, Send, forced_call
from exod.runner.tool_prompt import takes_tools, with_tools

log = logging.getLogger("exod.runner")

MIB = 1 << 20
HEARTBEAT_TOKENS = 16  # ranks > 0 report that generation goes on every this many tokens
_CACHE_KEY = "model"  # one model per runner: the prompt cache's model key is constant


TYPICAL_TOKENS = 2048  # a conversation as the batch reserves it (prompt + max_tokens), for sizing `max_sequences`
MOST_SEQUENCES = 64  # decoded at once at most, however much KV budget a small model leaves
FALLBACK_SEQUENCES = 8  # when the model's KV cache per token cannot be read


@attrs.frozen
class BatchLimits:
    """How much one runner decodes at once. The same on every rank of an instance (the daemon's config)."""

    max_sequences: int | None = None  # decoded together (more wait in the runner's queue); None: `sized`
    kv_bytes: int = 2048 * MIB  # KV cache the sequences in flight may reserve (prompt + max_tokens), whole model
    prompt_cache_bytes: int = 512 * MIB  # KV cache of finished conversations kept for their next turn
    prefill_step: int = 512  # prompt tokens per prefill chunk (and per embedding pass): decoding never stalls long

    def __attrs_post_init__(self) -> None:
        sequences = 1 if self.max_sequences is None else self.max_sequences
        if sequences < 1 or self.kv_bytes < 1 or self.prompt_cache_bytes < 0 or self.prefill_step < 1:
            raise ValueError(f"batch limits must be positive: {self}")

    def sized(self, token_bytes: int) -> tuple[int, str]:
        """How many sequences to decode at once, and why: as set, or as many conversations of a typical length
        (`TYPICAL_TOKENS`) as the KV budget holds for this model (``token_bytes`` a token; 0: unknown), within
        [1, `MOST_SEQUENCES`]. Decided once per runner, from the model it loaded: every rank loads the same
        model and so decides the same."""
        if self.max_sequences is not None:
            return self.max_sequences, "[limits] max_sequences"
        if token_bytes <= 0:
            return FALLBACK_SEQUENCES, f"the model's KV cache per token is unknown: {FALLBACK_SEQUENCES}"
        per = token_bytes * TYPICAL_TOKENS
        fit = self.kv_bytes // per
        chosen = max(1, min(MOST_SEQUENCES, fit))
        why = (
            f"kv_cache_mib {self.kv_bytes // MIB} holds {fit} conversations of {TYPICAL_TOKENS} tokens "
            f"({per / MIB:.1f} MiB each: {token_bytes} bytes a token)"
        )
        if fit > MOST_SEQUENCES:
            why += f"; at most {MOST_SEQUENCES}"
        elif fit < 1:
            why += "; at least 1"
        return chosen, why

    def argv(self) -> list[str]:
        return [
            "--max-sequences",
            "auto" if self.max_sequences is None else str(self.max_sequences),
            "--kv-bytes",
            str(self.kv_bytes),
            "--prompt-cache-bytes",
            str(self.prompt_cache_bytes),
            "--prefill-step",
            str(self.prefill_step),
        ]


class Lockstep:
    """Which queued commands join the batch at each step: rank 0 counts what it has, the group agrees on
    that count (one tiny collective), and every rank takes that many from its own queue. Every rank receives
    every command in the same order, so every rank takes the same ones and runs the same batch. Commands that
    arrived together (``arriving``: held while they are queued) are taken together, or none of them is."""

    def __init__(
        self, commands: queue.Queue[p.Command], group: Any, rank: int, *, arriving: threading.Lock | None = None
    ) -> None:
        self.commands, self.group, self.rank = commands, group, rank
        self.arriving = arriving or threading.Lock()

    @property
    def single(self) -> bool:
        """One rank: nothing to step together with."""
        return self.group is None

    def take(self, *, idle: bool) -> list[p.Command]:
        """The commands that join now; blocks for the first one when nothing is in flight."""
        taken = [self.commands.get()] if idle else []
        if self.group is None:
            with self.arriving:
                while True:
                    try:
                        taken.append(self.commands.get_nowait())
                    except queue.Empty:
                        return taken
        with self.arriving:
            mine = len(taken) + self.commands.qsize() if self.rank == 0 else 0
        count = int(self._all("sum", [mine])[0])
        while len(taken) < count:  # ranks > 0: rank 0 had them, so they are on their way here too
            taken.append(self.commands.get())
        return taken

    def agree(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values``, rank by rank (one all-gather); just ours on a single rank."""
        if self.group is None:
            return [values]
        gathered = self._all("gather", values)
        width = len(values)
        return [gathered[i * width : (i + 1) * width] for i in range(self.group.size())]

    def _all(self, op: str, values: list[int]) -> list[int]:
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        # the generator evaluates its next step asynchronously, and that step talks to the other ranks too:
        # let it finish first, or this rank's collectives and a peer's would pair up in different orders
        mx.synchronize(generation_stream)
        x = mx.array(values, dtype=mx.int64)
        if op == "sum":
            out = mx.distributed.all_sum(x, group=self.group, stream=mx.cpu)
        else:
            out = mx.distributed.all_gather(x, group=self.group, stream=mx.cpu)
        return [int(v) for v in out.tolist()]


def keyed_sampler(temperature: float, top_p: float, top_k: int, seed: int) -> Callable[[Any], Any]:
    """mlx-lm's sampling (top-p, top-k, temperature) from a random key of the request's own: the tokens
    depend on the seed alone, not on what else shares the batch or on the process's global random state."""
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_top_k, apply_top_p, greedy_sampler

    if temperature == 0:
        return greedy_sampler
    key, inverse = mx.random.key(seed), 1.0 / temperature
    draw = _draw()

    def sample(logprobs: Any) -> Any:
        nonlocal key
        if 0 < top_p < 1:
            logprobs = apply_top_p(logprobs, top_p)
        if top_k > 0:
            logprobs = apply_top_k(logprobs, top_k)
        key, token = draw(key, logprobs, inverse)
        return token

    return sample


@functools.cache
def _draw() -> Callable[[Any, Any, Any], tuple[Any, Any]]:
    """One token drawn from a key of its own, and the key for the next: compiled, as mlx-lm compiles its own
    draw (one fused kernel in place of a split and a categorical's half-dozen operations, every token)."""
    import mlx.core as mx

    @mx.compile
    def draw(key: Any, logprobs: Any, inverse_temperature: Any) -> tuple[Any, Any]:
        key, now = mx.random.split(key)
        return key, mx.random.categorical(logprobs * inverse_temperature, key=now)

    return draw


def scripted(tokens: list[int], eos: int) -> Callable[[Any], Any]:
    """A sampler that chooses ``tokens`` in turn, then the end of the sequence (tests only)."""
    import mlx.core as mx

    left = iter(tokens)

    def sample(logprobs: Any) -> Any:
        return mx.array([next(left, eos)] * logprobs.shape[0])

    return sample


def kv_bytes_per_token(model: Any) -> int:
    """KV cache one token takes in the whole model (every layer, keys and values), from its configuration:
    the same figure on every rank, whatever share of the layers it holds."""
    args = getattr(model, "args", None)
    layers = getattr(args, "num_hidden_layers", None)
    heads = getattr(args, "num_attention_heads", None)
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    head_dim = getattr(args, "head_dim", None) or (args.hidden_size // heads if heads else None)
    if not (layers and kv_heads and head_dim):
        return 0  # unknown shape: only the sequence limit bounds the batch
    import mlx.core as mx
    from mlx.utils import tree_flatten

    # Activations, and so keys and values, take the widest floating type they meet: a quantized model's packed
    # integers are not one (a GGUF's float16 scales with its float32 norms give a float32 cache).
    floats = [a.dtype.size for _, a in tree_flatten(model.parameters()) if mx.issubdtype(a.dtype, mx.floating)]
    return 2 * layers * kv_heads * head_dim * max(floats, default=mx.float16.size)


@attrs.frozen
class _Step:
    """One token of a sequence, in the shape the generator's responses have (`Batch._advance` reads either)."""

    token: int
    logprobs: Any
    finish_reason: str | None
    all_tokens: list[int] | None = None  # when it finished: the tokens whose keys and values ``prompt_cache`` holds
    prompt_cache: list[Any] | None = None


@attrs.define(eq=False)
class _Sequence:
    request: p.Generate
    prompt: list[int]
    output: Output
    detokenizer: Any
    sampler: Callable[[Any], Any]
    processors: list[Any]
    max_tokens: int
    uid: int = -1
    cached: int = 0  # prompt tokens whose KV came from the prompt cache
    steps: int = 0
    widest: int = 0  # the most sequences decoded together while this one ran
    fault: Exception | None = None  # what failed it alone (`Batch._fail`): one of its processors raised

    @property
    def reserved(self) -> int:
        return len(self.prompt) + self.max_tokens


@attrs.frozen
class _Embedding:
    """An input waiting for its embedding pass."""

    request: p.Generate
    prompt: list[int]


@attrs.define(eq=False)
class _Solo:
    """The one sequence decoded outside the generator (`Batch`'s module docstring): its prompt a chunk per step,
    then a token per step, the next one computed while this one is handed out (as `mlx_lm.generate_step` does),
    but for the first, handed out before the next forward pass is even built: 12-14% off the time to first
    token on a CPU, where building that pass and the daemon's share of the cores held it up."""

    seq: _Sequence
    cache: list[Any]  # mlx-lm's per-layer caches, the prompt cache's entry when one matched
    rest: list[int]  # prompt tokens not in the cache yet; the last one's forward pass gives the first token
    in_cache: list[int]  # the tokens whose keys and values ``cache`` holds
    next: Any = None  # the token being computed (an mx.array), once the prompt is in
    next_logprobs: Any = None


class _Guarded:
    """A sequence's logits processor whose failure is the sequence's alone: noted on it, the logits passed on
    as they are, so that the generator's step goes on for the others; the batch then ends it (`Batch._fail`)."""

    def __init__(self, seq: _Sequence, processor: Callable[[Any, Any], Any]) -> None:
        self.seq, self.processor = seq, processor

    def __call__(self, tokens: Any, logits: Any) -> Any:
        if self.seq.fault is None:
            try:
                return self.processor(tokens, logits)
            except Exception as exc:  # a constraint at a limit (`ConstraintFailed`), a defect: this request's
                self.seq.fault = exc
        return logits


class Batch:
    """The requests this runner decodes now, and those waiting for room."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        limits: BatchLimits,
        send: Send,
        rank: int,
        lockstep: Lockstep,
        script: str | None = None,
        on_token: Callable[[], None] = lambda: None,
    ) -> None:
        from mlx_lm.generate import BatchGenerator
        from mlx_lm.models.cache import LRUPromptCache

        self.token_bytes = kv_bytes_per_token(model)
        sequences, self.sizing = limits.sized(self.token_bytes)  # why that many: the runner reports it
        limits = attrs.evolve(limits, max_sequences=sequences)
        self.model, self.tokenizer, self.limits, self.send, self.rank = model, tokenizer, limits, send, rank
        self.lockstep = lockstep
        self.script = script
        self.on_token = on_token  # fault injection's hook: a runner busy with a generation
        self.generator = BatchGenerator(
            model,
            completion_batch_size=sequences,
            prefill_batch_size=sequences,
            prefill_step_size=limits.prefill_step,
            stop_tokens=[[t] for t in sorted(tokenizer.eos_token_ids)],
        )
        self.cache = LRUPromptCache(max_size=1 << 30, max_bytes=limits.prompt_cache_bytes)
        self.context: int | None = getattr(getattr(model, "args", None), "max_position_embeddings", None)
        width = getattr(getattr(model, "args", None), "vocab_size", None) or len(tokenizer._tokenizer)
        # the ids a request may name: rows of the embeddings the tokenizer can also say (echo decodes them)
        self.vocabulary: int = min(width, len(tokenizer._tokenizer))
        self.grammars = Grammars(tokenizer, width)  # constrained decoding, compiled per request
        self.waiting: deque[_Sequence] = deque()
        self.running: dict[int, _Sequence] = {}
        self.solo: _Solo | None = None
        self.arrived: list[_Embedding] = []  # inputs to embed taken since the last step
        self.embedding: deque[_Embedding] = deque()  # … and before: in the order of their passes
        self.stops = set(tokenizer.eos_token_ids)
        self._warming = False  # `run_alone`: the warm-up runs the generator, which a solo sequence would skip

    @property
    def idle(self) -> bool:
        busy = self.waiting or self.running or self.solo is not None or self.arrived or self.embedding
        return not busy

    # -- commands ------------------------------------------------------------------

    def join(self, request: p.Generate, prompt: list[int]) -> None:
        """Queue ``request`` (its tokenized ``prompt``) for the batch, or refuse it now with a `RequestError`."""
        if not self.fits(request, prompt, room=1):
            return
        room = request.max_tokens if self.context is None else min(request.max_tokens, self.context - len(prompt))
        try:
            constraint = self.grammars.processor(request)
        except GrammarError as exc:  # the same on every rank: each refuses it alike
            self.send(p.RequestError, request_id=request.request_id, message=str(exc), invalid=True, grammar=True)
            return
        self.waiting.append(self._sequence(request, prompt, room, constraint))

    def embed(self, request: p.Generate, prompt: list[int]) -> None:
        """Queue ``request`` (its ``prompt`` within the context: `fits`) for its embedding, computed at the next
        step with the others queued (`_embed_pass`)."""
        self.arrived.append(_Embedding(request, prompt))

    def fits(self, request: p.Generate, prompt: list[int], *, room: int) -> bool:
        """Whether ``prompt`` leaves ``room`` tokens of the model's context (a generation needs one, a forward
        pass over the prompt alone none); refused with a `RequestError` saying so if not."""
        if self.context is None or len(prompt) + room <= self.context:
            return True
        message = f"the prompt has {len(prompt)} tokens; this model's context is {self.context} tokens: shorten it"
        fields = {"invalid": True, "prompt_tokens": len(prompt), "context": self.context}
        self.send(p.RequestError, request_id=request.request_id, message=message, **fields)
        return False

    def cancel(self, request_id: str) -> None:
        """Drop ``request_id`` (its caller went away): every rank drops it at the same step."""
        for seq in self.waiting:
            if seq.request.request_id == request_id:
                self.waiting.remove(seq)
                self._done(seq, p.FinishReason.CANCELLED)
                return
        for queued in (self.arrived, self.embedding):
            for item in queued:
                if item.request.request_id == request_id:
                    queued.remove(item)
                    self._embedded(item, p.FinishReason.CANCELLED, 0)
                    return
        for seq in [*self.running.values(), *([self.solo.seq] if self.solo else [])]:
            if seq.request.request_id == request_id:
                self._leave(seq, p.FinishReason.CANCELLED)
                return

    def run_alone(self, request: p.Generate, prompt: list[int]) -> None:
        """Generate ``request`` to its end with nothing else in the batch (the warm-up, in the generator)."""
        self._warming = True
        try:
            self.join(request, prompt)
            while not self.idle:
                self.step()
        finally:
            self._warming = False

    # -- one step ------------------------------------------------------------------

    def step(self) -> None:
        """One embedding pass, if inputs wait for one; then start what fits, and one step of the generator: a
        prefill chunk and/or one token for each (or one step of the solo sequence, while it is alone)."""
        if self.arrived:  # shortest first: the inputs of a pass are alike, and little of it is padding
            self.embedding.extend(sorted(self.arrived, key=lambda item: len(item.prompt)))
            self.arrived.clear()
        if self.embedding:
            self._embed_pass()
        if self.solo is not None and self.waiting:
            self._batch_solo()  # a newcomer: the solo sequence moves into the generator's batch, to be joined
        if self.solo is None and self._may_go_solo():
            from mlx_lm.models.cache import make_prompt_cache

            seq = self.waiting.popleft()
            cache, seq.cached = self._cached(seq.prompt)
            cache = cache if cache is not None else make_prompt_cache(self.model)
            self.solo = _Solo(seq, cache, seq.prompt[seq.cached :], seq.prompt[: seq.cached])
        if self.solo is not None:
            self._solo_step()
            return
        self._start_waiting()
        if not self.running:
            return
        _, responses = self.generator.next()
        width = len(self.running)
        for response in responses:
            seq = self.running.get(response.uid)
            if seq is None:
                continue
            seq.widest = max(seq.widest, width)
            self._stepped(seq)  # outside the guard: what fails here is the runner's, not this request's
            try:
                if seq.fault is None:  # its token came from logits its processors could not make: not its own
                    self._advance(seq, response)
            except Exception as exc:  # making its output failed: this request's failure, not the batch's
                seq.fault = exc
            if seq.fault is not None:
                self._fail(seq, seq.fault)

    def _start_waiting(self) -> None:
        reserved = sum(s.reserved for s in self.running.values()) * self.token_bytes
        while self.waiting and len(self.running) < self.limits.max_sequences:
            seq = self.waiting[0]
            if self.running and reserved + seq.reserved * self.token_bytes > self.limits.kv_bytes:
                break  # it waits for room; alone it always starts, or it never would
            self.waiting.popleft()
            reserved += seq.reserved * self.token_bytes
            cache, seq.cached = self._cached(seq.prompt)
            (seq.uid,) = self.generator.insert(
                [seq.prompt[seq.cached :]],
                max_tokens=[seq.max_tokens],
                caches=[cache],
                all_tokens=[seq.prompt[: seq.cached]],
                samplers=[seq.sampler],
                logits_processors=[seq.processors],
            )
            self.running[seq.uid] = seq

    def _stepped(self, seq: _Sequence) -> None:
        seq.steps += 1
        if seq.steps == 2:
            self.on_token()
        if self.rank > 0 and seq.steps % HEARTBEAT_TOKENS == 0:
            self.send(p.Heartbeat, request_id=seq.request.request_id, tokens=seq.steps)

    def _advance(self, seq: _Sequence, response: Any) -> None:
        if response.finish_reason == "stop":  # the end of the sequence: its token is not text
            seq.detokenizer.finalize()
            seq.output.add(seq.detokenizer.last_segment, None)
            self._finished(seq, p.FinishReason.STOP, response)
            return
        seq.detokenizer.add_token(response.token)
        if response.finish_reason == "length":
            seq.detokenizer.finalize()
        if seq.output.add(seq.detokenizer.last_segment, response.token, response.logprobs):  # a stop string
            if response.finish_reason is None:
                self._leave(seq, p.FinishReason.STOP)
            else:
                self._finished(seq, p.FinishReason.STOP, response)
        elif response.finish_reason == "length":
            self._finished(seq, p.FinishReason.LENGTH, response)

    def _finished(self, seq: _Sequence, reason: p.FinishReason, response: Any) -> None:
        """The generator ended it (end of sequence, max_tokens): keep its KV for the next turn."""
        if self.solo is not None and self.solo.seq is seq:
            self.solo = None
        else:
            del self.running[seq.uid]
        self._keep(response.all_tokens, response.prompt_cache)
        self._done(seq, reason)

    def _leave(self, seq: _Sequence, reason: p.FinishReason) -> None:
        """We end it (a stop string, a cancel): out of the generator, its KV kept for the next turn."""
        if self.solo is not None and self.solo.seq is seq:
            solo, self.solo = self.solo, None
            self._keep(solo.in_cache, solo.cache)
            self._done(seq, reason)
            return
        del self.running[seq.uid]
        kept = self.generator.remove([seq.uid], return_prompt_caches=True).get(seq.uid)
        if kept is not None:
            cache, tokens = kept
            self._keep(tokens, cache)
        self._done(seq, reason)

    def _fail(self, seq: _Sequence, exc: Exception) -> None:
        """One sequence failed: it alone ends, with the error, and the batch goes on. Every rank fails it at the
        same step: each runs the same processors over the same tokens."""
        if self.running.pop(seq.uid, None) is not None:
            self.generator.remove([seq.uid])
        constraint = isinstance(exc, ConstraintFailed)
        message = str(exc) if constraint else f"this request failed in the runner: {type(exc).__name__}: {exc}"
        log.warning("request %s failed alone: %s", seq.request.request_id, message)
        self.send(p.RequestError, request_id=seq.request.request_id, message=message, invalid=constraint)

    def _done(self, seq: _Sequence, reason: p.FinishReason) -> None:
        seq.output.flush()
        self.send(
            p.Done,
            request_id=seq.request.request_id,
            finish_reason=p.FinishReason.TOOL_CALLS if seq.output.tool_calls else reason,
            prompt_tokens=len(seq.prompt),
            completion_tokens=seq.output.tokens,
            stop_sequence=seq.output.stop_sequence,
            cached_tokens=seq.cached,
            batch_size=max(seq.widest, 1),
            prompt_cache_bytes=self.cache.nbytes,
        )

    # -- embeddings ------------------------------------------------------------------

    def _embed_pass(self) -> None:
        """The inputs at the head of the queue, as many as one pass may hold, embedded in one forward pass: at
        most `max_sequences` of them, and at most `prefill_step` tokens once padded to the longest (an input
        longer than that goes alone). The bound a newcomer's prefill chunk has: decoding in flight waits for
        this pass no longer than for that chunk, and the pass's activations stay a chunk's. The queue holds
        the inputs taken at each step shortest first, after those taken before (none waits for ever). Every
        rank takes the same inputs (the same queue, the same rule) and runs the same pass: a pipeline needs
        them all."""
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        taken = [self.embedding.popleft()]
        longest = len(taken[0].prompt)
        while self.embedding and len(taken) < self.limits.max_sequences:
            wider = max(longest, len(self.embedding[0].prompt))
            if wider * (len(taken) + 1) > self.limits.prefill_step:
                break
            taken.append(self.embedding.popleft())
            longest = wider
        with mx.stream(generation_stream):  # after the generator's work on every rank: collectives pair up alike
            vectors = embeddings(self.model, [item.prompt for item in taken])
        for item, vector in zip(taken, vectors, strict=True):
            if self.rank == 0:
                self.send(p.Embedding, request_id=item.request.request_id, vector=vector)
            self._embedded(item, p.FinishReason.LENGTH, len(taken))

    def _embedded(self, item: _Embedding, reason: p.FinishReason, together: int) -> None:
        """Its `Done` (every rank sends it): ``together``, how many inputs shared its pass (0: none, cancelled)."""
        self.send(
            p.Done,
            request_id=item.request.request_id,
            finish_reason=reason,
            prompt_tokens=len(item.prompt),
            completion_tokens=0,
            batch_size=max(together, 1),
            prompt_cache_bytes=self.cache.nbytes,
        )

    # -- the solo sequence -----------------------------------------------------------

    def _may_go_solo(self) -> bool:
        """A request alone, on a single rank (a pipeline's ranks step together in the generator), whose logits
        nothing processes (penalties and grammars keep their context in the generator)."""
        alone = len(self.waiting) == 1 and not self.running
        return alone and self.lockstep.single and not self.waiting[0].processors and not self._warming

    def _solo_step(self) -> None:
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        solo = self.solo
        assert solo is not None
        with mx.stream(generation_stream):
            if len(solo.rest) > 1:  # the prompt, a chunk per step: commands are read between chunks
                chunk = solo.rest[: min(self.limits.prefill_step, len(solo.rest) - 1)]
                self.model(mx.array(chunk)[None], cache=solo.cache)
                mx.eval([c.state for c in solo.cache])
                solo.in_cache += chunk
                solo.rest = solo.rest[len(chunk) :]
                return
            if solo.next is None:  # the prompt's last token: its forward pass gives the first token
                solo.next, solo.next_logprobs = self._forward(solo, mx.array(solo.rest))
                solo.in_cache += solo.rest
                solo.rest = []
            self._solo_token(solo, pipeline=True)

    def _solo_token(self, solo: _Solo, *, pipeline: bool) -> int:
        """Hand out the token being computed. With ``pipeline``, the next one's forward pass starts before it is
        handed out (after it, for the first token: the time to first token); without, none starts."""
        import mlx.core as mx

        seq, current, logprobs = solo.seq, solo.next, solo.next_logprobs
        more = pipeline and seq.steps + 1 < seq.max_tokens
        first = seq.steps == 0  # handed out before the next forward pass is even built: time to first token
        solo.next = solo.next_logprobs = None
        if more and not first:
            solo.next, solo.next_logprobs = self._forward(solo, current)
        mx.eval(current, logprobs)
        token = int(current.item())
        if solo.next is not None:  # its forward pass is on its way: its keys and values are in the cache
            solo.in_cache.append(token)
        finish = "stop" if token in self.stops else "length" if seq.steps + 1 >= seq.max_tokens else None
        ended = {"all_tokens": solo.in_cache, "prompt_cache": solo.cache} if finish else {}
        self._stepped(seq)
        self._advance(seq, _Step(token, logprobs[0], finish, **ended))
        if more and first and self.solo is solo and not finish:
            solo.next, solo.next_logprobs = self._forward(solo, current)
            solo.in_cache.append(token)
        return token

    def _forward(self, solo: _Solo, tokens: Any) -> tuple[Any, Any]:
        """The next token after ``tokens`` (an mx.array, their keys and values added to the cache), computing."""
        import mlx.core as mx

        logits = self.model(tokens[None], cache=solo.cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = solo.seq.sampler(logprobs)
        mx.async_eval(token, logprobs)
        return token, logprobs

    def _batch_solo(self) -> None:
        """Move the solo sequence into the generator: the token it was computing handed out, the generator goes on
        from it (its forward pass, then the next token, with the same sampler: the tokens are those it had alone)."""
        solo = self.solo
        assert solo is not None
        rest = solo.rest
        if solo.next is not None:
            rest = [self._solo_token(solo, pipeline=False)]
            if self.solo is None:  # that token ended it
                return
        self.solo = None
        seq = solo.seq
        (seq.uid,) = self.generator.insert(
            [rest],
            max_tokens=[seq.max_tokens - seq.steps],
            caches=[solo.cache],
            all_tokens=[solo.in_cache],
            samplers=[seq.sampler],
            logits_processors=[seq.processors],
        )
        self.running[seq.uid] = seq

    # -- the prompt cache -----------------------------------------------------------

    def _keep(self, tokens: list[int] | None, cache: list[Any] | None) -> None:
        if tokens and cache and self.limits.prompt_cache_bytes:
            self.cache.insert_cache(_CACHE_KEY, list(tokens), cache)

    def _cached(self, prompt: list[int]) -> tuple[list[Any] | None, int]:
        """The KV cache of the longest prefix of ``prompt`` every rank holds, and its length in tokens.

        Ranks hold their own layers' KV and may have evicted different entries: each says what it has, and all
        use the shortest (trimming theirs to it), or none when a longer one cannot be trimmed. At least the
        prompt's last token is always computed: the first token is sampled from its logits."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        if not self.limits.prompt_cache_bytes:  # off: the same on every rank, nothing to agree on
            return None, 0
        cache, rest = self.cache.fetch_nearest_cache(_CACHE_KEY, prompt)
        have = 0 if cache is None else len(prompt) - len(rest)
        trimmable = cache is None or can_trim_prompt_cache(cache)
        if have == len(prompt) and have and trimmable:  # all of it: give back the last token to compute
            trim_prompt_cache(cache, 1)
            have -= 1
        views = self.lockstep.agree([have, int(trimmable)])
        agreed = min(v[0] for v in views)
        if any(v[0] > agreed and not v[1] for v in views) or agreed == len(prompt):
            agreed = 0
        if cache is None or agreed == 0:
            return None, 0
        if have > agreed:
            trim_prompt_cache(cache, have - agreed)
        return cache, agreed

    # -- making a sequence ----------------------------------------------------------

    def _sequence(self, request: p.Generate, prompt: list[int], max_tokens: int, constraint: Any = None) -> _Sequence:
        from mlx_lm.sample_utils import make_logits_processors

        seed = request.seed if request.seed is not None else zlib.crc32(request.request_id.encode())
        sampler = keyed_sampler(request.temperature, request.top_p, request.top_k, seed)
        if self.script is not None:
            eos = self.tokenizer.eos_token_id
            sampler = scripted(self.tokenizer.encode(self.script, add_special_tokens=False), eos)
        bias = {int(k): v for k, v in (request.logit_bias or {}).items()}
        processors = make_logits_processors(
            logit_bias=bias or None,
            presence_penalty=request.presence_penalty or None,
            frequency_penalty=request.frequency_penalty or None,
        )
        if constraint is not None and self.script is None:  # last: what it forbids stays forbidden (a script,
            processors.append(constraint)  # for tests, is the output whatever a constraint says)
        output = Output(self.tokenizer, request, self.send, speaks=self.rank == 0)
        seq = _Sequence(request, prompt, output, self.tokenizer.detokenizer, sampler, [], max_tokens)
        seq.processors = [_Guarded(seq, processor) for processor in processors]
        return seq


def embeddings(model: Any, prompts: list[list[int]]) -> list[list[float]]:
    """Each prompt's embedding, all in one forward pass: the last layer's hidden states (after the final norm,
    before the head), mean-pooled over the prompt's own tokens and L2-normalised, as Ollama and llama.cpp pool
    a generative model's.

    The prompts are padded on the right to the longest: under the causal mask no token attends to any token
    after it, so none of a prompt's tokens sees its padding, and its positions are those it has alone; the
    padding's own states are left out of the mean. (Padding on the left would need the padding masked in
    every layer, with a cache of the layer's own kind: mlx-lm's generator pads a batch's prompts on the right
    too.) On a pipeline every rank runs its layers over the same batch; mlx-lm gathers the result on each."""
    import mlx.core as mx

    inner = getattr(model, "model", None) or model.language_model.model
    longest = max(len(prompt) for prompt in prompts)
    padded = mx.array([prompt + [0] * (longest - len(prompt)) for prompt in prompts])
    hidden = inner(padded).astype(mx.float32)
    lengths = mx.array([len(prompt) for prompt in prompts])
    own = (mx.arange(longest)[None, :] < lengths[:, None])[..., None]  # each prompt's own tokens
    pooled = mx.where(own, hidden, 0.0).sum(axis=1) / lengths[:, None]
    vectors = pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
    return vectors.tolist()


def prompt_tokens(tokenizer: Any, request: p.Generate) -> list[int]:
    """The request's prompt as tokens: given, or its text encoded, or its messages through the chat template
    (tools too), ending with the beginning of a forced tool call. ValueError when it cannot be made."""
    if request.prompt_tokens is not None:
        tokens = list(request.prompt_tokens)
    elif request.prompt_text is not None:
        tokens = tokenizer.encode(request.prompt_text)
    else:
        messages, extra = request.prompt_messages, {}
        if request.tools and not getattr(tokenizer, "has_tool_calling", False):
            raise ValueError("this model's chat template writes tools in a form exod cannot read; send no tools")
        if request.tools and takes_tools(tokenizer.chat_template):
            extra = {"tools": request.tools}
        elif request.tools:  # the template has no place for them: exod writes them (exod.runner.tool_prompt)
            messages = with_tools(messages, request.tools)
        tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
        if isinstance(tokens, str):  # some tokenizers return text
            tokens = tokenizer.encode(tokens, add_special_tokens=False)
        if forced := forced_call(tokenizer, request):  # the call begun: `tool_choice`
            tokens = [*tokens, *tokenizer.encode(forced, add_special_tokens=False)]
    if not tokens:
        raise ValueError("empty prompt")
    return list(tokens)
