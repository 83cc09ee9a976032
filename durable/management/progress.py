"""A progress line on stderr for the long subcommands of ``manage.py durable``.

On a terminal the line is rewritten in place (carriage return); otherwise (a log
file, CI) a line is written at most every ``interval`` seconds, and at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Progress:
    """``write(text)`` writes ``text`` as is (no newline added); ``tty``: whether it goes to a terminal."""

    def __init__(
        self, write: Callable[[str], object], label: str, total: int | None, *, tty: bool, interval: float = 5.0
    ) -> None:
        self.write = write
        self.label = label
        self.total = total
        self.done = 0
        self.interval = interval
        self.tty = tty
        self._last = time.monotonic()
        self._started = self._last
        self._written = False

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.tty or now - self._last >= self.interval:
            self._last = now
            self._write()

    def finish(self) -> None:
        if self._written or self.tty:
            self._write(end=True)

    def line(self) -> str:
        elapsed = time.monotonic() - self._started
        rate = f", {self.done / elapsed:,.0f}/s" if elapsed > 0 and self.done else ""
        if not self.total:
            return f"{self.label}: {self.done:,}{rate}"
        width = 30
        filled = min(width, width * self.done // self.total)
        percent = min(100, 100 * self.done // self.total)
        return f"{self.label}: [{'#' * filled}{'.' * (width - filled)}] {self.done:,}/{self.total:,} ({percent}%){rate}"

    def _write(self, *, end: bool = False) -> None:
        self._written = True
        if self.tty:
            self.write("\r" + self.line() + ("\n" if end else ""))
        else:
            self.write(self.line() + "\n")
