"""exod.config: the embedded default, overrides, and a clear error for every mistake."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from exod.cluster.devcluster import cluster_token_file
from exod.config import DEFAULT, ConfigError, keep_alive, load
from fsm.placement import MIB


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "exod.toml"
    path.write_text(text)
    return path


def test_embedded_default_places_the_real_packaged_model_on_one_rank():
    from exod.host.packaged import DEFAULT_MODEL

    cfg = load(None, state_dir=Path("/tmp/x"))
    assert (cfg.host, cfg.port) == ("127.0.0.1", 8420)
    assert [(p.model, p.ranks) for p in cfg.placements] == [(DEFAULT_MODEL, 1)]
    assert cfg.daemon.policy.max_failures == 5 and cfg.daemon.policy.backoff.cap == 30.0
    assert cfg.daemon.state_dir == Path("/tmp/x")


def test_file_values_and_cli_overrides(tmp_path):
    path = write(
        tmp_path,
        '[daemon]\nport = 9000\nhf_home = "~/hf"\n[retry]\ninitial = 0.5\nmax_failures = 2\n'
        '[timeouts]\nconnect = 5\n[[place]]\npath = "/models/m"\nranks = 1\n',
    )
    cfg = load(path, port=0)
    assert cfg.port == 0  # the CLI wins
    assert cfg.daemon.hf_home == Path("~/hf").expanduser()
    assert cfg.daemon.policy.backoff.initial == 0.5 and cfg.daemon.policy.max_failures == 2
    assert cfg.daemon.timeouts.connect == 5.0
    assert cfg.placements[0].path == Path("/models/m") and cfg.placements[0].model is None


def test_the_old_name_max_retries_keeps_its_meaning_with_a_warning_and_both_names_at_once_are_refused(tmp_path):
    """The seeds' cap of 5 failed generations keeps its meaning under the old key."""
    with pytest.warns(DeprecationWarning, match="max_failures"):
        cfg = load(write(tmp_path, "[retry]\nmax_retries = 5\n"))
    assert cfg.daemon.policy.max_failures == 5
    with pytest.raises(ConfigError, match="give only max_failures"):
        load(write(tmp_path, "[retry]\nmax_retries = 5\nmax_failures = 5\n"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[deamon]\nport = 1\n", r"unknown section \[deamon\]"),
        ("[daemon]\nprot = 1\n", r"unknown key\(s\) \['prot'\]"),
        ("[daemon]\nport = 70000\n", r"\[daemon\] port: input should be less than or equal to 65535, got 70000"),
        ('[daemon]\noffline = "no"\n', r"\[daemon\] offline: input should be a valid boolean, got 'no'"),
        ("[daemon]\nhost = 5\n", r"\[daemon\] host: input should be a valid string, got 5"),
        ("[daemon]\nport = true\n", r"\[daemon\] port: input should be a valid integer"),
        ("[[place]]\nmodel = 3\n", r"\[place\] model: input should be a valid string, got 3"),
        ("[timeouts]\nconnect = -1\n", r"\[timeouts\] connect: input should be greater than 0"),
        ("[cluster]\nurl = 'http://e:2379'\n", r"\[cluster\] node_id: field required"),
        ("[retry]\ncap = 1\ninitial = 5\n", "cap"),
        ("[retry]\nmax_retries = 0\n", "max_retries"),
        ('[[place]]\nmodel = "../etc"\n', "org/name"),
        ('[[place]]\nmodel = "a/b"\npath = "/x"\n', "exactly one of"),
        ('[[place]]\nmodel = "a/b"\nranks = 0\n', "ranks"),
        ("[daemon\n", "not valid TOML"),
        ("[timeouts]\nconnect = inf\n", r"\[timeouts\] connect: input should be a finite number"),  # no watchdog
        ("[retry]\nfactor = nan\n", r"\[retry\] factor: input should be a finite number"),
    ],
)
def test_mistakes_are_named(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load(write(tmp_path, text))


def test_a_file_that_is_not_utf8_is_refused_saying_so_never_a_traceback(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('[daemon]\nhost = "café"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "nope.toml")


def test_serve_place_option_takes_repo_ids_and_local_directories(tmp_path):
    from exod.cli.daemon import _parse_place

    assert (_parse_place("exod/tiny-qwen2:2").model, _parse_place("exod/tiny-qwen2:2").ranks) == ("exod/tiny-qwen2", 2)
    assert _parse_place(f"{tmp_path}:1").path == tmp_path
    assert _parse_place("org/name").ranks == 1
    for bad in ("../etc:1", "org/name:0", "org/name:x"):
        with pytest.raises(ValueError):
            _parse_place(bad)


def served(monkeypatch, *args: str):
    """The configuration `exod serve ARGS` would run with (the daemon itself is not started)."""
    from click.testing import CliRunner

    import exod.serve
    from exod.cli import main

    seen = []

    async def serve(cfg) -> None:
        seen.append(cfg)

    monkeypatch.setattr(exod.serve, "serve", serve)
    result = CliRunner().invoke(main, ["serve", *args])
    assert result.exit_code == 0, result.output
    return seen[0]


def test_a_cluster_node_places_nothing_at_start_unless_asked(tmp_path, monkeypatch):
    """The embedded configuration places the default model on one host; a node of a cluster only what it is told."""
    state = ["--state-dir", str(tmp_path / "state")]
    alone = served(monkeypatch, *state)
    token = ["--cluster-token-file", str(cluster_token_file(tmp_path))]
    node = ["--cluster", "http://127.0.0.1:2379", "--node-id", "a", "--advertise", "127.0.0.1", *token, *state]
    in_cluster = served(monkeypatch, *node)
    asked = served(monkeypatch, *node, "--place", "exod/tiny-qwen2:2")
    own = write(tmp_path, '[[place]]\nmodel = "org/model"\nranks = 1\n')
    configured = served(monkeypatch, *node, "--config", str(own))
    assert [(p.model, p.ranks) for p in alone.placements] == [("gguf/smollm2-135m-instruct-q4_1", 1)]
    assert in_cluster.placements == () and in_cluster.cluster.node_id == "a"
    assert [(p.model, p.ranks) for p in asked.placements] == [("exod/tiny-qwen2", 2)]
    assert [(p.model, p.ranks) for p in configured.placements] == [("org/model", 1)]


def test_a_fault_without_generation_applies_to_every_generation(tmp_path):
    """As the README says: leaving out `generation` (or `rank`) means every one."""
    from exod.runner.faults import Fault, FaultSpec

    cfg = load(write(tmp_path, '[[fault]]\nrank = 1\nphase = "loading"\nkind = "hang"\n'))
    (spec,) = cfg.daemon.faults
    assert spec.generation is None
    assert all(spec.applies(1, generation) for generation in (1, 2, 7))
    assert not spec.applies(0, 1)
    pinned = load(write(tmp_path, '[[fault]]\ngeneration = 2\nphase = "loading"\nkind = "hang"\n')).daemon.faults[0]
    assert [pinned.applies(rank, 2) for rank in (0, 3)] == [True, True] and not pinned.applies(0, 1)
    assert FaultSpec(Fault.parse("busy:sigkill")).generation is None


def test_connection_limits_have_defaults_and_come_from_limits(tmp_path):
    default = load(None, state_dir=tmp_path)
    assert (default.read_timeout, default.keep_alive_timeout, default.max_connections) == (30.0, 5.0, 256)
    cfg = load(write(tmp_path, "[limits]\nread_timeout = 2\nkeep_alive_timeout = 0.5\nmax_connections = 8\n"))
    assert (cfg.read_timeout, cfg.keep_alive_timeout, cfg.max_connections) == (2.0, 0.5, 8)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[limits]\nread_timeout = 0\n", r"\[limits\] read_timeout: input should be greater than 0, got 0"),
        ("[limits]\nkeep_alive_timeout = -1\n", r"\[limits\] keep_alive_timeout: input should be greater than 0"),
        ("[limits]\nmax_connections = 2.5\n", r"\[limits\] max_connections: input should be a valid integer"),
        ('[limits]\nmax_connections = "many"\n', r"\[limits\] max_connections: input should be a valid integer"),
    ],
)
def test_connection_limit_mistakes_are_named(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load(write(tmp_path, text))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[limits]]\nmax_tokens = 5\n", r"limits must be written \[limits\] \(once\)"),
        ("[[retention]]\nmax_log_rows = 5\n", r"retention must be written \[retention\] \(once\)"),
        ('[place]\nmodel = "exod/tiny-qwen2"\n', r"place must be written \[\[place\]\] \(one per entry\)"),
        ("daemon = 5\n", r"daemon must be written \[daemon\] \(once\)"),
        ("daemon = 1\n", r"daemon must be written \[daemon\] \(once\)"),
        ("place = 3\n", r"place must be written \[\[place\]\] \(one per entry\)"),
    ],
)
def test_a_section_written_in_the_wrong_form_is_named(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load(write(tmp_path, text))


def test_a_cluster_node_needs_the_cluster_token_loopback_included_and_refuses_a_bad_one(tmp_path, monkeypatch):
    """Without it any local user could drive the node's agent; a token file others can read, an empty one, or
    none at all is refused before anything starts, saying what to do."""
    from click.testing import CliRunner

    import exod.serve
    from exod.cli import main

    monkeypatch.setattr(exod.serve, "serve", lambda cfg: pytest.fail("started without a usable token"))
    node = ["serve", "--cluster", "http://127.0.0.1:2379", "--node-id", "a", "--state-dir", str(tmp_path / "s")]
    readable = tmp_path / "readable.token"
    readable.write_text("x" * 43)
    readable.chmod(0o644)
    short = tmp_path / "short.token"
    short.write_text("abc")
    short.chmod(0o600)
    said = {}
    for name, extra in {
        "none": [],
        "missing": ["--cluster-token-file", str(tmp_path / "nowhere")],
        "readable": ["--cluster-token-file", str(readable)],
        "short": ["--cluster-token-file", str(short)],
    }.items():
        result = CliRunner().invoke(main, [*node, *extra])
        said[name] = (result.exit_code, result.output)
    assert all(code == 2 or code == 1 for code, _ in said.values()), said
    assert "--cluster-token-file" in said["none"][1] and "exod cluster-token" in said["none"][1]
    assert "exod cluster-token" in said["missing"][1]
    assert "chmod 600" in said["readable"][1]
    assert "at least 32 characters" in said["short"][1]


def test_exod_cluster_token_writes_a_secret_readable_by_its_owner_alone_and_never_overwrites_one(tmp_path):
    from click.testing import CliRunner

    from exod.cli import main
    from exod.cluster.token import read_token

    path = tmp_path / "cluster.token"
    made = CliRunner().invoke(main, ["cluster-token", str(path)])
    first = read_token(path)
    again = CliRunner().invoke(main, ["cluster-token", str(path)])
    assert made.exit_code == 0 and oct(path.stat().st_mode & 0o777) == "0o600" and len(first) >= 32
    assert again.exit_code == 1 and "exists already" in again.output and read_token(path) == first


# -- [models]: models that come and go (issue #29) -----------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "seconds"),
    [
        *[(-1, None), ("-1", None), ("-5m", None), (0, 0.0), ("0", 0.0), (300, 300.0), ("90s", 90.0)],
        *[("5m", 300.0), ("1h30m", 5400.0), ("2.5m", 150.0), ("500ms", 0.5), (" 10s ", 10.0), (1.5, 1.5)],
    ],
)
def test_a_keep_alive_is_read_as_ollama_reads_it(given, seconds):
    assert keep_alive(given) == seconds


