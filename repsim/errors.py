"""Typed errors whose message says what went wrong and how to fix it, in one line."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

DISK_FULL_TEXTS = ("No space left on device", "database or disk is full")  # ENOSPC rewrapped; SQLite's SQLITE_FULL


class RepsimError(Exception):
    """A user-facing error: ``<what>; <how to fix>``. The CLI prints it and exits 2."""

    def __init__(self, what: str, fix: str = ""):
        self.what, self.fix = what, fix
        super().__init__(f"{what}; {fix}" if fix else what)


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message, or its type's name when it has none: a cause to quote."""
    return str(err).splitlines()[0] if str(err) else type(err).__name__


class SpecError(RepsimError):
    """A data spec or config is malformed or points at something that does not exist."""


class DataError(RepsimError):
    """Source data is missing, unreadable or inconsistent."""


class StageError(RepsimError):
    """A stage output directory is not what the cache contract expects."""


class EvalError(RepsimError):
    """Features, labels or embeddings given to an evaluation are unusable (shape, count, NaN)."""


class SimilarityError(RepsimError):
    """A similarity source or neighbor list cannot be built from what it was given."""


class DiskFull(RepsimError):
    """A file system ran out of space, or has too little for what is asked of it."""


def disk_full(err: BaseException | None) -> bool:
    """Whether ``err`` or an error it came from says a disk is full: ENOSPC as an OSError or, from
    libraries that rewrap it (torch.save, SQLAlchemy over SQLite), only in the message."""
    while err is not None:
        if getattr(err, "errno", None) == errno.ENOSPC or any(text in str(err) for text in DISK_FULL_TEXTS):
            return True
        err = err.__cause__ or err.__context__
    return False


def mount_point(path: Path) -> Path:
    """The mount point of the file system holding ``path`` (or its nearest existing parent)."""
    path = path.resolve()
    while not path.exists() or (not os.path.ismount(path) and path != path.parent):
        path = path.parent
    return path


def disk_full_error(where: Path, what: str, needed: int) -> DiskFull:
    """``the file system at /mnt is full: <what> (F of T bytes free)``, to fix by freeing ``needed`` bytes."""
    space = shutil.disk_usage(mount_point(where))
    return DiskFull(f"the file system at {mount_point(where)} is full: {what} ({space.free:,} of {space.total:,} "
                    "bytes free now)",
                    f"free more than {needed:,} bytes there, or point REPSIM_HOME (or the stage's output) at a larger disk")


def require_free_space(where: Path, needed: int, what: str) -> None:
    """DiskFull, before anything is written, when ``where``'s file system has under ``needed`` bytes free."""
    free = shutil.disk_usage(mount_point(where)).free
    if free < needed:
        raise disk_full_error(where, f"{what} needs {needed:,} bytes free there", needed - free)
