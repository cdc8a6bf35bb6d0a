"""Real runner processes over the control protocol: load, warm up, stream, fail, die with the supervisor.

Every process is spawned through the `spawn` fixture, which kills and reaps it whatever happens and
asserts that none is left; every wait has a deadline (a lone ring rank 0 would wait forever).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from exod.host.ring import free_ports
from exod.host.tiny_model import make_tiny_model
from exod.runner import protocol as p

MESSAGES = [{"role": "user", "content": "hello there, how are you?"}]
MAX_TOKENS = 24
STEP_TIMEOUT = 20.0  # one phase of a tiny model takes well under a second; import mlx_lm ≈ 0.7 s


# -- helpers ----------------------------------------------------------------------


class RunnerProc:
    """A runner process and the supervisor's end of its control socket."""

    def __init__(self, args: list[str], sock: socket.socket, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.args, self.sock, self.proc, self.log = args, sock, proc, log
        self.reader = p.LineReader()
        self.lines: list[bytes] = []
        self.deadline_w: int | None = None  # the deadline pipe's write end, if it holds one

    def extend(self, seconds: float) -> None:
        """Its deadline: ``seconds`` from now."""
        assert self.deadline_w is not None
        os.write(self.deadline_w, b"%.6f\n" % (time.monotonic() + seconds))

    def send(self, command: p.Command) -> None:
        self.sock.sendall(command.to_line())

    def recv(self, timeout: float = STEP_TIMEOUT) -> p.Message | None:
        """The next message, or None at end of file."""
        deadline = time.monotonic() + timeout
        while not self.lines:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                pytest.fail(f"no message within {timeout} s; log:\n{self.log.read_text()[-3000:]}")
            if not data:
                return None
            self.lines += self.reader.feed(data)
        return p.from_json(self.lines.pop(0))

    def recv_until(self, done: type[p.Report], timeout: float = STEP_TIMEOUT) -> list[p.Message]:
        got: list[p.Message] = []
        while True:
            msg = self.recv(timeout)
            assert msg is not None, (
                f"channel closed before {done.type}; got {got}; log:\n{self.log.read_text()[-3000:]}"
            )
            assert not isinstance(msg, p.Failed) or done is p.Failed, f"runner failed: {msg.traceback}"
            got.append(msg)
            if isinstance(msg, done):
                return got

    def wait(self, timeout: float = STEP_TIMEOUT) -> int:
        return self.proc.wait(timeout=timeout)


def phases(messages: list[p.Message]) -> list[p.Phase]:
    return [m.phase for m in messages if isinstance(m, p.Status)]


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator:
    """Start runners like the supervisor does: socketpair, child end passed as an fd, logs to a file."""
    procs: list[RunnerProc] = []

    def start(
        *,
        rank: int = 0,
        world_size: int = 1,
        hostfile: Path | None = None,
        incarnation: int = 0,
        extra: tuple = (),
        deadline: float | None = None,
    ) -> RunnerProc:
        """``deadline``: seconds from now the runner may live unless extended (`RunnerProc.extend`)."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        args = [
            sys.executable, "-m", "exod.runner",
            "--runner-id", f"r{rank}", "--incarnation", str(incarnation),
            "--rank", str(rank), "--world-size", str(world_size),
            "--control-fd", str(child.fileno()),
        ]  # fmt: skip
        fds = [child.fileno()]
        deadline_r = deadline_w = None
        if deadline is not None:
            deadline_r, deadline_w = os.pipe()
            os.write(deadline_w, b"%.6f\n" % (time.monotonic() + deadline))
            args += ["--deadline-fd", str(deadline_r)]
            fds.append(deadline_r)
        if hostfile is not None:
            args += ["--hostfile", str(hostfile)]
        args += list(extra)
        log = tmp_path / f"runner{rank}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with log.open("wb") as out:
            proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, pass_fds=fds, env=env
            )
        child.close()  # only the runner holds the child end: its death is our EOF, ours is its EOF
        if deadline_r is not None:
            os.close(deadline_r)
        runner = RunnerProc(args, parent, proc, log)
        runner.deadline_w = deadline_w
        procs.append(runner)
        return runner

    try:
        yield start
    finally:
        for r in procs:
            if r.proc.poll() is None:
                r.proc.kill()
            r.proc.wait(timeout=10)
            r.sock.close()
            if r.deadline_w is not None:
                os.close(r.deadline_w)
        assert all(r.proc.returncode is not None for r in procs), "orphan runner processes"
        deadline = time.monotonic() + 5  # forked watchdogs exit with their runner
        while (left := live_processes_with_args([r.args for r in procs])) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"processes left behind: {left}"


def live_processes_with_args(argvs: list[list[str]]) -> list[int]:
    wanted = {"\0".join(a).encode() + b"\0" for a in argvs}
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if cmdline in wanted and state != "Z":
                found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("exod/tiny-qwen2", arch="qwen2", layers=4, hf_home=tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[list[int], str]:
    """Greedy token ids and text of in-process mlx-lm for the same chat prompt."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(model_dir))
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    tokens = [
        r.token
        for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS)
        if r.finish_reason != "stop"
    ]
    return tokens, mlx_lm.generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS)


