"""What a sharded decoder binds and runs: stage plans and its compiled forward's collectives."""

from __future__ import annotations

import math
import sys
from typing import Any

import jax
import jax.numpy as jnp
from rich.console import Console
from rich.table import Table

import boundary_jax as bj
from boundary_jax.report import KINDS, parse_hlo

from ..decoder.model import CausalLM
from ..decoder.moe import MoeCausalLM
from ..layers.lora import LoraSpec
from ..pipeline import PipelineCausalLM, split_microbatches
from ..pipeline.report import pipeline_plan_report
from ..serving.runtime import ShardedCausalLM

# A batch with ragged sequences, so every boundary runs on padded blocks.
PLAN_SEQUENCES = ([1] * 13, [2] * 5, [3] * 9, [4] * 2)
PLAN_TOKENS = sum(len(sequence) for sequence in PLAN_SEQUENCES)


def state_bytes(model: CausalLM, dtype: jnp.dtype) -> dict[str, int]:
    """`{"state_bytes_per_slot": bytes}` of the recurrent state a model keeps per sequence slot,
    or nothing for a model that keeps none."""
    state = model.state_bytes_per_slot(dtype)
    return {"state_bytes_per_slot": state} if state else {}


def batch_description() -> str:
    """The batch whose collectives `collective_report` measures, in words."""
    return f"{PLAN_TOKENS} tokens in {len(PLAN_SEQUENCES)} sequences"


def collective_report(runner: ShardedCausalLM) -> bj.report.CollectiveReport:
    """The collectives of the compiled sharded forward, by layer."""
    compiled = runner.lower_forward(PLAN_SEQUENCES).compile()
    return parse_hlo(compiled.as_text())


def middle_layer(num_layers: int) -> int:
    """A layer that is neither the stack entry nor the terminal layer, where there is one."""
    return num_layers // 2


def middle_sparse_layer(sparse_layers: tuple[bool, ...]) -> int | None:
    """The sparse layer nearest the middle that is neither the first nor the last; None when no
    such layer exists (a dense decoder, or too few layers)."""
    middle = middle_layer(len(sparse_layers))
    inner = [i for i in range(1, len(sparse_layers) - 1) if sparse_layers[i]]
    return min(inner, key=lambda i: abs(i - middle)) if inner else None


def weight_bytes_per_device(runner: ShardedCausalLM) -> list[int]:
    """The bytes of the model's parameters each device of the mesh holds (its shards of every
    parameter; FP8 values count one byte, their scales four), in the mesh's device order."""
    totals = dict.fromkeys(runner.mesh.devices.flat, 0)
    for leaf in jax.tree.leaves(runner.state):
        shard = math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        for device in leaf.sharding.device_set:  # other processes' devices too
            totals[device] += shard
    return list(totals.values())


def plan_report(runner: ShardedCausalLM) -> dict[str, Any]:
    """Every stage's bound plan for the runner's batch variant, measured collectives, and the
    parameter bytes each device holds (`weight_bytes_per_device`).

    `collectives_per_layer` and `bytes_per_layer` are those of `middle_layer` (of an MoE
    decoder, a middle sparse layer; bytes: the sum of each collective's full buffer, see
    `boundary_jax.report`), for a forward of `PLAN_SEQUENCES` (`batch_tokens` tokens in
    `batch_sequences` sequences). In a model built with `scan_layers`, each layer of a scanned run
    reports its run's plans and the collectives of the run's scan body (once per layer).
    `decode_cache` gives the decode cache's kind (`KVCache`, or DeepSeek's `LatentCache`) and
    the bytes one token takes in it on one device, per layer and over the layers that keep
    one, and the bytes of fixed-size recurrent state one sequence slot takes on one device
    (`state_bytes_per_slot`, present where a layer keeps one: Gated DeltaNet's conv and delta
    state). A branch's
    first stage reports its `fork` (from its source's prepared input) in place of entries, and
    its last stage its `merge` (`boundary_jax.report.describe_path`).
    """
    model = runner.model
    variant = (
        bj.BatchVariant.INPUT_SCATTERED if runner.input_scattered else bj.BatchVariant.ORDINARY
    )
    count = model.config.num_layers
    stages = [
        (index, name, boundary.plan)
        for index in range(count)
        for name, boundary in model.layer_structure(index).stages()
    ]
    report = collective_report(runner)
    middle = middle_sparse_layer(model.config.sparse_layers)
    if middle is None:
        middle = middle_layer(count)
    per_layer = model.cache_bytes_per_token(runner.dtype)
    return {
        "architecture": model.config.architecture,
        "mesh": runner.topology.mesh_shape(),
        "moe_ep": runner.topology.moe_ep,
        "moe_dispatch": model.moe_dispatch.value if isinstance(model, MoeCausalLM) else None,
        "scan_layers": model.options.scan_layers,
        "policy": stages[0][2].policy.value,
        "batch": variant.value,
        "batch_tokens": PLAN_TOKENS,
        "batch_sequences": len(PLAN_SEQUENCES),
        "decode_cache": {
            "kind": ", ".join(
                sorted({type(spec).__name__ for spec in model.cache_specs() if spec is not None})
            ),
            "bytes_per_token_per_layer": per_layer,
            "bytes_per_token": per_layer * model.token_cache_layers(),
        }
        | state_bytes(model, runner.dtype),
        "stages": bj.report.describe_stages(stages, variant),
        "middle_layer": middle,
        "collectives_per_layer": report.counts(middle),
        "bytes_per_layer": report.bytes(middle),
        "weight_bytes_per_device": weight_bytes_per_device(runner),
        "lora": lora_report(model.options.lora),
        **bj.report.describe_collectives(report, count),
    }


