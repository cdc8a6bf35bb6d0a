"""The daemon's state directory: private to its user, and held by one daemon at a time.

Private: the database, the runner logs and the hostfiles say which models run where and what they were
asked, so the directory and every directory the daemon makes in it are 0700 and every file it writes there
0600. The modes are given where each file is created, not by a process-wide umask: the daemon also
writes the user's Hugging Face cache, whose permissions are not ours to decide.

One daemon: two daemons on one directory would reap each other's runners and write the same database.
The lock is a ``flock`` on the directory itself. A lock *file* is not enough: deleted while its daemon
runs, the next daemon creates and locks a new one. An open descriptor of the directory cannot be swapped
under the lock (a directory moved away takes its database with it: a daemon started on a new, empty one
at the old path shares nothing with the first). ``daemon.lock`` is still locked as well, after the
directory, so that an older exod, which locks only that file, and this one refuse each other.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("exod.statedir")

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


class StateDirError(RuntimeError):
    """The state directory cannot be used; the message says which and what to do."""


class AlreadyRunning(StateDirError):
    """Another daemon holds this state directory."""


def private_dir(path: Path) -> Path:
    """Create ``path`` and its missing parents as 0700 (``mkdir -p`` would make the parents 0755 or so)."""
    if not path.is_dir():
        if path.parent != path:
            private_dir(path.parent)
        try:
            path.mkdir(mode=PRIVATE_DIR)
        except FileExistsError:  # made meanwhile by someone else, or a file: only the latter is an error
            if not path.is_dir():
                raise
    return path


def private_opener(path: str | os.PathLike[str], flags: int) -> int:
    """``open(..., opener=private_opener)``: a file it creates is 0600 from its first byte."""
    return os.open(path, flags, PRIVATE_FILE)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, 0600 even if an older exod left the file there with a wider mode, and whole:
    written beside it, then renamed over it, so a reader (the CLI finding ``daemon.json``) never sees it half
    written."""
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        with open(part, "w", opener=private_opener) as f:
            os.fchmod(f.fileno(), PRIVATE_FILE)
            f.write(text)
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)


class HeldDir:
    """The state directory a daemon holds, by its open descriptor: whatever is at its path later may not be it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    def replaced(self) -> str | None:
        """Why the directory at the path is no longer the one held (removed, moved, another made there)."""
        held = os.fstat(self._fd)
        try:
            now = os.stat(self.path)
        except OSError as exc:
            return f"the state directory {self.path} is gone ({exc.strerror}): its database with it"
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            return f"the state directory {self.path} was replaced by another directory: this daemon's is gone"
        return None


@contextlib.contextmanager
def state_dir_lock(state_dir: Path) -> Iterator[HeldDir]:
    """Create ``state_dir`` private (tightening one found open to others), and hold it until the block ends.

    Raises `AlreadyRunning` if another daemon holds it, `StateDirError` if it cannot be created or opened.
    """
    busy = AlreadyRunning(f"another exod daemon is using {state_dir}; stop it, or pass another --state-dir")
    with contextlib.ExitStack() as held:
        fds = []
        for path, open_it in ((state_dir, _open_dir), (state_dir / "daemon.lock", _open_lock_file)):
            try:
                fd = open_it(path)
            except OSError as exc:
                raise StateDirError(
                    f"cannot use the state directory {state_dir} ({path}: {exc.strerror}). "
                    "Check that it is a directory you can write, or pass another --state-dir."
                ) from exc
            held.callback(os.close, fd)  # closing the descriptor releases its lock
            fds.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a daemon holds the directory, or an older exod holds daemon.lock
                raise busy from None
        _tighten(state_dir)
        yield HeldDir(state_dir, fds[0])


def _open_dir(path: Path) -> int:
    private_dir(path)
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)


def _open_lock_file(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT, PRIVATE_FILE)


def _tighten(state_dir: Path) -> None:
    mode = stat.S_IMODE(state_dir.stat().st_mode)
    if not mode & 0o077:
        return
    try:
        state_dir.chmod(mode & PRIVATE_DIR)
    except OSError as exc:
        raise StateDirError(
            f"the state directory {state_dir} is open to other users (mode {mode:04o}) and cannot be made "
            f"private ({exc.strerror}): run `chmod 700 {state_dir}` as its owner, or pass another --state-dir."
        ) from exc
    log.warning(
        "%s was open to other users (mode %04o); it is now %04o, so only its owner can reach the state in it",
        state_dir,
        mode,
        mode & PRIVATE_DIR,
    )
