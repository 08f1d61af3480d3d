"""The command line's LoRA adapters: `--lora NAME=DIR` (repeatable; `--lora DIR` is named after
its folder) loads PEFT adapters over the checkpoint, and a prompt picks its adapter with
`--adapter NAME` (every prompt) or in its input file: an object `{"ids": [...], "adapter":
"NAME"}` in place of a list of ids (`--input-ids`, `--prompt-ids`), or a `.jsonl` prompt file of
`{"prompt": "...", "adapter": "NAME"}` lines (`--prompt-file`). A prompt without one runs the base
model. `train --train-lora r=16,alpha=32,targets=q,k,v,o` trains one adapter over a frozen base."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from ..layers.lora import LoraSpec, LoraTarget
from ..weights import read_json
from ..weights.peft import ADAPTER_CONFIG
from .options import InputError


def lora_source(text: str) -> tuple[str, str]:
    """`--lora NAME=DIR` or `--lora DIR` (named after its folder) as (name, folder)."""
    name, separator, folder = text.partition("=")
    if not separator:
        folder = text
        name = Path(text.rstrip("/")).name
    if not name or not folder:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR or DIR; got {text!r}")
    return name, folder


def add_lora_args(command: argparse.ArgumentParser, *, prompts: bool) -> None:
    """`--lora` (and, for a command with prompts, `--adapter`) on `command`."""
    command.add_argument(
        "--lora",
        type=lora_source,
        action="append",
        metavar="NAME=DIR",
        help="a PEFT LoRA adapter folder served over the checkpoint (repeat for several; DIR "
        "alone is named after its folder)",
    )
    if prompts:
        command.add_argument(
            "--adapter",
            help="the --lora adapter every prompt runs through (per prompt: an object "
            '{"ids": [...], "adapter": NAME} in the ids file, or a .jsonl --prompt-file of '
            '{"prompt": ..., "adapter": NAME} lines)',
        )


def lora_sources(args: argparse.Namespace) -> dict[str, str] | None:
    """`{name: folder}` of the `--lora` options, checked; None without any.

    Raises:
      InputError: A name given twice, a folder without `adapter_config.json`, or adapters on
        a `--preset` (adapters are trained over a checkpoint).
    """
    given = getattr(args, "lora", None)
    if not given:
        return None
    if args.checkpoint is None:
        raise InputError("--lora adapts a checkpoint's weights; pass --checkpoint, not --preset")
    sources: dict[str, str] = {}
    for name, folder in given:
        if name in sources:
            raise InputError(f"--lora: the adapter name {name!r} is given twice")
        if not (Path(folder) / ADAPTER_CONFIG).is_file():
            raise InputError(f"--lora {name}={folder}: no {ADAPTER_CONFIG} in {folder}")
        sources[name] = folder
    return sources


def ids_entry(entry: object) -> tuple[object, object]:
    """An ids file's entry as (ids, adapter name or None): a list of ids, or an object
    `{"ids": [...], "adapter": NAME}` (anything else gives ids None, for the caller to refuse)."""
    if isinstance(entry, dict):
        if set(entry) - {"ids", "adapter"} or "ids" not in entry:
            return None, None
        return entry["ids"], entry.get("adapter")
    return entry, None


def prompt_line(line: str, file: Path) -> tuple[str, str | None]:
    """A `.jsonl` prompt file's line as (prompt, adapter name or None)."""
    try:
        entry = json.loads(line)
    except ValueError as error:
        raise InputError(f"--prompt-file {file}: a line is not JSON ({error})") from None
    if not (
        isinstance(entry, dict)
        and isinstance(entry.get("prompt"), str)
        and not set(entry) - {"prompt", "adapter"}
    ):
        raise InputError(
            f'--prompt-file {file}: each .jsonl line is {{"prompt": TEXT, "adapter": NAME}} '
            f"(adapter optional); got {line[:60]!r}"
        )
    return entry["prompt"], entry.get("adapter")


