"""Multi-LoRA serving: PEFT adapters over tiny Qwen3, Llama, Gemma 3, OLMo 2, EXAONE 4, Apertus
and Arcee (and over the attention of tiny Qwen3-MoE, Mixtral, Qwen2-MoE and GPT-OSS) equal
`peft`'s float32 logits and greedy tokens (golden files of scripts/make_golden_lora.py) on every
mesh, a batch mixing adapter 1, adapter 2 and no adapter; the PEFT reader refuses what it does
not build."""

import functools
import json
import pathlib
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import boundary_jax as bj
from models.build import build_model, load_model
from models.config import PRESETS
from models.inputs.rows import decode_rows, pack_sequences
from models.layers.lora import LoraSpec, LoraTarget, adapter_indices
from models.options import BuildOptions
from models.pipeline import PipelineCausalLM, PipelineSplit, load_pipeline
from models.serving.runtime import ShardedCausalLM
from models.weights.load import load_config
from models.weights.peft import read_peft_adapter

GOLDEN = pathlib.Path(__file__).parents[1] / "golden"
NAMES = (
    "qwen3",
    "llama",
    "qwen3_moe",
    "gemma3",
    "olmo2",
    "exaone4",
    "mixtral",
    "qwen2_moe",
    "gpt_oss",
    "apertus",
    "arcee",
)
EXPERTS = ("qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss")  # adapters on their attention only
# (layout, attn_dp, attn_tp, input-scattered, pp, attn_cp)
LAYOUTS = {
    "TP 1": (1, 1, False, 1, 1),
    "TP 4": (1, 4, False, 1, 1),
    "DP 2 x TP 2": (2, 2, False, 1, 1),
    "input-scattered TP 4": (1, 4, True, 1, 1),
    "pipeline 2": (1, 2, False, 2, 1),
    "DP 2 x CP 2 x TP 2": (2, 2, False, 1, 2),
}
# The default run: the logits of Llama on TP 4, Qwen3 on pipeline 2, and Qwen3-MoE and GPT-OSS on
# DP 2 x TP 2; greedy decoding on Llama DP 2 x TP 2 (the FFN over the full TP group on both DP
# ranks' rows: the adapters gathered with them). The rest under slow.
DEFAULT_LOGITS = {
    ("llama", "TP 4"),
    ("qwen3", "pipeline 2"),
    ("qwen3_moe", "DP 2 x TP 2"),
    ("gpt_oss", "DP 2 x TP 2"),  # sinks, q/k/v/o biases, experts
}
DEFAULT_DECODE = {("llama", "DP 2 x TP 2")}


def cases(default: set[tuple[str, str]]) -> list:
    return [
        pytest.param(
            name,
            layout,
            id=f"{name}-{layout}",
            marks=[] if (name, layout) in default else [pytest.mark.slow],
        )
        for name in NAMES
        for layout in LAYOUTS
        if not (name in EXPERTS and "CP" in layout)  # no CP with experts yet
    ]


def golden(name: str) -> tuple[list[list[int]], list[str | None], dict[str, np.ndarray]]:
    prompts = json.loads((GOLDEN / "lora" / name / "prompts.json").read_text())
    reference = dict(np.load(GOLDEN / "lora" / name / "reference.npz"))
    return [p["ids"] for p in prompts], [p.get("adapter") for p in prompts], reference


def adapter_dirs(name: str) -> dict[str, pathlib.Path]:
    return {a: GOLDEN / "lora" / name / a for a in ("a1", "a2")}


