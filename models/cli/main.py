"""The `boundary-jax` command line: demo, forward, generate, train and plan.

Bad input ends with a one-line error naming the problem and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console

import boundary_jax as bj

from ..build import build_model, load_model
from ..checkpoints import load_config, save_checkpoint
from ..config import PRESETS, DecoderConfig
from ..families.decoder import Remat
from ..layers.attention import AttentionImpl
from ..layers.fp8_linear import Fp8Quantization
from ..layers.hyper_connections import HyperConnections
from ..serving.runtime import ShardedCausalLM
from ..serving.sampling import Sampling
from ..training.trainer import TrainConfig, Trainer
from .demo import run_demo
from .plan import plan_report, print_plan

EXIT_BAD_INPUT = 2
TOKENIZER_FILE = "tokenizer.json"


class InputError(ValueError):
    """A problem with what the user passed: reported in one line, exit code 2."""


def _parse_mesh(text: str) -> dict[str, int]:
    sizes = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in {axis.value for axis in bj.MeshAxis} or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(
                f"--mesh takes name=size pairs over {[a.value for a in bj.MeshAxis]}, e.g. "
                f"attn_dp=2,attn_tp=4; got {text!r}"
            )
        sizes[name] = int(value)
    if any(size < 1 for size in sizes.values()):
        raise argparse.ArgumentTypeError(f"mesh sizes must be positive; got {text!r}")
    return sizes


def _policy(text: str):
    try:
        return bj.ReductionPolicy.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _read_ids(path: str, vocab_size: int) -> list[list[int]]:
    file = Path(path)
    if not file.is_file():
        raise InputError(f"no token-id file at {path}")
    try:
        ids = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise InputError(f"{path} is not JSON: {error}") from None
    valid = (
        isinstance(ids, list)
        and ids
        and all(isinstance(s, list) and s for s in ids)
        and all(isinstance(t, int) and not isinstance(t, bool) for s in ids for t in s)
    )
    if not valid:
        raise InputError(f"{path} must hold a non-empty JSON list of non-empty lists of ints")
    bad = [t for s in ids for t in s if not 0 <= t < vocab_size]
    if bad:
        raise InputError(
            f"{path} has token ids outside the vocabulary [0, {vocab_size}): {sorted(set(bad))[:5]}"
        )
    return ids


def _console():
    return Console(stderr=True)


@contextlib.contextmanager
def _status(console, message: str):
    with console.status(message):
        start = time.perf_counter()
        yield
    console.log(f"{message} done in {time.perf_counter() - start:.1f}s")


def _build(args, console):
    """(model, mesh) for --checkpoint or --preset on --mesh."""
    topology = bj.Topology.from_axis_sizes(args.mesh, moe_ep=args.moe_ep)
    mesh = bj.make_mesh(topology)
    dtype = jnp.dtype(args.dtype)
    # Training runs XLA's attention (cuDNN's backward is not supported); the rest pick theirs.
    attention = AttentionImpl.XLA if args.command == "train" else None
    quantization = None
    if getattr(args, "quantize", None) == "fp8":
        quantization = Fp8Quantization.for_platform(mesh.devices.flat[0].platform)
    hyper_connections = None
    if args.hc_mult is not None:
        if args.checkpoint:
            raise InputError(
                "--hc-mult builds MHC layers with random weights, and a Hugging Face checkpoint "
                "holds no MHC weights; use it with --preset"
            )
        try:
            hyper_connections = HyperConnections(hc_mult=args.hc_mult)
        except ValueError as error:
            raise InputError(f"--hc-mult: {error}") from None
    if args.preset:
        if args.preset not in PRESETS:
            raise InputError(f"unknown preset {args.preset!r}; choose one of {sorted(PRESETS)}")
        with _status(console, f"building {args.preset} with random weights"):
            model = build_model(
                PRESETS[args.preset],
                topology,
                reduction=args.policy,
                moe_dispatch=args.moe_dispatch,
                dtype=dtype,
                seed=getattr(args, "seed", 0),
                remat=getattr(args, "remat", Remat.NONE),
                attention=attention,
                hyper_connections=hyper_connections,
                scan_layers=args.scan_layers,
                quantization=quantization,
            )
    else:
        directory = Path(args.checkpoint)
        if not directory.is_dir():
            raise InputError(f"no checkpoint directory at {args.checkpoint}")
        load_config(directory)
        with _status(console, f"loading {directory} onto {topology}"):
            model = load_model(
                directory,
                mesh,
                reduction=args.policy,
                moe_ep=args.moe_ep,
                moe_dispatch=args.moe_dispatch,
                dtype=dtype,
                remat=getattr(args, "remat", Remat.NONE),
                attention=attention,
                scan_layers=args.scan_layers,
                quantization=quantization,
            )
    return model, mesh


def _source_config(args) -> DecoderConfig:
    """The config of --preset or --checkpoint, read before building anything."""
    if getattr(args, "preset", None):
        if args.preset not in PRESETS:
            raise InputError(f"unknown preset {args.preset!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[args.preset]
    if not Path(args.checkpoint).is_dir():
        raise InputError(f"no checkpoint directory at {args.checkpoint}")
    return load_config(args.checkpoint)


def _load(args, console) -> ShardedCausalLM:
    """The runner of `_build`'s model."""
    model, mesh = _build(args, console)
    return ShardedCausalLM(model, mesh, input_scattered=args.input_scattered)