@pytest.mark.parametrize("given", ["soon", "5x", "", "m5", True, float("-inf"), float("nan"), "1h-5m", [5], "5m5m"])
def test_a_keep_alive_that_is_none_says_what_is_accepted(given):
    with pytest.raises(ValueError, match="seconds or a duration such as '5m'"):
        keep_alive(given)


def test_models_are_off_by_default_and_come_from_the_file_and_the_command_line(tmp_path):
    default = load(None, state_dir=tmp_path).daemon.models
    assert (default.on_demand, default.default_ranks, default.keep_alive) == (False, 1, None)
    text = '[models]\non_demand = true\ndefault_ranks = 2\nkeep_alive = "5m"\n\n[[place]]\nmodel = "a/b"\n'
    text += 'keep_alive = "1h"\n\n[[place]]\nmodel = "c/d"\n'
    cfg = load(write(tmp_path, text))
    assert (cfg.daemon.models.on_demand, cfg.daemon.models.default_ranks, cfg.daemon.models.keep_alive) == (
        True,
        2,
        300.0,
    )
    assert [p.keep_alive for p in cfg.placements] == [3600.0, DEFAULT]  # the second: [models] keep_alive
    assert load(write(tmp_path, text), on_demand=False).daemon.models.on_demand is False  # --no-on-demand wins


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[models]\nkeep_alive = "soon"\n', "keep_alive must be seconds or a duration"),
        ("[models]\ndefault_ranks = 0\n", "[models] default_ranks"),
        ('[models]\non_demand = "yes"\n', "[models] on_demand"),
        ('[[place]]\nmodel = "a/b"\nkeep_alive = "later"\n', "keep_alive must be seconds or a duration"),
        ("[models]\nunload = 1\n", "unknown key(s) ['unload'] in [models]"),
    ],
)
def test_models_mistakes_are_named(tmp_path, text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load(write(tmp_path, text))


def test_a_memory_budget_lowers_what_admission_may_reserve_and_sizes_the_runner_count_from_it(tmp_path, monkeypatch):
    """[limits] memory_mib: the node's room as admission counts it, never above the host's own."""
    monkeypatch.setattr("exod.config.model_room", lambda: 64 * 1024 * MIB)
    assert load(None, state_dir=tmp_path).daemon.memory_bytes == 64 * 1024 * MIB  # default: the host's
    budget = load(write(tmp_path, "[limits]\nmemory_mib = 1536\nrunner_memory_mib = 256\n")).daemon
    assert budget.memory_bytes == 1536 * MIB
    assert budget.limits.runners_per_node == 6  # 1536 / 256: sized from the budget, not the host
    assert load(write(tmp_path, "[limits]\nmemory_mib = 1000000\n")).daemon.memory_bytes == 64 * 1024 * MIB
    with pytest.raises(ConfigError, match=re.escape("[limits] memory_mib: input should be greater than or equal to 1")):
        load(write(tmp_path, "[limits]\nmemory_mib = 0\n"))


def test_cors_origins_come_from_the_api_section_and_a_bad_one_is_named_with_how_to_write_it(tmp_path):
    """#28: ``[api] cors_origins`` (the daemon's pages of other origins; `--cors-origin` replaces it)."""
    assert load(None, state_dir=tmp_path).cors_origins == ()  # none by default: browsers refuse other origins
    given = '[api]\ncors_origins = ["http://localhost:3000", "https://app.example.org:8443", "chrome-extension://x"]\n'
    assert load(write(tmp_path, given)).cors_origins == (
        "http://localhost:3000",
        "https://app.example.org:8443",
        "chrome-extension://x",
    )
    with pytest.raises(ConfigError, match=r"\[api\] cors_origins: CORS origin 'http://a.test/' .*scheme://host"):
        load(write(tmp_path, '[api]\ncors_origins = ["http://localhost:3000", "http://a.test/"]\n'))
    with pytest.raises(ConfigError, match=r"\[api\] cors_origins: input should be a valid list"):
        load(write(tmp_path, '[api]\ncors_origins = "http://localhost:3000"\n'))


def test_allowed_hosts_come_from_the_api_section_and_a_bad_one_is_named_with_how_to_write_it(tmp_path):
    """#45: ``[api] allowed_hosts``, the names a request's Host may give besides the daemon's own
    (`exod.api.middleware.HostAllowList`)."""
    default = load(None, state_dir=tmp_path)
    assert default.allowed_hosts == () and default.host_names == ()  # bound to 127.0.0.1: an address, no name
    cfg = load(write(tmp_path, '[api]\nallowed_hosts = ["exod.lan", "GPU-Box", "my_service", "*"]\n'))
    assert cfg.allowed_hosts == ("exod.lan", "gpu-box", "my_service", "*")
    for bad in ("http://exod.lan", "exod.lan:8420", "exod.lan/", "*.exod.lan", "two words", ""):
        with pytest.raises(ConfigError, match=r"\[api\] allowed_hosts: .* is not a host name: write the name alone"):
            load(write(tmp_path, f'[api]\nallowed_hosts = ["{bad}"]\n'))


def test_the_names_a_daemon_answers_to_are_its_bind_name_its_machines_name_on_every_address_and_the_configured(
    tmp_path, monkeypatch
):
    monkeypatch.setattr("socket.gethostname", lambda: "gpu-box")
    named = load(write(tmp_path, '[daemon]\nhost = "exod.lan"\n[api]\nallowed_hosts = ["other.lan"]\n'))
    assert named.host_names == ("exod.lan", "other.lan")
    assert load(write(tmp_path, '[daemon]\nhost = "0.0.0.0"\n')).host_names == ("gpu-box",)
    assert load(write(tmp_path, '[daemon]\nhost = "::"\n')).host_names == ("gpu-box",)
    assert load(write(tmp_path, '[daemon]\nhost = "::1"\n')).host_names == ()
