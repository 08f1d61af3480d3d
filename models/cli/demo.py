"""The main job: a small dense decoder, a small MoE decoder, a small hybrid (Nemotron-H)
stack, a small DeepSeek-V3-style decoder (latent attention, DeepSeek's MoE) and a small GPT-OSS
(attention sinks, alternating windows, biased clamped-SwiGLU experts) with random
weights under several layouts (the MoE ones also with their experts split over expert
parallelism, gathered or sent all-to-all; the DeepSeek one also with its dense layer fully
data-parallel), each checked against one device, with the collectives each layout runs and
its compile and step times.

It runs on any machine: each layout goes on the machine's accelerators where it fits (on a
machine with accelerators, also on one of them, and on all of them where they divide the heads)
and on 8 simulated CPU devices otherwise; the reference runs on one CPU device (float32 exactly).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import jax
import numpy as np
from rich.console import Console
from rich.table import Table

import boundary_jax as bj
from boundary_jax.report import KINDS

from ..build import build_model
from ..config import PRESETS, DecoderConfig, HybridConfig, HybridLayer
from ..layers.attention.self_attention import AttentionImpl
from ..options import BuildOptions
from ..serving.runtime import ShardedCausalLM
from .plan import batch_description, collective_report, middle_layer, middle_sparse_layer

PRESET = "tiny-qwen3"
MOE_PRESET = "tiny-qwen3-moe"
HYBRID_PRESET = "tiny-nemotron-h"
MLA_PRESET = "tiny-deepseek-v3"
GPT_OSS_PRESET = "tiny-gpt-oss"
DELTA_PRESET = "tiny-qwen3-next"
KIMI_PRESET = "tiny-kimi-linear"
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

    @property
    def size(self) -> int:
        """Devices the layout's mesh holds."""
        return self.attn_dp * self.attn_tp


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
HYBRID_LAYOUTS = tuple(
    dataclasses.replace(layout, moe_dispatch=GATHER) for layout in LAYOUTS[:3]
) + (
    Layout("TP 8, EP 8 gather", 1, 8, moe_ep=8, moe_dispatch=GATHER),
    Layout("attention DP 2 x TP 4, EP 2 gather", 2, 4, moe_ep=2, moe_dispatch=GATHER),
    Layout("attention DP 2 x TP 4, EP 8 all-to-all", 2, 4, moe_ep=8, moe_dispatch=ALL_TO_ALL),
)
"""The hybrid model's layouts: its MoE layers on gathered rows, their experts whole or split
over EP, or sent all-to-all (the mixers then gather their input back over attention TP).
Under the gather dispatch its mixers read their own rows, so neither input-scattered rows nor
a fully data-parallel dense FFN (attention DP 8) precede one."""
MLA_LAYOUTS = (
    Layout("TP 8", 1, 8, moe_dispatch=GATHER),
    Layout("attention DP 2 x TP 4, dense FFN DP", 2, 4, moe_dispatch=GATHER, dense_ffn_dp=True),
    Layout("input-scattered TP 4", 1, 4, input_scattered=True, moe_dispatch=GATHER),
    Layout("TP 8, EP 8 gather", 1, 8, moe_ep=8, moe_dispatch=GATHER),
    Layout("attention DP 2 x TP 4, EP 8 all-to-all", 2, 4, moe_ep=8, moe_dispatch=ALL_TO_ALL),
)
"""The DeepSeek model's layouts: heads over attention TP, its dense layer over the TP group or
fully data-parallel, its experts whole or over EP."""
GPT_OSS_LAYOUTS = (
    Layout("TP 4", 1, 4, moe_dispatch=GATHER),
    Layout("TP 8, EP 8 gather", 1, 8, moe_ep=8, moe_dispatch=GATHER),
    Layout("attention DP 2 x TP 4, EP 4 all-to-all", 2, 4, moe_ep=4, moe_dispatch=ALL_TO_ALL),
    Layout("attention DP 8, EP 8 all-to-all", 8, 1, moe_ep=8, moe_dispatch=ALL_TO_ALL),
)
"""The GPT-OSS model's layouts: its sinks split with their heads, its o bias counted on one
attention-TP rank, its experts (and their biases) whole, over EP with gathered rows, or sent
all-to-all (with EP 4 on DP 2 x TP 4, each expert's width split over 2 ranks)."""
DELTA_LAYOUTS = (
    Layout("TP 4", 1, 4, moe_dispatch=GATHER),
    Layout("input-scattered TP 4", 1, 4, input_scattered=True, moe_dispatch=GATHER),
    Layout("attention DP 2 x TP 4, EP 8 all-to-all", 2, 4, moe_ep=8, moe_dispatch=ALL_TO_ALL),
)
"""Qwen3-Next's layouts: its Gated DeltaNet layers' key heads (with their value heads and conv
channels) over attention TP, on ordinary and input-scattered rows, its experts gathered or sent
all-to-all."""
KIMI_LAYOUTS = (
    Layout("TP 4", 1, 4, moe_dispatch=GATHER),
    Layout("attention DP 2 x TP 4, EP 8 all-to-all", 2, 4, moe_ep=8, moe_dispatch=ALL_TO_ALL),
)
"""Kimi-Linear's layouts: its Kimi Delta Attention heads and latent attention heads over
attention TP, its experts gathered or sent all-to-all."""
SIMULATED_CPUS = 8
"""CPU devices the demo simulates for the layouts the machine's accelerators cannot hold."""