def _forward(args) -> None:
    console = _console()
    runner = _load(args, console)
    sequences = _read_ids(args.input_ids, runner.config.vocab_size)
    layers = args.capture_layers
    if layers is not None:
        count = runner.config.num_layers
        bad = sorted({i for i in layers if not 0 <= i <= count})
        if bad:
            raise InputError(
                f"--capture-layers takes indices in [0, {count}] (i < {count}: the residual "
                f"entering layer i; {count}: the residual the final norm reads); got {bad}"
            )
    with _status(console, f"forward of {len(sequences)} sequences"):
        if layers is None:
            logits = runner.forward(sequences)
        else:
            logits, hidden = runner.forward_captured(sequences, layers)
    np.save(args.out, logits.astype(np.float32))
    console.log(f"wrote logits {list(logits.shape)} to {args.out}")
    if layers is not None:
        path = captures_path(args.out)
        np.savez(path, **{f"layer_{i}": hidden[n].astype(np.float32) for n, i in enumerate(layers)})
        console.log(f"wrote hidden states of layers {layers} to {path}")


def captures_path(logits_path: str | Path) -> Path:
    """Where `forward --capture-layers` writes the captured hidden states: beside the logits,
    `<logits name without .npy>.hidden_states.npz` (one `layer_<i>` array per capture)."""
    path = Path(logits_path)
    stem = path.name[: -len(".npy")] if path.name.endswith(".npy") else path.name
    return path.with_name(f"{stem}.hidden_states.npz")


def _capture_layers(text: str) -> list[int]:
    items = [item.strip() for item in text.split(",")]
    if not items or not all(item.isdigit() for item in items):
        raise argparse.ArgumentTypeError(
            f"--capture-layers takes comma-separated layer indices, e.g. 2,5; got {text!r}"
        )
    return [int(item) for item in items]


def _generate(args) -> None:
    console = _console()
    runner = _load(args, console)
    prompts = _read_ids(args.prompt_ids, runner.config.vocab_size)
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1; got {args.max_new_tokens}")
    try:
        sampling = Sampling(args.temperature, top_k=args.top_k, top_p=args.top_p)
    except ValueError as error:
        raise InputError(str(error)) from None
    with _status(console, f"generating {args.max_new_tokens} tokens for {len(prompts)} prompts"):
        tokens = runner.generate(prompts, args.max_new_tokens, sampling=sampling, seed=args.seed)
    print(json.dumps(tokens.tolist()))


def _plan(args) -> None:
    console = _console()
    runner = _load(args, console)
    with _status(console, "compiling the sharded forward"):
        report = plan_report(runner)
    if args.json:
        print(json.dumps(report))
        return
    print_plan(report)


def _read_text(path: str) -> list[bytes]:
    """The bytes of a text file, or of every file under a directory (sorted by path)."""
    source = Path(path)
    if source.is_file():
        files = [source]
    elif source.is_dir():
        files = sorted(p for p in source.rglob("*") if p.is_file())
    else:
        raise InputError(f"no text file or directory at {path}")
    texts = [file.read_bytes() for file in files]
    if not any(texts):
        raise InputError(f"no text in {path}: it is empty (or a directory of empty files)")
    return texts


