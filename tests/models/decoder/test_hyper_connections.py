"""Dense decoders built with MHC hyper-connections: every mesh equals one device, gradients of
the MHC weights too, snapshots are refused, and the sums complete before each nonlinear update."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

import boundary_jax as bj
from boundary_jax import designs, residual_stream
from models.build import build_model
from models.cli.plan import collective_report
from models.config import PRESETS
from models.layers.hyper_connections import HyperConnections
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM

# Few Sinkhorn iterations keep the compiled programs small; the design is tested in full in
# tests/boundary_jax/test_designs.py.
HC = HyperConnections(hc_mult=4, sinkhorn_iters=3)
# Three layers: the stack entry, a middle layer and the terminal layer.
CONFIGS = {
    "qwen3": dataclasses.replace(PRESETS["tiny-qwen3"], num_layers=3),
    "mistral": PRESETS["tiny-mistral"],
    "qwen3-moe": PRESETS["tiny-qwen3-moe"],
}
PROMPTS = [[5, 7, 9, 11, 2], [3], [8, 8, 1, 4, 6, 2, 9], [17, 4]]
# (family, attn_dp, attn_tp, input-scattered)
LAYOUTS = [
    ("qwen3", 1, 2, False),
    ("qwen3", 1, 4, False),
    ("qwen3", 1, 8, False),
    ("qwen3", 2, 2, False),
    ("qwen3", 1, 4, True),
    ("mistral", 2, 2, False),
    ("qwen3-moe", 2, 2, False),
]


SLOW = pytest.mark.slow


def _id(layout) -> str:
    family, dp, tp, scattered = layout
    return f"{family}-dp{dp}-tp{tp}" + ("-scattered" if scattered else "")


@functools.cache
def runner(family: str, dp: int, tp: int, scattered: bool, mhc: bool = True) -> ShardedCausalLM:
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    model = build_model(
        CONFIGS[family], topology, BuildOptions(hyper_connections=HC if mhc else None)
    )
    return ShardedCausalLM(model, bj.make_mesh(topology), input_scattered=scattered)


@functools.cache
def one_device(family: str) -> np.ndarray:
    return runner(family, 1, 1, False).forward(PROMPTS)


def test_every_boundary_is_mhc_and_changes_the_output():
    """The option puts an MHC read and update on every stage and a head before the final
    norm; the logits differ from the plain decoder's of the same seed."""
    model = runner("qwen3", 1, 1, False).model
    for layer in model.layers:
        for boundary in (layer.attn_boundary, layer.ffn_boundary):
            assert isinstance(boundary.read, designs.MhcRead)
            assert isinstance(boundary.update, designs.MhcUpdate)
            assert boundary.read.hc_mult == HC.hc_mult
    assert isinstance(model.hyper_head, designs.MhcHead)
    plain = runner("qwen3", 1, 1, False, mhc=False).forward(PROMPTS)
    assert np.max(np.abs(plain - one_device("qwen3"))) > 0.1 * np.max(np.abs(plain))


# By default Qwen3 on input-scattered TP 4; the other meshes, Qwen3-MoE and Mistral under -m slow.
DEFAULT_LAYOUTS = {("qwen3", 1, 4, True)}


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(layout, id=_id(layout), marks=() if layout in DEFAULT_LAYOUTS else SLOW)
        for layout in LAYOUTS
    ],
)
def test_an_mhc_decoder_equals_one_device(layout):
    """float32 logits of ragged prompts on every mesh are within 1e-5 (relative) of one
    device's: the same seed gives the same weights, each rank holding its own shards."""
    family, dp, tp, scattered = layout
    want = one_device(family)
    got = runner(family, dp, tp, scattered).forward(PROMPTS)
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


def _pack_values(packed, table: np.ndarray) -> np.ndarray:
    """[sequences, longest, ...] per-token values -> [dp * rows per rank, ...] packed rows."""
    out = np.zeros((packed.rows_per_rank * len(packed.token_counts), *table.shape[2:]), table.dtype)
    for index, (rank, start, length) in enumerate(
        zip(packed.rank, packed.start, packed.lengths, strict=True)
    ):
        first = rank * packed.rows_per_rank + start
        out[first : first + length] = table[index, :length]
    return out


def _gradients(dp: int, tp: int) -> dict:
    """d(sum(logits * weights))/d(state) of the MHC qwen3 decoder on a dp x tp mesh."""
    run = runner("qwen3", dp, tp, False)
    topology = run.topology
    rows = PartitionSpec(topology.spec_entry((bj.TokenAxis.ATTN_DP,)))
    module = bj.ShardedModule(run.model, run.mesh)
    program = module.program(
        lambda model, rows_, batch: model(rows_, batch)[0],
        in_specs=(
            rows,
            bj.BatchFacts(_variant(run), topology, PartitionSpec()),
        ),
        out_specs=PartitionSpec(rows[0], None),
    )
    packed = run.pack(PROMPTS)
    vocab = run.config.vocab_size
    table = np.random.default_rng(0).standard_normal((len(PROMPTS), 7, vocab)).astype(np.float32)
    weights = run.place_array(_pack_values(packed, table))
    placed_rows, batch = run.place(packed)
    with jax.set_mesh(run.mesh):
        grads = jax.jit(
            jax.grad(lambda leaves: jnp.sum(program(leaves, placed_rows, batch) * weights))
        )(module.leaves)
    return {
        path: np.asarray(jax.device_get(v[...]))
        for path, v in nnx.to_flat_state(module.state_of(grads))
    }


