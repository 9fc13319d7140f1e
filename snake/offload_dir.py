"""The SSD tier's directory: checked before anything starts, created 0700, locked so that a
second trainer on the same directory gets a clear error instead of corrupting the first."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from snake.errors import ConfigError


def check_offload_dir(path: str | Path) -> Path:
    """Raise ConfigError if `path` cannot serve as offload_dir. Touches nothing."""
    p = Path(path).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ConfigError("offload_dir", str(path), "is a file, not a directory", "pass a directory path")
        if not os.access(p, os.W_OK | os.X_OK):
            raise ConfigError("offload_dir", str(path), "is not writable", "pick a directory you can write to")
        return p
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(
            "offload_dir", str(path), f"cannot be created: {parent} is not a writable directory",
            "pick a location you can write to",
        )
    return p


class DirLock:
    """An exclusive flock on `<dir>/.snake.lock`, held for the trainer's life."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        self.path = directory / ".snake.lock"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise ConfigError(
                "offload_dir", str(directory), "is in use by another snake trainer",
                "give each trainer its own offload_dir, or close the other one first",
            ) from None

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1
