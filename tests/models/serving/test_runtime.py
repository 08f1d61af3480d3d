"""The sharded runner: weights built into their shards, check_vma, buckets, on-device serving."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import boundary_jax as bj
from boundary_jax.fusions import AddRmsNorm, FusionProvider
from models.build import build_model
from models.config import PRESETS
from models.families.qwen3_moe import Qwen3MoeForCausalLM
from models.inputs.rows import RowsPhase, TokenRows, decode_rows, pack_sequences
from models.layers.moe.sparse import GroupedMatmulImpl
from models.options import BuildOptions
from models.serving import runtime as runtime_module
from models.serving.buckets import (
    CUBLAS_DECODE_OPTIONS,
    CUBLAS_DECODE_ROWS,
    DECODE_BLOCK,
    DecodeLoop,
    blocked_fori_loop,
    bucket,
    cache_length,
    decode_loop,
)
from models.serving.runtime import ShardedCausalLM
from models.serving.sampling import Sampling

PROMPTS = [[5, 7, 9, 11, 2], [3], [8, 8, 1]]


@pytest.fixture(scope="module")
def runner() -> ShardedCausalLM:
    topology = bj.Topology(attn_dp=2, attn_tp=2)
    mesh = bj.make_mesh(topology)
    return ShardedCausalLM(build_model(PRESETS["tiny-mistral"], topology, mesh=mesh), mesh)


def test_check_vma_stays_on_with_pallas_kernels_bound():
    """The varying-axes check stays on by default, also with fusion candidates bound and with
    Pallas expert kernels: each kernel declares how its outputs vary."""
    topology = bj.Topology(attn_tp=2)
    mesh = bj.make_mesh(topology)
    config = PRESETS["tiny-mistral"]
    assert ShardedCausalLM(build_model(config, topology), mesh).check_vma
    norm = AddRmsNorm("cpu", None)
    fused = FusionProvider(attn_input=(norm,), ffn_input=(norm,))
    assert ShardedCausalLM(
        build_model(config, topology, BuildOptions(fusions=fused)), mesh
    ).check_vma
    pallas = Qwen3MoeForCausalLM(
        PRESETS["tiny-qwen3-moe"],
        topology,
        BuildOptions(grouped_matmul=GroupedMatmulImpl.PALLAS_TRITON),
        rngs=nnx.Rngs(0),
    )
    assert ShardedCausalLM(pallas, mesh).check_vma


def test_buckets_are_fixed_sizes():
    """Sizes round up to powers of two (multiples of TP); cache lengths to a fixed list."""
    assert [bucket(n) for n in (1, 2, 3, 9, 64)] == [1, 2, 4, 16, 64]
    assert bucket(3, 2) == 4 and bucket(1, 4) == 4 and bucket(5, 6) == 12
    assert cache_length(20, 4096) == 128 and cache_length(129, 4096) == 256
    assert cache_length(3000, 2048) == 2048


def test_generate_shares_programs_across_nearby_request_shapes(runner):
    """Prompts of other lengths and counts within one bucket compile no new program."""
    runner.generate(PROMPTS, 3)
    sizes = runner.compiled_shapes()
    runner.generate([[4, 4, 4, 4], [1, 2]], 2)
    assert runner.compiled_shapes() == sizes


def test_placed_prefill_then_decode_equals_generate(runner):
    """The placed-input API (prefill, then two decode calls) gives generate()'s tokens."""
    want = runner.generate(PROMPTS, 5)
    packed = runner.pack(PROMPTS, bucketed=True)
    caches = runner.new_caches(packed.decode_rows_per_rank, 128)
    key = jax.random.key(0)
    last_rows = runner.place_array(packed.last_row_index())
    first, caches = runner.prefill(*runner.place(packed), caches, last_rows, key)
    lengths = np.asarray(packed.lengths, np.int32)
    rows, batch = runner.place(decode_rows(packed, np.zeros_like(lengths), lengths))
    rows = TokenRows(first, rows.positions, rows.segment_ids, RowsPhase.DECODE)
    out, caches = runner.decode(rows, batch, caches, key, 2, capacity=4)
    rows = TokenRows(out[1], rows.positions + 2, rows.segment_ids, RowsPhase.DECODE)
    # The step count and index were placed by the first call: this one copies nothing from the
    # host (a copy per call held the GPU idle while the call was issued).
    with jax.transfer_guard_host_to_device("disallow_explicit"):
        rest, caches = runner.decode(rows, batch, caches, key, 2, capacity=4)
    tokens = np.concatenate([np.asarray(first)[None], np.asarray(out[:2]), np.asarray(rest[:2])])
    np.testing.assert_array_equal(tokens[:, packed.slot_order()].T, want)


