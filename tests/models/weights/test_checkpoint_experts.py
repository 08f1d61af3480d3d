"""Loading MoE checkpoints: per-expert tensors stacked, each device reading only its experts."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

import boundary_jax as bj
from models import weights as checkpoint
from models.config import DecoderConfig, hf_name_map
from models.config.tensors import HFTensor
from models.layers.attention.self_attention import Attention
from models.layers.linear import ParallelLMHead, VocabParallelEmbedding
from models.layers.mlp import SwiGLU
from models.layers.moe import experts as routed_experts
from models.layers.moe import routing as moe_routing
from models.layers.moe import sparse as moe
from models.layers.moe.sparse import SparseMoe
from models.weights import load as checkpoint_load
from models.weights import load_config, load_params, load_tensor
from tests.models import make_mesh

GOLDEN = Path(__file__).parents[2] / "golden"
DP, TP = bj.MeshAxis.ATTN_DP.value, bj.MeshAxis.ATTN_TP.value


def tensors(name: str) -> dict[str, np.ndarray]:
    return load_file(str(GOLDEN / name / checkpoint.SINGLE_FILE))


def stacked(name: str, pattern: str, experts: int) -> np.ndarray:
    """The per-expert [out, in] tensors of a golden checkpoint as [experts, in, out]."""
    found = tensors(name)
    return np.stack([found[pattern.format(expert=e)].T for e in range(experts)])


CASES = [
    # (checkpoint, tensor pattern, experts, spec): experts over one axis, width over another.
    ("qwen3_moe", "model.layers.2.mlp.experts.{expert}.gate_proj.weight", 16, P(TP, None, DP)),
    ("qwen3_moe", "model.layers.0.mlp.experts.{expert}.down_proj.weight", 16, P(TP, DP, None)),
    (
        "qwen3_moe",
        "model.layers.0.mlp.experts.{expert}.up_proj.weight",
        16,
        P((DP, TP), None, None),
    ),
    ("mixtral", "model.layers.1.block_sparse_moe.experts.{expert}.w1.weight", 8, P(TP, None, DP)),
    ("mixtral", "model.layers.0.block_sparse_moe.experts.{expert}.w2.weight", 8, P(DP, TP, None)),
    ("qwen2_moe", "model.layers.2.mlp.experts.{expert}.up_proj.weight", 8, P(None, None, TP)),
]


@pytest.mark.parametrize("dp,tp", [(1, 4), (2, 4), (2, 2)])
@pytest.mark.parametrize("name,pattern,experts,spec", CASES)
def test_stacked_experts_shards_equal_safetensors(name, pattern, experts, spec, dp, tp):
    """Each device's shard of a stacked expert weight equals its slice of the HF tensors."""
    mesh = make_mesh(dp, tp)
    want = stacked(name, pattern, experts)
    source = HFTensor(pattern, transpose=True, experts=experts)
    array = load_tensor(GOLDEN / name, source, want.shape, mesh, spec, jnp.float32)
    assert array.shape == want.shape and array.sharding == NamedSharding(mesh, spec)
    for shard in array.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    # Distinct experts: a permuted or repeated expert block would not match.
    assert len({want[e].tobytes() for e in range(experts)}) == experts


GATE_UP_CASES = [
    # (checkpoint, one layer's expert tensor pattern, its parts, experts)
    ("qwen3_moe", "model.layers.2.mlp.experts.{expert}.{part}_proj.weight", ("gate", "up"), 16),
    ("mixtral", "model.layers.1.block_sparse_moe.experts.{expert}.{part}.weight", ("w1", "w3"), 8),
]


@pytest.mark.parametrize("spec", [P(TP, None, None, DP), P((DP, TP)), P(None, None, None, TP)])
@pytest.mark.parametrize("name,pattern,parts,experts", GATE_UP_CASES)
def test_stacked_gate_up_of_experts_equal_safetensors(name, pattern, parts, experts, spec):
    """gate_up [experts, in, 2, out]: part p of expert e is the HF tensor of that part and
    expert, transposed, each device holding its block of experts and of the width."""
    mesh = make_mesh(2, 4)
    want = np.stack(
        [stacked(name, pattern.replace("{part}", part), experts) for part in parts], axis=2
    )
    source = HFTensor(pattern, transpose=True, experts=experts, parts=parts, part_axis=2)
    array = load_tensor(GOLDEN / name, source, want.shape, mesh, spec, jnp.float32)
    assert array.sharding == NamedSharding(mesh, spec)
    for shard in array.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    assert np.abs(want[:, :, 0] - want[:, :, 1]).max() > 1e-3  # gate and up differ
    assert source.tensor_names()[experts] == pattern.format(expert=0, part=parts[1])


