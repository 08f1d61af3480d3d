"""Side outputs of the decoders: captured hidden states (EAGLE-3's auxiliary hidden states)
against transformers' `output_hidden_states`, what a capture costs in collectives, and a
deepstack-like extra contribution added once through `add_to_output`."""

import dataclasses
import functools
import json
import pathlib

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import boundary_jax as bj
from boundary_jax import residual_stream
from boundary_jax.report import parse_hlo
from models.build import build_model, load_model
from models.cli.plan import PLAN_SEQUENCES
from models.config import PRESETS
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM

GOLDEN = pathlib.Path(__file__).parents[2] / "golden"
# (name, attn_dp, attn_tp, input-scattered, scan_layers)
CASES = [
    ("qwen3", 1, 1, False, False),
    ("qwen3", 1, 1, False, True),
    ("qwen3", 1, 4, False, False),
    ("qwen3", 1, 4, False, True),
    ("qwen3", 2, 2, False, False),
    ("qwen3", 2, 2, False, True),
    ("qwen3", 1, 4, True, False),
    ("qwen3", 1, 4, True, True),
    ("llama", 1, 4, False, True),
    ("llama", 2, 2, False, False),
]
# By default Qwen3 scanned on DP 2 x TP 2 and jitted input-scattered TP 4, Llama (its untied head)
# scanned on TP 4: each layout kind, both stack forms and both families once; the rest slow.
DEFAULT_CASES = {
    ("qwen3", 2, 2, False, True),
    ("qwen3", 1, 4, True, False),
    ("llama", 1, 4, False, True),
}
SLOW = pytest.mark.slow


def _id(case) -> str:
    name, dp, tp, scattered, scan = case
    layout = f"dp{dp}-tp{tp}" + ("-scattered" if scattered else "")
    return f"{name}-{layout}-{'scan' if scan else 'jit'}"


@functools.cache
def golden(name: str) -> tuple[list[list[int]], np.ndarray, np.ndarray]:
    """(prompts, HF hidden states [layers + 1, prompts, longest, hidden], HF logits)."""
    prompts = json.loads((GOLDEN / name / "prompts.json").read_text())
    hidden = np.load(GOLDEN / name / "hidden_states.npz")["hidden_states"]
    return prompts, hidden, np.load(GOLDEN / name / "reference.npz")["logits"]


@functools.cache
def runner(name: str, dp: int, tp: int, scattered: bool, scan: bool = False) -> ShardedCausalLM:
    mesh = bj.make_mesh(bj.Topology(attn_dp=dp, attn_tp=tp))
    model = load_model(GOLDEN / name, mesh, BuildOptions(scan_layers=scan))
    return ShardedCausalLM(model, mesh, input_scattered=scattered)


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=_id(c), marks=() if c in DEFAULT_CASES else SLOW) for c in CASES]
)
def test_captured_hidden_states_equal_transformers(case):
    """Every capture index, asked in a shuffled order with a repeat, equals transformers'
    `output_hidden_states` (index = layer count: the residual before the final norm) within
    1e-4 of each layer's largest value, zero past each prompt's end; the logits beside them
    equal HF's."""
    name, dp, tp, scattered, scan = case
    prompts, want, want_logits = golden(name)
    count = want.shape[0] - 1
    layers = [count, 0, *range(1, count), 0]
    logits, hidden = runner(name, dp, tp, scattered, scan).forward_captured(prompts, layers)
    assert hidden.shape == (len(layers), *want.shape[1:])
    for got, layer in zip(hidden, layers, strict=True):
        scale = np.max(np.abs(want[layer]))
        assert np.max(np.abs(got - want[layer])) <= 1e-4 * scale, f"layer {layer}"
    assert np.max(np.abs(logits - want_logits)) <= 1e-4 * np.max(np.abs(want_logits))


