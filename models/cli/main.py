"""The `boundary-jax` command line: demo, forward, generate, serve, train, plan and launch.

Every option and input file is checked before a model is built or loaded. Bad input (an option,
a file, a path, a mesh the machine cannot hold, a model that runs out of memory, processes that
do not all join their group) ends with one line on stderr, `boundary-jax: error: ...`, and exit
code 2; SIGINT and SIGTERM end with one line and exit code 128 + the signal's number.

Under the environment of `models.distributed.ProcessGroup` (as `launch` sets it), the process
joins its group first and holds its share of the mesh's CPU devices.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import math
import os
import re
import sys
from collections.abc import Sequence

import jax
from safetensors import SafetensorError

import boundary_jax as bj

from ..config import PRESETS
from ..decoder.model import Remat
from ..distributed import DEFAULT_JOIN_TIMEOUT, JoinError, ProcessGroup
from ..layers.attention.context_parallel import CpAttentionMode
from . import commands, options
from .demo import run_demo
from .interrupts import interruption, report, signals_interrupt
from .launch import launch
from .lines import ERROR, EXIT_BAD_INPUT
from .lora import add_lora_args, lora_training
from .options import InputError
from .serve import add_serve_args, serve
from .train import train

EXIT_BROKEN_PIPE = 141
"""128 + SIGPIPE: what a shell reports for a writer whose reader left (`plan --json | head`)."""


class UsageError(Exception):
    """An option argparse refused."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors end the command in one line, like every other error,
    naming a misspelled option first (argparse would report a missing required option before
    an unknown one: `--promt hi` as no prompt)."""

    argv: tuple[str, ...] = ()

    def parse_args(self, args=None, namespace=None):
        _Parser.argv = tuple(sys.argv[1:] if args is None else args)
        return super().parse_args(args, namespace)

    def error(self, message: str):
        unknown = self._unknown_options()
        if unknown and "required" in message:
            hints = []
            for option in unknown:
                close = difflib.get_close_matches(option, list(self._option_string_actions), n=1)
                hints.append(f"{option} (did you mean {close[0]}?)" if close else option)
            message = f"unrecognized arguments: {' '.join(hints)}"
        raise UsageError(f"{message} (see {self.prog} --help)")

    def _unknown_options(self) -> list[str]:
        """The `--options` of the command line this parser does not know (after the command's
        name, for a command's parser)."""
        known = set(self._option_string_actions)
        argv = self.argv[: self.argv.index("--")] if "--" in self.argv else self.argv
        return [
            token.split("=", 1)[0]
            for token in argv
            if token.startswith("--") and token.split("=", 1)[0] not in known
        ]


def _demo(args: argparse.Namespace) -> None:
    run_demo(layers=args.layers, console=commands.console())


def _model_args(command: argparse.ArgumentParser) -> None:
    source = command.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a Hugging Face checkpoint directory")
    source.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        metavar="NAME",
        help=f"a built-in configuration with random weights: {', '.join(sorted(PRESETS))}",
    )
    command.add_argument(
        "--mesh",
        type=options.parse_mesh,
        default={},
        help="mesh axis sizes, e.g. attn_dp=2,attn_tp=4 (default: one device)",
    )
    command.add_argument(
        "--devices",
        type=options.positive_int,
        help="simulated CPU devices without an accelerator (default: the mesh's size)",
    )
    command.add_argument(
        "--policy", type=options.policy, default="auto", help="ar|rs|rsv|rs+rsv|auto"
    )
    command.add_argument("--input-scattered", action="store_true")
    command.add_argument(
        "--moe-ep",
        type=options.positive_int,
        default=1,
        help="MoE models: expert-parallel size (default 1)",
    )
    command.add_argument(
        "--moe-dispatch",
        type=bj.MoeDispatch,
        choices=tuple(bj.MoeDispatch),
        metavar="{gather,all-to-all}",
        help="MoE models: where the experts get their tokens (default gather)",
    )
    command.add_argument(
        "--cp-attention",
        type=CpAttentionMode,
        choices=tuple(CpAttentionMode),
        metavar="{all_gather,ring}",
        help="under --mesh attn_cp=N: how a prefill's attention reaches the other CP ranks' "
        "keys, one all-gather of K/V or a ppermute ring (default all_gather)",
    )
    command.add_argument(
        "--dense-ffn-dp",
        action="store_true",
        help="DeepSeek: run the dense layers' FFN fully data-parallel (whole weights on every "
        "rank, on its own rows) instead of split over the TP group",
    )
    command.add_argument(
        "--fusions",
        choices=options.FUSIONS,
        default="none",
        help="the boundaries' kernels: none (the built-in sums and XLA's add + norm) or pallas "
        "(the platform's fused Pallas add + norm, all-reduce + add + norm and add + norm + "
        "quantize, each where it takes the shape; none take any on CPU)",
    )
    command.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    command.add_argument(
        "--matmul-precision",
        type=options.matmul_precision,
        metavar="{default,high,highest}",
        help="the matmuls' precision (default: highest for float32, so a GPU computes true "
        "float32 rather than TF32; default for bfloat16)",
    )
    command.add_argument(
        "--hc-mult",
        type=options.positive_int,
        help="presets: build every boundary with MHC hyper-connections of this many residual "
        "streams (random MHC weights)",
    )
    command.add_argument(
        "--scan-layers",
        action="store_true",
        help="stack each run of identical layers between the first and the last once and run "
        "it as one lax.scan (compiles one layer body per run; default: unrolled)",
    )


