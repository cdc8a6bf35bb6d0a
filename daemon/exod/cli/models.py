"""`exod model`: the models in the local Hugging Face cache."""

from __future__ import annotations

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
    """Fetch MODEL_ID into the cache (progress bars on the terminal) and print its snapshot path."""
    from exod.host.models import InvalidModelId, ModelNotFound, resolve_model

    try:
        path = resolve_model(model_id, hf_home=hf_home, offline=offline, timeout=stall_timeout, show_progress=True)
    except (InvalidModelId, ModelNotFound) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(str(path))


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
