"""Files written whole or not at all, the errors that mean a storage cannot take a write, and JSON read from a file or
its gzip-compressed copy.

NOTE: the committed result files are kept as ``x.json.gz`` (``gzip -9n``: byte-identical on every run) so that a clone
stays light; everything that reads a result file reads it through ``read_json``, and writers keep writing ``x.json``.
"""

from __future__ import annotations

import errno
import gzip
import json
import os
from pathlib import Path

COMPRESSED_SUFFIX = ".gz"

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


def json_source(path: str | Path) -> Path | None:
    """The file that holds ``path``'s JSON: ``path`` itself (``x.json``), else its compressed copy beside it
    (``x.json.gz``), else None.

    The plain file wins where both exist: a run resumed from ``x.json.gz`` writes ``x.json``, which holds every sample
    the compressed copy did and the ones added since."""
    path = Path(path)
    for candidate in (path, path.with_name(path.name + COMPRESSED_SUFFIX)):
        if candidate.exists():
            return candidate
    return None


def read_json(path: str | Path):
    """The JSON in ``path`` or, where it is missing, in its compressed copy (``json_source``)."""
    source = json_source(path)
    if source is None:
        raise FileNotFoundError(f"{path} (nor {Path(path).name}{COMPRESSED_SUFFIX} beside it)")
    if source.name.endswith(COMPRESSED_SUFFIX):
        with gzip.open(source, "rt", encoding="utf-8") as handle:
            return json.load(handle)
    return json.loads(source.read_text())


def json_files(folder: str | Path, pattern: str = "*.json") -> list[Path]:
    """The JSON files in ``folder`` whose name matches ``pattern``, plain or compressed, sorted, each once and named as
    its plain file (``x.json`` for ``x.json.gz``): ``read_json`` reads any of them."""
    folder = Path(folder)
    compressed = folder.glob(pattern + COMPRESSED_SUFFIX)
    return sorted(
        {*folder.glob(pattern), *(path.with_name(path.name[: -len(COMPRESSED_SUFFIX)]) for path in compressed)}
    )
