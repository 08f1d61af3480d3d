"""An interrupt anywhere in a command ends it with one line and 128 + the signal's number: one
that a C++ callback wraps into another exception, one that Python drops (raised in `__del__`),
and one during the console script's imports."""

import pathlib
import signal
import subprocess
import sys
import time

import pytest
from jaxlib.mlir import ir

from models.cli.interrupts import Interrupted, interruption, report, signals_interrupt

ROOT = pathlib.Path(__file__).parents[3]


def test_a_signal_inside_a_cpp_callback_is_still_an_interruption(capsys):
    """SIGINT while Python runs inside an MLIR walk (as when JAX hashes a program before
    compiling it) reaches the command wrapped in the walk's RuntimeError; it still reports the
    interruption, while an error without a signal does not."""

    def on_operation(operation):
        signal.raise_signal(signal.SIGINT)
        return ir.WalkResult.ADVANCE

    with ir.Context():
        module = ir.Module.parse("module {}")
        with pytest.raises(RuntimeError) as caught, signals_interrupt():
            module.operation.walk(on_operation)
    assert not isinstance(caught.value, Interrupted)
    interrupted = interruption(caught.value)
    assert interrupted is not None and interrupted.signum == signal.SIGINT
    assert report(interrupted) == 128 + signal.SIGINT
    assert capsys.readouterr().err == "boundary-jax: interrupted by SIGINT\n"
    with signals_interrupt():
        assert interruption(RuntimeError("not a signal")) is None


def test_a_signal_python_drops_is_raised_as_the_block_ends(capsys):
    """SIGTERM raised inside `__del__` (where Python prints and drops exceptions, as in JAX's
    garbage-collection callback) lets the block run on, then ends it as an interruption, with
    nothing printed before the one line."""

    class Dropping:
        def __del__(self):
            signal.raise_signal(signal.SIGTERM)

    ran_on = False
    with pytest.raises(Interrupted) as caught, signals_interrupt():
        Dropping()
        ran_on = True
    assert ran_on and caught.value.signum == signal.SIGTERM
    assert report(caught.value) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == "boundary-jax: interrupted by SIGTERM\n"


def test_an_interrupt_during_the_imports_ends_in_one_line():
    """SIGINT half a second after `python -m models.cli` starts (while it imports JAX and the
    models) ends with exit code 130 and the interruption as the last line on stderr, with no
    traceback and nothing Python dropped. (Where JAX's garbage-collection callback or an audit
    hook swallows the signal, the command's own progress lines come first.)"""
    process = subprocess.Popen(
        [sys.executable, "-m", "models.cli", "plan", "--preset", "tiny-qwen3"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGINT, err
    assert err.splitlines()[-1] == "boundary-jax: interrupted by SIGINT", err
    assert "Traceback" not in err and "Exception ignored" not in err, err
