"""`boundary-jax train`: next-token training on text, written as a Hugging Face checkpoint (or,
with `--train-lora`, a LoRA adapter over the frozen model, written as a PEFT adapter folder).

Every input and output path is checked before the model is built. The checkpoint is written
into a temporary directory beside `--out` and renamed into place, so `--out` never holds a
partial checkpoint; a run from `--checkpoint` keeps that checkpoint's `config.json` (its token
ids and other keys), tokenizer files and `generation_config.json`. The first non-finite loss
stops the run with nothing more written; SIGINT and SIGTERM stop it with one line, keeping the
last complete `--save-every` checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import boundary_jax as bj

from ..distributed import fetch, is_first_process
from ..layers.attention.self_attention import AttentionImpl
from ..serving.text import TEXT_FILES, TextCodec
from ..training.trainer import TrainConfig, Trainer
from ..weights import read_hf_config_file, replace_directory, stage_checkpoint
from ..weights.peft import is_lora_parameter, peft_start, write_peft_adapter
from . import commands, options
from .interrupts import Interrupted, interruption, signals_deferred
from .options import InputError

DEFAULT_SEQ_LEN = 128
"""Tokens per training sequence without `--seq-len` (less where the context, the step or the
text is shorter)."""


def read_text(path: str) -> tuple[list[str], list[Path]]:
    """The UTF-8 text of a file, or of every text file under a directory (sorted by path),
    and the files skipped there as not text (binary: not UTF-8, or holding a NUL byte).

    Raises:
      InputError: No such path, a file that is not text, or no text at all.
    """
    source = Path(path)
    if source.is_file():
        text = _text_of(source)
        if text is None:
            raise InputError(f"--text {path} is not UTF-8 text; give a text file or a directory")
        texts, skipped = [text], []
    elif source.is_dir():
        texts, skipped = [], []
        for file in sorted(p for p in source.rglob("*") if p.is_file()):
            text = _text_of(file)
            if text is None:
                skipped.append(file)
            else:
                texts.append(text)
    else:
        raise InputError(f"--text: no text file or directory at {path}")
    if not any(texts):
        binary = f" ({len(skipped)} binary files skipped)" if skipped else ""
        raise InputError(
            f"--text: no text in {path}: it is empty (or a directory of empty files){binary}"
        )
    return texts, skipped


def _text_of(file: Path) -> str | None:
    """The file's UTF-8 text, or None for a binary file."""
    data = file.read_bytes()
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def tokenize(texts: list[str], codec: TextCodec) -> np.ndarray:
    """One int32 token stream of the texts (each encoded alone, then joined)."""
    ids = [i for text in texts for i in codec.encode(text)]
    return np.asarray(ids, np.int32)


def sequence_length(args: argparse.Namespace, context: int, tokens: int) -> int:
    """The tokens per training sequence: `--seq-len` checked against the model's context, the
    step (`--batch-tokens`) and the text; without it `DEFAULT_SEQ_LEN` or the smallest of those.

    Raises:
      InputError: `--seq-len` does not fit one of them (the message names which), or the text
        holds fewer than 2 tokens.
    """
    if args.seq_len is None:
        length = min(DEFAULT_SEQ_LEN, context, args.batch_tokens, tokens)
        if length < 2:
            raise InputError(f"--text {args.text} holds {tokens} token(s); training needs 2")
        return length
    limits = (
        (context, "the model's context (max_position_embeddings)", "--seq-len"),
        (args.batch_tokens, "--batch-tokens (a step holds whole sequences)", "--seq-len"),
        (tokens, f"the {tokens} tokens of --text {args.text}", "--seq-len"),
    )
    for limit, what, option in limits:
        if args.seq_len > limit:
            raise InputError(
                f"{option} {args.seq_len} is longer than {what}: {limit}; choose at most {limit}"
            )
    return args.seq_len