# Input-scattered TP 4 by default (its runner the cost test below builds); DP 2 x TP 2 slow.
@pytest.mark.parametrize("dp,tp,scattered", [pytest.param(2, 2, False, marks=SLOW), (1, 4, True)])
def test_a_capture_leaves_the_logits_unchanged(dp, tp, scattered):
    """The logits computed beside the captures are exactly the plain forward's."""
    prompts, *_ = golden("qwen3")
    run = runner("qwen3", dp, tp, scattered)
    logits, _ = run.forward_captured(prompts, [1, 3])
    np.testing.assert_array_equal(logits, run.forward(prompts))


def _report(lowered) -> bj.report.CollectiveReport:
    return parse_hlo(lowered.compile().as_text())


KINDS = {"AR": "all-reduce", "RS": "reduce-scatter", "AG": "all-gather"}


def _documented_capture_costs() -> dict[str, dict[str, tuple[str, ...]]]:
    """docs/collectives.md, the runtime captures table: batch -> column -> added kinds."""
    text = (pathlib.Path(__file__).parents[3] / "docs" / "collectives.md").read_text()
    text = text.split("## Captures", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        batch = cells.pop("batch")
        rows[batch] = {
            column: tuple(KINDS[k] for k in value.split() if k != "–")
            for column, value in cells.items()
        }
    return rows


CAPTURE_COSTS = _documented_capture_costs()


# One configuration per batch row of the table by default: ordinary on DP 2 x TP 2,
# input-scattered TP 4; ordinary TP 4 under -m slow.
@pytest.mark.parametrize(
    "dp,tp,scattered", [pytest.param(1, 4, False, marks=SLOW), (2, 2, False), (1, 4, True)]
)
def test_a_capture_costs_what_the_collectives_table_says(dp, tp, scattered):
    """Per layer the capturing forward runs the plain forward's collectives plus what
    docs/collectives.md says a captured layer costs (one all-gather where the residual is on
    attention-TP slices); the final read's capture adds what its column says (nothing)."""
    costs = CAPTURE_COSTS["input-scattered" if scattered else "ordinary"]
    assert set(costs) == {"captured layer (index < layers)", "final read (index = layers)"}
    run = runner("qwen3", dp, tp, scattered)
    captured = (0, 2, 3)
    plain = _report(run.lower_forward(PLAN_SEQUENCES))
    capturing = _report(run.lower_forward_captured(PLAN_SEQUENCES, captured))
    for layer in range(3):
        want = dict(plain.counts(layer))
        if layer in captured:
            for kind in costs["captured layer (index < layers)"]:
                want[kind] += 1
        assert capturing.counts(layer) == want, f"layer {layer}"
    want = dict(plain.counts(None))
    for kind in costs["final read (index = layers)"]:
        want[kind] += 1
    assert capturing.counts(None) == want


def test_capture_indices_outside_the_stack_are_rejected():
    """A capture index past the final read is refused while tracing."""
    prompts, *_ = golden("qwen3")
    with pytest.raises(ValueError, match=r"indices in \[0, 3\]"):
        runner("qwen3", 1, 1, False).forward_captured(prompts, [4])


# -- deepstack: an extra contribution added to the output of the first layers -------------------

CONFIG = dataclasses.replace(PRESETS["tiny-qwen3"], num_layers=3)
PROMPTS = [[5, 7, 9, 11, 2], [3], [8, 8, 1, 4, 6, 2, 9], [17, 4]]
DEEPSTACK = 2  # the extra joins the outputs of layers 0 and 1
LONGEST = max(len(p) for p in PROMPTS)
EXTRA = np.random.default_rng(5).standard_normal((DEEPSTACK, len(PROMPTS), LONGEST, 64))
EXTRA = (0.5 * EXTRA).astype(np.float32)


def _pack_values(packed, table: np.ndarray) -> np.ndarray:
    """[..., sequences, longest, hidden] per-token values -> [..., packed rows, hidden]."""
    out = np.zeros((*table.shape[:-3], packed.rows_per_rank * len(packed.token_counts), 64))
    for index, (rank, start, length) in enumerate(
        zip(packed.rank, packed.start, packed.lengths, strict=True)
    ):
        first = rank * packed.rows_per_rank + start
        out[..., first : first + length, :] = table[..., index, :length, :]
    return out.astype(table.dtype)


def _deepstack_body(by_hand: bool):
    """The decoder forward with `extra[i]` (on the attention's rows) joining layer i's output:
    through `add_to_output`, or by hand (snapshot the updated residual, add, `set_written`)."""

    def body(model, rows, batch, extra):
        stream = residual_stream.start(batch)
        x = model.embed(rows.ids)
        for index, layer in enumerate(model.layers):
            x, stream, _ = layer(x, stream, rows, None)
            if index < extra.shape[0]:
                if by_hand:
                    updated = residual_stream.snapshot(x, stream)
                    x, stream = residual_stream.set_written(updated + extra[index], stream)
                else:
                    rows_extra = residual_stream.onto_residual_rows(extra[index], stream)
                    x, stream = residual_stream.add_to_output(x, stream, rows_extra)
        hidden = residual_stream.final_norm(x, stream, model.final_read_norm, skip_empty=True)
        return model.lm_head(hidden)

    return body


@functools.cache
def deepstack_program(dp: int, tp: int, scattered: bool, by_hand: bool):
    """(f(extra table) -> logits [sequences, longest, vocab]) of the tiny decoder on a mesh."""
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    mesh = bj.make_mesh(topology)
    run = ShardedCausalLM(build_model(CONFIG, topology), mesh, input_scattered=scattered)
    rows = PartitionSpec(topology.spec_entry((bj.TokenAxis.ATTN_DP,)))
    extra_spec = PartitionSpec(None, rows[0], None)
    module = bj.ShardedModule(run.model, mesh)
    program = module.program(
        _deepstack_body(by_hand),
        in_specs=(
            rows,
            bj.BatchFacts(_variant(run), topology, PartitionSpec()),
            extra_spec,
        ),
        out_specs=PartitionSpec(rows[0], None),
    )
    packed = run.pack(PROMPTS)
    placed = run.place(packed)

    def logits(table: np.ndarray) -> np.ndarray:
        extra = jax.device_put(_pack_values(packed, table), NamedSharding(mesh, extra_spec))
        return packed.unpack(np.asarray(program(module.leaves, *placed, extra)))

    return logits


@functools.cache
def deepstack_reference(scale: float) -> np.ndarray:
    """One device, the extra (times `scale`) added by hand."""
    return deepstack_program(1, 1, False, True)(EXTRA * np.float32(scale))


# DP 2 x TP 2 and input-scattered TP 4 by default (the rows split both ways); TP alone slow.
@pytest.mark.parametrize(
    "dp,tp,scattered",
    [
        pytest.param(1, 1, False, marks=SLOW),
        pytest.param(1, 2, False, marks=SLOW),
        pytest.param(1, 4, False, marks=SLOW),
        pytest.param(1, 8, False, marks=SLOW),
        (2, 2, False),
        (1, 4, True),
    ],
)
def test_a_deepstack_contribution_is_added_once_on_every_mesh(dp, tp, scattered):
    """Extra per-token features added to the first layers' outputs through add_to_output equal
    the one-device decoder with them added by hand, and differ from it with the features
    added twice or not at all."""
    got = deepstack_program(dp, tp, scattered, False)(EXTRA)
    want = deepstack_reference(1.0)
    tolerance = 1e-5 * np.max(np.abs(want))
    assert np.max(np.abs(got - want)) <= tolerance
    for wrong in (0.0, 2.0):
        assert np.max(np.abs(got - deepstack_reference(wrong))) > 1000 * tolerance, wrong


def test_an_extra_needs_a_stream_with_residual_rows():
    """onto_residual_rows() before the stack has a residual names the state it needs."""
    stream = residual_stream.start(bj.BatchFacts.ordinary(bj.Topology()))
    with pytest.raises(RuntimeError, match="needs a written or pending stream"):
        residual_stream.onto_residual_rows(np.zeros((4, 64), np.float32), stream)


def _variant(run: ShardedCausalLM) -> bj.BatchVariant:
    """The batch variant the runner runs."""
    return bj.BatchVariant.INPUT_SCATTERED if run.input_scattered else bj.BatchVariant.ORDINARY
