"""``exod serve`` configuration: TOML in, validated values out, every mistake named."""

from __future__ import annotations

import enum
import ipaddress
import re
import socket
import tomllib
import warnings
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import attrs
import platformdirs
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model
from pydantic_core import PydanticCustomError

import fsm
from exod.cluster.etcd import EtcdSecurity
from exod.cluster.membership import DEFAULT_PREFIX, ClusterConfig
from exod.cluster.nodes import DEFAULT_TTL
from exod.cluster.tls import node_tls
from exod.cluster.token import read_secret, read_token
from exod.host.memory import model_room
from exod.host.models import validate_model_id
from exod.host.supervisor import Timeouts
from exod.runner.batch import BatchLimits
from exod.runner.faults import Fault, FaultSpec
from exod.state.retention import Retention
from fsm.admit import MIB


class Default(enum.Enum):
    DEFAULT = "default"  # not given: the configuration's value


DEFAULT = Default.DEFAULT


@attrs.frozen
class Models:
    """How models come and go (`fsm.instance`, "Residency"): placed on a first request, kept loaded while used."""

    on_demand: bool = False  # a request for a model not placed places it (`default_ranks` ranks) and waits for it
    default_ranks: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    keep_alive: float | None = None  # seconds an instance stays loaded unused before it is parked; None: forever


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
    faults: tuple[FaultSpec, ...] = ()  # injected faults, for tests (exod.runner.faults); empty in production
    script: str | None = None  # text every generation emits instead of sampling ([script], tests only)
    memory_bytes: int = attrs.Factory(lambda: model_room())  # what admission may reserve here (exod.host.memory)
    limits: fsm.Limits = attrs.Factory(lambda self: fsm.Limits.for_memory(self.memory_bytes), takes_self=True)
    retention: Retention = attrs.Factory(Retention)  # what the transition log and the runner files keep
    batch: BatchLimits = attrs.Factory(BatchLimits)  # what each runner decodes at once (exod.runner.batch)
    models: Models = attrs.Factory(Models)  # on-demand placement and keep-alive

    @property
    def db_path(self) -> Path:
        return self.state_dir / "state.db"


class ConfigError(ValueError):
    """The configuration file is wrong; the message names the file, the key and what is expected."""


@attrs.frozen
class Ceiling:
    """The longest a kind of duration may be: beyond it a value is a typo or an attack, and what the daemon
    computes from it (a deadline, the date `/api/ps` writes) would overflow."""

    seconds: float
    words: str  # how the error says it: "1 day"

    def check(self, name: str, seconds: float, given: object) -> float:
        """``seconds`` if within the ceiling; ValueError naming ``name``, the ceiling and what was ``given``."""
        if seconds > self.seconds:
            raise ValueError(f"{name} must be at most {self}, got {given!r}")
        return seconds

    def __str__(self) -> str:
        return f"{self.words} ({self.seconds:.0f} s)"


# Every duration's ceiling, in one place (README, "Durations"): the file's, and a keep-alive per request too.
_DAY = 86400.0
WAIT = Ceiling(_DAY, "1 day")  # every watchdog, grace, timeout and retry delay: [timeouts], [retry], [limits]
WINDOW = Ceiling(7 * _DAY, "7 days")  # [retry] reset_after: how long Ready before the retry budget refills
KEEP_ALIVE = Ceiling(3650 * _DAY, "10 years")  # an instance kept loaded unused; longer: -1, forever
LOG_AGE = Ceiling(3650 * _DAY, "10 years")  # [retention] max_log_age_days

# Go's durations as Ollama reads them, each unit at most once and largest first ("1h30m", not "5m5m" nor "30m1h")
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_DURATION = re.compile("".join(f"(?:{_NUMBER}{unit})?" for unit in ("h", "m", "s", "ms")))
_UNIT = (3600.0, 60.0, 1.0, 0.001)


