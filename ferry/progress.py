"""Progress bars (rich) for long steps on a terminal; nothing when quiet or when stderr is not a terminal."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator


@contextlib.contextmanager
def progress(description: str, total: int | None, quiet: bool = False) -> Iterator[Callable[..., None]]:
    """Yields update(completed, note="", total=None): advance the bar to `completed` of `total` (given here or at an
    update), with an optional note."""
    if quiet or not sys.stderr.isatty():
        yield lambda completed, note="", total=None: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  TextColumn("{task.fields[note]}"), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total, note="")
        yield lambda completed, note="", total=None: bar.update(task, completed=completed, note=note,
                                                               **({"total": total} if total else {}))
