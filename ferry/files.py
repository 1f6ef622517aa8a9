"""Output files written whole or not at all: a temporary beside the target, renamed over it at the end."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from ferry.errors import FerryError


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yields the temporary to write (same suffix, so tools that go by it still do); renames it to `path` when
    the block ends, removes it when the block fails. An OSError becomes a one-line FerryError."""
    tmp = path.with_name(path.name + ".tmp" + path.suffix)
    try:
        yield tmp
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise FerryError(f"{path}: cannot write ({e.strerror}); check the folder exists, is writable and has "
                         "space") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
