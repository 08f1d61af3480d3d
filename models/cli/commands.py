"""The commands that run a model: forward, generate and plan, and what they share (reading the
model's source and inputs, checking them, building the model: one program on the mesh, or
pipeline stages under `--mesh pp=N`).

Under several processes (`boundary-jax launch`, `models.distributed`) every process runs the
command on the same inputs; only the first writes files and prints results, and the others'
progress lines are silent."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import jax
import numpy as np
from rich.console import Console

import boundary_jax as bj

from ..build import build_model, load_model
from ..config import PRESETS, DecoderConfig
from ..decoder.model import CausalLM
from ..distributed import gather_json, is_first_process, require_everywhere
from ..layers.attention.self_attention import AttentionImpl
from ..layers.lora import LoraSpec
from ..pipeline import PipelineCausalLM, PipelineSplit, build_pipeline, load_pipeline
from ..serving import generation
from ..serving.generation import check_prompts, generate_ids
from ..serving.runtime import ShardedCausalLM
from ..serving.sampling import Sampling
from ..serving.text import TextCodec, TextStream, eos_token_ids, text_codec
from ..weights import check_checkpoint_files, load_config, read_json
from . import options
from .lora import ids_entry, lora_sources, prompt_adapters, prompt_line
from .options import InputError
from .plan import pipeline_plan, plan_report, print_pipeline_plan, print_plan


def console() -> Console:
    """Progress and log lines on stderr, without the source location (silent on every process
    but the first)."""
    return Console(stderr=True, log_path=False, quiet=not is_first_process())


@contextlib.contextmanager
def status(out: Console, message: str) -> Iterator[None]:
    """A spinner while the block runs, then one log line with its time."""
    with out.status(message):
        start = time.perf_counter()
        yield
    out.log(f"{message} done in {time.perf_counter() - start:.1f}s")


def check_on_first_process(check: Callable[[], None]) -> None:
    """Runs `check` (of what only process 0 uses: where it writes, where it listens) there, and
    every process raises its `InputError`, so that none goes on into a collective the first
    one left (one line from each, the same, which `launch` shows once).

    Raises:
      InputError: `check` raised it on process 0.
    """
    problem = None
    if is_first_process():
        try:
            check()
        except InputError as error:
            problem = str(error)
    first = gather_json(problem)[0]
    if first is not None:
        raise InputError(first)


# -- the model's source -----------------------------------------------------------------------


def checkpoint_dir(args: argparse.Namespace) -> Path | None:
    """`--checkpoint` as a directory (None for `--preset`)."""
    if args.checkpoint is None:
        return None
    directory = Path(args.checkpoint)
    if not directory.is_dir():
        raise InputError(f"no checkpoint directory at {args.checkpoint}")
    return directory


def source_config(args: argparse.Namespace) -> DecoderConfig:
    """The config of `--preset` or `--checkpoint` (whose weights files are checked too), read
    and checked against the options and the machine before anything is built."""
    if args.checkpoint is not None and jax.process_count() > 1:
        # Every process stops here when one lacks the checkpoint, rather than waiting forever
        # in a collective the failing one never joins.
        require_everywhere(Path(args.checkpoint) / "config.json", "checkpoint")
    directory = checkpoint_dir(args)
    config = PRESETS[args.preset] if directory is None else load_config(directory)
    if directory is not None:
        check_checkpoint_files(directory)
    options.topology(args, config.num_experts)
    options.check_devices(args)
    options.check_model(args, config)
    options.check_pipeline(args, config)
    return config


def codec(args: argparse.Namespace, config: DecoderConfig) -> TextCodec:
    """How the model reads and writes text."""
    return text_codec(checkpoint_dir(args), config.vocab_size)


def build(
    args: argparse.Namespace,
    out: Console,
    *,
    attention: AttentionImpl | None = None,
    lora: LoraSpec | None = None,
) -> CausalLM:
    """The model of `--checkpoint` or `--preset` on `--mesh` (after `source_config`), built
    with the command's `BuildOptions` (`attention`: a kernel the command requires; `lora`:
    adapter stacks to train, drawn at random over the base weights)."""
    topology = options.topology(args)
    built = options.build_options(args, topology, attention=attention)
    if lora is not None:
        built = built.replace(lora=lora)
    adapters = lora_sources(args)
    directory = checkpoint_dir(args)
    if directory is not None:
        mesh = bj.make_mesh(topology)
        with status(out, f"loading {directory} onto {topology}"):
            return load_model(directory, mesh, built, moe_ep=args.moe_ep, adapters=adapters)
    with status(out, f"building {args.preset} with random weights"):
        return build_model(PRESETS[args.preset], topology, built, seed=getattr(args, "seed", 0))


def build_stages(
    args: argparse.Namespace, out: Console, split: PipelineSplit
) -> tuple[CausalLM, ...]:
    """The pipeline stages (`split`'s layers each) of `--checkpoint` or `--preset` on `--mesh`
    (after `source_config`); each process builds or reads only its own devices' weights."""
    topology = options.topology(args)
    mesh = bj.make_mesh(topology)
    built = options.build_options(args, topology)
    stages = f"{topology.pp} pipeline stages (layers {list(split.sizes)})"
    adapters = lora_sources(args)
    directory = checkpoint_dir(args)
    if directory is not None:
        with status(out, f"loading {directory} onto {topology} in {stages}"):
            return load_pipeline(
                directory,
                mesh,
                built,
                split=split,
                moe_ep=args.moe_ep,
                adapters=adapters,
            )
    with status(out, f"building {args.preset} with random weights in {stages}"):
        return build_pipeline(
            PRESETS[args.preset],
            topology,
            mesh,
            built,
            split=split,
            seed=getattr(args, "seed", 0),
        )


def runner(
    args: argparse.Namespace, out: Console, config: DecoderConfig
) -> ShardedCausalLM | PipelineCausalLM:
    """The model of `build` placed on its mesh, or under `--mesh pp=N` (or `--pp-split`) the
    stages of `build_stages` on theirs (`config`: `source_config`'s)."""
    split = options.check_pipeline(args, config)
    mesh = bj.make_mesh(options.topology(args))
    if split is not None:
        if getattr(args, "two_batch_overlap", False):
            raise InputError(
                "--two-batch-overlap runs a whole model; pipeline stages already overlap their "
                "microbatches. Drop one of them"
            )
        stages = build_stages(args, out, split)
        return PipelineCausalLM(
            stages, mesh, microbatches=args.microbatches, input_scattered=args.input_scattered
        )
    return ShardedCausalLM(build(args, out), mesh, input_scattered=args.input_scattered)


# -- inputs -----------------------------------------------------------------------------------


def read_ids(option: str, path: str, vocab_size: int) -> list[list[int]]:
    """A JSON file of token-id lists (ragged), each id in the vocabulary; an entry may be an
    object `{"ids": [...], "adapter": NAME}` naming its LoRA adapter (`cli.lora`)."""
    file = Path(path)
    if not file.is_file():
        raise InputError(f"{option}: no token-id file at {path}")
    entries = read_json(file)
    ids = [ids_entry(entry)[0] for entry in entries] if isinstance(entries, list) else None
    valid = (
        isinstance(ids, list)
        and ids
        and all(isinstance(s, list) and s for s in ids)
        and all(isinstance(t, int) and not isinstance(t, bool) for s in ids for t in s)
    )
    if not valid:
        raise InputError(
            f"{path} must hold a non-empty JSON list of non-empty lists of ints (or of objects "
            '{"ids": [...], "adapter": NAME})'
        )
    check_vocabulary(path, ids, vocab_size)
    return ids


def check_vocabulary(source: str, ids: list[list[int]], vocab_size: int) -> None:
    """Every id of `ids` (from `source`) lies in [0, vocab_size) (`check_prompts`)."""
    try:
        check_prompts(ids, vocab_size, source=source)
    except ValueError as error:
        raise InputError(str(error)) from None


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The text prompts of `--prompt` (each one) or `--prompt-file` (one per non-empty line; a
    `.jsonl` file's lines are `{"prompt": ..., "adapter": ...}` objects, `cli.lora`)."""
    if args.prompt is not None:
        return list(args.prompt)
    file = Path(args.prompt_file)
    if not file.is_file():
        raise InputError(f"--prompt-file: no file at {args.prompt_file}")
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise InputError(f"--prompt-file {file} is not UTF-8 text: {error}") from None
    prompts = [line for line in lines if line.strip()]
    if file.suffix == ".jsonl":
        prompts = [prompt_line(line, file)[0] for line in prompts]
    if not prompts:
        raise InputError(f"--prompt-file {file} holds no prompt (one per non-empty line)")
    return prompts


def encode_prompts(
    args: argparse.Namespace, ids_option: str, config: DecoderConfig
) -> tuple[list[list[int]], list[str] | None, TextCodec | None]:
    """The token ids of the input (a token-id file, or text prompts encoded, with the chat
    template under `--chat`), the text prompts (None for ids) and the codec used."""
    ids_path = getattr(args, ids_option.removeprefix("--").replace("-", "_"))
    if ids_path is not None:
        if args.chat:
            raise InputError(f"--chat applies a chat template to text; {ids_option} are ids")
        return read_ids(ids_option, ids_path, config.vocab_size), None, None
    prompts = read_prompts(args)
    text = codec(args, config)
    encode = text.encode_chat if args.chat else text.encode
    sequences = [encode(prompt) for prompt in prompts]
    empty = [prompt for prompt, ids in zip(prompts, sequences, strict=True) if not ids]
    if empty:
        raise InputError(f"the prompt {empty[0]!r} encodes to no token ids")
    check_vocabulary(f"the encoded prompts ({text.description})", sequences, config.vocab_size)
    return sequences, prompts, text


def check_context(sequences: list[list[int]], extra: int, config: DecoderConfig) -> None:
    """The longest sequence, plus `extra` new tokens, fits the model's context."""
    try:
        generation.check_context(sequences, extra, config.max_position_embeddings)
    except ValueError as error:
        raise InputError(str(error)) from None


def write_atomically(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Calls `write(file)` on a temporary file beside `path`, then renames it to `path` (so
    `path` never holds a partial file)."""
    target = Path(path).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.partial-")
    try:
        with os.fdopen(handle, "wb") as file:
            write(file)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


# -- the commands -----------------------------------------------------------------------------


def forward(args: argparse.Namespace) -> None:
    """`forward`: float32 logits of token-id sequences or text prompts to `--out`."""
    out = console()
    config = source_config(args)
    sequences, _, text = encode_prompts(args, "--input-ids", config)
    check_context(sequences, 0, config)
    adapters = prompt_adapters(args, "--input-ids", len(sequences))
    layers = args.capture_layers
    count = config.num_layers
    if layers is not None:
        bad = sorted({i for i in layers if not 0 <= i <= count})
        if bad:
            raise InputError(
                f"--capture-layers takes indices in [0, {count}] (i < {count}: the residual "
                f"entering layer i; {count}: the residual the final norm reads); got {bad}"
            )
        if args.hc_mult is not None:
            raise InputError(
                "--capture-layers: captures of a decoder with hyper-connections are not "
                "supported (its residual is --hc-mult streams)"
            )
        if adapters is not None:
            raise InputError("--capture-layers captures the base model; drop the adapters")

    def check_out() -> None:
        options.check_output_file("--out", args.out)
        if layers is not None:
            options.check_output_file("--out", captures_path(args.out))

    check_on_first_process(check_out)
    if text is not None:
        out.log(f"{len(sequences)} prompts encoded with {text.description}")
    model = runner(args, out, config)
    with status(out, f"forward of {len(sequences)} sequences"):
        if layers is None:
            logits = model.forward(sequences, adapters=adapters)
        else:
            logits, hidden = model.forward_captured(sequences, layers)
    if not is_first_process():
        return
    write_atomically(args.out, lambda file: np.save(file, logits.astype(np.float32)))
    out.log(f"wrote logits {list(logits.shape)} to {args.out}")
    if layers is not None:
        path = captures_path(args.out)
        arrays = {f"layer_{i}": hidden[n].astype(np.float32) for n, i in enumerate(layers)}
        write_atomically(path, lambda file: np.savez(file, **arrays))
        out.log(f"wrote hidden states of layers {layers} to {path}")


def captures_path(logits_path: str | Path) -> Path:
    """Where `forward --capture-layers` writes the captured hidden states: beside the logits,
    `<logits name without .npy>.hidden_states.npz` (one `layer_<i>` array per capture)."""
    path = Path(logits_path)
    stem = path.name[: -len(".npy")] if path.name.endswith(".npy") else path.name
    return path.with_name(f"{stem}.hidden_states.npz")


def generate(args: argparse.Namespace) -> None:
    """`generate`: continuations of token-id or text prompts, stopping at the checkpoint's
    end-of-sequence ids; text streams to a terminal as it comes."""
    stdout = sys.stdout
    out = console()
    config = source_config(args)
    sequences, prompts, text = encode_prompts(args, "--prompt-ids", config)
    check_context(sequences, args.max_new_tokens, config)
    adapters = prompt_adapters(args, "--prompt-ids", len(sequences))
    if args.temperature == 0 and (args.top_k is not None or args.top_p is not None):
        raise InputError("--top-k and --top-p need --temperature > 0 (0, the default, is greedy)")
    sampling = Sampling(args.temperature, top_k=args.top_k, top_p=args.top_p)
    eos = () if args.ignore_eos else eos_token_ids(checkpoint_dir(args))
    first = is_first_process()
    stream = (
        text is not None and len(sequences) == 1 and not args.json and first and stdout.isatty()
    )
    if text is not None:
        out.log(f"{len(sequences)} prompts encoded with {text.description}")
    out.log(f"stopping at end-of-sequence ids {list(eos)}" if eos else "no end-of-sequence ids")
    model = runner(args, out, config)
    shown = TextStream(text) if stream else None

    def show(tokens: list[list[int]]) -> None:
        stdout.write(shown.push(tokens[0][shown.pushed :]))
        stdout.flush()

    start = time.perf_counter()
    tokens = generate_ids(
        model,
        sequences,
        args.max_new_tokens,
        eos_ids=eos,
        sampling=sampling,
        seed=args.seed,
        chunk=1 if stream else None,
        on_tokens=show if stream else None,
        adapters=adapters,
    )
    if shown is not None:
        stdout.write(shown.finish() + "\n")
        stdout.flush()
    count = sum(len(t) for t in tokens)
    seconds = time.perf_counter() - start
    out.log(f"generated {count} tokens in {seconds:.1f}s (compiling included)")
    if not first:
        return
    if text is None:
        print(json.dumps(tokens), file=stdout)
    elif args.json:
        rows = [
            {
                "prompt": p,
                "text": text.decode(t),
                "ids": t,
                "stopped_at_eos": bool(t) and t[-1] in eos,
            }
            for p, t in zip(prompts, tokens, strict=True)
        ]
        print(json.dumps(rows, ensure_ascii=False), file=stdout)
    elif not stream:
        for ids in tokens:
            print(text.decode(ids), file=stdout)


def plan(args: argparse.Namespace) -> None:
    """`plan`: the bound stage plans and the compiled forward's collectives (of each pipeline
    stage under `--mesh pp=N`, with its handoff and the schedule's bubble)."""
    out = console()
    model = runner(args, out, source_config(args))
    pipelined = isinstance(model, PipelineCausalLM)
    with status(
        out, "compiling each stage's forward" if pipelined else "compiling the sharded forward"
    ):
        report = pipeline_plan(model) if pipelined else plan_report(model)
    if not is_first_process():
        return
    if args.json:
        print(json.dumps(report))
        return
    (print_pipeline_plan if pipelined else print_plan)(report)
