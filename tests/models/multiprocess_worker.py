"""One process of the multi-process tests, started by `models.cli.launch.launch(module=...)`.

    python -m tests.models.multiprocess_worker LAYOUT OUT

It joins its group (`ProcessGroup.from_environment`), loads the golden Llama checkpoint as a
two-stage pipeline over every process's CPU devices (each process reading only its devices'
blocks), runs a forward and a greedy generation, and process 0 writes the logits, the tokens and
every process's checkpoint bytes read to OUT (.npz) and prints the tokens (the others print
nothing). LAYOUT:

  twisted  2 processes x 2 devices, pp=2 x attn_tp=2: each stage's TP group spans both
           processes and each TP rank's handoff crosses from one process to the other;
  stages   4 processes x 2 devices, pp=2 x attn_tp=4: each stage's TP group spans two
           processes, the handoff crosses to the other two;
  missing  2 processes: process 1's checkpoint directory does not exist (it must fail on every
           process with an error, not hang);
  die      2 processes: process 1 exits with code 3 before joining.
"""

import json
import pathlib
import sys

import jax
import numpy as np

from models.distributed import ProcessGroup, is_first_process, require_everywhere

GOLDEN = pathlib.Path(__file__).parents[1] / "golden" / "llama"
LOCAL_DEVICES = 2
NEW_TOKENS = 6


def main(layout: str, out: str) -> int:
    group = ProcessGroup.from_environment()
    if layout == "die" and group.process_id == 1:
        return 3
    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    group.join()
    checkpoint = GOLDEN
    if layout == "missing":
        checkpoint = GOLDEN if group.process_id == 0 else GOLDEN.with_name("absent")
    try:
        require_everywhere(checkpoint / "config.json", "checkpoint")
    except FileNotFoundError as error:
        print(f"worker {group.process_id}: {error}", file=sys.stderr)
        return 2
    return run(layout, out)


def run(layout: str, out: str) -> int:
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType, Mesh

    import boundary_jax as bj
    from models.checkpoints import load
    from models.pipeline import PipelineCausalLM, PipelineSplit, load_pipeline

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
    names = tuple(axis.value for axis in bj.MeshAxis)
    mesh = Mesh(np.asarray(grid).reshape(2, 1, 1, -1), names, axis_types=(AxisType.Explicit,) * 4)
    stages = load_pipeline(GOLDEN, mesh, split=PipelineSplit.of_sizes((1, 2), 3))
    runner = PipelineCausalLM(stages, mesh, microbatches=2)
    prompts = json.loads((GOLDEN / "prompts.json").read_text())
    logits = runner.forward(prompts)
    tokens = runner.generate(prompts, NEW_TOKENS)
    reads = np.asarray(multihost_utils.process_allgather(np.asarray([read[0]]))).reshape(-1)
    if is_first_process():
        np.savez(out, logits=logits, tokens=tokens, read_bytes=reads)
        print(json.dumps(tokens.tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