def keep_alive(value: object) -> float | None:
    """A keep-alive as Ollama takes it: seconds (a number or its text), or a duration (``"5m"``, ``"1h30m"``,
    ``"90s"``); negative keeps the model loaded forever (None), 0 parks it as soon as it is idle. At most
    `KEEP_ALIVE`. ValueError saying what is accepted otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"keep_alive must be seconds or a duration such as '5m', got {value!r}")
    text = value.strip() if isinstance(value, str) else value
    sign = 1.0
    if isinstance(text, str) and text.startswith("-"):
        sign, text = -1.0, text[1:]
    seconds: float | None = None
    if isinstance(text, (int, float)):
        seconds = float(text)
    elif isinstance(text, str) and text and (parts := _DURATION.fullmatch(text)):
        seconds = sum(float(n) * unit for n, unit in zip(parts.groups(), _UNIT, strict=True) if n is not None)
    elif isinstance(text, str):
        try:
            seconds = float(text)
        except ValueError:
            seconds = None
    if seconds is None or seconds != seconds or seconds * sign == float("-inf"):  # +inf: past the ceiling
        raise ValueError(
            f"keep_alive must be seconds or a duration such as '5m', '1h30m' or '90s' (each unit at most once, "
            f"largest first; negative: forever), got {value!r}"
        )
    seconds *= sign
    return None if seconds < 0 else KEEP_ALIVE.check("keep_alive", seconds, value)


@attrs.frozen
class Placement:
    """A model to keep placed: a repo id, or (config and CLI only) a local directory."""

    ranks: int
    model: str | None = None
    path: Path | None = None
    keep_alive: float | Default | None = DEFAULT  # seconds (None: forever); by default [models] keep_alive


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
    # exod.api.http_server: what one client can hold
    read_timeout: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))  # to wait for a body, in all
    send_timeout: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))  # for a client to take a part
    keep_alive_timeout: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))  # idle, or for headers
    max_connections: int = attrs.field(default=256, validator=attrs.validators.gt(0))  # more wait to be accepted
    cluster: ClusterConfig | None = None  # `exod serve --cluster`: a node of an etcd cluster (exod.cluster.membership)
    # exod.api.drain: on SIGTERM/SIGINT, how long requests in progress may take to finish before they are ended
    drain_timeout: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))
    cors_origins: tuple[str, ...] = ()  # exod.api.middleware.cors: pages of these origins may call the API
    allowed_hosts: tuple[str, ...] = ()  # exod.api.middleware.HostAllowList: names it answers to besides its own

    @property
    def host_names(self) -> tuple[str, ...]:
        """The names a request's ``Host`` may give besides an address (always answered), ``localhost`` and a
        cluster node's advertised address (`exod.api.app.create_app` adds those): the name it is bound by, its
        machine's name when bound to every address, and ``[api] allowed_hosts``."""
        bound = [] if is_address(self.host) else [self.host]
        wildcard = self.host.strip("[]") in ("", "0.0.0.0", "::")
        return tuple(dict.fromkeys([*bound, *([socket.gethostname()] if wildcard else []), *self.allowed_hosts]))

    def check_exposure(self) -> None:
        """Binding beyond loopback needs a bearer token, or an explicit --insecure; a cluster node always needs
        the cluster's token, loopback included: without it any local user could drive its agent."""
        if not is_loopback(self.host) and not self.api_key and not self.insecure:
            raise ConfigError(
                f"binding {self.host} exposes the API beyond this machine: pass --api-key KEY "
                "(or set EXOD_API_KEY), or --insecure if that is really intended"
            )
        if self.cluster is not None and not self.cluster.token:
            raise ConfigError(
                "a cluster node needs the cluster's token, the secret its nodes share: pass --cluster-token-file "
                "FILE (or [cluster] token_file), the same file on every node; `exod cluster-token FILE` makes one"
            )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_address(host: str) -> bool:
    """Whether ``host`` is an IP address written out (``[::1]`` too), not a name."""
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


# The file's schema, checked by pydantic: unknown sections and keys, and wrong types, are errors that name them
# (strict: `offline = "no"` is not true, `host = 5` is not a host). What the values mean is checked after.
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)  # `inf` would switch a watchdog off


def _at_most(most: float, said: str) -> AfterValidator:
    """A ceiling on a number of the file, said in its error as ``said`` ("1 day (86400 s)")."""

    def check(value: float) -> float:
        if value > most:
            raise PydanticCustomError("too_long", "must be at most {said}", {"said": said})
        return value

    return AfterValidator(check)


Wait = Annotated[float, Field(gt=0), _at_most(WAIT.seconds, str(WAIT))]  # seconds
Window = Annotated[float, Field(gt=0), _at_most(WINDOW.seconds, str(WINDOW))]
_LOG_DAYS = LOG_AGE.seconds / _DAY
Days = Annotated[float, Field(gt=0), _at_most(_LOG_DAYS, f"{LOG_AGE.words} ({_LOG_DAYS:.0f} days)")]
Whole = Annotated[int, Field(ge=1)]


class _Daemon(BaseModel):
    model_config = _STRICT

    host: str = "127.0.0.1"
    port: int = Field(8420, ge=0, le=65535)
    state_dir: str | None = None
    hf_home: str | None = None
    offline: bool | None = None


