"""A progress display with an ETA for long work: the supervised warm-up, the RL steps, evaluation,
Hugging Face conversion.

On a terminal :class:`Progress` keeps one live line at the bottom (a bar, done/total, elapsed time
and ETA, the latest text), redrawn in place; the lines the caller wants kept (every RL step's) are
printed above it. Anywhere else (a SLURM log, a pipe, a test) nothing is redrawn: it prints plain
lines, each ending in ``| done/total, elapsed, ETA``, at the counts the caller asks for and at
most every ``interval_s`` seconds for long work between them. No dependency (tqdm draws into log
files with carriage returns, and ``gspo-train`` disables it for Megatron's own bars).
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import Callable, TextIO

__all__ = ["Progress", "eta_seconds", "format_duration"]


def eta_seconds(elapsed: float, done: int, total: int) -> float | None:
    """Seconds left at the mean rate so far: ``elapsed / done`` per unit times the units left.
    ``done`` and ``total`` count this process's work only (a resumed run counts from where it
    resumed); None before the first unit (no rate yet)."""
    if done <= 0:
        return None
    return elapsed / done * max(total - done, 0)


def format_duration(seconds: float | None) -> str:
    """``m:ss`` under an hour, ``h:mm:ss`` from there; ``?`` when unknown."""
    if seconds is None:
        return "?"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """``total`` units of work, counted from ``start`` (units a resumed run had already done).

    ``update(done, text)`` reports the units done so far (default: one more) and what to say about
    the latest one. Where a line is printed:

    * plain output (not a terminal): when ``done`` is a multiple of ``every`` (0: never by count),
      when ``interval_s`` seconds have passed since the last line (0: never by time), and at the
      end if any line was printed before or ``every`` is set;
    * a terminal: the same lines without the count suffix, kept above the live line, only where
      there is ``text`` (the live line already shows the count).

    ``enabled=False`` (a rank that does not log, ``logging.progress: false``) makes every call a
    no-op. ``clock`` and ``tty`` are for tests.
    """

    BAR_WIDTH = 20
    REDRAW_S = 0.1
    """Least time between two redraws of the live line (the end of the work always redraws)."""

    def __init__(self, label: str, total: int, *, start: int = 0, every: int = 0,
                 interval_s: float = 30.0, enabled: bool = True, stream: TextIO | None = None,
                 tty: bool | None = None, clock: Callable[[], float] = time.monotonic):
        self.label, self.total, self.start = label, int(total), int(start)
        self.every, self.interval_s, self.enabled = every, interval_s, enabled
        self.stream = stream if stream is not None else sys.stdout
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty and isatty())
        self.tty = tty
        self.clock = clock
        self.t0 = self.last_line = clock()
        self.last_draw: float | None = None
        self.done = self.start
        self.text = ""
        self.lines = 0
        """Lines printed so far (kept lines on a terminal)."""

    # -- what is shown
    def elapsed(self) -> float:
        return self.clock() - self.t0

    def eta(self) -> float | None:
        return eta_seconds(self.elapsed(), self.done - self.start, self.total - self.start)

    def suffix(self) -> str:
        """``done/total, elapsed 1:02, ETA 3:04`` (ETA left out at the end)."""
        head = f"{self.done}/{self.total}, elapsed {format_duration(self.elapsed())}"
        return head if self.done >= self.total else f"{head}, ETA {format_duration(self.eta())}"

    def plain_line(self) -> str:
        """The line printed where the output is not a terminal."""
        what = self.text or self.label
        return f"{what} | {self.suffix()}"

    def live_line(self, width: int) -> str:
        """The terminal's live line, cut to ``width`` columns."""
        frac = min(max(self.done / self.total, 0.0), 1.0) if self.total > 0 else 1.0
        filled = int(frac * self.BAR_WIDTH)
        bar = "#" * filled + "-" * (self.BAR_WIDTH - filled)
        line = f"{self.label} [{bar}] {100 * frac:3.0f}% {self.suffix()}"
        if self.text:
            line += f" | {self.text}"
        return line[:max(width - 1, 1)]

    # -- reporting
    def update(self, done: int | None = None, text: str = "") -> None:
        if not self.enabled:
            return
        self.done = self.done + 1 if done is None else int(done)
        self.text = text
        now = self.clock()
        at_end = self.done >= self.total
        by_count = bool(self.every) and (self.done % self.every == 0 or at_end)
        by_time = bool(self.interval_s) and now - self.last_line >= self.interval_s
        if self.tty:
            if text and by_count:
                self._write("\r\x1b[K" + text + "\n")
                self.lines += 1
                self.last_draw = None  # the live line was overwritten
            if at_end or self.last_draw is None or now - self.last_draw >= self.REDRAW_S:
                width = shutil.get_terminal_size((100, 20)).columns
                self._write("\r\x1b[K" + self.live_line(width))
                self.last_draw = now
            return
        if by_count or by_time or (at_end and self.lines):
            self._write(self.plain_line() + "\n")
            self.lines += 1
            self.last_line = now

    def callback(self) -> Callable[[int], None] | None:
        """``update`` for code that reports a count as it goes (an engine's finished requests);
        None when disabled, so that such code has nothing to call."""
        return self.update if self.enabled else None

    def write(self, line: str) -> None:
        """Print ``line`` (a message of the caller's) without breaking the live line."""
        if not self.enabled:
            return
        if self.tty and self.last_draw is not None:
            self._write("\r\x1b[K" + line + "\n")
            self.last_draw = None
        else:
            self._write(line + "\n")

    def close(self) -> None:
        """Clear the live line (a terminal); the kept lines stay."""
        if self.enabled and self.tty and self.last_draw is not None:
            self._write("\r\x1b[K")
            self.last_draw = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write(self, s: str) -> None:
        self.stream.write(s)
        self.stream.flush()