def test_sampled_generation_is_reproducible_by_seed(runner):
    """Sampling on the device: one seed gives one continuation; token ids stay in the vocab."""
    sampling = Sampling(1.0, top_k=20, top_p=0.9)
    first = runner.generate(PROMPTS, 6, sampling=sampling, seed=1)
    again = runner.generate(PROMPTS, 6, sampling=sampling, seed=1)
    np.testing.assert_array_equal(first, again)
    assert first.shape == (3, 6) and first.dtype == np.int32
    assert (first >= 0).all() and (first < runner.config.vocab_size).all()
    others = [runner.generate(PROMPTS, 6, sampling=sampling, seed=s) for s in (2, 3, 4)]
    assert any(not np.array_equal(first, other) for other in others)


@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_generation_equals_generate(runner, chunk):
    """generate_stream yields the prefill's token, then `chunk` decode steps at a time, and
    they join to generate's tokens, greedy and sampled (each step draws with its own key)."""
    for sampling in (Sampling(), Sampling(1.0, top_k=20, top_p=0.9)):
        want = runner.generate(PROMPTS, 6, sampling=sampling, seed=1)
        pieces = list(runner.generate_stream(PROMPTS, 6, chunk=chunk, sampling=sampling, seed=1))
        assert [piece.shape[1] for piece in pieces] == [1] + [chunk] * (5 // chunk) + (
            [5 % chunk] if 5 % chunk else []
        )
        np.testing.assert_array_equal(np.concatenate(pieces, axis=1), want)


def _precisions(lowered) -> set[str]:
    """The precision of every dot in a lowered program's StableHLO."""
    dots = [line for line in lowered.as_text().splitlines() if "stablehlo.dot_general" in line]
    assert dots
    return {
        line.split("precision = [")[1].split("]")[0] if "precision = [" in line else "DEFAULT"
        for line in dots
    }


def test_float32_programs_multiply_in_float32(runner):
    """A float32 runner traces every matmul at HIGHEST (true float32 where a GPU defaults to
    TF32); asked for DEFAULT, it leaves them to the platform; a bfloat16 runner defaults to
    the platform's precision."""
    assert runner.matmul_precision is jax.lax.Precision.HIGHEST
    assert _precisions(runner.lower_forward(PROMPTS)) == {"HIGHEST, HIGHEST"}
    topology = bj.Topology()
    mesh = bj.make_mesh(topology)
    model = build_model(PRESETS["tiny-mistral"], topology)
    fast = ShardedCausalLM(
        model, mesh, options=model.options.replace(matmul_precision=jax.lax.Precision.DEFAULT)
    )
    assert "HIGHEST" not in str(_precisions(fast.lower_forward(PROMPTS)))
    half = ShardedCausalLM(
        build_model(PRESETS["tiny-mistral"], topology, BuildOptions(dtype=jnp.bfloat16)), mesh
    )
    assert half.matmul_precision is jax.lax.Precision.DEFAULT
    assert "HIGHEST" not in str(_precisions(half.lower_forward(PROMPTS)))


def test_runner_holds_no_unsharded_weights(runner):
    """Every parameter the runner keeps is split over the mesh as its spec says."""
    for _, variable in nnx.to_flat_state(runner.state):
        value = variable[...]
        assert isinstance(value, jax.Array)
        assert len(value.sharding.device_set) == 4
    assert not hasattr(runner, "_model")
    assert jnp.issubdtype(runner.dtype, jnp.floating)