SAMPLED = {"temperature": 1.0, "top_p": 1.0, "seed": 7}  # diverse tokens: a tiny random model's greedy output repeats


@pytest.fixture(scope="module")
def sampled_reference(model_dir: Path) -> tuple[list[int], str]:
    """Seeded temperature-1 sampling in-process: the same seed must give the same tokens in the runner."""
    import mlx_lm

    from exod.runner.batch import keyed_sampler

    model, tokenizer = mlx_lm.load(str(model_dir))
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    sampler = keyed_sampler(SAMPLED["temperature"], SAMPLED["top_p"], 0, SAMPLED["seed"])
    responses = list(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS, sampler=sampler))
    tokens = [r.token for r in responses if r.finish_reason != "stop"]
    assert len(set(tokens)) > 3, "the sampled reference should not be degenerate"
    return tokens, "".join(r.text for r in responses)


def collect(messages: list[p.Message], request_id: str) -> tuple[list[int], str]:
    tokens = [m for m in messages if isinstance(m, p.Token) and m.request_id == request_id]
    return [t.token_id for t in tokens if t.token_id is not None], "".join(t.text for t in tokens)


def generate(request_id: str, **kw: object) -> p.Generate:
    return p.Generate(request_id, prompt_messages=MESSAGES, max_tokens=MAX_TOKENS, **kw)


# -- protocol ---------------------------------------------------------------------

EXAMPLES: list[p.Message] = [
    p.Connect(),
    p.Load("/models/x", layers_total=4),
    p.WarmUp(),
    generate("q1", temperature=0.7, top_p=0.9, seed=3, stop=["\n"]),
    p.Generate("q2", prompt_tokens=[1, 2, 3]),
    p.Shutdown(),
    p.Status("r0", 2, p.Phase.WARMING_UP),
    p.Progress("r0", 2, 1, 4),
    p.Batching("r0", 2, 32, "kv_cache_mib 2048 holds 40 conversations of 2048 tokens"),
    p.Token("r0", 2, "q1", "héllo", 17),
    p.Token("r0", 2, "q1", "tail", None),
    p.Done("r0", 2, "q1", p.FinishReason.LENGTH, 12, 24),
    p.RequestError("r0", 2, "q1", "nope"),
    p.RequestError("r0", 2, "q1", "too long", invalid=True, prompt_tokens=4000, context=2048),
    p.Prompt("r0", 2, "q1", [1, 2, 3], "abc"),
    p.Prompt("r0", 2, "q1", [1, 2], "ab", [None, p.Alternative(2, "b", -0.5)], [[], [p.Alternative(2, "b", -0.5)]]),
    p.Generate("q4", prompt_tokens=[1, 2], max_tokens=0, echo_prompt=True, prompt_logprobs=2),
    p.Generate("q5", prompt_text="embed me", max_tokens=0, embed=True),
    p.Embedding("r0", 2, "q5", [0.6, -0.8]),
    p.Cancel("q1"),
    p.ToolCall("r0", 2, "q1", "get_weather", '{"city": "Paris"}'),
    p.Heartbeat("r0", 2, "q1", 40),
    p.Ping(),
    p.Pong("r0", 2),
    p.Generate("q3", prompt_text="abc", max_tokens=0, echo_prompt=True),
    p.Failed("r0", 2, "OSError", "boom", "Traceback…", retryable=True),
]


