"""The main job: a small decoder with random weights under several layouts, checked against
one device, with the collectives each layout runs and its compile and step times."""

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

from .config import PRESETS
from .report import collective_report, middle_layer
from .runtime import ShardedCausalLM, build_model

PRESET = "tiny-qwen3"
P = bj.ReductionPolicy


@dataclasses.dataclass(frozen=True)
class Layout:
    """One parallel configuration of the demo."""

    name: str
    attn_dp: int
    attn_tp: int
    input_scattered: bool = False
    policy: bj.ReductionPolicy = P.AUTO


LAYOUTS = (
    Layout("TP 8", 1, 8),
    Layout("attention DP 2 x TP 4", 2, 4),
    Layout("attention DP 2 x TP 4, ar", 2, 4, policy=P.AR),
    Layout("input-scattered TP 4", 1, 4, input_scattered=True),
    Layout("attention DP 8", 8, 1),
)


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


def run_demo(*, layers: int = 4, console: Console | None = None) -> list[dict]:
    """Runs every layout, prints one table per layout and a summary; returns the rows."""
    console = console or Console(stderr=True)
    out = Console(width=None if sys.stdout.isatty() else 100)
    config = dataclasses.replace(PRESETS[PRESET], num_layers=layers)
    prompts = demo_prompts(config.vocab_size)
    single = bj.Topology()
    with console.status("single-device reference"):
        reference = ShardedCausalLM(build_model(config, single), bj.make_mesh(single))
        expected = reference.forward(prompts)
    out.print(
        f"[bold]boundary-jax demo[/]: {PRESET} ({layers} layers, random weights), "
        f"{len(prompts)} ragged prompts, {len(jax.devices())} simulated {jax.default_backend()} "
        "devices"
    )
    rows = []
    for layout in LAYOUTS:
        topology = bj.Topology(attn_dp=layout.attn_dp, attn_tp=layout.attn_tp)
        with console.status(f"{layout.name}: building and compiling"):
            model = build_model(config, topology, reduction=layout.policy)
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
        middle = middle_layer(layers)
        row = {
            "layout": layout.name,
            "mesh": f"attn_dp={layout.attn_dp}, attn_tp={layout.attn_tp}",
            "policy": model.layers[0].ffn_boundary.plan.policy.value,
            "max_abs_logit_diff": float(np.max(np.abs(logits - expected))),
            "collectives": report.counts(middle),
            "bytes": report.bytes(middle),
            "compile_s": compile_seconds,
            "step_ms": step * 1e3,
        }
        rows.append(row)
        table = Table(title=f"{layout.name}: {row['mesh']}, policy {row['policy']}")
        table.add_column("measure")
        table.add_column("value", justify="right")
        table.add_row("max |logit diff| vs 1 device", f"{row['max_abs_logit_diff']:.2e}")
        for kind in KINDS:
            table.add_row(f"{kind} per layer", str(row["collectives"][kind]))
        table.add_row("collective bytes per layer", f"{row['bytes']:,}")
        table.add_row("compile", f"{compile_seconds:.2f} s")
        table.add_row("step (median of 10)", f"{row['step_ms']:.2f} ms")
        out.print(table)
    summary = Table(title=f"summary (collectives of layer {middle_layer(layers)})")
    for column in ("layout", "max |diff|", "AR", "RS", "AG", "bytes", "compile", "step"):
        summary.add_column(column, justify="left" if column == "layout" else "right")
    for row in rows:
        counts = row["collectives"]
        summary.add_row(
            row["layout"],
            f"{row['max_abs_logit_diff']:.1e}",
            str(counts["all-reduce"]),
            str(counts["reduce-scatter"]),
            str(counts["all-gather"]),
            f"{row['bytes']:,}",
            f"{row['compile_s']:.2f} s",
            f"{row['step_ms']:.1f} ms",
        )
    out.print(summary)
    worst = max(row["max_abs_logit_diff"] for row in rows)
    scale = float(np.max(np.abs(expected)))
    verdict = "match" if worst <= 1e-4 * scale else "DIFFER"
    out.print(
        f"all {len(rows)} layouts {verdict} the single-device logits "
        f"(worst {worst:.2e}, logits up to {scale:.1f}); collectives counted in layer {middle}"
    )
    return rows
