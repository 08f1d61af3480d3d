"""SIGINT and SIGTERM end a command alike: an `Interrupted` exception where the command is, so
it can say what it kept, and one line from `main`.

Only the standard library is imported here: the console entry (`models.cli.entry`) takes the
signals before the command's own imports."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

from .lines import PREFIX

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []
"""The signals raised as `Interrupted` within `signals_interrupt` and not yet reported."""


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


_held: list[bool] = []
"""Non-empty inside `signals_held`."""


def _raise_interrupted(signum: int, frame) -> None:
    _received.append(signum)
    if not _held:
        raise Interrupted(signum)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Inside `signals_interrupt`: a signal received in the block is raised as it ends, not
    where it lands. For imports: an exception raised inside an extension module's C-level
    import can be printed there, traceback and all, before it reaches the command."""
    _held.append(True)
    try:
        yield
    finally:
        _held.pop()
    raise_pending()


def interruption(error: BaseException) -> Interrupted | None:
    """The interruption `error` reports, or None when it is not one.

    A signal can arrive while Python runs inside a C++ callback (JAX hashing a program before
    compiling it, for one); the callback then wraps the `Interrupted` into another exception
    (a `RuntimeError`), which still reports the signal received. A plain `KeyboardInterrupt`
    (outside `signals_interrupt`) is SIGINT.
    """
    if isinstance(error, Interrupted):
        return error
    if _received:
        return Interrupted(_received[-1])
    if isinstance(error, KeyboardInterrupt):
        return Interrupted(signal.SIGINT)
    return None


def raise_pending() -> None:
    """Raises `Interrupted` for a signal received within `signals_interrupt` whose exception
    was dropped (raised inside a callback that swallowed it, as a compile's can): for long
    loops of device work, between their steps."""
    if _received:
        raise Interrupted(_received[-1])


def handed_on() -> None:
    """The signals received so far were passed to processes that end the command themselves
    (`launch`'s): none is left to raise or report."""
    _received.clear()


def report(interrupted: Interrupted) -> int:
    """Says on stderr, in one line, what stopped the command; returns its exit code."""
    _received.clear()
    note = f" {interrupted.note}" if interrupted.note else ""
    print(f"{PREFIX}interrupted by {interrupted.name}{note}", file=sys.stderr)
    return interrupted.exit_code


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGINT and SIGTERM raise `Interrupted` inside the block (main thread only; the previous
    handlers come back after).

    Python drops an exception raised inside a garbage-collection callback or `__del__` (after
    printing it): a signal arriving there is raised again, quietly, as the block ends, if
    nothing reported it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGINT) is not _raise_interrupted:
        _received.clear()
    previous = {signum: signal.signal(signum, _raise_interrupted) for signum in SIGNALS}
    previous_hook = sys.unraisablehook

    def unraisable(dropped) -> None:
        if not isinstance(dropped.exc_value, Interrupted):
            previous_hook(dropped)

    sys.unraisablehook = unraisable
    try:
        yield
        if _received:
            raise Interrupted(_received[-1])
    finally:
        sys.unraisablehook = previous_hook
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