def test_the_examples_cover_every_message_the_wire_knows() -> None:
    """A report left out of the wire's list is a ProtocolError in the daemon, which ends the runner (and its
    instance, non-retryable): the Prompt report did, until this test."""

    def every(cls: type) -> set[type]:
        return {sub for direct in cls.__subclasses__() for sub in {direct, *every(direct)}}

    concrete = {cls for cls in every(p.Message) if "type" in vars(cls)}
    assert concrete == set(p.COMMANDS) | set(p.REPORTS)
    assert {type(m) for m in EXAMPLES} == concrete


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: m.type)
def test_every_message_round_trips_as_one_json_line(message: p.Message) -> None:
    line = message.to_line()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line)["type"] == message.type
    assert p.from_json(line) == message
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        message.type = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    "line",
    [
        b"not json",
        b"[]",
        b'{"no": "type"}',
        b'{"type": "launch_missiles"}',
        b'{"type": "load"}',
        b'{"type": "load", "model_path": 7}',
        b'{"type": "connect", "extra": 1}',
        b'{"type": "status", "runner_id": "r", "incarnation": "1", "phase": "ready"}',
        b'{"type": "status", "runner_id": "r", "incarnation": 1, "phase": "dancing"}',
        b'{"type": "generate", "request_id": "q"}',
        b'{"type": "generate", "request_id": "q", "prompt_tokens": [1], "max_tokens": -1}',
        b"\xff\xfe",
    ],
)
def test_malformed_lines_raise_protocol_error(line: bytes) -> None:
    with pytest.raises(p.ProtocolError):
        p.from_json(line)


def test_line_reader_splits_and_bounds() -> None:
    reader = p.LineReader()
    assert reader.feed(b'{"type":"connect"}\n{"ty') == [b'{"type":"connect"}']
    assert reader.feed(b'pe":"warm_up"}\n\n') == [b'{"type":"warm_up"}']
    with pytest.raises(p.ProtocolError):
        reader.feed(b"x" * (p.MAX_LINE_BYTES + 1))


def test_tokens_are_queued_and_every_other_report_is_written_by_the_time_send_returns() -> None:
    """The model's loop never waits on the socket for a token but a request's first, yet the order holds: a
    Status (before a long, GIL-holding phase) or a Failed (before the exit) is on the wire, behind every token,
    once `send` returns."""
    from exod.runner.process import OUTBOX, Channel

    ours, theirs = socket.socketpair()
    with ours, theirs:
        channel = Channel(os.dup(ours.fileno()), "m/0", 1, closed=lambda: None)  # never this process's exit
        channel.send(p.Token, request_id="r", text="first", token_id=-1)
        theirs.settimeout(0)  # written at once: the time to first token waits for no thread
        assert p.from_json(theirs.recv(1 << 16)) == p.Token("m/0", 1, request_id="r", text="first", token_id=-1)
        theirs.settimeout(None)
        piece = "x" * 4096
        count = OUTBOX // 2  # 2 MiB: far past the socket's buffer, which nobody reads meanwhile
        queued = threading.Event()

        def tokens() -> None:
            for i in range(count):
                channel.send(p.Token, request_id="r", text=piece, token_id=i)
            queued.set()

        threading.Thread(target=tokens, daemon=True).start()
        assert queued.wait(timeout=60), "a token's send waited for the reader"
        status = threading.Thread(target=channel.send, args=(p.Status,), kwargs={"phase": p.Phase.READY}, daemon=True)
        status.start()
        status.join(timeout=0.5)
        assert status.is_alive(), "the status's send returned before it was written (nobody reads yet)"
        reader, got = p.LineReader(), []
        while len(got) < count + 1:
            got += [p.from_json(line) for line in reader.feed(theirs.recv(1 << 20))]
        status.join(timeout=60)
        assert not status.is_alive(), "the status's send did not return once it was written"
        assert [m.token_id for m in got[:count]] == list(range(count))  # type: ignore[attr-defined]
        assert got[count] == p.Status("m/0", 1, phase=p.Phase.READY)
        theirs.setblocking(False)
        with pytest.raises(BlockingIOError):
            theirs.recv(1)  # nothing after it


