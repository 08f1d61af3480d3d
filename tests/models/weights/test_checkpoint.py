"""Checkpoint loading: every device's shard equals its slice of the Hugging Face tensor."""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from safetensors.numpy import load_file, save_file

import boundary_jax as bj
from models import weights as checkpoint
from models.build import load_model
from models.config import DecoderConfig, hf_name_map
from models.config.tensors import HFTensor
from models.layers.attention.self_attention import Attention
from models.layers.linear import ParallelLMHead, VocabParallelEmbedding
from models.layers.mlp import SwiGLU
from models.weights import load as checkpoint_load
from models.weights import load_config, load_params
from tests.models import make_mesh, row_spec, sum_over

GOLDEN = Path(__file__).parents[2] / "golden"
CHECKPOINTS = ("qwen3", "llama", "mistral")


class TinyLayer(nnx.Module):
    def __init__(self, config: DecoderConfig, topology: bj.Topology, dtype, rngs: nnx.Rngs):
        eps = config.rms_norm_eps
        self.input_norm = bj.RMSNorm(config.hidden_size, eps=eps, param_dtype=dtype)
        self.post_attn_norm = bj.RMSNorm(config.hidden_size, eps=eps, param_dtype=dtype)
        self.attn = Attention(config.attention_spec(0), topology=topology, dtype=dtype, rngs=rngs)
        self.mlp = SwiGLU(
            config.hidden_size, config.intermediate_size, topology=topology, dtype=dtype, rngs=rngs
        )


class TinyDecoder(nnx.Module):
    """Only the module paths of the decoder, for the loader to fill."""

    def __init__(self, config: DecoderConfig, topology: bj.Topology, dtype, rngs: nnx.Rngs):
        self.embed = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, topology=topology, dtype=dtype, rngs=rngs
        )
        self.layers = nnx.List(
            [TinyLayer(config, topology, dtype, rngs) for _ in range(config.num_layers)]
        )
        self.final_norm = bj.RMSNorm(config.hidden_size, param_dtype=dtype)
        self.lm_head = ParallelLMHead(
            config.hidden_size,
            config.vocab_size,
            topology=topology,
            dtype=dtype,
            rngs=rngs,
            tied_embedding=self.embed if config.tie_word_embeddings else None,
        )


def abstract_params(directory: Path, mesh, dtype=jnp.float32, config=None) -> nnx.State:
    config = config or load_config(directory)
    topology = bj.Topology.from_mesh(mesh)
    abstract = nnx.eval_shape(lambda: TinyDecoder(config, topology, dtype, nnx.Rngs(0)))
    return nnx.split(abstract, nnx.Param)[1]


def hf_tensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint (single file, which wins, or index + shards), read whole."""
    index = directory / checkpoint.INDEX_FILE
    if (directory / checkpoint.SINGLE_FILE).exists():
        files = [checkpoint.SINGLE_FILE]
    else:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    tensors = {}
    for file in files:
        tensors |= load_file(str(directory / file))
    return tensors


def expected_full(tensors: dict, source: HFTensor, shape) -> np.ndarray:
    """The parameter Hugging Face tensors become: transposed, vocab padding zero-filled, stacked
    projections stacked on their parts axis."""
    if source.parts is not None:
        axis = source.part_axis
        inner = shape[:axis] + shape[axis + 1 :]
        parts = [expected_full(tensors, part, inner) for part in source.stacked_parts()]
        return np.stack(parts, axis=axis)
    tensor = tensors[source.name]
    value = tensor.T if source.transpose else tensor
    full = np.zeros(shape, np.float32)
    full[tuple(slice(0, n) for n in value.shape)] = value
    return full


def check_loaded(directory: Path, loaded: nnx.State, mesh, dtype) -> None:
    tensors = hf_tensors(directory)
    sources = hf_name_map(load_config(directory))
    specs = dict(nnx.to_flat_state(nnx.get_partition_spec(loaded)))
    flat = nnx.to_flat_state(loaded)
    assert {".".join(map(str, path)) for path, _ in flat} == set(sources)
    for path, variable in flat:
        source = sources[".".join(map(str, path))]
        array = variable.get_value()
        assert array.dtype == dtype, path
        assert array.sharding == NamedSharding(mesh, specs[path].get_value()), path
        full = expected_full(tensors, source, array.shape).astype(dtype)
        for shard in array.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index], err_msg=path)


@pytest.mark.parametrize("name", CHECKPOINTS)
@pytest.mark.parametrize("dp,tp", [(1, 4), (2, 2)])
def test_shards_equal_slices_of_hf_tensors(name, dp, tp):
    """Each device's shard equals the slice of the (transposed, padded) HF tensor it covers."""
    mesh = make_mesh(dp, tp)
    directory = GOLDEN / name
    loaded = load_params(directory, abstract_params(directory, mesh), mesh, jnp.float32)
    check_loaded(directory, loaded, mesh, jnp.float32)