@pytest.mark.slow
def test_gradients_of_the_mhc_weights_equal_one_device():
    """jax.grad through the decoder on attention DP 2 x TP 2 equals the one-device gradient
    for every parameter, the MHC reads' projections, biases and scales and the head's."""
    got, want = _gradients(2, 2), _gradients(1, 1)
    mhc = [p for p in want if "attn_mhc_read" in p or "ffn_mhc_read" in p or "hyper_head" in p]
    assert len(mhc) == 3 * (2 * 3 + 1), mhc
    assert set(got) == set(want)
    for path, value in want.items():
        scale = np.max(np.abs(value))
        assert scale > 0, path
        # A scalar's gradient sums over every token, so float32 reordering shows at 1e-4; a
        # missing or doubled sum would be off by a factor.
        rtol = 1e-3 if value.size == 1 else 1e-4
        np.testing.assert_allclose(
            got[path], value, rtol=rtol, atol=1e-5 * scale, err_msg=str(path)
        )


def test_snapshot_of_an_mhc_stream_raises_the_guides_message():
    """snapshot() after an MHC layer: 'snapshot requires a plain residual update'."""
    run = runner("qwen3", 1, 1, False)
    rows = PartitionSpec(None)

    def body(model, rows_, batch):
        out, stream, _ = model.layers[0](
            model.embed(rows_.ids), residual_stream.start(batch), rows_, None
        )
        return residual_stream.snapshot(out, stream)

    module = bj.ShardedModule(run.model, run.mesh)
    program = module.program(
        body,
        in_specs=(rows, bj.BatchFacts(_variant(run), run.topology, rows)),
        out_specs=rows,
    )
    with pytest.raises(NotImplementedError, match="snapshot requires a plain residual update"):
        program(module.leaves, *run.place(run.pack(PROMPTS)))


def _collectives(report, layer) -> list[tuple[str, int]]:
    return [(c.kind, c.bytes) for c in report.collectives if c.layer == layer]


@pytest.mark.parametrize("dp,tp,scattered", [(2, 2, False), (1, 4, True)])
def test_mhc_sums_complete_before_the_update_in_the_plain_collectives(dp, tp, scattered):
    """Per layer the compiled MHC decoder runs the plain decoder's collectives in the same
    order on buffers of the same size, so every sum is taken on the stage output [rows,
    hidden], before the nonlinear update; only the residual gathered back to the attention's
    rows at the end of an input-scattered stack carries hc_mult times the bytes
    (docs/collectives.md, "MHC decoders")."""
    mhc = collective_report(runner("qwen3", dp, tp, scattered))
    plain = collective_report(runner("qwen3", dp, tp, scattered, mhc=False))
    for layer in (0, 1, 2, None):
        want = _collectives(plain, layer)
        if scattered and layer == 2:
            kind, size = want[-1]
            assert kind == "all-gather"
            want[-1] = (kind, size * HC.hc_mult)
        assert _collectives(mhc, layer) == want, f"layer {layer}"


@pytest.mark.slow
def test_greedy_generation_of_an_mhc_decoder_equals_one_device():
    """Prefill into the sharded KV caches and the on-device decode loop of an MHC decoder on
    attention TP 4 give the one-device greedy tokens."""
    want = runner("qwen3", 1, 1, False).generate(PROMPTS, 4)
    np.testing.assert_array_equal(runner("qwen3", 1, 4, False).generate(PROMPTS, 4), want)


@dataclasses.dataclass(frozen=True)
class RecordingCandidate:
    """A fused sum + add + norm candidate that records the sums it is offered, then declines."""

    offered: list = dataclasses.field(default_factory=list, compare=False, hash=False)

    def __call__(self, request):
        self.offered.append(request.sum_axes)


def test_no_fused_candidate_is_offered_an_mhc_input():
    """A fusion candidate is asked at every input of the plain decoder (the attention-TP sum
    it could fuse among them) and never at an MHC input, whose update is nonlinear."""
    topology = bj.Topology(attn_tp=4)
    offered = {}
    for mhc in (False, True):
        candidate = RecordingCandidate()
        provider = bj.fusions.FusionProvider(attn_input=(candidate,), ffn_input=(candidate,))
        model = build_model(
            CONFIGS["qwen3"],
            topology,
            BuildOptions(fusions=provider, hyper_connections=HC if mhc else None),
        )
        ShardedCausalLM(model, bj.make_mesh(topology)).lower_forward(PROMPTS)
        offered[mhc] = candidate.offered
    # Layers 1 and 2 take the previous stage's sum at both inputs; layer 0 at its FFN's.
    assert offered[False].count((bj.TokenAxis.ATTN_TP,)) == 5, offered[False]
    assert offered[True] == []


def _variant(run: ShardedCausalLM) -> bj.BatchVariant:
    """The batch variant the runner runs."""
    return bj.BatchVariant.INPUT_SCATTERED if run.input_scattered else bj.BatchVariant.ORDINARY
