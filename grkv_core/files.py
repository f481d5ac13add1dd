"""Files written whole or not at all, and the errors that mean a storage cannot take a write."""

from __future__ import annotations

import errno
import os
from pathlib import Path

# NOTE: the OS errors that mean "this storage cannot take the write" (full, read-only, no permission, not a
# directory), as opposed to a bug: a sweep stops on them in one line instead of failing trials.
STORAGE_ERRNOS = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
    errno.ENOTDIR,
    errno.EFBIG,
    errno.EIO,
}


def storage_failure(error: BaseException) -> bool:
    """Whether ``error`` is a storage that cannot take a write (see ``STORAGE_ERRNOS``)."""
    return isinstance(error, OSError) and error.errno in STORAGE_ERRNOS


def write_atomically(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through ``<path>.tmp`` and a rename: a reader sees the old file or the new one,
    never a part; a failed write (a full disk) leaves no ``.tmp`` behind and raises."""
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
