"""SIGINT and SIGTERM end a command alike: an `Interrupted` exception where the command is, so
it can say what it kept, and one line from `main`."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A command stopped by a signal.

    Attributes:
      signum: The signal.
      note: Where the command stopped and what it kept, continuing "interrupted by SIGTERM"
        (e.g. "at step 3/10; nothing was written to out"); empty: nothing to say.
    """

    def __init__(self, signum: int, note: str = ""):
        super().__init__(signum, note)
        self.signum = signum
        self.note = note

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process the signal ended."""
        return 128 + self.signum


def _raise_interrupted(signum: int, frame) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGINT and SIGTERM raise `Interrupted` inside the block (main thread only; the previous
    handlers come back after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _raise_interrupted) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Holds SIGINT and SIGTERM back while the block runs (e.g. the renames that put a
    checkpoint in place); one that arrived is delivered as the block ends."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
