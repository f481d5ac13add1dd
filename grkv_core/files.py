"""Files written whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path


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
