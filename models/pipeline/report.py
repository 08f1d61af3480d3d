"""What a pipeline binds and runs: per stage its layers, bound plans, compiled collectives and
what it hands the next stage per token, and the schedule's bubble."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

import boundary_jax as bj
from boundary_jax.report import parse_hlo

from ..decoder.moe import MoeCausalLM
from ..distributed import gather_json
from .runtime import PipelineCausalLM


def pipeline_plan_report(
    runner: PipelineCausalLM, sequences: Sequence[Sequence[int]]
) -> dict[str, Any]:
    """The pipeline's plan for a forward of `sequences` (one microbatch per the runner's
    setting).

    Returns a dict with the split, microbatches and GPipe bubble, and per stage: its layers, its
    layers' bound plans (`boundary_jax.report.describe_stages`), the collectives its compiled
    program runs per layer (compiled by a process that holds the stage, gathered by every
    process), and its handoff to the next stage: the tensors `to_pp` sends, their bytes per
    token and the bytes each attention-TP rank sends per token (it sends its slice of the rows,
    the receiver gathers).
    """
    variant = (
        bj.BatchVariant.INPUT_SCATTERED if runner.input_scattered else bj.BatchVariant.ORDINARY
    )
    batch = runner.place(sequences)
    tp = runner.topology.attn_tp
    reports, inputs = [], {}
    for index, stage in enumerate(runner.stages):
        model = stage.model
        program = runner.forward_program(stage)
        rows, facts = batch.placed[index][0]
        out = jax.eval_shape(program, stage.leaves, inputs, rows, facts)
        collectives = None
        if stage.held:
            compiled = program.lower(stage.leaves, inputs, rows, facts).compile()
            hlo = parse_hlo(compiled.as_text())
            collectives = bj.report.describe_collectives(hlo, runner.config.num_layers)[
                "collectives_by_layer"
            ]
            collectives = [entry for entry in collectives if entry["layer"] in stage.layers]
        handoff = None
        if not stage.last:
            tokens = rows.ids.shape[0]
            per_token = sum(
                int(np.prod(leaf.shape[1:])) * leaf.dtype.itemsize for leaf in jax.tree.leaves(out)
            )
            handoff = {
                "tensors": {name: list(leaf.shape[1:]) for name, leaf in out.items()},
                "bytes_per_token": per_token,
                "bytes_per_token_per_attn_tp_rank": per_token // tp
                if tokens % tp == 0
                else per_token,
            }
            target = runner.stages[index + 1]
            inputs = jax.tree.map(
                lambda leaf, t=target: jax.ShapeDtypeStruct(
                    leaf.shape, leaf.dtype, sharding=NamedSharding(t.mesh, t.rows)
                ),
                out,
            )
        plans = [
            (layer, name, boundary.plan)
            for layer in stage.layers
            for name, boundary in model.layer_structure(layer).stages()
        ]
        reports.append(
            {
                "stage": index,
                "layers": [stage.layers.start, stage.layers.stop],
                "stages": bj.report.describe_stages(plans, variant),
                "collectives_by_layer": collectives,
                "handoff": handoff,
            }
        )
    # A stage compiles only on the processes that hold its devices.
    held = gather_json([report["collectives_by_layer"] for report in reports])
    for index, report in enumerate(reports):
        report["collectives_by_layer"] = next(
            stages[index] for stages in held if stages[index] is not None
        )
    first = runner.stages[0].model
    return {
        "architecture": runner.config.architecture,
        "mesh": runner.topology.mesh_shape(),
        "moe_ep": runner.topology.moe_ep,
        "moe_dispatch": first.moe_dispatch.value if isinstance(first, MoeCausalLM) else None,
        "policy": _policy(runner),
        "batch": variant.value,
        "split": list(runner.split.sizes),
        "microbatches": runner.microbatches,
        "bubble": runner.bubble,
        "pipeline_stages": reports,
    }


def _policy(runner: PipelineCausalLM) -> str:
    model = runner.stages[0].model
    _, boundary = model.layer_structure(model.layer_range.start).stages()[0]
    return boundary.plan.policy.value