def _quantize_arg(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--quantize",
        choices=options.QUANTIZATIONS,
        help="fp8: FP8 projection weights (128 x 128 blocks, quantized on load unless the "
        "checkpoint is FP8 already, which loads as FP8 without it) and FP8 inputs into them",
    )


def _overlap_arg(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--two-batch-overlap",
        action="store_true",
        help="run each batch as two microbatches, one's collectives beside the other's compute "
        "(needs at least two sequences; not with pipeline stages, attn_cp > 1, --scan-layers "
        "or --capture-layers)",
    )


def _pipeline_args(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--pp-split",
        type=options.pp_split,
        help="under --mesh pp=N: the layers of each pipeline stage, e.g. 10,14,8 (default: as "
        "even as the layers allow, the earlier stages holding the extra ones)",
    )
    command.add_argument(
        "--microbatches",
        type=options.positive_int,
        help="under --mesh pp=N: the microbatches a batch is split into on the GPipe schedule "
        "(default N)",
    )


def _launched(args: argparse.Namespace) -> list[str]:
    """The command `launch` runs in every process (its arguments after `--`)."""
    return args.launched[1:] if args.launched[:1] == ["--"] else args.launched


def _launch(args: argparse.Namespace) -> int:
    return launch(args.processes, _launched(args), port=args.port, join_timeout=args.join_timeout)


def _mesh_devices(args: argparse.Namespace) -> int:
    """The devices a parsed command's mesh takes over all processes."""
    return 8 if args.command == "demo" else args.devices or math.prod(args.mesh.values())


def _split_error(args: argparse.Namespace, processes: int) -> str | None:
    """Why the command's devices cannot be shared evenly by `processes` (None if they can)."""
    devices = _mesh_devices(args)
    if devices % processes == 0:
        return None
    where = "the demo" if args.command == "demo" else f"--mesh {options.mesh_text(args.mesh)}"
    return (
        f"the {devices} devices of {where} do not split over {processes} processes; give "
        "each process the same number"
    )


