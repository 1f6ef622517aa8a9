"""Progress bars (rich) for long steps on a terminal; nothing when quiet or when stderr is not a terminal."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator


@contextlib.contextmanager
def progress(description: str, total: int, quiet: bool = False) -> Iterator[Callable[..., None]]:
    """Yields update(completed, note=""): advance the bar to `completed` of `total`, with an optional note."""
    if quiet or not sys.stderr.isatty():
        yield lambda completed, note="": None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  TextColumn("{task.fields[note]}"), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total, note="")
        yield lambda completed, note="": bar.update(task, completed=completed, note=note)