def lora_report(spec: LoraSpec | None) -> dict[str, Any] | None:
    """The LoRA adapters a model serves (`--lora`): names in index order, stack rank, targets;
    None without adapters."""
    if spec is None:
        return None
    return {
        "adapters": list(spec.names),
        "rank": spec.rank,
        "targets": sorted(t.value for t in spec.targets),
    }


def pipeline_plan(runner: PipelineCausalLM) -> dict[str, Any]:
    """`models.pipeline.report.pipeline_plan_report` of `PLAN_SEQUENCES`, with `batch_tokens`
    and `batch_sequences` those of the microbatch whose compiled programs it measured (the
    first)."""
    packed = runner.pack(PLAN_SEQUENCES)
    first = split_microbatches(packed, runner.microbatches, runner.topology)[0].sequences
    return {
        **pipeline_plan_report(runner, PLAN_SEQUENCES),
        "batch_tokens": sum(len(PLAN_SEQUENCES[index]) for index in first),
        "batch_sequences": len(first),
    }


def print_pipeline_plan(report: dict[str, Any], console: Console | None = None) -> None:
    """Prints `models.pipeline.report.pipeline_plan_report`: the schedule, then each stage's
    plans, collectives and handoff as `print_plan` does."""
    console = console or Console(width=None if sys.stdout.isatty() else 120)
    console.print(
        f"[bold]{report['architecture']}[/] in {len(report['pipeline_stages'])} pipeline stages "
        f"(layers {report['split']}) on mesh {report['mesh']}, {report['microbatches']} "
        f"microbatches, GPipe bubble {report['bubble']:.0%}"
    )
    for stage in report["pipeline_stages"]:
        handoff = stage["handoff"]
        sends = (
            "the final norm and LM head"
            if handoff is None
            else f"hands on {handoff['tensors']}: {handoff['bytes_per_token']} bytes per token, "
            f"{handoff['bytes_per_token_per_attn_tp_rank']} per attention-TP rank"
        )
        console.print(f"[bold]stage {stage['stage']}[/]: layers {stage['layers']}, then {sends}")
        print_plan(
            {**report, **stage, "collectives_by_layer": stage["collectives_by_layer"] or []},
            console,
            title=False,
        )


def print_plan(
    report: dict[str, Any], console: Console | None = None, *, title: bool = True
) -> None:
    """Prints `plan_report` as tables (`title`: with the model and mesh line)."""
    console = console or Console(width=None if sys.stdout.isatty() else 120)
    if title:
        console.print(
            f"[bold]{report['architecture']}[/] on mesh {report['mesh']}, policy "
            f"{report['policy']}, {report['batch']} batch"
        )
        cache = report["decode_cache"]
        console.print(
            f"decode cache: {cache['kind']}, {cache['bytes_per_token_per_layer']:,} bytes per "
            f"token per layer on each device ({cache['bytes_per_token']:,} over its layers)"
            + (
                f", and {cache['state_bytes_per_slot']:,} bytes of recurrent state per sequence "
                "slot"
                if "state_bytes_per_slot" in cache
                else ""
            )
        )
        weights = report["weight_bytes_per_device"]
        console.print(
            f"parameter bytes per device: {min(weights):,}"
            + (f" to {max(weights):,}" if max(weights) != min(weights) else "")
        )
        lora = report.get("lora")
        if lora is not None:
            console.print(
                f"LoRA adapters {', '.join(lora['adapters'])} (indices 1..{len(lora['adapters'])}"
                f"), stacks of rank {lora['rank']} on {', '.join(lora['targets'])}"
            )
    table = Table(title="bound stage plans")
    for column in (
        "layer",
        "stage",
        "input: completes",
        "fused with add+norm",
        "moves input",
        "exit (first eligible option)",
    ):
        table.add_column(column)
    for stage in report["stages"]:
        option = stage["exit_options"][0]
        exit = f"{option['exit']}: {option['runs']}"
        if "merge" in stage:
            exit += f"; merges onto {stage['merge']['into_residual_rows']}"
        if "fork" in stage:  # a branch's first stage: no entry, its source's prepared input
            fork = stage["fork"]
            row = (f"fork from {fork['source_input_rows']}: nothing", "-", fork["moves_input"])
        else:
            entry = next(e for e in stage["entries"] if e["primary"])
            row = (
                f"{entry['from']}: {entry['completes']}",
                entry["fused_with_add_norm"],
                entry["moves_input"],
            )
        table.add_row(str(stage["layer"]), stage["stage"], *row, exit)
    console.print(table)
    for stage in report["stages"]:
        for part, where in stage.get("replicated", {}).items():
            console.print(f"layer {stage['layer']} {stage['stage']}: {part} {where}")
    batch = f"{report['batch_tokens']} tokens in {report['batch_sequences']} sequences"
    counts = Table(title=f"collectives per layer (compiled HLO; bytes for a batch of {batch})")
    counts.add_column("layer")
    for kind in KINDS:
        counts.add_column(kind)
    counts.add_column("bytes")
    for layer in report["collectives_by_layer"]:
        sequence = layer["sequence"]
        counts.add_row(
            str(layer["layer"]), *(str(sequence.count(kind)) for kind in KINDS), str(layer["bytes"])
        )
    console.print(counts)
