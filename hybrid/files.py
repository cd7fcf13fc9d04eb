"""Files written whole, records appended whole, and write failures that end in one line.

``atomic_write(path)`` yields a temporary path beside ``path`` to write to; only when the block
ends without error is it renamed over ``path``, so a full disk or a kill never leaves a
half-written file (the temporary one is removed). An ``OSError`` (a full disk, a read-only
or vanished directory) becomes ``RunDirError``, which names the file and what to do.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path
from typing import Iterator

from hybrid.errors import UserError


class RunDirError(UserError, OSError):
    """A file of the run could not be written: one line with the path and the fix."""


def write_error(path: str | os.PathLike, err: OSError) -> RunDirError:
    reason = err.strerror or str(err)
    return RunDirError(f"cannot write {path}: {reason}; free space there or choose another "
                       f"directory (hydra.run.dir=...)")


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[Path]:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as err:
        raise write_error(path, err) from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def user_cache_dir() -> Path:
    """Where hybrid keeps what it builds or measures once per machine (the built-in corpora,
    ``hybrid-plan calibrate``'s device file): ``$XDG_CACHE_HOME/hybrid``, else
    ``~/.cache/hybrid``, as HF's caches resolve it."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hybrid"


def write_text(path: str | os.PathLike, text: str) -> None:
    """``path.write_text(text)``, whole or not at all."""
    with atomic_write(path) as tmp:
        tmp.write_text(text)


class AtomicFiles:
    """Several files that appear together and whole: ``handle(path)`` is an open temporary
    file beside ``path``; ``commit()`` flushes them to disk and renames them over their paths
    in the order given (put the file whose presence means "complete" last); leaving the block
    without ``commit()`` (an error, Ctrl-C) removes every temporary file, and the paths keep
    what they held before."""

    def __init__(self, paths: list[str]):
        self.paths = [Path(p) for p in paths]
        self._temps: dict[Path, tuple[Path, object]] = {}

    def __enter__(self) -> "AtomicFiles":
        return self

    def handle(self, path: str | os.PathLike):
        path = Path(path)
        if path not in self._temps:
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            self._temps[path] = (tmp, open(tmp, "wb"))
        return self._temps[path][1]

    def commit(self, stale: list[str] = ()) -> None:
        """Make every file appear (each one that was never written, empty); remove
        ``stale`` paths that a previous output left and this one does not replace."""
        mode = 0o666 & ~_umask()  # like a plain open(); mkstemp-style 0600 would surprise
        for path in self.paths:
            handle = self.handle(path)
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
            os.chmod(self._temps[path][0], mode)
        for path in self.paths:
            os.replace(self._temps.pop(path)[0], path)
        for path in stale:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def __exit__(self, *exc) -> None:
        for tmp, handle in self._temps.values():
            handle.close()
            with contextlib.suppress(OSError):
                tmp.unlink()
        self._temps.clear()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class JsonLines:
    """A ``.jsonl`` file whose records are whole or absent: each line goes out in one
    ``write``, and one that does not fit (a full disk, a file size limit) is cut off again, so
    a reader never meets half a record."""

    def __init__(self, path: Path, append: bool):
        self.path = path
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if append else os.O_TRUNC)
        try:
            self._fd = os.open(path, flags, 0o666)
        except OSError as err:
            raise write_error(path, err) from None

    def append(self, record: dict) -> None:
        line = (json.dumps(record) + "\n").encode()
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            if os.write(self._fd, line) != len(line):
                raise OSError(errno.ENOSPC, "no space left for the whole record")
        except OSError as err:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)
            raise write_error(self.path, err) from None

    def close(self) -> None:
        os.close(self._fd)
