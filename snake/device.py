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


class Copier:
    """Host <-> device copies for the device mover: on CUDA on its own stream (so they
    overlap compute), waited for on the mover's executor thread; on CPU plain copies."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Blocking: dst.copy_(src) for each (dst, src) pair."""
        if self.stream is None:
            for dst, src in pairs:
                dst.copy_(src)
            return
        # outputs of compute were synchronized by the compute actor before they were sent
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        self.stream.synchronize()