def test_devices_read_only_their_experts(monkeypatch):
    """With 16 experts over 4 ranks and the width over 2, every read is one expert's half-width
    block: no device reads an expert outside its block, nor a whole expert it splits."""
    reads = []
    original = checkpoint_load._Checkpoint.read

    def recording_read(self, name, index):
        block = original(self, name, index)
        reads.append((name, block.shape))
        return block

    monkeypatch.setattr(checkpoint_load._Checkpoint, "read", recording_read)
    pattern = "model.layers.0.mlp.experts.{expert}.{part}_proj.weight"
    source = HFTensor(pattern, transpose=True, experts=16, parts=("gate", "up"), part_axis=2)
    mesh, spec = make_mesh(2, 4), P(TP, None, None, DP)
    load_tensor(GOLDEN / "qwen3_moe", source, (16, 64, 2, 16), mesh, spec, "f4")
    # Stored [out=16, in=64]: each read is 8 of the 16 output rows, all 64 inputs.
    assert sorted(reads) == sorted(
        (pattern.format(expert=e, part=part), (8, 64))
        for e in range(16)
        for part in ("gate", "up")
        for _ in "ab"
    )


def test_name_map_of_moe_decoders():
    """Sparse layers map to SparseMoe's stacked parameters, dense ones to the MLP; biases and the
    shared expert appear where the architecture has them."""
    qwen3 = hf_name_map(load_config(GOLDEN / "qwen3_moe"))
    assert qwen3["layers.0.mlp.gate_up_proj"] == HFTensor(
        "model.layers.0.mlp.experts.{expert}.{part}.weight",
        transpose=True,
        experts=16,
        parts=("gate_proj", "up_proj"),
        part_axis=2,
    )
    assert qwen3["layers.2.mlp.router"] == HFTensor(
        "model.layers.2.mlp.gate.weight", transpose=True
    )
    assert qwen3["layers.1.mlp.gate_up_proj.kernel"].tensor_names() == (
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
    )
    assert "layers.1.mlp.router" not in qwen3 and "layers.0.mlp.gate_up_proj.kernel" not in qwen3
    assert not any(".bias" in path or "shared" in path for path in qwen3)

    mixtral = hf_name_map(load_config(GOLDEN / "mixtral"))
    assert mixtral["layers.1.mlp.down_proj"].name == (
        "model.layers.1.block_sparse_moe.experts.{expert}.w2.weight"
    )
    assert mixtral["layers.1.mlp.gate_up_proj"].tensor_names()[8:10] == (
        "model.layers.1.block_sparse_moe.experts.0.w3.weight",
        "model.layers.1.block_sparse_moe.experts.1.w3.weight",
    )
    assert mixtral["layers.0.mlp.router"].name == "model.layers.0.block_sparse_moe.gate.weight"

    qwen2_moe = hf_name_map(load_config(GOLDEN / "qwen2_moe"))
    assert qwen2_moe["layers.0.attn.kv_proj.bias"] == HFTensor(
        "model.layers.0.self_attn.{part}_proj.bias", parts=("k", "v"), part_axis=0
    )
    assert qwen2_moe["layers.2.mlp.shared_expert.expert_gate"] == HFTensor(
        "model.layers.2.mlp.shared_expert_gate.weight", transpose=True
    )
    assert qwen2_moe["layers.1.mlp.gate_up_proj.kernel"] == HFTensor(  # the dense layer
        "model.layers.1.mlp.{part}_proj.weight", transpose=True, parts=("gate", "up"), part_axis=1
    )
    assert "layers.0.attn.o_proj.bias" not in qwen2_moe
    # Every tensor of each checkpoint is named by exactly one parameter.
    for name, mapping in (("qwen3_moe", qwen3), ("mixtral", mixtral), ("qwen2_moe", qwen2_moe)):
        named = [t for source in mapping.values() for t in source.tensor_names()]
        assert sorted(named) == sorted(tensors(name)), name
    qwen2 = hf_name_map(load_config(GOLDEN / "qwen2"))
    assert sorted(t for s in qwen2.values() for t in s.tensor_names()) == sorted(tensors("qwen2"))


