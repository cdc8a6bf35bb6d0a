"""``exod serve`` configuration: TOML in, validated values out, every mistake named."""

from __future__ import annotations

import os
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

import attrs
import platformdirs

import fsm
from exod.faults import Fault, FaultSpec
from exod.membership import ClusterConfig
from exod.models import validate_model_id
from exod.retention import Retention
from exod.supervisor import Timeouts
from fsm.admit import MIB


@attrs.frozen
class DaemonConfig:
    """What the controller needs: where state lives, how models are found, the policies and the limits."""

    state_dir: Path
    hf_home: Path | None = None
    offline: bool | None = None  # None: HF_HUB_OFFLINE decides; the hub is tried and fails fast otherwise
    timeouts: Timeouts = attrs.Factory(Timeouts)
    policy: fsm.RetryPolicy = attrs.Factory(fsm.RetryPolicy)
    download_policy: fsm.Backoff = fsm.DEFAULT_DOWNLOAD_BACKOFF
    download_timeout: float = 30.0  # seconds without a byte before a download is given up (and retried)
    max_requests_per_instance: int = 16  # in flight + queued; beyond it: Overloaded (HTTP 429)
    queue_timeout: float = 30.0  # a request no Ready runner took by then fails instead of waiting on
    faults: tuple[FaultSpec, ...] = ()  # injected faults, for tests (exod.faults); empty in production
    script: str | None = None  # text every generation emits instead of sampling ([script], tests only)
    memory_bytes: int = attrs.Factory(lambda: host_memory())  # what admission may reserve on this node
    limits: fsm.Limits = attrs.Factory(lambda self: fsm.Limits.for_memory(self.memory_bytes), takes_self=True)
    retention: Retention = attrs.Factory(Retention)  # what the transition log and the runner files keep

    @property
    def db_path(self) -> Path:
        return self.state_dir / "state.db"


def host_memory() -> int:
    """This machine's physical memory in bytes (Linux and macOS)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def free_memory() -> int:
    """This machine's memory available to a new process, in bytes: Linux's MemAvailable (free memory plus
    what the page cache would give back), else the free pages, else the physical memory."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        return host_memory()


class ConfigError(ValueError):
    """The configuration file is wrong; the message names the file, the key and what is expected."""


@attrs.frozen
class Placement:
    """A model to keep placed: a repo id, or (config and CLI only) a local directory."""

    ranks: int
    model: str | None = None
    path: Path | None = None


@attrs.frozen
class ServeConfig:
    daemon: DaemonConfig
    host: str = "127.0.0.1"
    port: int = 8420
    placements: tuple[Placement, ...] = ()
    api_key: str | None = None
    insecure: bool = False
    max_tokens: int = 4096
    max_body_bytes: int = 1 << 20
    # exod.http_server: what one client can hold
    read_timeout: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))  # to wait for a body, in all
    keep_alive_timeout: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))  # idle, or for headers
    max_connections: int = attrs.field(default=256, validator=attrs.validators.gt(0))  # more wait to be accepted
    cluster: ClusterConfig | None = None  # `exod serve --cluster`: a node of an etcd cluster (exod.membership)
    # exod.drain: on SIGTERM/SIGINT, how long requests in progress may take to finish before they are ended
    drain_timeout: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))

    def check_exposure(self) -> None:
        """Binding beyond loopback needs a bearer token, or an explicit --insecure."""
        if not is_loopback(self.host) and not self.api_key and not self.insecure:
            raise ConfigError(
                f"binding {self.host} exposes the API beyond this machine: pass --api-key KEY "
                "(or set EXOD_API_KEY), or --insecure if that is really intended"
            )


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


_SECTIONS = {
    "daemon": {"host", "port", "state_dir", "hf_home", "offline"},
    "retry": {"initial", "factor", "cap", "max_retries", "reset_after"},
    "timeouts": {f.name for f in attrs.fields(Timeouts)},  # connect, load_progress, warm_up, generate, …
    "place": {"model", "path", "ranks"},
    "cluster": {f.name for f in attrs.fields(ClusterConfig)},  # url, node_id, advertise, lease_ttl, prefix
    "fault": {"rank", "generation", "phase", "kind"},  # fault injection, for tests: never set by default
    "script": {"text"},  # scripted output, for tests (a tool call from a random-weight model): never by default
    "retention": {f.name for f in attrs.fields(Retention)},  # max_log_rows, max_log_age_days, keep_runner_logs
    "limits": {
        "max_requests_per_instance",
        "queue_timeout",
        "max_tokens",
        "max_body_bytes",
        "read_timeout",
        "keep_alive_timeout",
        "max_connections",
        "drain_timeout",
        "runners_per_node",
        "ranks_per_instance",
        "instances_per_model",
        "runner_memory_mib",
    },
}


_LISTS = frozenset({"place", "fault"})  # the sections written [[...]], once per entry


def _listed(body: Any) -> list[Any]:
    return body if isinstance(body, list) else [body]


def _script(section: dict[str, Any], where: str) -> str | None:
    text = section.get("text")
    if text is not None and (not isinstance(text, str) or not text):
        raise ConfigError(f"{where}: [script] text must be a non-empty string, got {text!r}")
    return text


def default_state_dir() -> Path:
    return Path(platformdirs.user_data_dir("exod"))