def test_rows_with_a_sequence_bound_give_the_same_logits(runner):
    """Rows packed with `max_sequence_rows` (a static field of the rows) run through the
    runner's program, their attention blocked, with the unbounded logits."""
    sequences = PROMPTS * 4
    packed = [
        pack_sequences(sequences, runner.topology, rows_per_rank=64, max_sequence_rows=bound)
        for bound in (5, None)
    ]
    bounded, unbounded = (np.asarray(runner.forward_rows(p)) for p in packed)
    np.testing.assert_allclose(bounded, unbounded, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [4, None])
def test_blocked_fori_loop_runs_each_index_once_in_order(block):
    """Blocks of a static trip count, then the remainder (or one loop, block None): every index
    below the traced count runs once and in order, none past it (counts below, at and past one
    block)."""

    def body(i, carry):
        return (carry[0] * 7 + i + 1) % 1_000_003, carry[1] + 1

    run = jax.jit(lambda count: blocked_fori_loop(count, body, (0, 0), block=block))
    for count in (0, 3, 4, 9, 12):
        want = (0, 0)
        for i in range(count):
            want = body(i, want)
        assert tuple(int(x) for x in run(jnp.int32(count))) == want


def test_one_gpu_decodes_in_one_graphed_loop_and_gpu_meshes_in_blocks():
    """On one GPU the decode program is compiled with its loop in CUDA graphs (WHILE and
    CONDITIONAL added to XLA's default command types) and runs one loop, its products through
    cuBLAS without the dot merger from CUBLAS_DECODE_ROWS rows; a GPU mesh of several devices
    keeps XLA's defaults and runs DECODE_BLOCK steps (at most the capacity) per loop of static
    trip count; other platforms run one loop under XLA's defaults."""
    narrow = decode_loop("gpu", 64, 1, CUBLAS_DECODE_ROWS - 1)
    assert narrow.block is None
    options = narrow.compiler_options
    types = options["xla_gpu_enable_command_buffer"].split(",")
    assert {"FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN", "WHILE", "CONDITIONAL"} == set(
        types
    )
    assert not set(CUBLAS_DECODE_OPTIONS) & set(options)
    assert decode_loop("gpu", 64, 1, 8) == narrow
    wide = decode_loop("gpu", 64, 1, CUBLAS_DECODE_ROWS)
    assert wide.block is None
    assert wide.compiler_options == options | CUBLAS_DECODE_OPTIONS
    assert wide.compiler_options["xla_gpu_enable_triton_gemm"] is False
    assert wide.compiler_options["xla_disable_hlo_passes"] == "dot-merger"
    assert decode_loop("gpu", 64, 1, 4 * CUBLAS_DECODE_ROWS) == wide
    for rows in (8, CUBLAS_DECODE_ROWS):
        assert decode_loop("gpu", 64, 2, rows) == DecodeLoop(block=DECODE_BLOCK)
        assert decode_loop("gpu", 8, 4, rows) == DecodeLoop(block=8)
        for platform in ("cpu", "tpu"):
            for devices in (1, 8):
                loop = decode_loop(platform, 64, devices, rows)
                assert loop == DecodeLoop() and loop.compiler_options is None


def test_decode_programs_follow_the_rows_each_dp_rank_multiplies(runner, monkeypatch):
    """The runner asks `decode_loop` with the decode rows one device multiplies and builds
    one decode program per loop form, so batches whose forms differ run programs of their own."""
    asked = []

    def loop(platform, capacity, devices, rows):
        asked.append((devices, rows))
        return DecodeLoop(block=rows)

    monkeypatch.setattr(runtime_module, "decode_loop", loop)
    for prompts in (PROMPTS, PROMPTS * 3):
        packed = runner.pack(prompts, bucketed=True)
        caches = runner.new_caches(packed.decode_rows_per_rank, 128)
        lengths = np.asarray(packed.lengths, np.int32)
        rows, batch = runner.place(decode_rows(packed, np.zeros_like(lengths), lengths))
        rows = TokenRows(rows.ids, rows.positions, rows.segment_ids, RowsPhase.DECODE)
        runner.decode(rows, batch, caches, jax.random.key(0), 2, capacity=4)
        assert asked[-1] == (4, packed.decode_rows_per_rank)
    assert len({rows for _, rows in asked}) == 2
    forms = {name[-1] for name in runner.compiled_shapes() if name[0] == "_decode_program"}
    assert {DecodeLoop(block=rows) for _, rows in asked} <= forms
