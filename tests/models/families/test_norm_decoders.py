"""EXAONE 4.0, OLMo 2 and Gemma 3 (text) on boundaries equal transformers; their collectives."""

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import boundary_jax as bj
import models.layers.attention.self_attention
from boundary_jax import make_mesh
from models.build import build_model, load_model
from models.cli.plan import collective_report
from models.config import DecoderConfig, family_of, read_hf_config
from models.families.exaone4 import Exaone4ForCausalLM
from models.families.gemma3 import Gemma3ForCausalLM
from models.families.olmo2 import Olmo2ForCausalLM
from models.layers.hyper_connections import HyperConnections
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM
from tests.boundary_jax.test_collectives import DOCUMENTED, NAMES
from tests.models.families.test_decoder import golden, runner

GOLDEN = pathlib.Path(__file__).parents[2] / "golden"
FAMILIES = ("exaone4", "olmo2", "gemma3")
# (name, attn_dp, attn_tp, input-scattered)
LAYOUTS = (
    ("TP 1", 1, 1, False),
    ("TP 4", 1, 4, False),
    ("DP 2 x TP 2", 2, 2, False),
    ("input-scattered TP 4", 1, 4, True),
)
# Each family once by default, the three together covering the layouts that split attention:
# EXAONE 4 on TP 4, OLMo 2 on DP 2 x TP 2, Gemma 3 input-scattered TP 4 (the layouts themselves
# run for every family of tests/models/families/test_decoder.py); the other layouts under -m slow.
DEFAULT_LAYOUT = {"exaone4": "TP 4", "olmo2": "DP 2 x TP 2", "gemma3": "input-scattered TP 4"}
CASES = [
    pytest.param(
        name,
        *layout[1:],
        id=f"{name}-{layout[0]}",
        marks=[pytest.mark.xdist_group(name)]
        + ([pytest.mark.slow] if layout[0] != DEFAULT_LAYOUT[name] else []),
    )
    for name in FAMILIES
    for layout in LAYOUTS
]


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize("name,dp,tp,scattered", CASES)
def test_logits_and_greedy_tokens_match_transformers(name, dp, tp, scattered):
    """float32 logits of ragged prompts within 1e-4 (relative to the largest) of HF's, zero past
    each end, and HF's greedy tokens through the sharded KV cache."""
    prompts, reference = golden(name)
    run = runner(name, dp, tp, scattered)
    logits = run.forward(prompts)
    assert logits.shape == reference["logits"].shape
    assert relative_error(logits, reference["logits"]) <= 1e-4
    for index, length in enumerate(reference["lengths"]):
        assert not np.any(logits[index, length:]), "logits past a sequence's end must be zero"
    tokens = run.generate(prompts, reference["generated"].shape[1])
    np.testing.assert_array_equal(tokens, reference["generated"])


def test_model_classes():
    """Each checkpoint builds its family's class; a class rejects the others' configs."""
    classes = (Exaone4ForCausalLM, Olmo2ForCausalLM, Gemma3ForCausalLM)
    configs = [
        read_hf_config(json.loads((GOLDEN / n / "config.json").read_text())) for n in FAMILIES
    ]
    assert [family_of(config) for config in configs] == list(classes)
    with pytest.raises(ValueError, match="Gemma3ForCausalLM builds Gemma3ForCausalLM; got a Ex"):
        Gemma3ForCausalLM(configs[0], bj.Topology(), rngs=nnx.Rngs(0))
    with pytest.raises(NotImplementedError, match="MHC hyper-connections replace it"):
        build_model(configs[1], bj.Topology(), BuildOptions(hyper_connections=HyperConnections()))


@pytest.mark.parametrize(
    "name,dp,tp,scattered,scan",
    [
        pytest.param("exaone4", 1, 4, True, False, marks=pytest.mark.slow),
        ("olmo2", 2, 2, False, True),
        pytest.param("gemma3", 1, 4, True, False, marks=pytest.mark.slow),
    ],
)
def test_captured_hidden_states_equal_transformers(name, dp, tp, scattered, scan):
    """The residual entering each layer (and the one the final norm reads) equals transformers'
    `output_hidden_states` within 1e-4 of each layer's largest value: a post-norm update or an
    output transform is applied before the capture reads the residual."""
    prompts, _ = golden(name)
    want = np.load(GOLDEN / name / "hidden_states.npz")["hidden_states"]
    layers = list(range(want.shape[0]))[::-1]
    run = runner(name, dp, tp, scattered)
    if scan:
        mesh = make_mesh(bj.Topology(attn_dp=dp, attn_tp=tp))
        model = load_model(GOLDEN / name, mesh, BuildOptions(scan_layers=True))
        run = ShardedCausalLM(model, mesh, input_scattered=scattered)
    _, hidden = run.forward_captured(prompts, layers)
    for got, layer in zip(hidden, layers, strict=True):
        assert relative_error(got, want[layer]) <= 1e-4, f"layer {layer}"


@pytest.mark.parametrize("mutant", ["missing", "doubled"])
def test_olmo2_qk_norm_sum_over_all_heads_is_needed(monkeypatch, mutant):
    """Under attention TP 4, OLMo 2's q/k norm without the sum of squares over the ranks' heads
    (each rank's own mean), or with it taken twice (the mean `attn_tp` times too large), gives
    logits far from HF's."""
    honest = models.layers.attention.self_attention.sharded_rms_norms

    def broken(xs, weights, topology, group, *, eps):
        if mutant == "missing":
            return honest(xs, weights, bj.Topology(), group, eps=eps)
        ranks = topology.size(topology.sum_axes(group))
        return tuple(y / np.sqrt(ranks) for y in honest(xs, weights, topology, group, eps=eps))

    monkeypatch.setattr(models.layers.attention.self_attention, "sharded_rms_norms", broken)
    prompts, reference = golden("olmo2")
    mesh = make_mesh(bj.Topology(attn_tp=4))
    logits = ShardedCausalLM(load_model(GOLDEN / "olmo2", mesh), mesh).forward(prompts)
    assert relative_error(logits, reference["logits"]) > 1e-2