def refuse_router_loss(hf_config: dict | None) -> None:
    """Refuses a checkpoint whose config asks transformers to add the MoE router's auxiliary loss
    to the training loss (`output_router_logits`): `train` minimizes the next-token loss alone.

    Raises:
      InputError: The config, or its `text_config`, sets `output_router_logits`.
    """
    for config in (hf_config or {}, (hf_config or {}).get("text_config") or {}):
        if config.get("output_router_logits"):
            raise InputError(
                "train minimizes the next-token loss alone, and this checkpoint's config asks "
                "for the MoE router's auxiliary loss too (output_router_logits=true, "
                f"router_aux_loss_coef={config.get('router_aux_loss_coef')}); set "
                "output_router_logits to false in its config.json to train without it"
            )


def train(args: argparse.Namespace) -> None:
    """`train`: see the module docstring."""
    out = commands.console()
    if options.pipelined(args):
        raise InputError(
            f"train runs one program; --mesh {options.mesh_text(args.mesh)} (pipeline stages) is "
            "for forward, generate and plan (train pipeline stages through "
            "models.pipeline.PipelineTrainer)"
        )
    if args.hc_mult is not None:
        raise InputError(
            "train writes a Hugging Face checkpoint, which holds no MHC weights; --hc-mult "
            "models train through models.training.Trainer instead"
        )
    config = commands.source_config(args)
    source = commands.checkpoint_dir(args)
    hf_config = None if source is None else read_hf_config_file(source)
    refuse_router_loss(hf_config)
    options.check_output_directory("--out", args.out, overwrite=args.overwrite)
    codec = commands.codec(args, config)
    texts, skipped = read_text(args.text)
    if skipped:
        out.log(f"--text: skipped {len(skipped)} binary files, e.g. {skipped[0]}")
    tokens = tokenize(texts, codec)
    length = sequence_length(args, config.max_position_embeddings, len(tokens))
    keep = [] if source is None else [source / n for n in TEXT_FILES if (source / n).is_file()]
    out.log(f"{len(tokens):,} tokens of text encoded with {codec.description}")
    lora = args.train_lora
    # Training runs XLA's attention (cuDNN's backward is not supported).
    model = commands.build(
        args, out, attention=AttentionImpl.XLA, lora=None if lora is None else lora.spec
    )
    if lora is not None:
        model = peft_start(model, args.seed)
        out.log(f"training a rank-{lora.spec.rank} LoRA adapter over the frozen base")
    schedule = TrainConfig(
        learning_rate=args.lr,
        total_steps=args.steps,
        warmup_steps=min(args.warmup, args.steps - 1),
    )
    trainer = Trainer(
        model,
        bj.make_mesh(model.topology),
        schedule.optimizer(),
        input_scattered=args.input_scattered,
        trainable=None if lora is None else is_lora_parameter,
    )
    del model
    run = _Run(args, trainer, tokens, length, hf_config, keep)
    summary = run.train(out)
    print(json.dumps(summary, allow_nan=False))