def test_commands_written_at_once_are_taken_in_one_step_however_slowly_they_are_queued() -> None:
    """The supervisor writes the commands posted together at once (one call's inputs to embed): the runner
    takes them in the same step, so that they share a forward pass, even when the reader thread is slow to
    queue them (here 20 ms each) and the model's thread was waiting for the first."""
    from exod.runner.batch import Lockstep
    from exod.runner.process import Channel

    ours, theirs = socket.socketpair()
    with ours, theirs:
        channel = Channel(os.dup(ours.fileno()), "m/0", 1, closed=lambda: None)
        put = channel.commands.put

        def slowly(command: p.Command) -> None:
            put(command)
            time.sleep(0.02)

        channel.commands.put = slowly  # type: ignore[method-assign]
        channel.start_reader()
        lockstep = Lockstep(channel.commands, None, 0, arriving=channel.arriving)
        commands = [p.Generate(f"e{i}", prompt_tokens=[i + 1], max_tokens=0, embed=True) for i in range(5)]
        theirs.sendall(b"".join(c.to_line() for c in commands))
        assert lockstep.take(idle=True) == commands
        theirs.sendall(commands[0].to_line())
        assert lockstep.take(idle=True) == commands[:1]


# -- real processes ---------------------------------------------------------------


def test_single_rank_loads_warms_up_and_streams_the_reference_tokens(
    spawn, model_dir, reference, sampled_reference
) -> None:
    runner = spawn()
    runner.send(p.Load(str(model_dir)))
    loading = runner.recv_until(p.Status)  # WEIGHTS
    loading += runner.recv_until(p.Status)  # LOADED
    assert phases(loading) == [p.Phase.WEIGHTS, p.Phase.LOADED]
    progress = [(m.layers_loaded, m.layers_total) for m in loading if isinstance(m, p.Progress)]
    assert progress == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert all((m.runner_id, m.incarnation) == ("r0", 0) for m in loading)

    runner.send(p.WarmUp())
    assert phases(runner.recv_until(p.Status) + runner.recv_until(p.Status)) == [p.Phase.WARMING_UP, p.Phase.READY]

    # two requests queued back to back are decoded in one batch, each exactly as it would be alone
    runner.send(generate("a"))
    runner.send(generate("b"))
    both = runner.recv_until(p.Done)
    both += runner.recv_until(p.Done)
    ref_tokens, ref_text = reference
    assert collect(both, "a") == (ref_tokens, ref_text)
    assert collect(both, "b") == (ref_tokens, ref_text)
    dones = {m.request_id: m for m in both if isinstance(m, p.Done)}
    assert {d.batch_size for d in dones.values()} == {2}  # decoded together
    done = dones["a"]
    assert done.completion_tokens == len(ref_tokens)
    assert done.finish_reason == (p.FinishReason.LENGTH if len(ref_tokens) == MAX_TOKENS else p.FinishReason.STOP)

    runner.send(generate("c", **SAMPLED))
    assert collect(runner.recv_until(p.Done), "c") == sampled_reference

    runner.send(p.Shutdown())
    assert runner.wait() == 0


