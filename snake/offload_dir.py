"""The SSD tier's directory: checked before anything starts, created 0700, locked so that a
second trainer on the same directory gets a clear error instead of corrupting the first."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
import warnings
from pathlib import Path

from snake.errors import ConfigError

MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")


class InMemoryOffloadWarning(UserWarning):
    """offload_dir is on a file system that lives in memory (tmpfs, ramfs): its "SSD" tier
    takes CPU memory, which the placement, the memory check and the planner count as disk."""


class FrozenFromDiskWarning(UserWarning):
    """A streamed model's frozen layer weights, mapped from a file in offload_dir, are more
    than the memory left available: the page cache cannot hold them, so every pass over the
    layers reads them from the disk again, which the planner does not count."""


def memory_fs(path: str | Path, mountinfo: str | None = None) -> str | None:
    """The type of the file system `path` is on when it lives in memory ("tmpfs",
    "ramfs"), else None: from the mount table (`/proc/self/mountinfo`, or `mountinfo`),
    the longest mount point above the resolved path. None where there is no such table."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    target = Path(path).resolve()
    best: tuple[int, str] | None = None
    for line in mountinfo.splitlines():
        fields, sep, rest = line.partition(" - ")
        parts = fields.split()
        if not sep or len(parts) < 5 or not rest:
            continue
        point = Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[4]))  # "\040": a space
        if target == point or point in target.parents:
            depth = len(point.parts)
            if best is None or depth >= best[0]:
                best = (depth, rest.split()[0])
    return best[1] if best is not None and best[1] in MEMORY_FILE_SYSTEMS else None


# where the FHS keeps temporary files on disk, where /tmp may be a tmpfs (Fedora, Arch)
DISK_TEMP = "/var/tmp"


def scratch_parent(mountinfo: str | None = None, candidates: tuple[str, ...] | None = None) -> str | None:
    """Where a temporary offload_dir goes (`snake train` without --offload-dir): the first of
    `candidates` (the system's temporary directory, then DISK_TEMP) that is a writable
    directory on a disk, not in memory: an SSD tier in a tmpfs takes the CPU memory it is
    meant to spare. None where each is in memory or unusable (the system's default then,
    which warns: InMemoryOffloadWarning)."""
    for c in candidates if candidates is not None else (tempfile.gettempdir(), DISK_TEMP):
        if os.path.isdir(c) and os.access(c, os.W_OK | os.X_OK) and memory_fs(c, mountinfo) is None:
            return c
    return None


def check_offload_dir(path: str | Path) -> Path:
    """Make sure `path` can serve as offload_dir: create it (mode 0700) if missing and
    probe that a file can be written there. Raises ConfigError naming the problem."""
    p = Path(path).expanduser()
    if p.is_symlink():
        target = os.readlink(p)
        if not p.exists():
            raise ConfigError(
                "offload_dir", str(path), f"is a symlink to {target}, which does not exist",
                "create the target directory or point offload_dir at a real directory",
            )
        p = p.resolve()  # a symlink to a directory elsewhere: the files go there
    if p.exists() and not p.is_dir():
        raise ConfigError("offload_dir", str(path), "is a file, not a directory", "pass a directory path")
    if not p.exists():
        try:
            p.mkdir(mode=0o700, parents=True)
        except OSError as e:
            raise ConfigError(
                "offload_dir", str(path), f"cannot be created ({e.strerror})", "pick a location you can write to"
            ) from e
    try:
        fd, probe = tempfile.mkstemp(prefix=".snake-probe-", dir=p)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(
            "offload_dir", str(path), f"is not writable ({e.strerror})", "pick a directory you can write to"
        ) from e
    return p


class DirLock:
    """An exclusive flock on `<dir>/.snake.lock`, held for the trainer's life. The file is
    removed as the lock is released (it was left behind in every offload_dir): a locker
    that opened it just before keeps a lock on a removed file, which it sees (the path no
    longer names the file it locked) and tries again."""

    def __init__(self, directory: Path) -> None:
        self._fd = -1
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # a directory already there keeps its mode
        self.path = directory / ".snake.lock"
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise ConfigError(
                    "offload_dir", str(directory), "is in use by another snake trainer",
                    "give each trainer its own offload_dir, or close the other one first",
                ) from None
            try:
                now, held = os.stat(self.path), os.fstat(fd)
                same = (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
            except FileNotFoundError:  # removed by the trainer that held it, as this one opened it
                same = False
            if same:
                self._fd = fd
                return
            os.close(fd)

    def release(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)  # while held: a locker that opened it meanwhile tries again
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        # a trainer dropped without close(): free the directory for the next one, and say so
        if getattr(self, "_fd", -1) >= 0:
            warnings.warn(
                f"snake: a trainer's lock on {self.path.parent} was never released: close the "
                "SnakeTrainer (async with, or await close()); released now",
                ResourceWarning, stacklevel=2,
            )
            self.release()