@dataclasses.dataclass(frozen=True)
class DemoDevices:
    """The devices the demo runs on.

    Attributes:
      accelerators: The machine's accelerators (GPUs, TPUs); none on a CPU-only machine.
      cpus: The (simulated) CPU devices: the layouts the accelerators cannot hold run there,
        and the single-device reference on the first.
    """

    accelerators: tuple[jax.Device, ...]
    cpus: tuple[jax.Device, ...]

    @classmethod
    def of_machine(cls) -> DemoDevices:
        """The default backend's devices as accelerators (none when it is the CPU) and the CPU
        backend's (`jax_num_cpu_devices` set before the backends start).

        Raises:
          ValueError: JAX runs without its CPU backend (`JAX_PLATFORMS` leaves it out).
        """
        default = tuple(jax.devices())
        accelerators = () if default[0].platform == "cpu" else default
        try:
            cpus = tuple(jax.devices("cpu"))
        except RuntimeError:
            raise ValueError(
                "the demo runs the layouts the accelerators cannot hold on simulated CPU devices, "
                f"and JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')!r} leaves out the CPU; add "
                "it (e.g. JAX_PLATFORMS=cuda,cpu)"
            ) from None
        return cls(accelerators, cpus)

    def layouts(self, base: tuple[Layout, ...]) -> tuple[Layout, ...]:
        """`base`, after (on a machine with accelerators) one device and TP over all of them
        where that is between 2 and 8 ranks dividing the models' 8 heads; an MoE model's (its
        `base` has a dispatch) gather their experts."""
        count = len(self.accelerators)
        if not count:
            return base
        dispatch = base[0].moe_dispatch
        extra = [Layout("1 device", 1, 1, moe_dispatch=dispatch)]
        if 1 < count < 8 and 8 % count == 0:
            extra.append(Layout(f"TP {count}", 1, count, moe_dispatch=dispatch))
        return (*extra, *base)

    def for_layout(self, layout: Layout) -> tuple[jax.Device, ...]:
        """The accelerators where the layout fits on them, else the CPU devices."""
        pool = self.accelerators if len(self.accelerators) >= layout.size else self.cpus
        if len(pool) < layout.size:
            raise ValueError(
                f"the layout {layout.name!r} needs {layout.size} devices; the demo has "
                f"{len(self.accelerators)} accelerators and {len(self.cpus)} CPU devices"
            )
        return pool[: layout.size]

    def describe(self) -> str:
        """The machine's devices in words."""
        cpus = f"{len(self.cpus)} simulated cpu devices"
        if not self.accelerators:
            return cpus
        first = self.accelerators[0]
        return f"{len(self.accelerators)} {first.platform} ({first.device_kind}) and {cpus}"


def devices_label(devices: tuple[jax.Device, ...]) -> str:
    """`8 cpu` or `1 gpu`: how many devices of which platform."""
    return f"{len(devices)} {devices[0].platform}"


