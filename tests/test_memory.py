"""exod.host.memory: each platform's readings faked (psutil's numbers, MLX's Metal device), and this machine's."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from exod.config import DaemonConfig
from exod.host import memory

GIB = 1 << 30


def fake_psutil(monkeypatch, *, total: int, available: int) -> None:
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=total, available=available))


def fake_mlx(monkeypatch, *, metal: bool, info: dict | None = None, new_api: bool = True) -> None:
    """An ``mlx.core`` with a Metal backend or not; ``new_api``: mx.device_info(device) beside mx.metal's."""
    mx = SimpleNamespace(gpu="gpu", metal=SimpleNamespace(is_available=lambda: metal, device_info=lambda: info))
    if new_api:
        mx.device_info = lambda device=None: info if device == "gpu" else {}
    monkeypatch.setitem(sys.modules, "mlx.core", mx)


def test_linux_free_is_mem_available_and_room_is_total(monkeypatch):
    fake_psutil(monkeypatch, total=64 * GIB, available=40 * GIB)
    fake_mlx(monkeypatch, metal=False)  # mlx[cpu]: no Metal
    assert memory.total_memory() == 64 * GIB
    assert memory.free_memory() == 40 * GIB
    assert memory.metal_working_set() is None
    assert memory.model_room() == 64 * GIB


def test_macos_intel_free_is_psutil_available_not_all_physical_memory(monkeypatch):
    free, inactive = 4 * GIB, 8 * GIB  # psutil on macOS: available = free + inactive
    fake_psutil(monkeypatch, total=32 * GIB, available=free + inactive)
    fake_mlx(monkeypatch, metal=False)
    assert memory.free_memory() == 12 * GIB
    assert memory.model_room() == 32 * GIB


@pytest.mark.parametrize("new_api", [True, False], ids=["mx.device_info", "mx.metal.device_info"])
def test_apple_silicon_room_is_the_metal_working_set(monkeypatch, new_api):
    fake_psutil(monkeypatch, total=128 * GIB, available=100 * GIB)
    fake_mlx(monkeypatch, metal=True, info={"max_recommended_working_set_size": 96 * GIB}, new_api=new_api)
    assert memory.metal_working_set() == 96 * GIB
    assert memory.model_room() == 96 * GIB
    assert memory.free_memory() == 100 * GIB  # free memory is still psutil's, not MLX's


def test_apple_silicon_room_is_capped_at_total_memory(monkeypatch):
    fake_psutil(monkeypatch, total=16 * GIB, available=8 * GIB)
    fake_mlx(monkeypatch, metal=True, info={"max_recommended_working_set_size": 24 * GIB})
    assert memory.model_room() == 16 * GIB


@pytest.mark.parametrize(
    "info", [{}, {"max_recommended_working_set_size": 0}, {"max_recommended_working_set_size": "x"}]
)
def test_metal_without_a_usable_working_set_falls_back_to_total(monkeypatch, info):
    fake_psutil(monkeypatch, total=32 * GIB, available=8 * GIB)
    fake_mlx(monkeypatch, metal=True, info=info)
    assert memory.model_room() == 32 * GIB


def test_mlx_missing_falls_back_to_total(monkeypatch):
    fake_psutil(monkeypatch, total=32 * GIB, available=8 * GIB)
    monkeypatch.setitem(sys.modules, "mlx.core", None)  # import mlx.core raises ImportError
    assert memory.metal_working_set() is None
    assert memory.model_room() == 32 * GIB


def test_mlx_raising_falls_back_to_total(monkeypatch, caplog):
    def broken():
        raise RuntimeError("Failed to load device")

    fake_psutil(monkeypatch, total=32 * GIB, available=8 * GIB)
    mx = SimpleNamespace(gpu="gpu", metal=SimpleNamespace(is_available=lambda: True, device_info=broken))
    mx.device_info = lambda device=None: broken()
    monkeypatch.setitem(sys.modules, "mlx.core", mx)
    assert memory.model_room() == 32 * GIB
    assert "Failed to load device" in caplog.text


def test_daemon_config_reserves_the_model_room(monkeypatch):
    fake_psutil(monkeypatch, total=128 * GIB, available=100 * GIB)
    fake_mlx(monkeypatch, metal=True, info={"max_recommended_working_set_size": 96 * GIB})
    assert DaemonConfig(state_dir=Path("/tmp/x")).memory_bytes == 96 * GIB


def test_this_machine():
    total, free, room = memory.total_memory(), memory.free_memory(), memory.model_room()
    assert 0 < free <= total
    assert 0 < room <= total
