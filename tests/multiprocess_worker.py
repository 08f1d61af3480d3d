"""One process of the multi-process tests, started by `models.cli.launch.launch(module=...)`.

    python -m tests.multiprocess_worker LAYOUT OUT

It joins its group (`ProcessGroup.from_environment`), checks that a checkpoint missing on
process 1 stops every process (each records that it raised), loads the golden Llama checkpoint
as a two-stage pipeline over every process's CPU devices (each process reading only its devices'
blocks), runs a forward and a greedy generation, and process 0 writes the logits, the tokens,
every process's checkpoint bytes read and whether each raised to OUT (.npz) and prints the tokens
(the others print nothing). LAYOUT:

  twisted  2 processes x 2 devices, pp=2 x attn_tp=2: each stage's TP group spans both
           processes and each TP rank's handoff crosses from one process to the other;
  stages   4 processes x 2 devices, pp=2 x attn_tp=4: each stage's TP group spans two
           processes, the handoff crosses to the other two;
  die      2 processes: process 1 exits with code 3 before joining (nothing else runs);
  refuse   2 processes: each prints a note and REFUSAL to its standard error and exits 2
           before joining, as every process of a command refused on its input does;
  interrupted
           2 processes, no group: each prints a note and INTERRUPTION and exits 130, as every
           process of an interrupted command does; process 1 first writes OUT.ready.1 and
           waits for SIGTERM (the launcher stopping it), process 0 for that file;
  channel  2 processes: process 0 sends a step through the serving `Channel` from a thread,
           as the server's engine does, and process 1 receives it in `follow`'s place (another
           call stack); process 1 writes what it received to OUT. A process still waiting
           after CHANNEL_TIMEOUT seconds exits with code 1;
  drain    2 processes, no group: each writes OUT.ready.<process>, waits for SIGTERM, then
           takes DRAIN seconds to end (as a server finishing its requests), writes
           OUT.<process> and exits 0.

JAX and the models are imported after that, and the module sits in the top `tests` package
(`tests.models` imports them), so a process that dies, refuses or drains costs no import.
"""

import json
import os
import pathlib
import sys

GOLDEN = pathlib.Path(__file__).parent / "golden" / "llama"
LOCAL_DEVICES = 2
NEW_TOKENS = 6
CHANNEL_TIMEOUT = 60
DRAIN = 1.5
REFUSAL = "boundary-jax: error: every process refuses this alike"
INTERRUPTION = "boundary-jax: interrupted by SIGINT"


def main(layout: str, out: str) -> int:
    if layout == "die" and os.environ["BOUNDARY_JAX_PROCESS_ID"] == "1":
        return 3
    if layout == "refuse":
        print(f"a note from process {os.environ['BOUNDARY_JAX_PROCESS_ID']}", file=sys.stderr)
        print(REFUSAL, file=sys.stderr)
        return 2
    if layout == "interrupted":
        return interrupted(out, os.environ["BOUNDARY_JAX_PROCESS_ID"])
    if layout == "drain":
        return drain(out, os.environ["BOUNDARY_JAX_PROCESS_ID"])
    import jax

    from models.distributed import ProcessGroup

    group = ProcessGroup.from_environment()
    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    group.join()
    if layout == "channel":
        return exchange(out, group.process_id)
    return run(layout, out, group.process_id)


def interrupted(out: str, process: str) -> int:
    import signal
    import threading
    import time

    ready = pathlib.Path(f"{out}.ready.1")
    if process == "1":
        stopped = threading.Event()
        signal.signal(signal.SIGTERM, lambda signum, frame: stopped.set())
        ready.touch()
        stopped.wait(CHANNEL_TIMEOUT)
    else:
        deadline = time.monotonic() + CHANNEL_TIMEOUT
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    print(f"a note from process {process}", file=sys.stderr)
    print(INTERRUPTION, file=sys.stderr)
    return 130


def drain(out: str, process: str) -> int:
    import signal
    import threading
    import time

    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stopped.set())
    pathlib.Path(f"{out}.ready.{process}").touch()
    stopped.wait()
    time.sleep(DRAIN)
    pathlib.Path(f"{out}.{process}").touch()
    return 0


def exchange(out: str, process: int) -> int:
    import faulthandler
    import threading

    import numpy as np

    from models.serving.lockstep import Channel, Kind

    faulthandler.dump_traceback_later(CHANNEL_TIMEOUT, exit=True)
    if process == 0:
        sender = threading.Thread(
            target=Channel().send, args=(Kind.STEP, np.asarray([7, 8, 9], np.int32))
        )
        sender.start()
        sender.join()
    else:
        kind, payload = Channel().receive()
        np.savez(out, kind=int(kind), payload=payload)
    return 0


def run(layout: str, out: str, process: int) -> int:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType, Mesh

    import boundary_jax as bj
    from models.distributed import is_first_process, require_everywhere
    from models.pipeline import PipelineCausalLM, PipelineSplit, load_pipeline, transport
    from models.weights import load

    absent = GOLDEN.with_name("absent") if process == 1 else GOLDEN
    try:
        require_everywhere(absent / "config.json", "checkpoint")
        raised = ""
    except FileNotFoundError as error:
        raised = str(error)
    read = [0]
    original = load._read_tensor

    def counted(checkpoint, name, transpose, reads):
        block = original(checkpoint, name, transpose, reads)
        read[0] += block.nbytes
        return block

    load._read_tensor = counted
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if layout == "twisted":
        (a0, a1), (b0, b1) = devices[:2], devices[2:]
        grid = [[a0, b0], [b1, a1]]
    else:
        grid = [devices[:4], devices[4:]]
    # The axes make_mesh lays out for pp x attn_tp (no expert-parallel split of an axis).
    names = tuple(bj.Topology(pp=2, attn_tp=len(grid[0])).mesh_shape())
    mesh = Mesh(np.asarray(grid).reshape(2, 1, 1, -1), names, axis_types=(AxisType.Explicit,) * 4)
    stages = load_pipeline(GOLDEN, mesh, split=PipelineSplit.of_sizes((1, 2), 3))
    runner = PipelineCausalLM(stages, mesh, microbatches=2)
    prompts = json.loads((GOLDEN / "prompts.json").read_text())
    logits = runner.forward(prompts)
    tokens = runner.generate(prompts, NEW_TOKENS)
    local = np.asarray([read[0], int(raised.startswith("processes [1] cannot go on"))])
    gathered = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, 2)
    if is_first_process():
        np.savez(
            out,
            logits=logits,
            tokens=tokens,
            read_bytes=gathered[:, 0],
            raised=gathered[:, 1],
            waited=transport.over_gloo(mesh),
        )
        print(json.dumps(tokens.tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