def _input_args(command: argparse.ArgumentParser, ids_option: str) -> None:
    inputs = command.add_mutually_exclusive_group(required=True)
    inputs.add_argument(ids_option, help="a JSON file: a list of token-id lists")
    inputs.add_argument(
        "--prompt",
        action="append",
        help="a text prompt (repeat for several), encoded with the "
        "checkpoint's tokenizer.json (UTF-8 bytes without one)",
    )
    inputs.add_argument("--prompt-file", help="a text file: one prompt per non-empty line")
    command.add_argument(
        "--chat", action="store_true", help="apply the checkpoint's chat template to each prompt"
    )


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="boundary-jax",
        description="Run decoders built on layer boundaries, sharded over a JAX mesh.",
    )
    commands_ = parser.add_subparsers(dest="command", required=True)

    demo = commands_.add_parser(
        "demo",
        help="the embedded demo: small models under several layouts, on the machine's devices "
        "and on 8 simulated CPU devices",
    )
    demo.add_argument("--layers", type=options.positive_int, default=4, help="decoder layers")
    demo.set_defaults(run=_demo, mesh={"attn_dp": 8})

    forward = commands_.add_parser("forward", help="logits of token-id sequences or text")
    _model_args(forward)
    _quantize_arg(forward)
    _pipeline_args(forward)
    _overlap_arg(forward)
    _input_args(forward, "--input-ids")
    add_lora_args(forward, prompts=True)
    forward.add_argument("--out", required=True, help="where to write the logits (.npy)")
    forward.add_argument(
        "--capture-layers",
        type=options.capture_layers,
        help="e.g. 2,5: also write the hidden states entering these layers (the layer count: "
        "the residual the final norm reads) to <out>.hidden_states.npz",
    )
    forward.set_defaults(run=commands.forward)

    generate = commands_.add_parser(
        "generate", help="continuation of token-id or text prompts (greedy or sampled)"
    )
    _model_args(generate)
    _quantize_arg(generate)
    _pipeline_args(generate)
    _overlap_arg(generate)
    _input_args(generate, "--prompt-ids")
    add_lora_args(generate, prompts=True)
    generate.add_argument("--max-new-tokens", type=options.positive_int, required=True)
    generate.add_argument(
        "--temperature", type=options.non_negative_float, default=0.0, help="0 (default): greedy"
    )
    generate.add_argument("--top-k", type=options.positive_int, default=None)
    generate.add_argument("--top-p", type=options.probability, default=None)
    generate.add_argument("--seed", type=int, default=0, help="PRNG seed for sampling")
    generate.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate --max-new-tokens for every prompt, past end-of-sequence ids",
    )
    generate.add_argument(
        "--json",
        action="store_true",
        help="text prompts: print one JSON list of {prompt, text, ids, stopped_at_eos}",
    )
    generate.set_defaults(run=commands.generate)

    serving = commands_.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions), "
        "continuously batched over a paged KV cache",
    )
    _model_args(serving)
    _quantize_arg(serving)
    add_serve_args(serving)
    add_lora_args(serving, prompts=False)
    serving.set_defaults(run=serve, pp_split=None, microbatches=None)

    train_ = commands_.add_parser(
        "train", help="train on text (next-token loss, AdamW) and write a checkpoint directory"
    )
    _model_args(train_)
    train_.add_argument("--text", required=True, help="a text file or a directory of text files")
    train_.add_argument("--steps", type=options.positive_int, required=True, help="optimizer steps")
    train_.add_argument(
        "--batch-tokens", type=options.positive_int, default=1024, help="tokens per step"
    )
    train_.add_argument(
        "--seq-len",
        type=options.sequence_length,
        default=None,
        help="tokens per sequence, 2 or more (default: 128, or less where the model's context, "
        "--batch-tokens or the text is shorter)",
    )
    train_.add_argument(
        "--lr", type=options.positive_float, default=3e-3, help="peak learning rate"
    )
    train_.add_argument(
        "--warmup", type=options.non_negative_int, default=10, help="warmup steps (default 10)"
    )
    train_.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    train_.add_argument(
        "--remat",
        type=Remat,
        choices=tuple(Remat),
        default=Remat.NONE,
        metavar="{none,full,dots}",
        help="what each layer keeps for the backward pass (default none: everything)",
    )
    train_.add_argument(
        "--log-every", type=options.positive_int, default=10, help="progress every N steps"
    )
    train_.add_argument(
        "--save-every",
        type=options.positive_int,
        help="also write the checkpoint every N steps (an interrupted run keeps the last)",
    )
    train_.add_argument(
        "--train-lora",
        type=lora_training,
        metavar="r=R,alpha=A,targets=q,k,...",
        help="train a LoRA adapter (targets among q k v o gate up down) over the frozen model "
        "and write it as a PEFT adapter folder to --out",
    )
    train_.add_argument("--out", required=True, help="where to write the trained checkpoint")
    train_.add_argument(
        "--overwrite", action="store_true", help="replace an --out directory that holds files"
    )
    train_.set_defaults(run=train)

    plan = commands_.add_parser(
        "plan", help="each stage's bound plan and the collectives the compiled forward runs"
    )
    _model_args(plan)
    _quantize_arg(plan)
    _pipeline_args(plan)
    add_lora_args(plan, prompts=False)
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(run=commands.plan)

    processes = commands_.add_parser(
        "launch",
        help="run a command in several local processes under jax.distributed (e.g. launch "
        "--processes 2 -- forward --preset ... --mesh pp=2,attn_tp=2 ...)",
    )
    processes.add_argument(
        "--processes", type=options.positive_int, required=True, help="how many processes"
    )
    processes.add_argument(
        "--port", type=options.positive_int, help="the coordinator's port (default: a free one)"
    )
    processes.add_argument(
        "--join-timeout",
        type=options.positive_float,
        default=DEFAULT_JOIN_TIMEOUT,
        help="seconds the processes wait for each other to join (default "
        f"{DEFAULT_JOIN_TIMEOUT:g})",
    )
    processes.add_argument(
        "launched", nargs=argparse.REMAINDER, help="-- then the command every process runs"
    )
    processes.set_defaults(run=_launch, mesh={}, devices=None)
    return parser