class TinyMoeLayer(nnx.Module):
    def __init__(self, config: DecoderConfig, sparse: bool, topology, rngs: nnx.Rngs):
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.input_norm = bj.RMSNorm(hidden, eps=eps)
        self.post_attn_norm = bj.RMSNorm(hidden, eps=eps)
        self.attn = Attention(config.attention_spec(0), topology=topology, rngs=rngs)
        if sparse:
            moe = config.moe
            self.mlp = SparseMoe(
                hidden,
                moe.num_experts,
                moe.expert_intermediate_size,
                top_k=moe.top_k,
                renormalize=moe.renormalize,
                expert_entry=TP,
                width_entry=DP,
                rngs=rngs,
            )
        else:
            self.mlp = SwiGLU(hidden, config.intermediate_size, topology=topology, rngs=rngs)


class TinyMoeDecoder(nnx.Module):
    """The module paths of an MoE decoder built from SparseMoe, for the loader to fill."""

    def __init__(self, config: DecoderConfig, topology, rngs: nnx.Rngs):
        hidden, vocab = config.hidden_size, config.vocab_size
        self.embed = VocabParallelEmbedding(vocab, hidden, topology=topology, rngs=rngs)
        self.layers = nnx.List(
            [TinyMoeLayer(config, s, topology, rngs) for s in config.sparse_layers]
        )
        self.final_norm = bj.RMSNorm(hidden)
        self.lm_head = ParallelLMHead(hidden, vocab, topology=topology, rngs=rngs)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_load_params_fills_sparse_moe(name):
    """load_params fills a decoder whose sparse layers are SparseMoe modules: every stacked
    expert shard equals the HF tensors' slice (experts over attn_tp, width over attn_dp)."""
    mesh = make_mesh(2, 4)
    config = load_config(GOLDEN / name)
    topology = bj.Topology.from_mesh(mesh)
    abstract = nnx.eval_shape(lambda: TinyMoeDecoder(config, topology, nnx.Rngs(0)))
    state = load_params(GOLDEN / name, nnx.split(abstract, nnx.Param)[1], mesh, jnp.float32)
    sources = hf_name_map(config)
    found = tensors(name)
    flat = nnx.to_flat_state(state)
    assert {".".join(map(str, path)) for path, _ in flat} == set(sources)
    checked = 0
    for path, variable in flat:
        source = sources[".".join(map(str, path))]
        if source.experts is None:
            continue
        want = np.stack([found[t].T for t in source.tensor_names()])
        if source.parts is not None:  # part-major names; the parts axis is 2
            want = np.stack(np.split(want, len(source.parts)), axis=2)
        for shard in variable.get_value().addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
        checked += 1
    assert checked == 2 * sum(config.sparse_layers)


def test_missing_and_misshaped_expert_named(tmp_path):
    """A missing expert tensor, or one expert of another shape, fails naming the tensor."""
    source = GOLDEN / "mixtral"
    pattern = "model.layers.0.block_sparse_moe.experts.{expert}.w1.weight"
    hf = HFTensor(pattern, transpose=True, experts=8)
    mesh = make_mesh(1, 2)
    for edit, match in (
        (lambda t: t.pop(pattern.format(expert=5)), r"no tensor '.*experts.5.w1.weight'"),
        (
            lambda t: t.update({pattern.format(expert=3): t[pattern.format(expert=3)][:8]}),
            r"differ in shape",
        ),
    ):
        target = tmp_path / str(len(list(tmp_path.iterdir())))
        target.mkdir()
        shutil.copy(source / "config.json", target / "config.json")
        found = tensors("mixtral")
        edit(found)
        save_file(found, str(target / checkpoint.SINGLE_FILE))
        with pytest.raises(ValueError, match=match):
            load_tensor(target, hf, (8, 64, 16), mesh, P(TP), jnp.float32)
    with pytest.raises(
        ValueError,
        match=r"has shape \(8, 16, 64\) \(read transposed, as \(8, 64, 16\).*is \(8, 16, 64\)",
    ):
        load_tensor(source, hf, (8, 16, 64), mesh, P(TP), jnp.float32)  # not transposed


