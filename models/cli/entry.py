"""The `boundary-jax` console script: it takes SIGINT and SIGTERM before importing the command
line (JAX, the models), so an interrupt during those imports also ends in one line."""

from __future__ import annotations

from .interrupts import interruption, report, signals_held, signals_interrupt


def main() -> int:
    """Runs `models.cli.main.main` on the process's arguments; an interrupt at any point,
    imports included, ends with one line and 128 + the signal's number."""
    try:
        with signals_interrupt():
            with signals_held():
                from .main import main as command

            return command()
    except BaseException as error:
        interrupted = interruption(error)
        if interrupted is None:
            raise
        return report(interrupted)
