"""The same model over 2 and 4 local processes under `jax.distributed` (tensor parallelism and the
pipeline across processes, each process reading only its devices' checkpoint blocks) equals one
process; processes that fail to join, die or lack the checkpoint end the run with an error; a
serving step sent from process 0's engine thread reaches the others."""

import functools
import io
import json
import os
import pathlib
import signal
import socket
import threading
import time

import numpy as np
import pytest
from safetensors import safe_open

import boundary_jax as bj
from models.build import load_model
from models.cli import launch as launch_module
from models.cli.interrupts import Interrupted, signals_interrupt
from models.cli.launch import free_port_pair, launch
from models.cli.main import main
from models.distributed import JoinError, ProcessGroup
from models.serving.lockstep import Kind
from models.serving.runtime import ShardedCausalLM
from tests.multiprocess_worker import (
    DRAIN,
    GOLDEN,
    INTERRUPTION,
    NEW_TOKENS,
    REFUSAL,
)

ROOT = pathlib.Path(__file__).parents[3]
WORKER = "tests.multiprocess_worker"

# Launches on one machine interfere when they overlap (two at once failed with a gloo size
# mismatch, each passing alone), so one xdist worker runs them all, one after another.
pytestmark = pytest.mark.xdist_group("multiprocess")


@functools.cache
def one_process() -> tuple[np.ndarray, np.ndarray]:
    """Logits and greedy tokens of the golden checkpoint in this one process (attention TP 2)."""
    topology = bj.Topology(attn_tp=2)
    mesh = bj.make_mesh(topology)
    runner = ShardedCausalLM(load_model(GOLDEN, mesh), mesh)
    prompts = json.loads((GOLDEN / "prompts.json").read_text())
    return runner.forward(prompts), runner.generate(prompts, NEW_TOKENS)


def checkpoint_bytes() -> int:
    total = 0
    for file in GOLDEN.glob("*.safetensors"):
        with safe_open(str(file), framework="numpy") as tensors:
            total += sum(tensors.get_tensor(name).nbytes for name in tensors.keys())  # noqa: SIM118
    return total


def _launch(monkeypatch, processes: int, layout: str, out: pathlib.Path, **options) -> int:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    return launch(processes, [layout, str(out)], module=WORKER, **options)


# Both run under -m slow. Two processes: each stage's TP group and each handoff cross them, and
# each process reads its devices' checkpoint blocks. Four: each stage on two processes, the same
# crossings at twice the processes' start-up on a 2-core machine.
@pytest.mark.parametrize(
    "processes,layout,share",
    [
        pytest.param(2, "twisted", 0.55, id="2-processes-tp-and-pp-across", marks=pytest.mark.slow),
        pytest.param(
            4, "stages", 0.4, id="4-processes-tp-within-pp-across", marks=pytest.mark.slow
        ),
    ],
)
def test_processes_give_the_one_process_logits_and_tokens(
    monkeypatch, capfd, tmp_path, processes, layout, share
):
    """A two-stage pipeline over 2 processes (each stage's TP group and each handoff crossing
    them) and over 4 (each stage on two processes) gives one process's logits (within 1e-5 of
    the largest) and greedy tokens, which are transformers'; only process 0 prints, each
    process reads only its devices' blocks of the checkpoint, a checkpoint missing on one
    process raised on every process, and the pipeline waited for each program (gloo)."""
    out = tmp_path / "result.npz"
    assert _launch(monkeypatch, processes, layout, out) == 0
    printed = [line for line in capfd.readouterr().out.splitlines() if line.strip()]
    result = np.load(out)
    logits, tokens = one_process()
    reference = np.load(GOLDEN / "reference.npz")
    assert np.max(np.abs(result["logits"] - logits)) <= 1e-5 * np.max(np.abs(logits))
    np.testing.assert_array_equal(result["tokens"], tokens)
    np.testing.assert_array_equal(result["tokens"], reference["generated"])
    assert printed == [json.dumps(tokens.tolist())]
    # Before loading, process 1 was given a checkpoint that is not there: every process raised.
    assert np.all(result["raised"] == 1)
    assert result["waited"]
    read = result["read_bytes"]
    assert len(read) == processes and np.all(read > 0)
    assert np.all(read < share * checkpoint_bytes()), read


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["attn_tp=2", "pp=2"])
def test_plan_over_processes_reports_what_one_process_does(monkeypatch, capfd, mesh):
    """`plan --json` under `launch --processes 2` equals one process's: every device's parameter
    bytes (each process holds only its own shards) and each stage's collectives (a stage
    compiles only where its devices are; process 0 printed an empty table for stage 1)."""
    args = ["plan", "--preset", "tiny-qwen3", "--mesh", mesh, "--json"]
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    assert launch(2, args) == 0
    over_processes = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    assert main(args) == 0
    assert over_processes == json.loads(capfd.readouterr().out.strip().splitlines()[-1])