def prompt_adapters(
    args: argparse.Namespace, ids_option: str, count: int
) -> list[str | None] | None:
    """Each of the `count` prompts' adapter name: from `--adapter`, or from the ids file or
    `.jsonl` prompt file; None where no prompt names one.

    Raises:
      InputError: Bad `--lora` options (`lora_sources`), an adapter named both ways, a name
        that is not a string or is not loaded with `--lora`.
    """
    loaded = list(lora_sources(args) or {})
    per_prompt: list[object] = [None] * count
    ids_path = getattr(args, ids_option.removeprefix("--").replace("-", "_"))
    if ids_path is not None:
        per_prompt = [ids_entry(entry)[1] for entry in read_json(ids_path)]
    elif args.prompt_file is not None and args.prompt_file.endswith(".jsonl"):
        lines = Path(args.prompt_file).read_text(encoding="utf-8").splitlines()
        per_prompt = [prompt_line(line, Path(args.prompt_file))[1] for line in lines if line]
    named = any(a is not None for a in per_prompt)
    if args.adapter is not None:
        if named:
            raise InputError(
                "--adapter names one adapter for every prompt, but the input names adapters "
                "per prompt; drop one of them"
            )
        per_prompt = [args.adapter] * count
    if not any(a is not None for a in per_prompt):
        return None
    for name in per_prompt:
        if name is not None and (not isinstance(name, str) or name not in loaded):
            raise InputError(
                f"the prompts name the LoRA adapter {name!r}, which is not loaded; the --lora "
                f"adapters are {loaded}. Load it with --lora NAME=DIR"
            )
    return per_prompt


TARGET_NAMES = {
    "q": LoraTarget.Q,
    "k": LoraTarget.K,
    "v": LoraTarget.V,
    "o": LoraTarget.OUT,
    "gate": LoraTarget.GATE,
    "up": LoraTarget.UP,
    "down": LoraTarget.DOWN,
}
TRAINED_ADAPTER = "trained"
"""The name of the adapter `train --train-lora` trains (its stacks hold that one adapter)."""


@dataclasses.dataclass(frozen=True)
class LoraTraining:
    """`train --train-lora r=R,alpha=A,targets=q,k,...`: a LoRA adapter trained over a frozen
    base, written as a PEFT folder.

    Attributes:
      spec: The model's stacks: one adapter of rank `r` on the targets, its delta scaled by
        alpha / r (`LoraSpec.scaling`: B trains in PEFT's units).
      alpha: PEFT's `lora_alpha`.
    """

    spec: LoraSpec
    alpha: float


def lora_training(text: str) -> LoraTraining:
    """`--train-lora r=16,alpha=32,targets=q,k,v,o` (targets among q k v o gate up down)."""
    fields: dict[str, list[str]] = {}
    key = None
    for item in text.split(","):
        name, separator, value = item.partition("=")
        if separator:
            key = name.strip()
            fields[key] = [value.strip()]
        elif key == "targets":
            fields[key].append(item.strip())
        else:
            raise argparse.ArgumentTypeError(f"expected r=R,alpha=A,targets=q,k,...; got {text!r}")
    if set(fields) != {"r", "alpha", "targets"}:
        raise argparse.ArgumentTypeError(
            f"--train-lora takes r=, alpha= and targets= (e.g. r=16,alpha=32,targets=q,k,v,o); "
            f"got {sorted(fields)}"
        )
    unknown = [t for t in fields["targets"] if t not in TARGET_NAMES]
    try:
        rank, alpha = int(fields["r"][0]), float(fields["alpha"][0])
    except ValueError:
        raise argparse.ArgumentTypeError(f"r is an int and alpha a number; got {text!r}") from None
    if unknown or rank < 1 or alpha <= 0:
        raise argparse.ArgumentTypeError(
            f"r >= 1, alpha > 0 and targets among {sorted(TARGET_NAMES)}; got r={rank}, "
            f"alpha={alpha}, unknown targets {unknown}"
        )
    targets = frozenset(TARGET_NAMES[t] for t in fields["targets"])
    return LoraTraining(LoraSpec((TRAINED_ADAPTER,), rank, targets, alpha / rank), alpha)