class _Run:
    """One training run: its steps, its saves and what an interruption leaves."""

    def __init__(self, args, trainer: Trainer, tokens, length, hf_config, keep):
        self.args = args
        self.trainer = trainer
        self.tokens = tokens
        self.length = length
        self.hf_config = hf_config
        self.keep = keep
        self.saved_step = 0
        self.step = 0

    def train(self, out) -> dict:
        """Runs every step and writes the checkpoint; returns the summary."""
        try:
            return self._steps(out)
        except BaseException as error:
            interrupted = interruption(error)
            if interrupted is None:
                raise
            raise Interrupted(interrupted.signum, self._note()) from None

    def _note(self) -> str:
        where = f"at step {self.step + 1}/{self.args.steps}"
        if self.saved_step:
            return f"{where}; {self.args.out} holds the checkpoint of step {self.saved_step}"
        return f"{where}; nothing was written to {self.args.out}"

    def _steps(self, out) -> dict:
        args, trainer = self.args, self.trainer
        rng = np.random.default_rng(args.seed)
        sequences = args.batch_tokens // self.length
        losses, timed_tokens, timed_seconds = [], 0, 0.0
        for index in range(args.steps):
            self.step = index
            starts = rng.integers(0, len(self.tokens) - self.length + 1, sequences)
            windows = [self.tokens[s : s + self.length] for s in starts]
            # Under --train-lora every sequence runs the one adapter being trained (index 1).
            adapters = None if args.train_lora is None else [1] * len(windows)
            batch = trainer.pack(windows, max_sequence_rows=self.length, adapters=adapters)
            start = time.perf_counter()
            loss = trainer.step(batch)["loss"]
            seconds = time.perf_counter() - start
            number = self.step + 1
            if not math.isfinite(loss):
                raise InputError(
                    f"step {number}/{args.steps}: the loss is {loss}; stopped, {self._kept()}. "
                    f"Lower --lr (now {args.lr:g})"
                )
            losses.append(loss)
            if index > 0 or args.steps == 1:  # the first step also compiles
                timed_tokens, timed_seconds = timed_tokens + batch.tokens, timed_seconds + seconds
            if index == 0:
                out.log(
                    f"step 1/{args.steps}  loss {loss:.4f}  (compiled and ran in {seconds:.1f}s)"
                )
            elif number % args.log_every == 0 or number == args.steps:
                speed = timed_tokens / timed_seconds
                out.log(f"step {number}/{args.steps}  loss {loss:.4f}  {speed:,.0f} tokens/s")
            if args.save_every and number % args.save_every == 0 and number < args.steps:
                self._save(out, number)
        self._save(out, args.steps)
        return {
            "steps": args.steps,
            "loss_first": losses[0],
            "loss_last": losses[-1],
            "tokens_per_s": timed_tokens / timed_seconds if timed_seconds else 0.0,
            "tokens_per_step": batch.tokens,
            "out": str(args.out),
        }

    def _kept(self) -> str:
        if self.saved_step:
            return f"{self.args.out} keeps the checkpoint of step {self.saved_step}"
        return f"nothing was written to {self.args.out}"

    def _save(self, out, step: int) -> None:
        """Writes the parameters after `step` steps to `--out`, if they are all finite."""
        params = self.trainer.state.params
        finite = jax.jit(lambda p: jnp.all(jnp.stack([jnp.isfinite(v).all() for v in p.values()])))
        if not bool(finite(params)):
            raise InputError(
                f"step {step}/{self.args.steps}: the parameters are not finite; stopped, "
                f"{self._kept()}. Lower --lr (now {self.args.lr:g})"
            )
        # Every process takes part in reading the parameters back; process 0 writes them.
        params = {path: fetch(value) for path, value in params.items()}
        if not is_first_process():
            self.saved_step = step
            return
        staged = None
        try:
            with commands.status(out, f"writing the checkpoint of step {step} to {self.args.out}"):
                staged = self._stage(params)
                with signals_deferred():
                    overwrite = self.args.overwrite or self.saved_step > 0
                    replace_directory(staged, self.args.out, overwrite=overwrite)
                    staged, self.saved_step = None, step
        finally:
            if staged is not None:  # interrupted between writing and renaming
                shutil.rmtree(staged, ignore_errors=True)

    def _stage(self, params: dict[str, np.ndarray]) -> Path:
        """The checkpoint (a PEFT adapter folder under `--train-lora`) written into a new
        temporary directory beside `--out`."""
        lora = self.args.train_lora
        if lora is None:
            return stage_checkpoint(
                self.trainer.config,
                params,
                self.args.out,
                scan_layers=self.args.scan_layers,
                hf_config=self.hf_config,
                copy_files=self.keep,
            )
        target = Path(self.args.out).absolute()
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.partial-"))
        try:
            base = self.args.checkpoint or self.args.preset
            write_peft_adapter(params, lora.spec, staged, alpha=lora.alpha, base=base)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        return staged
