"""Running one model over several processes with JAX's multi-controller runtime
(`jax.distributed`): joining the processes, and agreeing before work that one process may fail.

Every process runs the same program on the same inputs; each holds its own devices (one host's
GPUs, or CPU devices) and a mesh spans all of them. A process group is described by four
environment variables, which `boundary-jax launch` sets for the processes it starts on this host
and which a multi-host launch sets on each host (docs/distributed.md):

  BOUNDARY_JAX_COORDINATOR    host:port of process 0's coordination service
  BOUNDARY_JAX_NUM_PROCESSES  how many processes
  BOUNDARY_JAX_PROCESS_ID     this process's index, 0 .. N - 1
  BOUNDARY_JAX_JOIN_TIMEOUT   seconds to wait for every process to join (default 60)

Before `jax.distributed.initialize`, the processes answer a roll call on the coordinator's next
port (process 0 listens there): a process that does not join in time makes every other one
fail with an error naming it, where the coordination service itself would abort the process.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

COORDINATOR = "BOUNDARY_JAX_COORDINATOR"
NUM_PROCESSES = "BOUNDARY_JAX_NUM_PROCESSES"
PROCESS_ID = "BOUNDARY_JAX_PROCESS_ID"
JOIN_TIMEOUT = "BOUNDARY_JAX_JOIN_TIMEOUT"
DEFAULT_JOIN_TIMEOUT = 60.0
_READY = b"ready"


class JoinError(RuntimeError):
    """The processes did not all join the group in time."""


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """The processes one model runs over.

    Attributes:
      coordinator: `host:port` of process 0's coordination service; the roll call uses the
        next port.
      num_processes: How many processes.
      process_id: This process's index.
      join_timeout: Seconds every process waits for the others to join.
    """

    coordinator: str
    num_processes: int
    process_id: int
    join_timeout: float = DEFAULT_JOIN_TIMEOUT

    def __post_init__(self):
        host, _, port = self.coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(
                f"{COORDINATOR} is host:port (e.g. 127.0.0.1:8476); got {self.coordinator!r}"
            )
        if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"{PROCESS_ID} must be in [0, {NUM_PROCESSES}); got process {self.process_id} of "
                f"{self.num_processes}"
            )
        if self.join_timeout <= 0:
            raise ValueError(f"{JOIN_TIMEOUT} must be positive; got {self.join_timeout}")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> ProcessGroup | None:
        """The group the environment describes, or None when `BOUNDARY_JAX_COORDINATOR` is
        unset (a single process).

        Raises:
          ValueError: The variables are incomplete or malformed.
        """
        if COORDINATOR not in environ:
            return None
        missing = [name for name in (NUM_PROCESSES, PROCESS_ID) if name not in environ]
        if missing:
            raise ValueError(f"{COORDINATOR} is set, so {missing} must be set too")
        try:
            return cls(
                environ[COORDINATOR],
                int(environ[NUM_PROCESSES]),
                int(environ[PROCESS_ID]),
                float(environ.get(JOIN_TIMEOUT, DEFAULT_JOIN_TIMEOUT)),
            )
        except ValueError as error:
            raise ValueError(f"bad process group variables: {error}") from None

    def environment(self) -> dict[str, str]:
        """The environment variables describing this process of the group."""
        return {
            COORDINATOR: self.coordinator,
            NUM_PROCESSES: str(self.num_processes),
            PROCESS_ID: str(self.process_id),
            JOIN_TIMEOUT: str(self.join_timeout),
        }

    @property
    def _roll_call(self) -> tuple[str, int]:
        host, _, port = self.coordinator.rpartition(":")
        return host, int(port) + 1

    def join(self) -> None:
        """Joins the group: the roll call, then `jax.distributed.initialize` (call it before
        any other JAX work).

        Cluster auto-detection is off, so a scheduler's environment variables cannot override
        the group's. In a group of several processes the programs' locations keep only their
        innermost frame: jaxlib pairs the processes' collectives by a launch id drawn from the
        executable's fingerprint, which holds each op's location, so the same collective traced
        from two call stacks (process 0's serving engine sends what the others' `follow`
        receives) never met its peers and both processes waited forever.

        Raises:
          JoinError: A process did not join within `join_timeout`.
        """
        deadline = time.monotonic() + self.join_timeout
        if self.num_processes > 1:
            if self.process_id == 0:
                self._call_roll(deadline)
            else:
                self._answer_roll(deadline)
        if self.num_processes > 1:
            jax.config.update("jax_include_full_tracebacks_in_locations", False)
        jax.distributed.initialize(
            self.coordinator,
            self.num_processes,
            self.process_id,
            cluster_detection_method="deactivate",
            initialization_timeout=max(1, math.ceil(deadline - time.monotonic())),
        )

    def _call_roll(self, deadline: float) -> None:
        """Process 0: waits until every other process has reported, then releases them."""
        joined: dict[int, socket.socket] = {}
        try:
            server = socket.create_server(self._roll_call)
        except OSError as error:
            host, port = self._roll_call
            raise JoinError(
                f"process 0 cannot listen on {host}:{port} for the roll call ({error}); give "
                f"{COORDINATOR} a port whose next port is free too"
            ) from None
        with server:
            try:
                while len(joined) < self.num_processes - 1:
                    server.settimeout(max(deadline - time.monotonic(), 0.001))
                    try:
                        connection, _ = server.accept()
                    except TimeoutError:
                        missing = sorted(set(range(1, self.num_processes)) - set(joined))
                        raise JoinError(
                            f"processes {missing} of {self.num_processes} did not join "
                            f"{self.coordinator} within {self.join_timeout:g} s; start each with "
                            f"{NUM_PROCESSES}={self.num_processes} and its own {PROCESS_ID} "
                            "(boundary-jax launch does), or raise "
                            f"{JOIN_TIMEOUT}"
                        ) from None
                    connection.settimeout(max(deadline - time.monotonic(), 0.001))
                    sender = _read_id(connection)
                    if sender in joined or not 0 < sender < self.num_processes:
                        connection.close()
                        raise JoinError(
                            f"process id {sender} joined {self.coordinator} twice or is outside "
                            f"[1, {self.num_processes}); give each process its own {PROCESS_ID}"
                        )
                    joined[sender] = connection
                for connection in joined.values():
                    connection.sendall(_READY)
            finally:
                for connection in joined.values():
                    connection.close()

    def _answer_roll(self, deadline: float) -> None:
        """A process other than 0: reports to process 0, then waits for every other one."""
        address = f"{self._roll_call[0]}:{self._roll_call[1]}"
        while True:
            try:
                connection = socket.create_connection(
                    self._roll_call, timeout=max(deadline - time.monotonic(), 0.001)
                )
                break
            except OSError:
                if time.monotonic() >= deadline:
                    raise JoinError(
                        f"process {self.process_id}: process 0 did not answer at {address} "
                        f"within {self.join_timeout:g} s; start process 0 with "
                        f"{COORDINATOR}={self.coordinator}"
                    ) from None
                time.sleep(0.05)
        with connection:
            connection.sendall(str(self.process_id).encode())
            connection.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                ready = connection.recv(len(_READY))
            except TimeoutError:
                ready = b""
            if ready != _READY:
                raise JoinError(
                    f"process {self.process_id}: the other processes of {self.num_processes} did "
                    f"not all join {self.coordinator} within {self.join_timeout:g} s"
                )


def _read_id(connection: socket.socket) -> int:
    """The process id a joining process sent, or -1 for anything else."""
    try:
        return int(connection.recv(16).decode())
    except (TimeoutError, ValueError, UnicodeDecodeError):
        return -1


def agree(problem: str | None) -> None:
    """Raises on every process when any process has a problem (all must call it).

    For work that may fail on one process (a checkpoint missing there): each checks first and
    calls `agree` with what is wrong on it, or None, so that no process runs on into a
    collective that the failing one never joins.

    Raises:
      FileNotFoundError: Some process reported a problem; the message names the processes, and
        this process's own problem where it has one.
    """
    failing = np.asarray([problem is not None], np.int32)
    if jax.process_count() > 1:
        failing = np.asarray(multihost_utils.process_allgather(failing)).reshape(-1)
    where = [int(index) for index in np.flatnonzero(failing)]
    if where:
        own = f"; on this process: {problem}" if problem else ""
        raise FileNotFoundError(f"processes {where} cannot go on{own}")


def require_everywhere(path: Path, what: str) -> None:
    """Every process has the file `path`, or every process raises (see `agree`).

    Raises:
      FileNotFoundError: Some process lacks `path`.
    """
    agree(None if Path(path).is_file() else f"no {what}: {path} is missing")


def is_first_process() -> bool:
    """This is process 0, which prints and writes results (the others compute the same)."""
    return jax.process_index() == 0


def gather_json(value: Any) -> list[Any]:
    """Every process's `value` (anything `json` writes), in process order; all of them must
    call it. For facts only some processes can compute, as a stage's compiled collectives."""
    if jax.process_count() == 1:
        return [value]
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(data.size))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(sizes.size, -1)
    return [json.loads(row[:size].tobytes()) for row, size in zip(rows, sizes, strict=True)]


def fetch(value: jax.Array) -> np.ndarray:
    """The whole of a global array on this host: read back directly where this process holds
    every shard, gathered from the other processes otherwise (all of them must call it)."""
    if value.is_fully_addressable:
        return np.asarray(jax.device_get(value))
    return np.asarray(multihost_utils.process_allgather(value, tiled=True))