def test_tied_checkpoint_has_no_lm_head_kernel():
    """With tied embeddings the name map and the loaded state have no lm_head.kernel."""
    config = load_config(GOLDEN / "qwen3")
    assert config.tie_word_embeddings and "lm_head.kernel" not in hf_name_map(config)
    assert "lm_head.kernel" in hf_name_map(load_config(GOLDEN / "llama"))
    assert hf_name_map(config)["layers.2.attn.k_norm.weight"].name == (
        "model.layers.2.self_attn.k_norm.weight"
    )


def test_load_bf16():
    """Loading with dtype=bfloat16 gives bf16 shards equal to the rounded HF values."""
    mesh = make_mesh(2, 2)
    directory = GOLDEN / "llama"
    loaded = load_params(directory, abstract_params(directory, mesh), mesh, jnp.bfloat16)
    check_loaded(directory, loaded, mesh, jnp.bfloat16)


def copy_checkpoint(source: Path, target: Path, edit) -> Path:
    """A copy of a single-file checkpoint whose tensors `edit(dict)` rewrites."""
    target.mkdir()
    shutil.copy(source / "config.json", target / "config.json")
    tensors = load_file(str(source / checkpoint.SINGLE_FILE))
    save_file(edit(tensors), str(target / checkpoint.SINGLE_FILE))
    return target


def test_bf16_checkpoint_loads_as_float32(tmp_path):
    """A bfloat16 checkpoint loads into float32 parameters holding the bf16 values."""
    to_bf16 = lambda tensors: {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}  # noqa: E731
    directory = copy_checkpoint(GOLDEN / "mistral", tmp_path / "bf16", to_bf16)
    mesh = make_mesh(1, 4)
    loaded = load_params(directory, abstract_params(directory, mesh), mesh, jnp.float32)
    check_loaded(directory, loaded, mesh, jnp.float32)