def test_stop_strings_and_bad_requests_do_not_kill_the_runner(spawn, model_dir, sampled_reference) -> None:
    _, ref_text = sampled_reference
    runner = spawn()
    runner.send(p.Generate("early", prompt_tokens=[1, 2]))
    assert runner.recv_until(p.RequestError)[-1] == p.RequestError("r0", 0, "early", "runner is not ready")
    runner.send(p.Load(str(model_dir)))
    runner.send(p.WarmUp())
    runner.recv_until(p.Status)
    while runner.recv_until(p.Status)[-1].phase != p.Phase.READY:
        pass
    stop = ref_text[len(ref_text) // 2 : len(ref_text) // 2 + 3]
    assert ref_text.find(stop) > 0
    runner.send(generate("s", stop=[stop, "never appears ~~"], **SAMPLED))
    messages = runner.recv_until(p.Done)
    _, text = collect(messages, "s")
    assert text == ref_text[: ref_text.find(stop)]
    assert messages[-1].finish_reason == p.FinishReason.STOP
    runner.send(p.Shutdown())
    assert runner.wait() == 0


def test_two_rank_pipeline_over_loopback_ring_streams_the_reference_tokens(
    spawn, model_dir, reference, sampled_reference, tmp_path
) -> None:
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(2)]))
    ranks = [spawn(rank=r, world_size=2, hostfile=hostfile) for r in (0, 1)]
    for r in ranks:
        r.send(p.Connect())
    for r in ranks:
        assert phases(r.recv_until(p.Status) + r.recv_until(p.Status)) == [p.Phase.JOINING, p.Phase.JOINED]
    for r in ranks:
        r.send(p.Load(str(model_dir)))
    for i, r in enumerate(ranks):
        loading = r.recv_until(p.Status) + r.recv_until(p.Status)
        assert phases(loading) == [p.Phase.WEIGHTS, p.Phase.LOADED]
        progress = [(m.layers_loaded, m.layers_total) for m in loading if isinstance(m, p.Progress)]
        assert progress == [(1, 2), (2, 2)], f"rank {i} holds half of the 4 layers"
    for r in reversed(ranks):  # the planner's order: ranks > 0 first, rank 0 last
        r.send(p.WarmUp())
    for r in ranks:
        assert phases(r.recv_until(p.Status) + r.recv_until(p.Status)) == [p.Phase.WARMING_UP, p.Phase.READY]
    for r in ranks:
        r.send(generate("g"))
    out0, out1 = (r.recv_until(p.Done) for r in ranks)
    assert collect(out0, "g") == reference
    assert not any(isinstance(m, p.Token) for m in out1), "only rank 0 streams tokens"
    beats = [m for m in out1 if isinstance(m, p.Heartbeat)]  # rank 1 says it is alive, for its watchdog
    assert isinstance(out1[-1], p.Done) and [b.tokens for b in beats] == list(range(16, MAX_TOKENS, 16))
    cached = out0[-1].prompt_cache_bytes  # each rank caches its own layers' KV: the one field that differs
    assert cached > 0 and out0[-1] == attrs.evolve(out1[-1], runner_id="r0", prompt_cache_bytes=cached)
    for r in ranks:  # sampling stays in lockstep: every rank seeds the same and sees the same logits
        r.send(generate("h", **SAMPLED))
    out0, out1 = (r.recv_until(p.Done) for r in ranks)
    assert collect(out0, "h") == sampled_reference
    assert [type(m) for m in out1 if not isinstance(m, p.Heartbeat)] == [p.Done]
    for r in ranks:
        r.send(p.Shutdown())
    assert [r.wait() for r in ranks] == [0, 0]


