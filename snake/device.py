"""The only place that probes CUDA. Every other module asks here."""

from __future__ import annotations

import ctypes.util
from functools import cache

import torch

from snake.errors import ConfigError


def cuda_available() -> bool:
    return torch.cuda.is_available()


@cache
def cuda_driver_present() -> bool:
    """libcuda (the driver, not the runtime) can be found: kvikio needs it even for host buffers."""
    if not cuda_available():
        return False
    return ctypes.util.find_library("cuda") is not None


def resolve_device(name: str | None) -> torch.device:
    """None: CUDA if present, else CPU. A CUDA name without CUDA is a ConfigError."""
    if name is None:
        return torch.device("cuda" if cuda_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not cuda_available():
            raise ConfigError("device", name, "asks for CUDA but none is available", "use device='cpu' or None")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(
                "device", name, f"does not exist: {torch.cuda.device_count()} CUDA device(s)", "pick an existing index"
            )
    return dev


def pin_host_memory(device: torch.device) -> bool:
    """Pinned host buffers only make sense (and only work) with CUDA."""
    return device.type == "cuda"


def device_memory_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return None


def synchronize(device: torch.device) -> None:
    """Wait for the device's current stream. Call only off the event loop."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