@functools.cache
def runner(name: str, layout: str):
    dp, tp, scattered, pp, cp = LAYOUTS[layout]
    topology = bj.Topology(attn_dp=dp, attn_cp=cp, attn_tp=tp, pp=pp)
    mesh = bj.make_mesh(topology)
    if pp > 1:
        config = load_config(GOLDEN / name)
        layers = config.num_layers
        split = PipelineSplit.of_sizes((layers - layers // 2, layers // 2), layers)
        stages = load_pipeline(GOLDEN / name, mesh, split=split, adapters=adapter_dirs(name))
        return PipelineCausalLM(stages, mesh, microbatches=2)
    model = load_model(GOLDEN / name, mesh, BuildOptions(), adapters=adapter_dirs(name))
    return ShardedCausalLM(model, mesh, input_scattered=scattered)


@pytest.mark.parametrize("name,layout", cases(DEFAULT_LOGITS))
def test_logits_match_peft(name, layout):
    """float32 logits of a batch mixing adapter 1, adapter 2 and none are within 1e-4 (of the
    largest) of peft's, each sequence through its own adapter."""
    prompts, adapters, reference = golden(name)
    logits = runner(name, layout).forward(prompts, adapters=adapters)
    want = reference["logits"]
    scale = np.max(np.abs(want))
    assert np.max(np.abs(logits - want)) <= 1e-4 * scale
    # The adapters move the logits far more than the tolerance: a dropped one shows.
    assert np.max(np.abs(reference["base_logits"] - want)) > 0.1 * scale


@pytest.mark.parametrize("name,layout", cases(DEFAULT_DECODE))
def test_greedy_tokens_match_peft(name, layout):
    """Greedy decoding through the sharded KV cache gives peft's tokens, each sequence decoding
    with its adapter (the adapters ride the decode rows, slot by slot)."""
    prompts, adapters, reference = golden(name)
    tokens = runner(name, layout).generate(
        prompts, reference["generated"].shape[1], adapters=adapters
    )
    np.testing.assert_array_equal(tokens, reference["generated"])


def test_adapters_by_index_and_none_equal_names():
    """Adapters named by index give the names' logits; a batch without adapters runs the base
    model (the stacks untouched)."""
    prompts, adapters, reference = golden("llama")
    run = runner("llama", "DP 2 x TP 2")
    indices = list(reference["adapters"])  # numpy ints, as a server may hold them
    np.testing.assert_allclose(
        run.forward(prompts, adapters=indices),
        run.forward(prompts, adapters=adapters),
        rtol=0,
        atol=1e-6 * np.max(np.abs(reference["logits"])),
    )
    base = run.forward(prompts)
    scale = np.max(np.abs(reference["base_logits"]))
    assert np.max(np.abs(base - reference["base_logits"])) <= 1e-4 * scale


def test_unknown_adapter_names_are_refused():
    """A batch naming an adapter that is not loaded (or one per sequence too few) fails with
    the loaded names."""
    prompts, _, _ = golden("llama")
    run = runner("llama", "DP 2 x TP 2")
    with pytest.raises(ValueError, match=r"no LoRA adapter 'a3' is loaded.*\['a1', 'a2'\]"):
        run.forward(prompts, adapters=["a1", "a3", None, None])
    with pytest.raises(ValueError, match="one LoRA adapter"):
        run.forward(prompts, adapters=["a1"])
    with pytest.raises(ValueError, match="loaded without adapters"):
        adapter_indices(None, ["a1"], 1)


def test_packed_rows_carry_each_sequence_adapter():
    """Every row of a packed sequence carries its adapter (padding 0), and decode rows carry
    each slot's, under attention DP and CP."""
    topology = bj.Topology(attn_dp=2, attn_cp=2, attn_tp=1)
    sequences = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]
    packed = pack_sequences(sequences, topology, adapters=[1, 2, 0, 3])
    rows = packed.unpack(packed.rows.adapters[:, None])[..., 0]
    for index, (sequence, adapter) in enumerate(zip(sequences, [1, 2, 0, 3], strict=True)):
        np.testing.assert_array_equal(rows[index, : len(sequence)], adapter)
    assert not np.any(packed.rows.adapters[np.asarray(packed.rows.segment_ids) < 0])
    decode = decode_rows(packed, np.zeros(4, np.int32), np.asarray(packed.lengths))
    slots = decode.rows.adapters.reshape(2, 2, -1)[:, 0]  # [dp, slots], alike over CP
    for index, adapter in enumerate([1, 2, 0, 3]):
        assert slots[packed.rank[index], packed.slot[index]] == adapter


def _copy_adapter(tmp_path: pathlib.Path, **changes) -> pathlib.Path:
    target = tmp_path / "adapter"
    shutil.copytree(GOLDEN / "lora" / "llama" / "a1", target)
    settings = json.loads((target / "adapter_config.json").read_text())
    (target / "adapter_config.json").write_text(json.dumps({**settings, **changes}))
    return target


def test_peft_reader_folds_scaling_and_refuses_other_options(tmp_path):
    """The reader folds lora_alpha / r (rsLoRA: / sqrt(r)) into B and refuses DoRA, biases,
    extra trained modules and the variants that change the product with the option named;
    fan_in_fan_out, which PEFT resets on nn.Linear, reads as the plain adapter."""
    config = load_config(GOLDEN / "llama")
    a1 = read_peft_adapter(GOLDEN / "lora" / "llama" / "a1", "a1", config)
    stored = load_file(GOLDEN / "lora" / "llama" / "a1" / "adapter_model.safetensors")
    b = stored["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    np.testing.assert_allclose(a1.weights[1, LoraTarget.DOWN][1], b.T * 8 / 4)
    a2 = read_peft_adapter(GOLDEN / "lora" / "llama" / "a2", "a2", config)
    assert a2.targets == {LoraTarget.Q, LoraTarget.V, LoraTarget.UP, LoraTarget.DOWN}
    stored = load_file(GOLDEN / "lora" / "llama" / "a2" / "adapter_model.safetensors")
    b = stored["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    np.testing.assert_allclose(a2.weights[0, LoraTarget.Q][1], b.T * 4 / 8**0.5, rtol=1e-6)
    refused = (
        ("use_dora", True),
        ("bias", "all"),
        ("modules_to_save", ["lm_head"]),
        ("use_bdlora", {"target_modules_bd_a": ["q_proj"]}),
        ("kasa_config", {"svd_rank": 4}),
    )
    flipped = read_peft_adapter(_copy_adapter(tmp_path / "fifo", fan_in_fan_out=True), "x", config)
    np.testing.assert_array_equal(
        flipped.weights[1, LoraTarget.DOWN][1], a1.weights[1, LoraTarget.DOWN][1]
    )
    for option, value in refused:
        with pytest.raises(NotImplementedError, match=option):
            read_peft_adapter(_copy_adapter(tmp_path / option, **{option: value}), "x", config)
    with pytest.raises(ValueError, match="LORA"):
        read_peft_adapter(_copy_adapter(tmp_path / "ia3", peft_type="IA3"), "x", config)


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "corda", "loftq"])
def test_inits_that_rewrite_the_base_weights_are_refused(tmp_path, init):
    """PEFT applies these initializations to the base model when it loads the adapter (the
    targeted weights become residuals), so the adapter read over the checkpoint's weights would
    give other logits: refused with the option named. Initializations that touch only A and B
    read as the plain adapter."""
    config = load_config(GOLDEN / "llama")
    with pytest.raises(NotImplementedError, match=f"init_lora_weights='{init}'"):
        read_peft_adapter(_copy_adapter(tmp_path / init, init_lora_weights=init), "x", config)
    plain = read_peft_adapter(GOLDEN / "lora" / "llama" / "a1", "a1", config)
    other = read_peft_adapter(_copy_adapter(tmp_path / "eva", init_lora_weights="eva"), "x", config)
    assert other.weights.keys() == plain.weights.keys()
    for key, (a, b) in plain.weights.items():
        np.testing.assert_array_equal(other.weights[key][0], a)
        np.testing.assert_array_equal(other.weights[key][1], b)


def test_per_module_ranks_and_some_layers_equal_the_uniform_adapter(tmp_path):
    """`rank_pattern` / `alpha_pattern` give a module its own rank and scale (PEFT's pattern
    match on the module's name), `layers_to_transform` an adapter of some layers only. Llama's
    a1 with each v_proj at rank 6 (A gains two random rows, B two zero columns) and alpha 12
    (the same product), and without layer 1 (layers 0 and 2), gives a1's logits with layer 1's
    B zero, on DP 2 x TP 2."""
    source = GOLDEN / "lora" / "llama" / "a1"
    stored = load_file(source / "adapter_model.safetensors")
    rng = np.random.default_rng(0)
    patterned, zeroed = {}, {}
    for name, value in stored.items():
        layer_one = ".layers.1." in name
        zeroed[name] = np.zeros_like(value) if layer_one and "lora_B" in name else value
        if layer_one:
            continue
        if ".v_proj.lora_A" in name:
            value = np.concatenate([value, rng.normal(size=(2, value.shape[1]))])
        elif ".v_proj.lora_B" in name:
            value = np.concatenate([value, np.zeros((value.shape[0], 2))], axis=1)
        patterned[name] = np.ascontiguousarray(value, np.float32)
    settings = json.loads((source / "adapter_config.json").read_text())
    folders = {}
    for name, tensors, changes in (
        ("zeroed", zeroed, {}),
        (
            "patterned",
            patterned,
            {
                "rank_pattern": {"v_proj": 6},
                "alpha_pattern": {"v_proj": 12},
                "layers_to_transform": [0, 2],
            },
        ),
    ):
        folders[name] = tmp_path / name
        folders[name].mkdir()
        (folders[name] / "adapter_config.json").write_text(json.dumps(settings | changes))
        save_file(tensors, folders[name] / "adapter_model.safetensors")
    config = load_config(GOLDEN / "llama")
    adapter = read_peft_adapter(folders["patterned"], "p", config)
    assert adapter.rank == 6 and (1, LoraTarget.Q) not in adapter.weights
    prompts, _, _ = golden("llama")
    topology = bj.Topology(attn_dp=2, attn_tp=2)
    mesh = bj.make_mesh(topology)
    model = load_model(GOLDEN / "llama", mesh, adapters=folders)
    run = ShardedCausalLM(model, mesh)
    zeroed_logits = run.forward(prompts, adapters=["zeroed"] * len(prompts))
    patterned_logits = run.forward(prompts, adapters=["patterned"] * len(prompts))
    base = run.forward(prompts)
    scale = np.max(np.abs(zeroed_logits))
    assert np.max(np.abs(patterned_logits - zeroed_logits)) <= 1e-5 * scale
    assert np.max(np.abs(zeroed_logits - base)) > 1e-2 * scale  # the adapter matters


def test_peft_reader_refuses_experts_and_other_modules(tmp_path):
    """An adapter on MoE experts, on the LM head, or of another base model is refused; one over
    a family without adapter stacks says so before reading its tensors."""
    config = load_config(GOLDEN / "llama")
    for bad, error, match in (
        ("mlp.experts.0.gate_proj", NotImplementedError, "MoE expert"),
        ("lm_head_proj", NotImplementedError, "other than the attention"),
    ):
        target = _copy_adapter(tmp_path / bad)
        tensors = load_file(target / "adapter_model.safetensors")
        key = "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"
        tensors[key.replace("mlp.gate_proj", bad)] = tensors.pop(key)
        save_file(tensors, target / "adapter_model.safetensors")
        with pytest.raises(error, match=match):
            read_peft_adapter(target, "x", config)
    qwen3 = load_config(GOLDEN / "qwen3")
    with pytest.raises(ValueError, match="another base model"):
        read_peft_adapter(GOLDEN / "lora" / "llama" / "a1", "x", qwen3)
    adapter = GOLDEN / "lora" / "llama" / "a1"
    with pytest.raises(
        NotImplementedError, match="DeepseekV3ForCausalLM builds its layers without"
    ):
        load_model(GOLDEN / "deepseek_v3", bj.make_mesh(bj.Topology()), adapters={"a": adapter})


def test_lora_is_refused_where_it_is_not_built():
    """MLP adapters on a model with experts, FP8 and scanned layers refuse adapter stacks when
    the model is built."""
    spec = LoraSpec(("a",), 4, frozenset({LoraTarget.Q}))
    mlp = LoraSpec(("a",), 4, frozenset({LoraTarget.Q, LoraTarget.UP}))
    with pytest.raises(NotImplementedError, match=r"MoE experts.*\['up_proj'\]"):
        build_model(PRESETS["tiny-qwen3-moe"], bj.Topology(), BuildOptions(lora=mlp))
    with pytest.raises(NotImplementedError, match="scan_layers"):
        build_model(PRESETS["tiny-qwen3"], bj.Topology(), BuildOptions(lora=spec, scan_layers=True))


def test_a_gate_adapter_is_refused_on_an_ungated_mlp():
    """An adapter stack on gate_proj over Arcee's ungated MLP (it has none) is refused when the
    model is built, naming the projections it has."""
    config = load_config(GOLDEN / "arcee")
    spec = LoraSpec(("a1",), 4, frozenset({LoraTarget.Q, LoraTarget.GATE}))
    with pytest.raises(NotImplementedError, match="no gate_proj.*Target up_proj and down_proj"):
        build_model(config, bj.Topology(), BuildOptions(lora=spec))