@pytest.mark.slow
def test_training_over_processes_writes_the_one_process_checkpoint(monkeypatch, tmp_path):
    """`launch --processes 2 -- train --out` on DP 2 x TP 2 across the processes: every process
    reads the parameters back, process 0 writes them, and the checkpoint equals the one a
    single process trains (it failed reading arrays of the other process's devices)."""
    text = tmp_path / "train.txt"
    text.write_text(" ".join(f"word{i % 37} and token {i % 11}." for i in range(400)))
    args = ["train", "--checkpoint", str(ROOT / "tests" / "golden" / "text"), "--mesh"]
    args += ["attn_dp=2,attn_tp=2", "--steps", "3", "--batch-tokens", "64", "--seq-len", "16"]
    args += ["--text", str(text)]
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    assert launch(2, [*args, "--out", str(tmp_path / "two")]) == 0
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    with (
        safe_open(str(tmp_path / "two" / "model.safetensors"), framework="numpy") as two,
        safe_open(str(tmp_path / "one" / "model.safetensors"), framework="numpy") as one,
    ):
        assert set(two.keys()) == set(one.keys())
        for name in one.keys():  # noqa: SIM118
            np.testing.assert_allclose(two.get_tensor(name), one.get_tensor(name), atol=1e-6)


@pytest.mark.parametrize(
    "command,message",
    [
        (
            ["generate", "--preset", "tiny-qwen3", "--prompt-ids", "ids.json"],
            "the following arguments are required: --max-new-tokens",
        ),
        (
            ["forward", "--preset", "tiny-qwen3", "--mesh", "pp=2,attn_tp=2", "--out", "x"],
            "one of the arguments --input-ids --prompt --prompt-file is required",
        ),
        (["demo"], "the 8 devices of the demo do not split over 3 processes"),
        (["launch", "--processes", "2", "--", "demo"], "not another launch"),
    ],
    ids=["missing option", "missing input", "uneven devices", "nested launch"],
)
def test_a_bad_launched_command_ends_in_one_line_before_any_process_starts(
    monkeypatch, capsys, command, message
):
    """`launch` checks the command it would run (its options, and that its devices split
    evenly over the processes) once, in the launcher: one line, exit 2, no process started."""
    started = []
    monkeypatch.setattr("models.cli.main.launch", lambda *args, **kwargs: started.append(args))
    assert main(["launch", "--processes", "3", "--", *command]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not started


def test_a_process_that_dies_before_joining_ends_the_launch(monkeypatch, capfd, tmp_path):
    """The launcher stops the other processes and returns the failing one's exit code."""
    assert _launch(monkeypatch, 2, "die", tmp_path / "none.npz", join_timeout=60) == 3
    assert "process 1 exited with code 3; stopping processes [0]" in capfd.readouterr().err


@pytest.mark.parametrize(
    ("layout", "code", "line"), [("refuse", 2, REFUSAL), ("interrupted", 130, INTERRUPTION)]
)
def test_a_command_every_process_stops_alike_ends_in_its_one_line(
    monkeypatch, capfd, tmp_path, layout, code, line
):
    """Every process prints the same line saying why it stops (refused, exit code 2;
    interrupted, 130; one of them only once the launcher stops it): the run ends with that exit
    code and that line once, nothing from the launcher, and the processes' other lines."""
    assert _launch(monkeypatch, 2, layout, tmp_path / "out") == code
    lines = capfd.readouterr().err.splitlines()
    assert lines.count(line) == 1, lines
    assert not [line for line in lines if line.startswith("boundary-jax launch:")], lines
    assert any(line.startswith("a note from process") for line in lines), lines


def test_a_message_sent_from_another_call_stack_reaches_the_other_process(monkeypatch, tmp_path):
    """Serving over processes: process 0's engine thread sends a step through `Channel` and
    process 1 receives it from another call stack, as `serve` under `launch` does (its first
    request hung there when the programs' locations held each process's whole stack)."""
    out = tmp_path / "received.npz"
    assert _launch(monkeypatch, 2, "channel", out) == 0
    received = np.load(out)
    assert int(received["kind"]) == int(Kind.STEP)
    np.testing.assert_array_equal(received["payload"], [7, 8, 9])


def test_a_signal_to_the_launcher_reaches_every_process_and_is_waited_for(monkeypatch, tmp_path):
    """SIGTERM to the launcher goes to each process, and the launcher waits while they end as
    they would alone (here for longer than STOP_GRACE, as a server finishing its requests):
    exit code 0, no process killed (`serve` under launch cut off a running stream)."""
    monkeypatch.setattr(launch_module, "STOP_GRACE", DRAIN / 3)
    out = tmp_path / "drained"

    def signal_when_ready():
        deadline = time.monotonic() + 60
        while not all(pathlib.Path(f"{out}.ready.{i}").exists() for i in range(2)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    signaller = threading.Thread(target=signal_when_ready)
    signaller.start()
    try:
        with signals_interrupt():
            code = _launch(monkeypatch, 2, "drain", out)
    except Interrupted:
        pytest.fail("the launcher stopped the processes instead of waiting for them")
    finally:
        signaller.join()
    assert code == 0
    assert all(pathlib.Path(f"{out}.{i}").exists() for i in range(2))


def test_a_process_that_never_joins_is_an_error_after_the_timeout():
    """The roll call fails after the join timeout on either side, naming who is missing, before
    JAX's coordination service is started (which would abort the process)."""
    coordinator = f"127.0.0.1:{free_port_pair()}"
    with pytest.raises(JoinError, match=r"processes \[1, 2\] of 3 did not join"):
        ProcessGroup(coordinator, 3, 0, join_timeout=0.5).join()
    with pytest.raises(JoinError, match="process 2: process 0 did not answer"):
        ProcessGroup(coordinator, 3, 2, join_timeout=0.5).join()


def test_the_process_group_is_read_from_the_environment():
    """The four variables describe a group; a partial or malformed set is refused."""
    environ = {
        "BOUNDARY_JAX_COORDINATOR": "10.0.0.1:8476",
        "BOUNDARY_JAX_NUM_PROCESSES": "4",
        "BOUNDARY_JAX_PROCESS_ID": "3",
    }
    group = ProcessGroup.from_environment(environ)
    assert group == ProcessGroup("10.0.0.1:8476", 4, 3)
    assert ProcessGroup.from_environment(group.environment()) == group
    assert ProcessGroup.from_environment({}) is None
    with pytest.raises(ValueError, match="PROCESS_ID'] must be set"):
        ProcessGroup.from_environment(
            {"BOUNDARY_JAX_COORDINATOR": "h:1"} | {"BOUNDARY_JAX_NUM_PROCESSES": "2"}
        )
    with pytest.raises(ValueError, match=r"must be in \[0, BOUNDARY_JAX_NUM_PROCESSES\)"):
        ProcessGroup.from_environment({**environ, "BOUNDARY_JAX_PROCESS_ID": "4"})
    with pytest.raises(ValueError, match="host:port"):
        ProcessGroup.from_environment({**environ, "BOUNDARY_JAX_COORDINATOR": "10.0.0.1"})


def test_process_zero_output_comes_through_without_the_connection_messages(capsysbinary):
    """gloo's messages are dropped, whole or printed into each other's line by two threads (each
    one's own line end then comes alone, dropped as well); process 0's lines, empty ones
    included, come through; the other processes' do not."""
    message = b"[Gloo] Rank %d is connected to 1 peer ranks. Expected number of connected peer"
    message += b" ranks is : 1"
    output = [
        message % 0 + b"\n",
        message % 0 + message % 1 + b"\n",
        b"\n",
        b"[[1, 2]]\n",
        b"\n",
        message % 1 + message % 0 + message % 1 + b"\n",
        b"\n",
        b"\n",
        b"done\n",
    ]
    for shown in (True, False):
        launch_module.forward_output(io.BytesIO(b"".join(output)), shown)
        assert capsysbinary.readouterr().out == (b"[[1, 2]]\n\ndone\n" if shown else b"")


def test_free_port_pair_gives_two_free_ports():
    port = free_port_pair()
    for candidate in (port, port + 1):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", candidate))


class _Group:
    """A process group of two whose join fails (the command line's view of one)."""

    num_processes = 2

    def join(self):
        raise JoinError("processes [1] of 2 did not join 127.0.0.1:1 within 1 s; raise it\nmore")


def test_the_command_line_reports_a_group_it_cannot_join_in_one_line(monkeypatch, capsys):
    """Malformed group variables, a mesh whose devices do not split over the processes and a
    failed join each end the command with one error line and exit code 2."""
    args = ["plan", "--preset", "tiny-qwen3", "--mesh", "pp=2"]
    monkeypatch.setenv("BOUNDARY_JAX_COORDINATOR", "nohost")
    monkeypatch.setenv("BOUNDARY_JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("BOUNDARY_JAX_PROCESS_ID", "0")
    assert main(args) == 2
    assert capsys.readouterr().err == (
        "boundary-jax: error: bad process group variables: BOUNDARY_JAX_COORDINATOR is host:port "
        "(e.g. 127.0.0.1:8476); got 'nohost'\n"
    )
    monkeypatch.setattr(ProcessGroup, "from_environment", staticmethod(_Group))
    assert main(["plan", "--preset", "tiny-qwen3", "--mesh", "attn_tp=3"]) == 2
    assert capsys.readouterr().err == (
        "boundary-jax: error: the 3 devices of --mesh attn_tp=3 do not split over 2 processes; "
        "give each process the same number\n"
    )
    assert main(args) == 2
    assert capsys.readouterr().err == (
        "boundary-jax: error: processes [1] of 2 did not join 127.0.0.1:1 within 1 s; raise it\n"
    )