def test_corrupt_weights_fail_non_retryable_and_exit_non_zero(spawn, model_dir, tmp_path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.unlink()  # never write through a link into the cache
    weights.write_bytes(data[: len(data) // 2])
    runner = spawn()
    runner.send(p.Load(str(broken)))
    failed = runner.recv_until(p.Failed)[-1]
    assert isinstance(failed, p.Failed)
    assert failed.retryable is False
    assert "safetensors" in failed.message and "Traceback" in failed.traceback
    assert runner.recv() is None
    assert runner.wait() != 0


def test_missing_model_dir_fails_non_retryable(spawn, tmp_path) -> None:
    runner = spawn()
    runner.send(p.Load(str(tmp_path / "nowhere")))
    failed = runner.recv_until(p.Failed)[-1]
    assert (failed.exception_type, failed.retryable) == ("FileNotFoundError", False)
    assert runner.wait() != 0


def test_malformed_command_fails_the_runner(spawn) -> None:
    runner = spawn(incarnation=3)
    runner.sock.sendall(b'{"type": "load"}\n')
    failed = runner.recv_until(p.Failed)[-1]
    # the daemon sent garbage: its bug, not the model's, so retrying is allowed (the budget bounds it)
    assert (failed.runner_id, failed.incarnation, failed.retryable) == ("r0", 3, True)
    assert runner.wait() != 0


def test_an_undecodable_request_is_that_request_s_error_and_the_runner_lives_on(spawn) -> None:
    runner = spawn(incarnation=1)
    runner.sock.sendall(b'{"type": "generate", "request_id": "bad", "prompt_messages": "not a list"}\n')
    refused = runner.recv_until(p.RequestError)[-1]
    assert refused.request_id == "bad" and "invalid request" in refused.message
    runner.sock.sendall(p.Generate(request_id="early", prompt_tokens=[1, 2]).to_line())
    assert runner.recv_until(p.RequestError)[-1].request_id == "early"  # still answering


def test_closing_the_control_channel_ends_an_idle_runner(spawn) -> None:
    runner = spawn()
    time.sleep(0.2)
    runner.sock.close()
    assert runner.wait(timeout=10) == 0


def test_closing_the_control_channel_ends_a_runner_stuck_in_ring_init(spawn, tmp_path) -> None:
    """A lone rank 0 blocks forever inside mx.distributed.init, holding the GIL: the watchdog process ends it."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(2)]))
    runner = spawn(rank=0, world_size=2, hostfile=hostfile)
    runner.send(p.Connect())
    assert phases(runner.recv_until(p.Status)) == [p.Phase.JOINING]
    time.sleep(0.3)
    assert runner.proc.poll() is None, "still waiting for its peer"
    started = time.monotonic()
    runner.sock.close()
    assert runner.wait(timeout=10) == -signal.SIGKILL  # no Python thread can run: killed, not exited
    assert time.monotonic() - started < 5


def test_a_runner_past_its_unextended_deadline_is_killed_even_holding_the_gil_in_ring_init(spawn, tmp_path) -> None:
    """The dead man's switch (DESIGN §5): its supervisor still holds the channel open (a stalled daemon), but
    no longer extends the deadline; a lone rank 0 blocks in mx.distributed.init with the GIL held, and its
    watchdog process ends it at the deadline all the same."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(2)]))
    runner = spawn(rank=0, world_size=2, hostfile=hostfile, deadline=60)
    runner.send(p.Connect())
    assert phases(runner.recv_until(p.Status)) == [p.Phase.JOINING]
    runner.extend(2.0)
    deadline = time.monotonic() + 2.0
    assert runner.wait(timeout=30) == -signal.SIGKILL  # killed from outside: no Python thread can run
    ended = time.monotonic()
    assert deadline <= ended < deadline + 5
    assert "deadline passed without an extension" in runner.log.read_text()


def test_a_runner_whose_deadline_is_extended_lives_on_and_serves(spawn, model_dir) -> None:
    runner = spawn(deadline=2.0)
    for _ in range(16):  # twice as long as its first deadline, extended every 0.25 s
        runner.extend(2.0)
        time.sleep(0.25)
    assert runner.proc.poll() is None
    runner.extend(60)  # a load on a busy machine may take longer than the beat's deadline
    runner.send(p.Load(str(model_dir)))
    assert runner.recv_until(p.Status)[-1].phase is p.Phase.WEIGHTS  # it still answers
    runner.sock.close()
    assert runner.wait(timeout=10) == 0


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ((256, 256), (256, 256)),  # under a hard limit below what mlx_lm asks: that raised, every runner failed
        ((1024, 8192), (2048, 8192)),  # the soft one raised as mlx-lm wants, within the hard one
        ((3000, 20000), (3000, 20000)),  # found by the fault campaign: never lowered (it became (2048, 4096))
    ],
)
def test_mlx_lm_is_imported_without_lowering_or_overstepping_the_descriptor_limits(before, after):
    """mlx_lm.utils sets RLIMIT_NOFILE to (2048, 4096) at import, in the runner and in the daemon
    (`exod.host.models.has_pipeline` looks into mlx-lm's code)."""
    import subprocess
    import sys

    code = (
        f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, {before})\n"
        "from exod.host.models import has_pipeline; assert has_pipeline('qwen2')\n"
        "from mlx_lm.utils import load_model; print(resource.getrlimit(resource.RLIMIT_NOFILE))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(after)


def test_scoring_a_prompt_in_chunks_gives_what_one_pass_gives(model_dir: Path, monkeypatch) -> None:
    """`score` holds a chunk's logits at a time, not the whole prompt's (a 2,048-token prompt over a 150k
    vocabulary would be 1.2 GB): chunked over its KV cache, every value is the one-pass value."""
    import mlx_lm

    from exod.runner import process

    model, tokenizer = mlx_lm.load(str(model_dir))
    prompt = tokenizer.encode("the quick brown fox jumps over the lazy dog " * 12)
    monkeypatch.setattr(process, "SCORE_CHUNK", 7)
    chunked = process.score(model, tokenizer, prompt, 2)
    monkeypatch.setattr(process, "SCORE_CHUNK", len(prompt))
    whole = process.score(model, tokenizer, prompt, 2)
    assert len(chunked["logprobs"]) == len(chunked["top_logprobs"]) == len(prompt)
    assert chunked["logprobs"][0] is None
    pairs = zip(chunked["logprobs"][1:], whole["logprobs"][1:], strict=True)
    assert max(abs(a.logprob - b.logprob) for a, b in pairs) < 1e-5
    assert [[a.token_id for a in row] for row in chunked["top_logprobs"]] == [
        [a.token_id for a in row] for row in whole["top_logprobs"]
    ]