def load(path: Path | None = None, **overrides: Any) -> ServeConfig:
    """Read ``path`` (default: the embedded default.toml) and apply CLI ``overrides`` (None = not given)."""
    where = str(path) if path else "the embedded default configuration"
    try:
        text = path.read_text() if path else resources.files("exod").joinpath("default.toml").read_text()
        data = tomllib.loads(text)
    except OSError as exc:
        raise ConfigError(f"cannot read {where}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where} is not valid TOML: {exc}") from exc
    for section, body in data.items():
        if section not in _SECTIONS:
            raise ConfigError(f"{where}: unknown section [{section}]; known: {sorted(_SECTIONS)}")
        if isinstance(body, list) != (section in _LISTS) or not all(isinstance(e, dict) for e in _listed(body)):
            form = f"[[{section}]] (one per entry)" if section in _LISTS else f"[{section}] (once)"
            raise ConfigError(f"{where}: {section} must be written {form}")
        for entry in _listed(body):
            if unknown := set(entry) - _SECTIONS[section]:
                raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)} in [{section}]")
    d = {**data.get("daemon", {}), **{k: v for k, v in overrides.items() if v is not None}}
    try:
        retry = data.get("retry", {})
        default = fsm.RetryPolicy()
        policy = fsm.RetryPolicy(
            backoff=fsm.Backoff(
                initial=retry.get("initial", default.backoff.initial),
                factor=retry.get("factor", default.backoff.factor),
                cap=retry.get("cap", default.backoff.cap),
            ),
            max_retries=retry.get("max_retries", default.max_retries),
            reset_after=retry.get("reset_after", default.reset_after),
        )
        timeouts = Timeouts(**{k: float(v) for k, v in data.get("timeouts", {}).items()})
        placements = tuple(_placement(p) for p in data.get("place", []))
        faults = tuple(
            FaultSpec(Fault.parse(f"{f['phase']}:{f['kind']}"), rank=f.get("rank"), generation=f.get("generation"))
            for f in data.get("fault", [])
        )
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    port = d.get("port", 8420)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"{where}: port must be an int in 0..65535, got {port!r}")
    limits = data.get("limits", {})
    for key, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"{where}: [limits] {key} must be a positive number, got {value!r}")
    whole = ("max_connections", "runners_per_node", "ranks_per_instance", "instances_per_model", "runner_memory_mib")
    for key in whole:
        if key in limits and not isinstance(limits[key], int):
            raise ConfigError(f"{where}: [limits] {key} must be a whole number, got {limits[key]!r}")
    kept = data.get("retention", {})
    for key, value in kept.items():  # whole numbers, but for the age: a day and a half is fine
        number = (int, float) if key == "max_log_age_days" else int
        if isinstance(value, bool) or not isinstance(value, number) or value <= 0:
            what = "a positive number" if key == "max_log_age_days" else "a whole number >= 1"
            raise ConfigError(f"{where}: [retention] {key} must be {what}, got {value!r}")
    connections = limits.get("max_connections", 256)
    memory = host_memory()
    sized = fsm.Limits.for_memory(memory, runner_floor_bytes=limits.get("runner_memory_mib", 512) * MIB)
    admission = fsm.Limits(
        runners_per_node=limits.get("runners_per_node", sized.runners_per_node),
        ranks_per_instance=limits.get("ranks_per_instance", sized.ranks_per_instance),
        instances_per_model=limits.get("instances_per_model", sized.instances_per_model),
        runner_floor_bytes=sized.runner_floor_bytes,
    )
    daemon = DaemonConfig(
        state_dir=Path(d.get("state_dir") or default_state_dir()).expanduser(),
        hf_home=Path(d["hf_home"]).expanduser() if d.get("hf_home") else None,
        offline=d.get("offline"),
        timeouts=timeouts,
        policy=policy,
        max_requests_per_instance=int(limits.get("max_requests_per_instance", 16)),
        queue_timeout=float(limits.get("queue_timeout", 30.0)),
        faults=faults,
        script=_script(data.get("script", {}), where),
        memory_bytes=memory,
        limits=admission,
        retention=Retention(**kept),
    )
    return ServeConfig(
        daemon=daemon,
        host=str(d.get("host", "127.0.0.1")),
        port=port,
        placements=placements,
        max_tokens=int(limits.get("max_tokens", 4096)),
        max_body_bytes=int(limits.get("max_body_bytes", 1 << 20)),
        read_timeout=float(limits.get("read_timeout", 30.0)),
        keep_alive_timeout=float(limits.get("keep_alive_timeout", 5.0)),
        max_connections=connections,
        drain_timeout=float(limits.get("drain_timeout", 30.0)),
        cluster=_cluster(data.get("cluster"), where),
    )


def _cluster(section: dict[str, Any] | None, where: str) -> ClusterConfig | None:
    if not section:
        return None
    missing = sorted({"url", "node_id", "advertise"} - set(section))
    if missing:
        raise ConfigError(f"{where}: [cluster] needs {missing} (or pass --cluster, --node-id and --advertise)")
    try:
        return ClusterConfig(**section)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: [cluster]: {exc}") from exc


def _placement(entry: dict[str, Any]) -> Placement:
    if ("model" in entry) == ("path" in entry):
        raise ValueError("each [[place]] needs exactly one of model = 'org/name' or path = '/a/model/dir'")
    ranks = entry.get("ranks", 1)
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"[[place]] ranks must be an int >= 1, got {ranks!r}")
    if "model" in entry:
        return Placement(ranks, model=validate_model_id(entry["model"]))
    return Placement(ranks, path=Path(entry["path"]).expanduser())