def _tokenize(texts: list[bytes], args, vocab_size: int) -> np.ndarray:
    """One int32 token stream: the checkpoint's tokenizer.json when it has one, else bytes."""
    tokenizer_file = Path(args.checkpoint or "") / TOKENIZER_FILE
    if args.checkpoint and tokenizer_file.is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise InputError(
                f"{tokenizer_file} needs the `tokenizers` package (pip install tokenizers); "
                "it is not installed"
            ) from None
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        text = [t.decode("utf-8", errors="replace") for t in texts]
        ids = [i for encoding in tokenizer.encode_batch(text) for i in encoding.ids]
        return np.asarray(ids, np.int32)
    if vocab_size < 256:
        raise InputError(
            f"byte-level tokens need a vocabulary of at least 256 ids; the model has {vocab_size}"
        )
    return np.frombuffer(b"".join(texts), np.uint8).astype(np.int32)


def _train(args) -> None:
    console = _console()
    if args.steps < 1:
        raise InputError(f"--steps must be at least 1; got {args.steps}")
    if args.hc_mult is not None:
        raise InputError(
            "train writes a Hugging Face checkpoint, which holds no MHC weights; --hc-mult "
            "models train through models.training.Trainer instead"
        )
    if args.batch_tokens < 2:
        raise InputError(f"--batch-tokens must be at least 2; got {args.batch_tokens}")
    texts = _read_text(args.text)
    tokens = _tokenize(texts, args, _source_config(args).vocab_size)
    model, mesh = _build(args, console)
    config = model.config
    length = min(args.seq_len, config.max_position_embeddings, args.batch_tokens, len(tokens))
    if length < 2:
        raise InputError(f"{args.text} holds {len(tokens)} token(s); training needs at least 2")
    sequences = args.batch_tokens // length
    schedule = TrainConfig(
        learning_rate=args.lr,
        total_steps=args.steps,
        warmup_steps=min(args.warmup, args.steps - 1),
    )
    trainer = Trainer(model, mesh, schedule.optimizer(), input_scattered=args.input_scattered)
    del model
    rng = np.random.default_rng(args.seed)
    losses, timed_tokens, timed_seconds = [], 0, 0.0
    for step in range(args.steps):
        starts = rng.integers(0, len(tokens) - length + 1, sequences)
        batch = trainer.pack([tokens[s : s + length] for s in starts], max_sequence_rows=length)
        start = time.perf_counter()
        loss = trainer.step(batch)["loss"]
        seconds = time.perf_counter() - start
        losses.append(loss)
        if step > 0 or args.steps == 1:  # the first step also compiles
            timed_tokens, timed_seconds = timed_tokens + batch.tokens, timed_seconds + seconds
        if step == 0 or (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            speed = timed_tokens / timed_seconds if timed_seconds else 0.0
            console.log(f"step {step + 1}/{args.steps}  loss {loss:.4f}  {speed:,.0f} tokens/s")
    with _status(console, f"writing {args.out}"):
        save_checkpoint(config, trainer.state.params, args.out, scan_layers=args.scan_layers)
        if args.checkpoint and (Path(args.checkpoint) / TOKENIZER_FILE).is_file():
            shutil.copy(Path(args.checkpoint) / TOKENIZER_FILE, Path(args.out) / TOKENIZER_FILE)
    summary = {
        "steps": args.steps,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "tokens_per_s": timed_tokens / timed_seconds if timed_seconds else 0.0,
        "tokens_per_step": batch.tokens,
        "out": str(args.out),
    }
    print(json.dumps(summary))


def _demo(args) -> None:
    run_demo(layers=args.layers, console=_console())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="boundary-jax",
        description="Run decoders built on layer boundaries, sharded over a JAX mesh.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo", help="the embedded demo: a small model under several layouts on 8 CPU devices"
    )
    demo.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    demo.set_defaults(run=_demo, mesh={"attn_dp": 8})

    def model_args(command):
        source = command.add_mutually_exclusive_group(required=True)
        source.add_argument("--checkpoint", help="a Hugging Face checkpoint directory")
        source.add_argument("--preset", help="a built-in configuration with random weights")
        command.add_argument(
            "--mesh", type=_parse_mesh, default={}, help="e.g. attn_dp=2,attn_tp=4 (default 1)"
        )
        command.add_argument(
            "--devices", type=int, help="simulated CPU devices without an accelerator"
        )
        command.add_argument("--policy", type=_policy, default="auto", help="ar|rs|rsv|rs+rsv|auto")
        command.add_argument("--input-scattered", action="store_true")
        command.add_argument(
            "--moe-ep",
            type=int,
            default=1,
            help="MoE checkpoints: expert-parallel size, dividing the full TP group (default 1)",
        )
        command.add_argument(
            "--moe-dispatch",
            type=bj.MoeDispatch,
            choices=tuple(bj.MoeDispatch),
            metavar="{gather,all-to-all}",
            help="MoE checkpoints: where the experts get their tokens (default gather)",
        )
        command.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
        command.add_argument(
            "--hc-mult",
            type=int,
            help="presets: build every boundary with MHC hyper-connections of this many "
            "residual streams (random MHC weights)",
        )
        command.add_argument(
            "--scan-layers",
            action="store_true",
            help="stack each run of identical layers between the first and the last once and "
            "run it as one lax.scan (compiles one layer body per run; default: unrolled)",
        )

    def quantize_arg(command):
        command.add_argument(
            "--quantize",
            choices=("fp8",),
            help="fp8: FP8 projection weights (128 x 128 blocks, quantized on load unless the "
            "checkpoint is FP8 already, which loads as FP8 without it) and FP8 inputs into them",
        )

    forward = commands.add_parser("forward", help="logits of token-id sequences")
    model_args(forward)
    quantize_arg(forward)
    forward.add_argument("--input-ids", required=True, help="JSON list of token-id lists")
    forward.add_argument("--out", required=True, help="where to write the logits (.npy)")
    forward.add_argument(
        "--capture-layers",
        type=_capture_layers,
        help="e.g. 2,5: also write the hidden states entering these layers (the layer count: "
        "the residual the final norm reads) to <out>.hidden_states.npz",
    )
    forward.set_defaults(run=_forward)

    generate = commands.add_parser(
        "generate", help="continuation of token-id prompts (greedy, or sampled on the device)"
    )
    model_args(generate)
    quantize_arg(generate)
    generate.add_argument("--prompt-ids", required=True, help="JSON list of token-id lists")
    generate.add_argument("--max-new-tokens", type=int, required=True)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    generate.add_argument("--top-k", type=int, default=None)
    generate.add_argument("--top-p", type=float, default=None)
    generate.add_argument("--seed", type=int, default=0, help="PRNG seed for sampling")
    generate.set_defaults(run=_generate)

    train = commands.add_parser(
        "train", help="train on text (next-token loss, AdamW) and write a checkpoint directory"
    )
    model_args(train)
    train.add_argument("--text", required=True, help="a text file or a directory of text files")
    train.add_argument("--steps", type=int, required=True, help="optimizer steps")
    train.add_argument(
        "--batch-tokens", type=int, default=1024, help="tokens per step (default 1024)"
    )
    train.add_argument(
        "--seq-len",
        type=int,
        default=128,
        help="tokens per sequence (default 128, at most the model's context)",
    )
    train.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    train.add_argument("--warmup", type=int, default=10, help="warmup steps (default 10)")
    train.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    train.add_argument(
        "--remat",
        type=Remat,
        choices=tuple(Remat),
        default=Remat.NONE,
        metavar="{none,full,dots}",
        help="what each layer keeps for the backward pass (default none: everything)",
    )
    train.add_argument("--log-every", type=int, default=10, help="progress every N steps")
    train.add_argument("--out", required=True, help="where to write the trained checkpoint")
    train.set_defaults(run=_train)

    plan = commands.add_parser(
        "plan", help="each stage's bound plan and the collectives the compiled forward runs"
    )
    model_args(plan)
    quantize_arg(plan)
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(run=_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `boundary-jax` command."""
    args = _parser().parse_args(argv)
    devices = getattr(args, "devices", None) or math.prod(args.mesh.values()) or 1
    if args.command == "demo":
        devices = 8
    if devices > jax.config.jax_num_cpu_devices:
        with contextlib.suppress(RuntimeError):  # backends already up (e.g. called in-process)
            jax.config.update("jax_num_cpu_devices", devices)
    try:
        args.run(args)
    except (InputError, ValueError, FileNotFoundError, NotImplementedError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        print(f"boundary-jax: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0
