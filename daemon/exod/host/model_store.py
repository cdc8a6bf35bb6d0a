"""The models of this node's Hugging Face cache as a user manages them: list the whole ones, copy one under a new
name, add a model directory, remove one (Ollama's ``/api/tags``, ``/api/copy``, ``/api/create``, ``/api/delete``).

Each change appears whole or not at all: a copy is written beside the cache and renamed into it (as a GGUF import
is, `exod.host.gguf_import`), and a removal renames the model's folder out of the cache before deleting it, so a
reader never finds half a model, and a change given up half way (``Abandoned``) leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from exod.host.gguf_import import _publish
from exod.host.models import CachedModel, hub_cache_dir, is_complete, list_cached_models, validate_model_id

__all__ = ["Abandoned", "copy_model", "is_whole", "keep_only", "local_models", "remove_model", "repo_dir"]


class Abandoned(Exception):
    """The caller gave the change up (its client went away): nothing of it stays."""


def repo_dir(model_id: str, hf_home: Path | None) -> Path:
    """The model's folder in the cache (``models--org--name``), whether or not it is there."""
    return hub_cache_dir(hf_home) / ("models--" + validate_model_id(model_id).replace("/", "--"))


def local_models(hf_home: Path | None) -> list[CachedModel]:
    """The whole models of the cache, one per repository: the snapshot its ``refs/main`` names (else the newest).
    Half a download (a weight file missing) is not listed: it cannot be served."""
    chosen: dict[str, CachedModel] = {}
    for model in list_cached_models(hf_home):
        if not is_whole(model.path):
            continue
        main = _main(model.repo_id, hf_home)
        current = chosen.get(model.repo_id)
        if current is None or model.revision == main or (current.revision != main and _newer(model, current)):
            chosen[model.repo_id] = model
    return [chosen[k] for k in sorted(chosen)]


def copy_model(
    source: Path, model_id: str, hf_home: Path | None, *, abandoned: Callable[[], bool] = lambda: False
) -> Path:
    """Make the model directory ``source`` (a snapshot of the cache, or any Hugging Face-layout directory) a model
    of the cache named ``model_id``; returns its snapshot. Files are hard links where the file system allows (a
    copy takes no room), copies elsewhere. `Abandoned` (nothing kept) once ``abandoned()`` says so."""
    repo = repo_dir(model_id, hf_home)
    if not is_whole(source):
        raise FileNotFoundError(f"{source} is not a whole model directory (config.json and its weights)")
    staging = repo.parent / f".exod-copy-{uuid.uuid4().hex}"  # beside the repositories: huggingface_hub ignores it
    try:
        for path in sorted(source.rglob("*")):
            if abandoned():
                raise Abandoned(f"the copy of {source} as {model_id} was given up")
            target = staging / path.relative_to(source)
            if path.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            real = path.resolve()  # the cache's snapshot files are links to its blobs
            try:
                os.link(real, target)
            except OSError:  # another file system, or links not allowed: a copy
                shutil.copy2(real, target)
        snapshot = _publish(repo, staging, _revision(source))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    keep_only(snapshot)
    return snapshot


def keep_only(snapshot: Path) -> None:
    """Remove the model's other snapshots: a name made again means the new model, also to a reader that found the
    old one before (`exod.host.models.ModelFiles.path` looks again once its files are gone)."""
    for other in snapshot.parent.iterdir():
        if other != snapshot and other.is_dir():
            gone = snapshot.parent.parent.parent / f".exod-removed-{uuid.uuid4().hex}"
            os.replace(other, gone)
            shutil.rmtree(gone, ignore_errors=True)


def is_whole(directory: Path) -> bool:
    """A model directory with its config and weights, every one readable: at least one weight file, and each that
    its index names (a download stopped half way has its config, and some of its weights or none: not whole)."""
    if not is_complete(directory) or not any(directory.glob("*.safetensors")):
        return False
    try:
        index = json.loads((directory / "model.safetensors.index.json").read_text())
    except FileNotFoundError:
        return True
    except (OSError, ValueError):
        return False
    named = index.get("weight_map", {}).values() if isinstance(index, dict) else ()
    return all(isinstance(name, str) and (directory / name).is_file() for name in set(named))


def remove_model(model_id: str, hf_home: Path | None) -> bool:
    """Remove the model's folder from the cache (every snapshot, its blobs); False if it was not there. Renamed
    out of the cache first: a reader sees it whole, then gone."""
    repo = repo_dir(model_id, hf_home)
    if not repo.is_dir():
        return False
    gone = repo.parent / f".exod-removed-{uuid.uuid4().hex}"
    os.replace(repo, gone)
    shutil.rmtree(gone, ignore_errors=True)
    return True


def _main(repo_id: str, hf_home: Path | None) -> str | None:
    try:
        return (repo_dir(repo_id, hf_home) / "refs" / "main").read_text().strip()
    except (OSError, ValueError):
        return None


def _newer(a: CachedModel, b: CachedModel) -> bool:
    try:
        return a.path.stat().st_mtime > b.path.stat().st_mtime
    except OSError:
        return False


def _revision(source: Path) -> str:
    """The copy's snapshot name: the source's own where it is a commit of the cache, else a digest of what it holds
    (the same directory copied twice is one snapshot)."""
    if re.fullmatch(r"[0-9a-f]{40}", source.name):
        return source.name
    digest = hashlib.sha1(usedforsecurity=False)
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        stat = path.stat()
        digest.update(f"{path.relative_to(source)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()
