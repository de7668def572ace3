"""Progress of the long work -- tracing a class, capturing a catalog -- for people waiting on it.

Silent in library use: the messages go to the ``cadence_fx.progress`` logger, which has no
handler of its own and does not pass them up. ``show()`` (the CLI and the demo call it) prints
them on stderr: on a terminal as one line rewritten in place, elsewhere (a log file, CI) as one
line per message. ::

    cadence_fx.progress.show()
    compiled.capture_catalog(x, state)
    # class 3/6 ((24, 24, 4), 8): compiling ...
    # class 3/6 ((24, 24, 4), 8): traced 6.2 s, passes 0.4 s, probe 0.1 s
    # capture 3/6 ((24, 24, 4), 8): 0.3 s
"""
from __future__ import annotations

import logging
import sys
from typing import Optional, TextIO

__all__ = ["show", "hide", "note"]

log = logging.getLogger("cadence_fx.progress")
log.propagate = False
log.addHandler(logging.NullHandler())


class _Lines(logging.Handler):
    """One line per message; on a terminal the line of a step still running is rewritten by the
    next message instead of left behind."""

    def __init__(self, stream: Optional[TextIO]):
        super().__init__(logging.INFO)
        self._stream = stream   # None: whatever sys.stderr is when a message comes
        self.open = False       # a running step's line is on the terminal, not yet ended

    def emit(self, record: logging.LogRecord) -> None:
        stream = self._stream or sys.stderr
        msg = "cadence-fx: " + record.getMessage()
        running = getattr(record, "running", False)
        try:
            if hasattr(stream, "isatty") and stream.isatty():
                stream.write(("\r\x1b[K" if self.open else "") + msg + ("" if running else "\n"))
                self.open = running
            else:
                stream.write(msg + "\n")
            stream.flush()
        except (OSError, ValueError):   # the stream was closed: progress is not worth an error
            pass


def show(stream: Optional[TextIO] = None) -> None:
    """Print progress on ``stream`` (stderr by default) from now on."""
    hide()
    log.addHandler(_Lines(stream))
    log.setLevel(logging.INFO)


def hide() -> None:
    for h in [h for h in log.handlers if isinstance(h, _Lines)]:
        log.removeHandler(h)


def note(msg: str, *args, running: bool = False) -> None:
    """One progress message; ``running`` for a step that has started and will be followed by
    the message that ends it."""
    log.info(msg, *args, extra={"running": running})
