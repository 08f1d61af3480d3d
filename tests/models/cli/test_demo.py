"""The demo on any machine: each layout runs on the machine's accelerators where it fits and on
the simulated CPU devices otherwise (tested here with CPU devices pretending to be the
accelerators of a 1-, 3-, 4- and 8-device machine)."""

import jax
import numpy as np
from rich.console import Console

import boundary_jax as bj
from models.build import build_model
from models.cli.demo import (
    LAYOUTS,
    MOE_LAYOUTS,
    DemoDevices,
    Layout,
    demo_config,
    demo_prompts,
    run_layout,
    summary_table,
)
from models.serving.runtime import ShardedCausalLM

CPUS = tuple(jax.devices())


def pretend(accelerators: int) -> DemoDevices:
    """A machine whose accelerators are the last `accelerators` CPU devices."""
    return DemoDevices(CPUS[len(CPUS) - accelerators :], CPUS)


def test_a_cpu_only_machine_runs_every_layout_on_the_simulated_cpus():
    """Without accelerators the layouts are the CPU-only demo's, each on the first CPUs."""
    machine = DemoDevices.of_machine()
    assert machine.accelerators == () and len(machine.cpus) == 8
    assert machine.layouts(LAYOUTS) == LAYOUTS and machine.layouts(MOE_LAYOUTS) == MOE_LAYOUTS
    for layout in LAYOUTS + MOE_LAYOUTS:
        assert machine.for_layout(layout) == CPUS[: layout.size]
    assert machine.describe() == "8 simulated cpu devices"


def test_a_one_gpu_machine_runs_one_device_there_and_the_rest_on_the_cpus():
    """One accelerator (the failing case: the demo asked it for 8 devices) runs a one-device
    layout; every 8-device layout goes to the simulated CPUs."""
    machine = pretend(1)
    dense, moe = machine.layouts(LAYOUTS), machine.layouts(MOE_LAYOUTS)
    assert dense == (Layout("1 device", 1, 1), *LAYOUTS)
    assert moe[0] == Layout("1 device", 1, 1, moe_dispatch=bj.MoeDispatch.GATHER)
    assert machine.for_layout(dense[0]) == CPUS[-1:]
    for layout in dense[1:] + moe[1:]:
        assert machine.for_layout(layout) == CPUS[: layout.size]


def test_machines_of_several_accelerators_use_those_that_fit():
    """Four accelerators also run TP 4 there; three run only the one-device layout there;
    eight run every layout there."""
    four = pretend(4)
    layouts = four.layouts(LAYOUTS)
    assert [layout.name for layout in layouts[:2]] == ["1 device", "TP 4"]
    assert four.for_layout(layouts[1]) == CPUS[4:]
    assert [layout.name for layout in pretend(3).layouts(LAYOUTS)[:2]] == ["1 device", "TP 8"]
    eight = pretend(8)
    assert eight.layouts(LAYOUTS)[1:] == LAYOUTS
    assert all(eight.for_layout(layout) == CPUS[: layout.size] for layout in LAYOUTS)


def test_a_layout_runs_on_the_devices_it_is_given():
    """run_layout places the model on the given device (a pretend accelerator) and matches the
    single-device logits; the summary says where each layout ran when the machine has
    accelerators (and, on a CPU-only machine, keeps its columns)."""
    config = demo_config("tiny-qwen3", 2)
    prompts = demo_prompts(config.vocab_size)
    single = bj.Topology()
    expected = ShardedCausalLM(build_model(config, single), bj.make_mesh(single)).forward(prompts)
    machine = pretend(1)
    layout = machine.layouts(LAYOUTS)[0]
    placed = machine.for_layout(layout)
    row = run_layout(config, layout, placed, prompts, expected, 1, Console(quiet=True))
    assert placed == (CPUS[-1],)
    assert row["devices"] == "1 cpu" and row["device_ids"] == [CPUS[-1].id]
    assert row["max_abs_logit_diff"] <= 1e-5 * float(np.max(np.abs(expected)))
    headers = [column.header for column in summary_table([row], devices_column=True).columns]
    assert headers[:3] == ["model", "layout", "devices"]
    assert list(summary_table([row], devices_column=True).columns[2].cells) == ["1 cpu"]
    assert "devices" not in [c.header for c in summary_table([row], devices_column=False).columns]


def test_the_hybrids_layer_patterns_are_cut_to_the_demos_layers():
    """The demo's 4-layer Qwen3-Next and Kimi-Linear keep their presets' first four layer kinds
    (linear attention on 0 and 1, full attention on 2 and 3) and dense layers."""
    for preset, dense in (("tiny-qwen3-next", (1, 3)), ("tiny-kimi-linear", (0,))):
        config = demo_config(preset, 4)
        assert config.num_layers == 4
        assert config.linear_attention.layers == (True, True, False, False)
        assert config.moe.mlp_only_layers == dense
