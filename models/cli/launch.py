"""`boundary-jax launch`: one command run by several local processes under `jax.distributed`.

Each process gets the environment of `models.distributed.ProcessGroup` (a coordinator on
127.0.0.1, the process count and its index) and runs `python -m models.cli <command>`; its
devices are its share of the mesh (CPU devices: the mesh's size over the processes). The
launcher waits for them all; when one fails, it stops the others and returns that process's
exit code, so a process that dies or never joins ends the run instead of hanging it. SIGINT or
SIGTERM to the launcher goes to every process, and the launcher waits for them to end as the
command ends in one process (`serve` lets running requests finish); a second signal stops
them at once.

Only process 0's standard output comes through (results are printed there), without the lines
the CPU collectives library (gloo) prints as its devices connect; every process's standard
error does, but a one-line message of the command line (`boundary-jax: error: ...`,
`boundary-jax: interrupted ...`) comes once however many processes print it: every process
refuses a bad command alike. A process that said in its one line why it stopped (refused its
command, exit code 2; interrupted, 128 + the signal) ends the run with that line, as the
command does in one process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

from ..distributed import DEFAULT_JOIN_TIMEOUT, ProcessGroup
from .interrupts import handed_on, interruption
from .lines import PREFIX

HOST = "127.0.0.1"
STOP_GRACE = 5.0
"""Seconds a stopped process gets to exit before it is killed."""
GLOO_MARKS = (b"[Gloo] ", b"connected peer ranks")
"""Pieces of the CPU collectives library's connection messages (which two devices' threads may
print into each other's line)."""


def free_port_pair(host: str = HOST) -> int:
    """A port p such that p and p + 1 (the coordinator and its roll call) are free now."""
    for _ in range(100):
        with socket.socket() as first:
            first.bind((host, 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind((host, port + 1))
                except OSError:
                    continue
        return port
    raise OSError(f"found no two consecutive free ports on {host}")


def launch(
    processes: int,
    command: Sequence[str],
    *,
    port: int | None = None,
    join_timeout: float = DEFAULT_JOIN_TIMEOUT,
    python: str = sys.executable,
    module: str = "models.cli",
) -> int:
    """Runs `boundary-jax <command>` in `processes` local processes of one group.

    Args:
      processes: How many processes.
      command: The command line after `boundary-jax` (e.g. `["forward", "--preset", ...]`).
      port: The coordinator's port (the roll call takes the next one); None picks free ones.
      join_timeout: Seconds the processes wait for each other to join.
      python: The interpreter the processes run.
      module: What they run (`python -m module *command`): the command line by default; any
        program that joins its `ProcessGroup.from_environment()`.

    Returns:
      0 when every process succeeded, else the first failing process's exit code.

    Raises:
      ValueError: `processes` is not positive or `command` is empty.
    """
    if processes < 1:
        raise ValueError(f"--processes must be at least 1; got {processes}")
    if not command:
        raise ValueError(
            "launch needs the command every process runs after --, e.g. launch --processes 2 "
            "-- plan --preset tiny-qwen3 --mesh pp=2"
        )
    coordinator = f"{HOST}:{free_port_pair() if port is None else port}"
    children, readers, errors = [], [], _Errors()
    for index in range(processes):
        group = ProcessGroup(coordinator, processes, index, join_timeout)
        child = subprocess.Popen(
            [python, "-m", module, *command],
            env={**os.environ, **group.environment()},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        reader = threading.Thread(
            target=forward_output, args=(child.stdout, index == 0), daemon=True
        )
        reader.start()
        children.append(child)
        readers.append(reader)
        errors.read(index, child.stderr)
    try:
        try:
            return _wait(children, errors)
        except KeyboardInterrupt as error:
            signum = interruption(error).signum
            for child in children:
                if child.poll() is None:
                    child.send_signal(signum)
            handed_on()
            return _wait(children, errors)
    finally:
        _stop(children, errors)
        for reader in readers:
            reader.join()
        errors.join()


def forward_output(stream: IO[bytes], shown: bool) -> None:
    """Copies a child's standard output to ours (`shown`) or drops it, line by line, without
    gloo's connection messages. Where its threads printed several into one line, each one's
    own line end comes after it as an empty line, dropped too."""
    line_ends_owed = 0
    for line in stream:
        if any(mark in line for mark in GLOO_MARKS):
            line_ends_owed += max(line.count(GLOO_MARKS[0]) - 1, 0)
        elif line_ends_owed and not line.strip():
            line_ends_owed -= 1
        elif shown:
            sys.stdout.buffer.write(line)
            sys.stdout.buffer.flush()
    stream.close()


class _Errors:
    """The children's standard error, copied to ours line by line, each one-line message of the
    command line once (the first process to print it shows it)."""

    def __init__(self):
        self._shown: set[bytes] = set()
        self._lock = threading.Lock()
        self._readers: list[threading.Thread] = []
        self._said_why: set[int] = set()

    def read(self, index: int, stream: IO[bytes]) -> None:
        """Starts copying child `index`'s standard error."""
        reader = threading.Thread(target=self._copy, args=(index, stream), daemon=True)
        reader.start()
        self._readers.append(reader)

    def said_why(self, index: int) -> bool:
        """Whether child `index` printed a one-line message saying why it stopped (read to its
        end: the child has exited)."""
        self._readers[index].join(STOP_GRACE)
        return index in self._said_why

    def join(self) -> None:
        """Waits until every child's standard error is copied to its end."""
        for reader in self._readers:
            reader.join()

    def _copy(self, index: int, stream: IO[bytes]) -> None:
        for line in stream:
            if line.startswith(PREFIX.encode()):
                with self._lock:
                    self._said_why.add(index)
                    if line in self._shown:
                        continue
                    self._shown.add(line)
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()
        stream.close()


def _wait(children: list[subprocess.Popen], errors: _Errors) -> int:
    """Waits for every child; at the first failure, reports it (unless the child said why in
    its own one line) and returns its code."""
    while True:
        # A process a signal ended reads as a shell reports it, 128 + the signal.
        codes = [child.poll() for child in children]
        codes = [128 - code if code is not None and code < 0 else code for code in codes]
        failed = [(index, code) for index, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            index, code = failed[0]
            if errors.said_why(index):
                return code
            running = [i for i, c in enumerate(codes) if c is None]
            print(
                f"boundary-jax launch: process {index} exited with code {code}"
                + (f"; stopping processes {running}" if running else ""),
                file=sys.stderr,
            )
            return code
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.05)


def _stop(children: list[subprocess.Popen], errors: _Errors) -> None:
    """Stops the children still running: terminate, then kill after `STOP_GRACE`; says which
    of them exited with an error of their own that they did not say in their one line (a
    command that stops cleanly on SIGTERM, as `serve`, exits 0; one ended by the signal itself
    is not reported)."""
    running = [(index, child) for index, child in enumerate(children) if child.poll() is None]
    for _, child in running:
        child.terminate()
    deadline = time.monotonic() + STOP_GRACE
    for index, child in running:
        try:
            child.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        if child.returncode > 0 and not errors.said_why(index):
            print(
                f"boundary-jax launch: stopped process {index} exited with code {child.returncode}",
                file=sys.stderr,
            )
