"""Files written whole, and write failures that end in one line.

``atomic_write(path)`` yields a temporary path beside ``path`` to write to; only when the block
ends without error is it renamed over ``path``, so a full disk or a kill never leaves a
half-written file (the temporary one is removed). An ``OSError`` (a full disk, a read-only
or vanished directory) becomes ``RunDirError``, which names the file and what to do.
"""

from __future__ import annotations

import contextlib
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


def write_text(path: str | os.PathLike, text: str) -> None:
    """``path.write_text(text)``, whole or not at all."""
    with atomic_write(path) as tmp:
        tmp.write_text(text)