def demo_config(preset: str, layers: int) -> DecoderConfig:
    """`preset` with `layers` decoder layers (its dense-only layers kept where they exist; a
    hybrid stack's pattern, or its linear-attention layers', repeated or cut to `layers`)."""
    config = PRESETS[preset]
    hybrid = config.hybrid
    if hybrid is not None:
        kinds = (hybrid.layers * layers)[:layers]
        mamba = hybrid.mamba if HybridLayer.MAMBA2 in kinds else None
        moe = hybrid.moe if HybridLayer.MOE in kinds else None
        return dataclasses.replace(
            config, num_layers=layers, hybrid=HybridConfig(kinds, mamba, moe)
        )
    moe = config.moe
    if moe is not None:
        dense = tuple(layer for layer in moe.mlp_only_layers if layer < layers)
        moe = dataclasses.replace(moe, mlp_only_layers=dense)
    kinds = config.layer_types
    if kinds is not None:  # the pattern of attention kinds repeated or cut to `layers`
        kinds = (kinds * layers)[:layers]
    linear = config.linear_attention
    if linear is not None:  # the linear-attention layers' pattern, alike
        linear = dataclasses.replace(linear, layers=(linear.layers * layers)[:layers])
    return dataclasses.replace(
        config, num_layers=layers, moe=moe, layer_types=kinds, linear_attention=linear
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


def run_layout(
    config: DecoderConfig,
    layout: Layout,
    devices: tuple[jax.Device, ...],
    prompts: list[list[int]],
    expected: np.ndarray,
    middle: int,
    console: Console,
) -> dict:
    """One layout of one model on `devices`: built, compiled, checked against `expected`,
    timed."""
    topology = bj.Topology(attn_dp=layout.attn_dp, attn_tp=layout.attn_tp, moe_ep=layout.moe_ep)
    with console.status(f"{layout.name}: building and compiling"), jax.default_device(devices[0]):
        model = build_model(
            config,
            topology,
            BuildOptions(
                reduction=layout.policy,
                moe_dispatch=layout.moe_dispatch,
                attention=AttentionImpl.for_platform(devices[0].platform),
                dense_ffn_dp=layout.dense_ffn_dp,
            ),
        )
        runner = ShardedCausalLM(
            model, bj.make_mesh(topology, devices), input_scattered=layout.input_scattered
        )
        start = time.perf_counter()
        report = collective_report(runner)
        compile_seconds = time.perf_counter() - start
    with console.status(f"{layout.name}: running"):
        packed = runner.pack(prompts)
        logits = packed.unpack(jax.device_get(runner.forward_rows(packed)))
        step = _step_time(runner, packed)
    return {
        "model": config.architecture,
        "layout": layout.name,
        "devices": devices_label(tuple(runner.mesh.devices.flat)),
        "device_ids": [device.id for device in runner.mesh.devices.flat],
        "mesh": f"attn_dp={layout.attn_dp}, attn_tp={layout.attn_tp}, moe_ep={layout.moe_ep}",
        "policy": model.layers[0].stages()[-1][1].plan.policy.value,
        "max_abs_logit_diff": float(np.max(np.abs(logits - expected))),
        "logit_scale": float(np.max(np.abs(expected))),
        "middle_layer": middle,
        "collectives": report.counts(middle),
        "bytes": report.bytes(middle),
        "compile_s": compile_seconds,
        "step_ms": step * 1e3,
    }


def _layout_table(row: dict) -> Table:
    title = f"{row['model']}, {row['layout']} on {row['devices']}: {row['mesh']}"
    table = Table(title=f"{title}, policy {row['policy']}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("max |logit diff| vs 1 device", f"{row['max_abs_logit_diff']:.2e}")
    for kind in KINDS:
        table.add_row(f"{kind} in layer {row['middle_layer']}", str(row["collectives"][kind]))
    table.add_row(
        f"collective bytes in layer {row['middle_layer']} ({batch_description()})",
        f"{row['bytes']:,}",
    )
    table.add_row("compile", f"{row['compile_s']:.2f} s")
    table.add_row("step (median of 10)", f"{row['step_ms']:.2f} ms")
    return table


def run_demo(
    *, layers: int = 4, console: Console | None = None, devices: DemoDevices | None = None
) -> list[dict]:
    """Runs every layout of each model, prints one table per layout and a summary; returns
    the rows.

    Args:
      layers: Decoder layers of each model.
      console: Where progress goes (default: stderr).
      devices: Where the layouts run (default: `DemoDevices.of_machine()`).
    """
    console = console or Console(stderr=True, log_path=False)
    devices = devices or DemoDevices.of_machine()
    out = Console(width=None if sys.stdout.isatty() else 120)
    runs = (
        (PRESET, LAYOUTS),
        (MOE_PRESET, MOE_LAYOUTS),
        (HYBRID_PRESET, HYBRID_LAYOUTS),
        (MLA_PRESET, MLA_LAYOUTS),
        (GPT_OSS_PRESET, GPT_OSS_LAYOUTS),
        (DELTA_PRESET, DELTA_LAYOUTS),
        (KIMI_PRESET, KIMI_LAYOUTS),
    )
    presets = [preset for preset, _ in runs]
    out.print(
        f"[bold]boundary-jax demo[/]: {', '.join(presets[:-1])} and {presets[-1]} "
        f"({layers} layers, random weights), "
        f"{len(demo_prompts(PRESETS[PRESET].vocab_size))} ragged prompts, on {devices.describe()}"
    )
    rows = []
    for preset, layouts in runs:
        config = demo_config(preset, layers)
        prompts = demo_prompts(config.vocab_size)
        single = bj.Topology()
        with console.status(f"{preset}: single-device reference"):
            with jax.default_device(devices.cpus[0]):
                model = build_model(config, single, BuildOptions(attention=AttentionImpl.XLA))
            mesh = bj.make_mesh(single, devices.cpus[:1])
            expected = ShardedCausalLM(model, mesh).forward(prompts)
        middle = middle_sparse_layer(config.sparse_layers)
        middle = middle_layer(layers) if middle is None else middle
        for layout in devices.layouts(layouts):
            placed = devices.for_layout(layout)
            row = run_layout(config, layout, placed, prompts, expected, middle, console)
            rows.append(row)
            out.print(_layout_table(row))
    out.print(summary_table(rows, devices_column=bool(devices.accelerators)))
    bad = [row for row in rows if row["max_abs_logit_diff"] > 1e-4 * row["logit_scale"]]
    verdict = "match" if not bad else f"DIFFER ({', '.join(r['layout'] for r in bad)})"
    worst = max(row["max_abs_logit_diff"] / row["logit_scale"] for row in rows)
    out.print(
        f"all {len(rows)} layouts {verdict} their model's single-device logits (worst "
        f"{worst:.1e} relative to the largest logit)"
    )
    return rows


def summary_table(rows: list[dict], *, devices_column: bool) -> Table:
    """The demo's closing table: a row per layout run; `devices_column` adds where each ran
    (on a machine with accelerators; on a CPU-only one every layout runs on the CPU)."""
    middles = " / ".join(sorted({str(row["middle_layer"]) for row in rows}))
    summary = Table(
        title=f"summary (collectives of layer {middles}, sparse in the MoE models; bytes for "
        f"{batch_description()})"
    )
    where = ("devices",) if devices_column else ()
    columns = ("model", "layout", *where, "max |diff|", "AR", "RS", "AG", "A2A", "bytes")
    for column in (*columns, "compile", "step"):
        left = column in ("model", "layout", "devices")
        summary.add_column(column, justify="left" if left else "right")
    for row in rows:
        counts = row["collectives"]
        summary.add_row(
            row["model"].removesuffix("ForCausalLM"),
            row["layout"],
            *(row["devices"] for _ in where),
            f"{row['max_abs_logit_diff']:.1e}",
            str(counts["all-reduce"]),
            str(counts["reduce-scatter"]),
            str(counts["all-gather"]),
            str(counts["all-to-all"]),
            f"{row['bytes']:,}",
            f"{row['compile_s']:.2f} s",
            f"{row['step_ms']:.1f} ms",
        )
    return summary
