"""The main job: a small dense decoder, a small MoE decoder and a small DeepSeek-V3-style decoder
(latent attention, DeepSeek's MoE) with random weights under several layouts (the MoE ones also
with their experts split over expert parallelism, gathered or sent all-to-all; the DeepSeek one
also with its dense layer fully data-parallel), each checked against one device, with the
collectives each layout runs and its compile and step times."""

from __future__ import annotations

import dataclasses
import sys
import time

import jax
import numpy as np
from rich.console import Console
from rich.table import Table

import boundary_jax as bj
from boundary_jax.report import KINDS

from ..build import build_model
from ..config import PRESETS, DecoderConfig
from ..serving.runtime import ShardedCausalLM
from .plan import collective_report, middle_layer, middle_sparse_layer

PRESET = "tiny-qwen3"
MOE_PRESET = "tiny-qwen3-moe"
MLA_PRESET = "tiny-deepseek-v3"
P = bj.ReductionPolicy
GATHER, ALL_TO_ALL = bj.MoeDispatch.GATHER, bj.MoeDispatch.ALL_TO_ALL


@dataclasses.dataclass(frozen=True)
class Layout:
    """One parallel configuration of the demo.

    Attributes:
      moe_ep: Expert-parallel size of an MoE model's sparse layers (1: every rank holds every
        expert, a slice of its width).
      moe_dispatch: Where the experts get their tokens; None for the dense model.
      dense_ffn_dp: The DeepSeek model's dense layer runs fully data-parallel.
    """

    name: str
    attn_dp: int
    attn_tp: int
    input_scattered: bool = False
    policy: bj.ReductionPolicy = P.AUTO
    moe_ep: int = 1
    moe_dispatch: bj.MoeDispatch | None = None
    dense_ffn_dp: bool = False


LAYOUTS = (
    Layout("TP 8", 1, 8),
    Layout("attention DP 2 x TP 4", 2, 4),
    Layout("attention DP 2 x TP 4, ar", 2, 4, policy=P.AR),
    Layout("input-scattered TP 4", 1, 4, input_scattered=True),
    Layout("attention DP 8", 8, 1),
)
MOE_LAYOUTS = tuple(dataclasses.replace(layout, moe_dispatch=GATHER) for layout in LAYOUTS) + (
    Layout("TP 8, EP 8 gather", 1, 8, moe_ep=8, moe_dispatch=GATHER),
    Layout("attention DP 2 x TP 4, EP 8 all-to-all", 2, 4, moe_ep=8, moe_dispatch=ALL_TO_ALL),
    Layout("attention DP 2 x TP 4, EP 2 all-to-all", 2, 4, moe_ep=2, moe_dispatch=ALL_TO_ALL),
    Layout("attention DP 8, EP 8 all-to-all", 8, 1, moe_ep=8, moe_dispatch=ALL_TO_ALL),
)
"""The MoE model's layouts: the dense ones (experts whole on every rank, their width split over
the TP group) and expert parallelism in both dispatch modes (with EP 2 all-to-all, each
expert's width split over attention TP 4)."""
MLA_LAYOUTS = (
    Layout("TP 8", 1, 8, moe_dispatch=GATHER),
    Layout("attention DP 2 x TP 4, dense FFN DP", 2, 4, moe_dispatch=GATHER, dense_ffn_dp=True),
    Layout("input-scattered TP 4", 1, 4, input_scattered=True, moe_dispatch=GATHER),
    Layout("TP 8, EP 8 gather", 1, 8, moe_ep=8, moe_dispatch=GATHER),
    Layout("attention DP 2 x TP 4, EP 8 all-to-all", 2, 4, moe_ep=8, moe_dispatch=ALL_TO_ALL),
)
"""The DeepSeek model's layouts: heads over attention TP, its dense layer over the TP group or
fully data-parallel, its experts whole or over EP."""


def demo_config(preset: str, layers: int) -> DecoderConfig:
    """`preset` with `layers` decoder layers (its dense-only layers kept where they exist)."""
    config = PRESETS[preset]
    moe = config.moe
    if moe is not None:
        dense = tuple(layer for layer in moe.mlp_only_layers if layer < layers)
        moe = dataclasses.replace(moe, mlp_only_layers=dense)
    return dataclasses.replace(config, num_layers=layers, moe=moe)