def test_devices_read_only_their_blocks(monkeypatch):
    """Sharded tensors are read block by block: no read of a split tensor covers all of it."""
    reads = []
    original = checkpoint_load._Checkpoint.read

    def recording_read(self, name, index):
        block = original(self, name, index)
        reads.append((name, block.size))
        return block

    monkeypatch.setattr(checkpoint_load._Checkpoint, "read", recording_read)
    mesh = make_mesh(1, 4)
    directory = GOLDEN / "qwen3"
    load_params(directory, abstract_params(directory, mesh), mesh, jnp.float32)
    tensors = hf_tensors(directory)
    q_reads = [size for name, size in reads if name == "model.layers.0.self_attn.q_proj.weight"]
    assert q_reads == [tensors["model.layers.0.self_attn.q_proj.weight"].size // 4] * 4


def test_missing_tensor_is_named(tmp_path):
    """A tensor absent from the checkpoint fails with its name and the parameter it feeds."""
    drop = lambda t: {k: v for k, v in t.items() if k != "model.layers.1.self_attn.k_norm.weight"}  # noqa: E731
    directory = copy_checkpoint(GOLDEN / "qwen3", tmp_path / "missing", drop)
    mesh = make_mesh(1, 2)
    with pytest.raises(
        ValueError,
        match=r"no tensor 'model.layers.1.self_attn.k_norm.weight'.*"
        r"layers.1.attn.k_norm.weight",
    ):
        load_params(directory, abstract_params(directory, mesh), mesh, jnp.float32)


def test_misshaped_tensor_is_named(tmp_path):
    """A tensor whose shape does not fit its parameter fails with both shapes."""
    name = "model.layers.0.mlp.up_proj.weight"
    shrink = lambda t: t | {name: t[name][:64]}  # noqa: E731
    directory = copy_checkpoint(GOLDEN / "mistral", tmp_path / "shape", shrink)
    mesh = make_mesh(1, 2)
    with pytest.raises(ValueError, match=rf"{name} has shape \(64, 64\).*is \(64, 128\)"):
        load_params(directory, abstract_params(directory, mesh), mesh, jnp.float32)


def test_unused_tensor_and_wrong_model_rejected(tmp_path):
    """Tensors the model would ignore, or a model built from another config, are errors; an
    extra tensor of no elements holds nothing to ignore, and loads."""
    empty = {"model.layers.0.mlp.shared_experts.up_proj.weight": np.zeros((0, 64), np.float32)}
    directory = copy_checkpoint(GOLDEN / "mistral", tmp_path / "empty", lambda t: t | empty)
    mesh = make_mesh(1, 2)
    loaded = load_params(directory, abstract_params(directory, mesh), mesh, jnp.float32)
    check_loaded(directory, loaded, mesh, jnp.float32)
    extra = lambda t: t | {"model.layers.9.mlp.up_proj.weight": t["model.norm.weight"]}  # noqa: E731
    directory = copy_checkpoint(GOLDEN / "mistral", tmp_path / "extra", extra)
    with pytest.raises(ValueError, match="does not use.*layers.9"):
        load_params(directory, abstract_params(directory, mesh), mesh, jnp.float32)
    shallow = dataclasses.replace(load_config(GOLDEN / "llama"), num_layers=2)
    state = abstract_params(GOLDEN / "llama", mesh, config=shallow)
    with pytest.raises(ValueError, match="model lacks"):
        load_params(GOLDEN / "llama", state, mesh, jnp.float32)


def _fused_experts(tensors: dict) -> dict:
    """The per-expert tensors of each layer as transformers holds them in memory: one
    gate_up_proj [experts, 2 x width, hidden] and one down_proj [experts, hidden, width]."""
    fused = {k: v for k, v in tensors.items() if ".experts." not in k}
    layers = {k.split(".experts.")[0] for k in tensors if ".experts." in k}
    for layer in layers:
        experts = sorted(
            {int(k.split(".")[5]) for k in tensors if k.startswith(f"{layer}.experts.")}
        )

        def stacked(projection, layer=layer, experts=experts):
            return np.stack([tensors[f"{layer}.experts.{e}.{projection}.weight"] for e in experts])

        fused[f"{layer}.experts.gate_up_proj"] = np.concatenate(
            [stacked("gate_proj"), stacked("up_proj")], axis=1
        )
        fused[f"{layer}.experts.down_proj"] = stacked("down_proj")
    return fused


def test_tensors_of_another_layout_are_refused_saying_which(tmp_path):
    """A base model's tensors (no 'model.' prefix) and experts fused per layer are refused,
    the message saying which layout it found."""
    strip = lambda t: {k.removeprefix("model."): v for k, v in t.items()}  # noqa: E731
    directory = copy_checkpoint(GOLDEN / "mistral", tmp_path / "base", strip)
    mesh = make_mesh(1, 2)
    with pytest.raises(ValueError, match="without the 'model.' prefix"):
        load_params(directory, abstract_params(directory, mesh), mesh, jnp.float32)
    directory = copy_checkpoint(GOLDEN / "qwen3_moe", tmp_path / "fused", _fused_experts)
    with pytest.raises(ValueError, match="experts fused per layer"):
        load_model(directory, mesh)


def test_a_tied_checkpoints_lm_head_must_equal_its_embedding(tmp_path):
    """A tied model's checkpoint holding lm_head.weight as well loads where the two are equal
    (torch's files hold both); where they differ transformers unties them, so it is refused
    with the key to set."""
    mesh = make_mesh(1, 2)
    embed = "model.embed_tokens.weight"
    for name, head in (("equal", lambda t: t[embed]), ("differs", lambda t: t[embed] * 2)):
        directory = copy_checkpoint(
            GOLDEN / "qwen3", tmp_path / name, lambda t, head=head: t | {"lm_head.weight": head(t)}
        )
        state = abstract_params(directory, mesh)
        if name == "equal":
            check_loaded(
                directory, load_params(directory, state, mesh, jnp.float32), mesh, jnp.float32
            )
            continue
        with pytest.raises(ValueError, match="lm_head.weight differs.*tie_word_embeddings"):
            load_params(directory, state, mesh, jnp.float32)


@pytest.mark.parametrize("name", ["model.embed_tokens.weight", "lm_head.weight"])
def test_vocab_rows_short_of_the_vocab_size_are_refused(tmp_path, name):
    """The vocab axis is padded past the checkpoint's vocab size, never past its tensors: an
    embedding or head with fewer rows than config.json's vocab_size is refused, named."""
    short = lambda t: t | {name: t[name][:-8]}  # noqa: E731
    directory = copy_checkpoint(GOLDEN / "mistral", tmp_path / "short", short)
    mesh = make_mesh(1, 2)
    with pytest.raises(ValueError, match=rf"{name} has shape"):
        load_params(directory, abstract_params(directory, mesh), mesh, jnp.float32)


def test_a_single_file_beside_an_index_is_the_one_read(tmp_path):
    """As transformers: model.safetensors wins over a (stale) index and its shards."""
    directory = copy_checkpoint(GOLDEN / "mistral", tmp_path / "both", lambda t: t)
    tensors = load_file(str(directory / checkpoint.SINGLE_FILE))
    save_file({k: v * 2 for k, v in tensors.items()}, str(directory / "stale.safetensors"))
    weight_map = {"weight_map": dict.fromkeys(tensors, "stale.safetensors")}
    (directory / checkpoint.INDEX_FILE).write_text(json.dumps(weight_map))
    mesh = make_mesh(1, 2)
    loaded = load_params(directory, abstract_params(directory, mesh), mesh, jnp.float32)
    check_loaded(directory, loaded, mesh, jnp.float32)


def test_an_index_naming_the_wrong_shard_is_refused_naming_both(tmp_path):
    """A tensor the index maps to a shard that does not hold it is refused before any value is
    read (by the command line's file check and by the load), naming the tensor and the file."""
    directory = copy_checkpoint(GOLDEN / "mistral", tmp_path / "wrong", lambda t: t)
    tensors = load_file(str(directory / checkpoint.SINGLE_FILE))
    (directory / checkpoint.SINGLE_FILE).unlink()
    names = sorted(tensors)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    weight_map = {}
    for file, held in shards.items():
        save_file({name: tensors[name] for name in held}, str(directory / file))
        weight_map |= dict.fromkeys(held, file)
    index = directory / checkpoint.INDEX_FILE
    index.write_text(json.dumps({"weight_map": weight_map}))
    mesh = make_mesh(1, 2)
    loaded = load_params(directory, abstract_params(directory, mesh), mesh, jnp.float32)
    check_loaded(directory, loaded, mesh, jnp.float32)
    moved = names[0]
    index.write_text(json.dumps({"weight_map": weight_map | {moved: "b.safetensors"}}))
    match = f"maps {moved} to b.safetensors, which does not hold it"
    with pytest.raises(ValueError, match=match):
        checkpoint.check_checkpoint_files(directory)
    with pytest.raises(ValueError, match=match):
        load_params(directory, abstract_params(directory, mesh), mesh, jnp.float32)


def test_missing_files(tmp_path):
    """A directory without config.json or weights fails with FileNotFoundError naming it."""
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_params(tmp_path, nnx.State({}), make_mesh(1, 1), jnp.float32)
    shutil.copy(GOLDEN / "qwen3" / "config.json", tmp_path / "config.json")
    mesh = make_mesh(1, 1)
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        load_params(tmp_path, abstract_params(tmp_path, mesh), mesh, jnp.float32)


def test_loaded_model_runs_under_shard_map():
    """The loaded state merges into the model and runs inside shard_map with its own specs."""
    mesh = make_mesh(2, 2)
    directory = GOLDEN / "mistral"
    config = load_config(directory)
    topology = bj.Topology.from_mesh(mesh)
    graphdef, _ = nnx.split(
        nnx.eval_shape(lambda: TinyDecoder(config, topology, jnp.float32, nnx.Rngs(0)))
    )
    state = load_params(directory, abstract_params(directory, mesh), mesh, jnp.float32)
    rows = row_spec(topology)
    ids = jax.device_put(jnp.arange(16, dtype=jnp.int32), NamedSharding(mesh, rows))

    def body(state, ids):
        model = nnx.merge(graphdef, state)
        embedded = sum_over(model.embed(ids), topology, bj.SumGroup.ATTN_TP)
        return model.lm_head(model.final_norm(embedded))

    logits = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(nnx.get_partition_spec(state), rows),
            out_specs=row_spec(topology, None),
        )
    )(state, ids)
    tensors = hf_tensors(directory)
    x = tensors["model.embed_tokens.weight"][np.arange(16)].astype(np.float64)
    x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + config.rms_norm_eps)
    want = (x * tensors["model.norm.weight"]) @ tensors["lm_head.weight"].T
    np.testing.assert_allclose(np.asarray(logits), want, atol=1e-4)


@pytest.mark.parametrize("name", ["exaone4", "olmo2", "gemma3"])
def test_norm_families_load_each_norm_into_its_boundary(name):
    """Post-norm checkpoints load their post-attention / post-feedforward norms into the
    boundaries' updates, Gemma 3's into input norms and output transforms, OLMo 2's
    whole-projection q/k norms split like their heads (k shared by two ranks at TP 4)."""
    mesh = make_mesh(1, 4)
    model = load_model(GOLDEN / name, mesh)
    check_loaded(GOLDEN / name, nnx.state(model, nnx.Param), mesh, jnp.float32)
    names = hf_name_map(load_config(GOLDEN / name))
    if name == "gemma3":
        assert names["layers.1.post_ffn_norm.weight"].name == (
            "model.layers.1.post_feedforward_layernorm.weight"
        )
        assert names["layers.1.pre_ffn_norm.weight"].name == (
            "model.layers.1.pre_feedforward_layernorm.weight"
        )
    else:
        assert names["layers.1.post_attn_norm.weight"].name == (
            "model.layers.1.post_attention_layernorm.weight"
        )
        assert "layers.1.input_norm.weight" not in names