# --------------------------------------------------------------------------------------------
# Collectives (docs/collectives.md, "Post-norm and sandwich-norm decoders")
# --------------------------------------------------------------------------------------------

TABLE = pathlib.Path(__file__).parents[3] / "docs" / "collectives.md"
P = bj.ReductionPolicy
# (attn_dp, attn_tp, input-scattered, policy)
CONFIGURATIONS = (
    (1, 4, False, P.AUTO),
    (2, 2, False, P.AUTO),
    (2, 2, False, P.AR),
    (1, 4, True, P.AUTO),
)


def _documented_families() -> dict[str, tuple[str, ...]]:
    """The family table: name -> what its attention compute adds under attention TP > 1."""
    text = TABLE.read_text().split("## Post-norm and sandwich-norm decoders", 1)[1]
    lines = [line for line in text.split("\n## ", 1)[0].splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        compute = cells["attention compute (attention TP > 1)"]
        rows[cells["golden"]] = tuple(NAMES[kind] for kind in compute.split() if kind != "–")
    return rows


FAMILY_ROWS = _documented_families()


def four_layer_config(name: str) -> DecoderConfig:
    """The golden's architecture with 4 layers (its layer pattern repeated)."""
    raw = json.loads((GOLDEN / name / "config.json").read_text())
    raw["num_hidden_layers"] = 4
    if "layer_types" in raw:
        raw["layer_types"] = (raw["layer_types"] * 2)[:4]
    return read_hf_config(raw)


# By default OLMo 2's ar row (see below) and Gemma 3 DP 2 x TP 2; the rest under -m slow.
DEFAULT_CONFIGURATION = {
    "exaone4": set(),
    "olmo2": {(2, 2, False, P.AR)},
    "gemma3": {(2, 2, False, P.AUTO)},
}


@pytest.mark.parametrize(
    "name,dp,tp,scattered,policy",
    [
        pytest.param(
            name,
            *c,
            id=f"{name}-dp{c[0]}-tp{c[1]}{'-scattered' if c[2] else ''}-{c[3].value}",
            marks=[] if c in DEFAULT_CONFIGURATION[name] else [pytest.mark.slow],
        )
        for name in FAMILIES
        for c in CONFIGURATIONS
        # ar completes the FFN's sum at its exit (no sum carried to the next input): OLMo 2,
        # whose attention adds its own all-reduce, holds that row for the three.
        if c[3] is P.AUTO or name == "olmo2"
    ],
)
def test_each_layer_runs_the_pre_norm_collectives(name, dp, tp, scattered, policy):
    """Every layer runs the dense table's collectives for its configuration (the update and
    output transforms add none), plus what the family table documents inside attention,
    between the attention input and the FFN input."""
    assert set(FAMILY_ROWS) == set(FAMILIES)
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    model = build_model(four_layer_config(name), topology, BuildOptions(reduction=policy))
    report = collective_report(
        ShardedCausalLM(model, make_mesh(topology), input_scattered=scattered)
    )
    row = DOCUMENTED[
        (
            "1" if dp == 1 else ">1",
            ">1",
            "input-scattered" if scattered else "ordinary",
            policy.value,
        )
    ]
    compute = FAMILY_ROWS[name]
    for index in range(4):
        entry = row["stack entry"] if index == 0 else row["attention input"]
        exit_ = row["last FFN exit"] if index == 3 else row["FFN exit"]
        want = entry + compute + row["FFN input"] + exit_
        assert report.sequence(index) == want, f"layer {index}"


# bfloat16 by default through Gemma 3 (output transforms, the embedding scale); OLMo 2 and
# EXAONE 4 (post-norm updates) under -m slow.
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if n != "gemma3" else []) for n in FAMILIES]
)
def test_bfloat16_load_stays_close_to_transformers_bfloat16(name):
    """A bfloat16 load (post-norm updates and output transforms in bf16, Gemma's embedding
    scale rounded to bf16) stays within bf16 rounding (5% of the largest logit) of HF in bf16."""
    prompts, reference = golden(name)
    logits = runner(name, 2, 2, False, jnp.bfloat16).forward(prompts)
    scale = np.max(np.abs(reference["logits"]))
    assert np.max(np.abs(logits - reference["logits_bf16"])) <= 0.05 * scale


def test_post_norm_layers_read_the_residual_as_is():
    """A post-norm layer's boundaries have no input norm; their updates hold the norms."""
    model = build_model(four_layer_config("olmo2"), bj.Topology())
    layer = model.layers[1]
    assert layer.attn_boundary.norm is None and layer.ffn_boundary.norm is None
    assert isinstance(layer.attn_boundary.update, bj.designs.PostNormUpdate)
    assert layer.attn_boundary.update is layer.post_attn_norm
    assert not layer.attn_boundary.declaration.update.plain
    gemma = build_model(four_layer_config("gemma3"), bj.Topology()).layers[1]
    assert gemma.input_norm.gemma and gemma.attn_boundary.declaration.has_output_transform
    assert gemma.attn_boundary.declaration.update.plain