class _Retry(BaseModel):
    model_config = _STRICT

    initial: Wait = fsm.RetryPolicy().backoff.initial
    factor: float = Field(fsm.RetryPolicy().backoff.factor, ge=1, le=100)
    cap: Wait = fsm.RetryPolicy().backoff.cap
    max_failures: Whole | None = None  # charged failed generations before giving up (default 5)
    max_retries: Whole | None = None  # its old name, same meaning: accepted with a DeprecationWarning
    reset_after: Window = fsm.RetryPolicy().reset_after

    def failures(self, where: str) -> int | None:
        """``max_failures``, or the deprecated ``max_retries`` (warned); both at once is an error."""
        if self.max_retries is None:
            return fsm.RetryPolicy().max_failures if self.max_failures is None else self.max_failures
        if self.max_failures is not None:
            raise ConfigError(f"{where}: [retry] max_retries is the old name of max_failures: give only max_failures")
        warnings.warn(
            f"{where}: [retry] max_retries is deprecated: call it max_failures (same meaning: the failed "
            "generations after which an instance is deleted)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.max_retries


_Timeouts = create_model(  # one number of seconds per phase of `exod.host.supervisor.Timeouts`, at most a day
    "_Timeouts", __config__=_STRICT, **{f.name: (Wait, f.default) for f in attrs.fields(Timeouts)}
)


class _Place(BaseModel):
    model_config = _STRICT

    model: str | None = None
    path: str | None = None
    ranks: Whole = 1
    keep_alive: float | str | None = None  # None: [models] keep_alive


class _Models(BaseModel):
    model_config = _STRICT

    on_demand: bool = False
    default_ranks: Whole = 1
    keep_alive: float | str = -1


class _Cluster(BaseModel):
    model_config = _STRICT

    url: str
    node_id: str
    advertise: str
    lease_ttl: int = Field(DEFAULT_TTL, ge=2)
    prefix: str = DEFAULT_PREFIX
    token_file: str | None = None  # the cluster's credential (`exod cluster-token FILE` makes one)
    etcd_ca: str | None = None  # a secured etcd: its CA, this node's client certificate and key, a user
    etcd_cert: str | None = None
    etcd_key: str | None = None
    etcd_user: str | None = None
    etcd_password_file: str | None = None
    tls_cert: str | None = None  # node-to-node HTTPS (exod.cluster.tls): this node's certificate and key,
    tls_key: str | None = None
    tls_ca: str | None = None  # and the CA of every node's (etcd_ca when not given)
    forward_idle: Wait | None = None  # a forwarded request's bound on its controller's silence; None: 3 lease TTLs


class _Api(BaseModel):
    model_config = _STRICT

    cors_origins: list[str] = []  # none: browsers refuse pages of other origins (exod.api.middleware.cors)
    allowed_hosts: list[str] = []  # names (Host) answered besides its addresses, localhost and its own names


class _Fault(BaseModel):  # fault injection, for tests: never set by default
    model_config = _STRICT

    rank: int | None = Field(None, ge=0)
    generation: int | None = Field(None, ge=1)
    phase: str
    kind: str


class _Script(BaseModel):  # scripted output, for tests (a tool call from a random-weight model): never by default
    model_config = _STRICT

    text: str = Field(..., min_length=1)


class _Retention(BaseModel):
    model_config = _STRICT

    max_log_rows: Whole = Retention().max_log_rows
    max_log_age_days: Days = Retention().max_log_age_days  # a day and a half is fine
    keep_runner_logs: Whole = Retention().keep_runner_logs


class _Limits(BaseModel):
    model_config = _STRICT

    max_requests_per_instance: Whole = 16
    queue_timeout: Wait = 30.0
    max_tokens: Whole = 4096
    max_body_bytes: Whole = 1 << 20
    read_timeout: Wait = 30.0
    send_timeout: Wait = 30.0
    keep_alive_timeout: Wait = 5.0
    max_connections: Whole = 256
    drain_timeout: Wait = 30.0
    runners_per_node: Whole | None = None  # None: from this host's memory
    ranks_per_instance: Whole | None = None
    instances_per_model: Whole = 8
    runner_memory_mib: Whole = 512
    memory_mib: Whole | None = None  # None: this host's model room (exod.host.memory); capped at it
    max_sequences: Whole | None = None  # None: sized from kv_cache_mib and the model (BatchLimits.sized)
    kv_cache_mib: Whole = BatchLimits().kv_bytes // MIB
    prompt_cache_mib: Annotated[int, Field(ge=0)] = BatchLimits().prompt_cache_bytes // MIB
    prefill_step: Whole = BatchLimits().prefill_step


class _File(BaseModel):
    model_config = _STRICT

    daemon: _Daemon = Field(default_factory=_Daemon)
    retry: _Retry = Field(default_factory=_Retry)
    timeouts: _Timeouts = Field(default_factory=_Timeouts)  # type: ignore[valid-type]
    place: list[_Place] = []
    cluster: _Cluster | None = None
    fault: list[_Fault] = []
    script: _Script | None = None
    retention: _Retention = Field(default_factory=_Retention)
    limits: _Limits = Field(default_factory=_Limits)
    api: _Api = Field(default_factory=_Api)
    models: _Models = Field(default_factory=_Models)


_LISTS = frozenset({"place", "fault"})  # the sections written [[...]], once per entry


def _named(error: ValidationError, where: str) -> ConfigError:
    """pydantic's first complaint, in the file's own terms: the section, the key, what is expected."""
    first = error.errors()[0]
    loc = [part for part in first["loc"] if isinstance(part, str)]
    section, key = [*loc, "", ""][:2]
    if first["type"] == "extra_forbidden" and not key:
        return ConfigError(f"{where}: unknown section [{section}]; known: {sorted(_File.model_fields)}")
    if first["type"] == "extra_forbidden":
        return ConfigError(f"{where}: unknown key(s) {[key]} in [{section}]")
    if not key and first["type"] in ("list_type", "model_type", "dict_type", "model_attributes_type"):
        form = f"[[{section}]] (one per entry)" if section in _LISTS else f"[{section}] (once)"
        return ConfigError(f"{where}: {section} must be written {form}")
    got = first.get("input")
    return ConfigError(f"{where}: [{section}] {key}: {first['msg'][0].lower()}{first['msg'][1:]}, got {got!r}")


def default_state_dir() -> Path:
    return Path(platformdirs.user_data_dir("exod"))


def load(path: Path | None = None, **overrides: Any) -> ServeConfig:
    """Read ``path`` (default: the embedded default.toml) and apply CLI ``overrides`` (None = not given)."""
    where = str(path) if path else "the embedded default configuration"
    try:
        text = (path or resources.files("exod").joinpath("default.toml")).read_text(encoding="utf-8")
        data = tomllib.loads(text)
    except OSError as exc:
        raise ConfigError(f"cannot read {where}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where} is not UTF-8 text, as TOML must be (byte {exc.start}: {exc.reason})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where} is not valid TOML: {exc}") from exc
    try:
        file = _File.model_validate(data)
    except ValidationError as exc:
        raise _named(exc, where) from None
    given = {k: v for k, v in overrides.items() if v is not None and k in _Daemon.model_fields}
    d = file.daemon.model_copy(update=given)
    retry, limits = file.retry, file.limits
    try:
        policy = fsm.RetryPolicy(
            backoff=fsm.Backoff(initial=retry.initial, factor=retry.factor, cap=retry.cap),
            max_failures=retry.failures(where),
            reset_after=retry.reset_after,
        )
        placements = tuple(_placement(p) for p in file.place)
        faults = tuple(
            FaultSpec(Fault.parse(f"{f.phase}:{f.kind}"), rank=f.rank, generation=f.generation) for f in file.fault
        )
        origins = _origins(file.api.cors_origins)
        hosts = _allowed_hosts(file.api.allowed_hosts)
        models = Models(
            on_demand=file.models.on_demand if overrides.get("on_demand") is None else overrides["on_demand"],
            default_ranks=file.models.default_ranks,
            keep_alive=_keep_alive("[models]", file.models.keep_alive),
        )
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    memory = model_room()  # a budget lowers what admission may reserve here, never raises it past the host's
    memory = memory if limits.memory_mib is None else min(memory, limits.memory_mib * MIB)
    sized = fsm.Limits.for_memory(memory, runner_floor_bytes=limits.runner_memory_mib * MIB)
    admission = fsm.Limits(
        runners_per_node=limits.runners_per_node or sized.runners_per_node,
        ranks_per_instance=limits.ranks_per_instance or sized.ranks_per_instance,
        instances_per_model=limits.instances_per_model,
        runner_floor_bytes=sized.runner_floor_bytes,
    )
    daemon = DaemonConfig(
        state_dir=Path(d.state_dir or default_state_dir()).expanduser(),
        hf_home=Path(d.hf_home).expanduser() if d.hf_home else None,
        offline=d.offline,
        timeouts=Timeouts(**file.timeouts.model_dump()),
        policy=policy,
        max_requests_per_instance=limits.max_requests_per_instance,
        queue_timeout=limits.queue_timeout,
        faults=faults,
        script=file.script.text if file.script else None,
        memory_bytes=memory,
        limits=admission,
        retention=Retention(**file.retention.model_dump()),
        batch=BatchLimits(
            max_sequences=limits.max_sequences,
            kv_bytes=limits.kv_cache_mib * MIB,
            prompt_cache_bytes=limits.prompt_cache_mib * MIB,
            prefill_step=limits.prefill_step,
        ),
        models=models,
    )
    return ServeConfig(
        daemon=daemon,
        host=d.host,
        port=d.port,
        placements=placements,
        max_tokens=limits.max_tokens,
        max_body_bytes=limits.max_body_bytes,
        read_timeout=limits.read_timeout,
        send_timeout=limits.send_timeout,
        keep_alive_timeout=limits.keep_alive_timeout,
        max_connections=limits.max_connections,
        drain_timeout=limits.drain_timeout,
        cluster=_cluster(file.cluster, where),
        cors_origins=origins,
        allowed_hosts=hosts,
    )


_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s]+")