def demo_prompts(vocab_size: int) -> list[list[int]]:
    """Ragged prompts: uneven lengths, so attention-DP ranks get uneven token counts."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab_size, length).tolist() for length in (11, 3, 17, 6, 1, 9)]


def _step_time(runner: ShardedCausalLM, packed, repeats: int = 10) -> float:
    runner.forward_rows(packed).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.forward_rows(packed).block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _run_layout(
    config: DecoderConfig, layout: Layout, prompts, expected: np.ndarray, middle: int, console
) -> dict:
    """One layout of one model: built, compiled, checked against `expected`, timed."""
    topology = bj.Topology(attn_dp=layout.attn_dp, attn_tp=layout.attn_tp, moe_ep=layout.moe_ep)
    with console.status(f"{layout.name}: building and compiling"):
        model = build_model(
            config,
            topology,
            reduction=layout.policy,
            moe_dispatch=layout.moe_dispatch,
            dense_ffn_dp=layout.dense_ffn_dp,
        )
        runner = ShardedCausalLM(
            model, bj.make_mesh(topology), input_scattered=layout.input_scattered
        )
        start = time.perf_counter()
        report = collective_report(runner)
        compile_seconds = time.perf_counter() - start
    with console.status(f"{layout.name}: running"):
        packed = runner.pack(prompts)
        logits = packed.unpack(jax.device_get(runner.forward_rows(packed)))
        step = _step_time(runner, packed)
    return {
        "model": config.architecture.value,
        "layout": layout.name,
        "mesh": f"attn_dp={layout.attn_dp}, attn_tp={layout.attn_tp}, moe_ep={layout.moe_ep}",
        "policy": model.layers[0].ffn_boundary.plan.policy.value,
        "max_abs_logit_diff": float(np.max(np.abs(logits - expected))),
        "logit_scale": float(np.max(np.abs(expected))),
        "middle_layer": middle,
        "collectives": report.counts(middle),
        "bytes": report.bytes(middle),
        "compile_s": compile_seconds,
        "step_ms": step * 1e3,
    }


def _layout_table(row: dict) -> Table:
    table = Table(title=f"{row['model']}, {row['layout']}: {row['mesh']}, policy {row['policy']}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("max |logit diff| vs 1 device", f"{row['max_abs_logit_diff']:.2e}")
    for kind in KINDS:
        table.add_row(f"{kind} in layer {row['middle_layer']}", str(row["collectives"][kind]))
    table.add_row(f"collective bytes in layer {row['middle_layer']}", f"{row['bytes']:,}")
    table.add_row("compile", f"{row['compile_s']:.2f} s")
    table.add_row("step (median of 10)", f"{row['step_ms']:.2f} ms")
    return table


def run_demo(*, layers: int = 4, console: Console | None = None) -> list[dict]:
    """Runs every layout of the three models, prints one table per layout and a summary;
    returns the rows."""
    console = console or Console(stderr=True)
    out = Console(width=None if sys.stdout.isatty() else 120)
    runs = ((PRESET, LAYOUTS), (MOE_PRESET, MOE_LAYOUTS), (MLA_PRESET, MLA_LAYOUTS))
    out.print(
        f"[bold]boundary-jax demo[/]: {PRESET}, {MOE_PRESET} and {MLA_PRESET} ({layers} layers, "
        f"random weights), {len(demo_prompts(PRESETS[PRESET].vocab_size))} ragged prompts, "
        f"{len(jax.devices())} simulated {jax.default_backend()} devices"
    )
    rows = []
    for preset, layouts in runs:
        config = demo_config(preset, layers)
        prompts = demo_prompts(config.vocab_size)
        single = bj.Topology()
        with console.status(f"{preset}: single-device reference"):
            reference = ShardedCausalLM(build_model(config, single), bj.make_mesh(single))
            expected = reference.forward(prompts)
        middle = middle_sparse_layer(config.sparse_layers)
        middle = middle_layer(layers) if middle is None else middle
        for layout in layouts:
            row = _run_layout(config, layout, prompts, expected, middle, console)
            rows.append(row)
            out.print(_layout_table(row))
    middles = " / ".join(sorted({str(row["middle_layer"]) for row in rows}))
    summary = Table(title=f"summary (collectives of layer {middles}; sparse in the MoE models)")
    columns = ("model", "layout", "max |diff|", "AR", "RS", "AG", "A2A", "bytes", "compile")
    for column in (*columns, "step"):
        summary.add_column(column, justify="left" if column in ("model", "layout") else "right")
    for row in rows:
        counts = row["collectives"]
        summary.add_row(
            row["model"].removesuffix("ForCausalLM"),
            row["layout"],
            f"{row['max_abs_logit_diff']:.1e}",
            str(counts["all-reduce"]),
            str(counts["reduce-scatter"]),
            str(counts["all-gather"]),
            str(counts["all-to-all"]),
            f"{row['bytes']:,}",
            f"{row['compile_s']:.2f} s",
            f"{row['step_ms']:.1f} ms",
        )
    out.print(summary)
    bad = [row for row in rows if row["max_abs_logit_diff"] > 1e-4 * row["logit_scale"]]
    verdict = "match" if not bad else f"DIFFER ({', '.join(r['layout'] for r in bad)})"
    worst = max(row["max_abs_logit_diff"] / row["logit_scale"] for row in rows)
    out.print(
        f"all {len(rows)} layouts {verdict} their model's single-device logits (worst "
        f"{worst:.1e} relative to the largest logit)"
    )
    return rows