def test_hf_tensor_validates_stacking():
    """A stacked HFTensor needs an {expert} field and a count (stacked parts: a {part} field,
    the parts and their axis), and no vocab padding."""
    with pytest.raises(ValueError, match="both an {expert} field"):
        HFTensor("model.layers.0.mlp.experts.0.w1.weight", experts=8)
    with pytest.raises(ValueError, match="both an {expert} field"):
        HFTensor("model.layers.0.mlp.experts.{expert}.w1.weight")
    with pytest.raises(ValueError, match="needs the size it pads from"):
        HFTensor("x.w", padded_axis=0)
    with pytest.raises(ValueError, match="no padded axis"):
        HFTensor("x.{expert}.w", experts=2, padded_axis=0, padded_from=4)
    assert json.dumps(HFTensor("x.{expert}.w", experts=2).tensor_names()) == '["x.0.w", "x.1.w"]'
    named = r"a {part} field in its name \(or part_rows of one tensor\), parts=.* and part_axis"
    with pytest.raises(ValueError, match=named):
        HFTensor("x.{part}.w", parts=("k", "v"))
    with pytest.raises(ValueError, match="a {part} field in its name"):
        HFTensor("x.k.w", parts=("k", "v"), part_axis=1)
    with pytest.raises(ValueError, match="stacked parts take no padded axis"):
        HFTensor("x.{part}.w", parts=("k",), part_axis=1, padded_axis=0, padded_from=4)
    gate_up = HFTensor("x.{expert}.{part}.w", experts=2, parts=("g", "u"), part_axis=2)
    assert gate_up.tensor_names() == ("x.0.g.w", "x.1.g.w", "x.0.u.w", "x.1.u.w")
    kv = HFTensor("x.{part}.w", parts=("k", "v"), part_axis=1)
    assert kv.tensor_names() == ("x.k.w", "x.v.w")


def hf_sparse_block(found: dict, prefix: str, x: np.ndarray, top_k: int, renormalize: bool):
    """Qwen2-MoE's sparse block written as transformers does, on the raw [out, in] tensors."""
    linear = lambda v, name: v @ found[prefix + name].astype(np.float64).T  # noqa: E731
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    logits = linear(x, "gate.weight")
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        chosen = np.argsort(-probs[t], kind="stable")[:top_k]
        weights = probs[t, chosen] / (probs[t, chosen].sum() if renormalize else 1.0)
        for e, w in zip(chosen, weights, strict=True):
            e_prefix = f"experts.{e}."
            h = silu(linear(x[t], e_prefix + "gate_proj.weight"))
            h = h * linear(x[t], e_prefix + "up_proj.weight")
            out[t] += w * linear(h, e_prefix + "down_proj.weight")
    shared = silu(linear(x, "shared_expert.gate_proj.weight"))
    shared = linear(
        shared * linear(x, "shared_expert.up_proj.weight"), "shared_expert.down_proj.weight"
    )
    return out + shared / (1 + np.exp(-linear(x, "shared_expert_gate.weight")))


def test_loaded_experts_feed_moe_functions():
    """Golden Qwen2-MoE weights loaded by the name map, run by the MoE functions (experts over 4
    ranks, summed here), equal the block computed the transformers way from the raw tensors."""

    config = load_config(GOLDEN / "qwen2_moe")
    sources = hf_name_map(config)
    found = tensors("qwen2_moe")
    mesh = make_mesh(1, 4)
    params = {}
    for part in (
        "router",
        "gate_up_proj",
        "down_proj",
        "shared_expert.gate_up_proj",
        "shared_expert.down_proj",
        "shared_expert.expert_gate",
    ):
        source = sources[f"layers.2.mlp.{part}"]
        one = found[source.tensor_names()[0]]
        shape = one.shape[::-1] if source.experts is None else (source.experts, *one.shape[::-1])
        if source.parts is not None:
            axis = source.part_axis
            shape = (*shape[:axis], len(source.parts), *shape[axis:])
        spec = P(TP) if source.experts is not None else P()
        loaded = load_tensor(GOLDEN / "qwen2_moe", source, shape, mesh, spec, jnp.float32)
        # On the host from here: the MoE functions run inside shard_map, on local arrays.
        params[part] = np.asarray(loaded)
    x = np.random.default_rng(0).standard_normal((10, config.hidden_size)).astype(np.float32)
    moe_config = config.moe
    local = moe_config.num_experts // 4

    @jax.jit
    def block(x, params):
        routing = moe_routing.route(x, params["router"], top_k=moe_config.top_k, renormalize=False)
        outputs = sum(
            routed_experts.expert_outputs(
                x,
                routing,
                *(params[p][r * local : (r + 1) * local] for p in ("gate_up_proj", "down_proj")),
                expert_offset=r * local,
            )
            for r in range(4)
        )
        parts = ("gate_up_proj", "down_proj", "expert_gate")
        shared = moe.shared_expert(x, *(params[f"shared_expert.{p}"] for p in parts))
        return moe_routing.finalize(
            moe_routing.MoeOutput(expert_outputs=outputs, routing=routing, shared=shared)
        )

    got = block(jnp.asarray(x), params)
    want = hf_sparse_block(found, "model.layers.2.mlp.", x.astype(np.float64), 2, False)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