def cors_origin(text: str) -> str:
    """An origin as browsers send it (``scheme://host[:port]``, no path: ``http://localhost:3000``,
    ``chrome-extension://ID``), or ``*`` for any; ValueError saying so otherwise."""
    if text == "*" or _ORIGIN.fullmatch(text):
        return text
    raise ValueError(
        f"CORS origin {text!r} is not an origin: write scheme://host[:port] as the browser sends it, with no path "
        "or trailing slash (e.g. http://localhost:3000), or * for any"
    )


def _origins(given: list[str]) -> tuple[str, ...]:
    """The file's origins; a bad one's error names the setting, so the user knows which line to fix."""
    try:
        return tuple(cors_origin(o) for o in given)
    except ValueError as exc:
        raise ValueError(f"[api] cors_origins: {exc}") from exc


_HOST = re.compile(r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*\.?", re.IGNORECASE)


def allowed_host(text: str) -> str:
    """A name as a URL's host gives it (``exod.lan``; an address is always answered), or ``*`` for any (the
    DNS rebinding check off, for a proxy in front that checks names itself); ValueError saying so otherwise."""
    if text == "*" or (len(text) <= 253 and _HOST.fullmatch(text)) or is_address(text):
        return text.lower()
    raise ValueError(
        f"{text!r} is not a host name: write the name alone, as a URL gives it, with no scheme, port or path "
        "(e.g. 'exod.lan'; each name of its own, no wildcard), or '*' for any name (no DNS rebinding check)"
    )


def _allowed_hosts(given: list[str]) -> tuple[str, ...]:
    try:
        return tuple(allowed_host(h) for h in given)
    except ValueError as exc:
        raise ValueError(f"[api] allowed_hosts: {exc}") from exc


def _cluster(section: _Cluster | None, where: str) -> ClusterConfig | None:
    if section is None:
        return None
    secured = {"token_file", "etcd_ca", "etcd_cert", "etcd_key", "etcd_user", "etcd_password_file"}
    secured |= {"tls_cert", "tls_key", "tls_ca"}
    fields = section.model_dump(exclude=secured)

    def path(value: str | None) -> Path | None:
        return None if value is None else Path(value).expanduser()

    try:
        token = "" if section.token_file is None else read_token(Path(section.token_file).expanduser())
        secret = path(section.etcd_password_file)
        password = "" if secret is None else read_secret(secret, "etcd password")
        etcd = EtcdSecurity(
            path(section.etcd_ca), path(section.etcd_cert), path(section.etcd_key), section.etcd_user, password
        )
        tls_ca = path(section.tls_ca) or path(section.etcd_ca)
        tls = node_tls(tls_ca, path(section.tls_cert), path(section.tls_key), section.advertise)
        return ClusterConfig(**fields, token=token, etcd=etcd, tls=tls)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: [cluster]: {exc}") from exc


def _keep_alive(section: str, value: float | str) -> float | None:
    """`keep_alive` of a section of the file, its error naming the section."""
    try:
        return keep_alive(value)
    except ValueError as exc:
        raise ValueError(f"{section} {exc}") from exc


def _placement(entry: _Place) -> Placement:
    if (entry.model is None) == (entry.path is None):
        raise ValueError("each [[place]] needs exactly one of model = 'org/name' or path = '/a/model/dir'")
    kept = DEFAULT if entry.keep_alive is None else _keep_alive("[[place]]", entry.keep_alive)
    if entry.model is not None:
        return Placement(entry.ranks, model=validate_model_id(entry.model), keep_alive=kept)
    return Placement(entry.ranks, path=Path(entry.path).expanduser(), keep_alive=kept)  # type: ignore[arg-type]