def _one_line(error: BaseException) -> str:
    """The error's first line, in the words of the options (`self.x=3` reads `x=3`)."""
    lines = str(error).strip().splitlines()
    message = lines[0].rstrip(". ") if lines else type(error).__name__
    return re.sub(r"\bself\.", "", message)


def _out_of_memory(error: BaseException) -> bool:
    return isinstance(error, MemoryError) or "RESOURCE_EXHAUSTED" in str(error)


def _fail(message: str) -> int:
    print(f"{ERROR}{message}", file=sys.stderr)
    return EXIT_BAD_INPUT


BAD_INPUT_ERRORS = (
    InputError,
    ValueError,
    NotImplementedError,
    OSError,
    SafetensorError,
    JoinError,
)
"""What a command raises for input it cannot take (after the options' own checks)."""


def _ended_by(error: BaseException) -> int:
    """The one line and exit code of a command that `error` ended: an interruption (checked
    first, since a signal inside a C++ callback arrives wrapped in another exception), a reader
    that closed stdout, bad input, or running out of memory; anything else is raised again."""
    interrupted = interruption(error)
    if interrupted is not None:
        return report(interrupted)
    if isinstance(error, BrokenPipeError):
        # The reader left: send the rest of stdout nowhere, so flushing at exit cannot fail.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    if isinstance(error, BAD_INPUT_ERRORS):
        if isinstance(error, OSError) and error.filename is not None and error.strerror:
            return _fail(f"{error.filename}: {error.strerror}")
        return _fail(_one_line(error))
    if isinstance(error, Exception) and _out_of_memory(error):
        return _fail(f"out of memory: {_one_line(error)}. Use a smaller batch or more devices")
    raise error


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `boundary-jax` command (see the module docstring)."""
    try:
        args = _parser().parse_args(argv)
        if args.command == "launch" and _launched(args):
            # Checked here once, before any process starts, instead of in every process (an
            # empty command is `launch`'s own error).
            launched = _parser().parse_args(_launched(args))
            if launched.command == "launch":
                return _fail("launch runs a command in several processes, not another launch")
            if error := _split_error(launched, args.processes):
                return _fail(error)
    except UsageError as error:
        return _fail(str(error))
    try:
        group = ProcessGroup.from_environment()
    except ValueError as error:
        return _fail(_one_line(error))
    devices = _mesh_devices(args)
    if group is not None:
        if error := _split_error(args, group.num_processes):
            return _fail(error)
        devices //= group.num_processes
    if devices > jax.config.jax_num_cpu_devices:
        with contextlib.suppress(RuntimeError):  # backends already up (e.g. called in-process)
            jax.config.update("jax_num_cpu_devices", devices)
    try:
        with signals_interrupt():
            if group is not None:
                group.join()
            code = args.run(args)
            sys.stdout.flush()
    except BaseException as error:
        return _ended_by(error)
    return code or 0
