"""Where each model parameter comes from in a Hugging Face checkpoint: the tensor names per
family, in one room.

`hf_name_map(config)` maps every parameter path of a decoder (`layers.3.input_norm.weight`) to its
`HFTensor`: the safetensors name (`model.layers.3.input_layernorm.weight`), whether it is an
`nn.Linear` weight read transposed, the vocab padding, the stacks one parameter holds (the
experts of a layer, the parts one matmul computes together, the layers of a scanned run), and
the rows it takes of a tensor that feeds several parameters (Nemotron-H's fused Mamba2 in_proj).
"""

from __future__ import annotations

import dataclasses
import re

from . import (
    Architecture,
    DecoderConfig,
    HybridLayer,
    Mamba2Spec,
    MlaConfig,
    ResidualDesign,
)


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """Where one model parameter comes from in a Hugging Face checkpoint.

    Attributes:
      name: The safetensors tensor name, e.g. "model.layers.0.self_attn.q_proj.weight"; for
        stacked experts a pattern with an `{expert}` field, e.g.
        "model.layers.0.mlp.experts.{expert}.gate_proj.weight".
      transpose: The tensor is an `nn.Linear` weight [out, in]; the parameter is [in, out] (for
        stacked experts: each expert's [out, in] becomes [in, out] behind the expert axis).
      padded_axis: The parameter axis padded past the checkpoint's vocab size with zeros, or
        None when the shapes must match exactly.
      experts: For a stack of per-expert tensors, their number: parameter axis 0 runs over the
        experts 0 .. experts - 1, and expert e comes from `name.format(expert=e)`. None for one
        tensor.
      layers: For a parameter of a scanned run of layers (`boundary_jax.StackedLayers`), the
        model layers it stacks: parameter axis 0 runs over them, and layer l's part (itself
        possibly a stack of experts or parts) comes from the name with `{layer}` replaced by l.
        None for one layer's parameter.
      parts: For projections stacked in one parameter (`ColumnParallelLinear(parts=...)`, the
        experts' `gate_up_proj`), the values of the name's `{part}` field, e.g. ("k", "v") in
        "self_attn.{part}_proj.weight": one layer's parameter axis `part_axis` runs over them,
        and each part may itself be a stack of experts. None for one tensor.
      part_axis: The axis of one layer's parameter that `parts` stack on.
      rows: The parameter is rows [start, stop) of the stored tensor's first axis (an
        `nn.Linear` weight's output features, before the transpose), e.g. one projection of a
        fused one; None for the whole tensor. Each device reads only its rows of those.
      part_rows: For stacked parts cut from ONE tensor (`name` without a `{part}` field), each
        part's `rows`; `parts` then only names them. None for parts of their own tensors.
    """

    name: str
    transpose: bool = False
    padded_axis: int | None = None
    experts: int | None = None
    layers: tuple[int, ...] | None = None
    parts: tuple[str, ...] | None = None
    part_axis: int | None = None
    rows: tuple[int, int] | None = None
    part_rows: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self):
        stacked = "{expert}" in self.name
        if stacked != (self.experts is not None):
            raise ValueError(
                "a stacked-experts HFTensor needs both an {expert} field in its name and "
                f"experts=N; got name={self.name!r}, experts={self.experts!r}"
            )
        if self.experts is not None and (self.experts < 1 or self.padded_axis is not None):
            raise ValueError(
                f"stacked experts need experts >= 1 and no padded axis; got {self.experts=}, "
                f"{self.padded_axis=}"
            )
        if ("{layer}" in self.name) != (self.layers is not None) or (
            self.layers is not None and (not self.layers or self.padded_axis is not None)
        ):
            raise ValueError(
                "a stacked-layers HFTensor needs a {layer} field in its name, layers=(l, ...) "
                f"and no padded axis; got name={self.name!r}, layers={self.layers!r}, "
                f"padded_axis={self.padded_axis!r}"
            )
        named_parts = self.parts is not None and self.part_rows is None
        if ("{part}" in self.name) != named_parts or (self.parts is None) != (
            self.part_axis is None
        ):
            raise ValueError(
                "a stacked-parts HFTensor needs a {part} field in its name (or part_rows of one "
                f"tensor), parts=(name, ...) and part_axis; got name={self.name!r}, "
                f"parts={self.parts!r}, part_axis={self.part_axis!r}, "
                f"part_rows={self.part_rows!r}"
            )
        if self.part_rows is not None and (
            self.parts is None or len(self.part_rows) != len(self.parts)
        ):
            raise ValueError(
                f"part_rows gives one row range per part; got parts={self.parts!r}, "
                f"part_rows={self.part_rows!r}"
            )
        for start, stop in (self.part_rows or ()) + ((self.rows,) if self.rows else ()):
            if not 0 <= start < stop or self.padded_axis is not None:
                raise ValueError(
                    f"rows are a non-empty range [start, stop) of an unpadded tensor; got "
                    f"{(start, stop)} with padded_axis={self.padded_axis!r}"
                )
        if self.parts is not None and self.padded_axis is not None:
            raise ValueError(f"stacked parts take no padded axis; got {self.padded_axis=}")

    def layer_parts(self) -> tuple[HFTensor, ...]:
        """Per layer of a stacked-layers parameter, the source of its part; else (self,)."""
        if self.layers is None:
            return (self,)
        return tuple(
            dataclasses.replace(self, name=self.name.replace("{layer}", str(i)), layers=None)
            for i in self.layers
        )

    def stacked_parts(self) -> tuple[HFTensor, ...]:
        """Per part of one layer's stacked-parts parameter, the source of its part."""
        if self.part_rows is not None:
            return tuple(
                dataclasses.replace(self, parts=None, part_axis=None, part_rows=None, rows=rows)
                for rows in self.part_rows
            )
        return tuple(
            dataclasses.replace(
                self, name=self.name.replace("{part}", part), parts=None, part_axis=None
            )
            for part in self.parts
        )

    def tensor_names(self) -> tuple[str, ...]:
        """The checkpoint tensors this parameter is made of, in parameter order."""
        if self.layers is not None:
            return tuple(name for part in self.layer_parts() for name in part.tensor_names())
        if self.parts is not None:
            return tuple(name for part in self.stacked_parts() for name in part.tensor_names())
        if self.experts is None:
            return (self.name,)
        return tuple(self.name.format(expert=e) for e in range(self.experts))


# Each design's norms, by the layer attribute that holds them (`models.families.designs`).
_NORM_TENSORS = {
    ResidualDesign.PRE_NORM: {
        "input_norm.weight": HFTensor("input_layernorm.weight"),
        "post_attn_norm.weight": HFTensor("post_attention_layernorm.weight"),
    },
    ResidualDesign.POST_NORM: {
        "post_attn_norm.weight": HFTensor("post_attention_layernorm.weight"),
        "post_ffn_norm.weight": HFTensor("post_feedforward_layernorm.weight"),
    },
    ResidualDesign.SANDWICH: {
        "input_norm.weight": HFTensor("input_layernorm.weight"),
        "post_attn_norm.weight": HFTensor("post_attention_layernorm.weight"),
        "pre_ffn_norm.weight": HFTensor("pre_feedforward_layernorm.weight"),
        "post_ffn_norm.weight": HFTensor("post_feedforward_layernorm.weight"),
    },
}
_KV_PARTS = ("k", "v")
_LAYER_TENSORS = {
    "attn.q_proj.kernel": HFTensor("self_attn.q_proj.weight", transpose=True),
    "attn.kv_proj.kernel": HFTensor(
        "self_attn.{part}_proj.weight", transpose=True, parts=_KV_PARTS, part_axis=1
    ),
    "attn.o_proj.kernel": HFTensor("self_attn.o_proj.weight", transpose=True),
    "mlp.gate_up_proj.kernel": HFTensor(
        "mlp.{part}_proj.weight", transpose=True, parts=("gate", "up"), part_axis=1
    ),
    "mlp.down_proj.kernel": HFTensor("mlp.down_proj.weight", transpose=True),
}
_QK_NORM_TENSORS = {
    "attn.q_norm.weight": HFTensor("self_attn.q_norm.weight"),
    "attn.k_norm.weight": HFTensor("self_attn.k_norm.weight"),
}
_QKV_BIAS_TENSORS = {
    "attn.q_proj.bias": HFTensor("self_attn.q_proj.bias"),
    "attn.kv_proj.bias": HFTensor("self_attn.{part}_proj.bias", parts=_KV_PARTS, part_axis=0),
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer some older checkpoints store
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def mtp_layer(name: str, config: DecoderConfig) -> int | None:
    """The layer index of a DeepSeek checkpoint tensor that belongs to a multi-token-prediction
    layer (`model.layers.{i}.*` with i >= num_layers, as DeepSeek-V3's `model.layers.61.*`),
    which the causal LM does not run; None for any other tensor (or another family)."""
    if config.mla is None:
        return None
    found = _LAYER_INDEX.match(name)
    layer = None if found is None else int(found.group(1))
    return layer if layer is not None and layer >= config.num_layers else None


_LONGCAT_SKIPPED = re.compile(r"model\.(mtp\.|layers\.\d+\.mlp\.experts\.(\d+)\.)")


def longcat_skipped(name: str, config: DecoderConfig) -> bool:
    """Whether a LongCat-Flash checkpoint tensor is one the causal LM never reads: the
    multi-token-prediction head (`model.mtp.*`, which transformers ignores too), or a weight of
    a zero-computation expert (`mlp.experts.{e}.*` with e >= n_routed_experts: transformers 5
    holds `gate_up_proj` for every expert and `save_pretrained` writes those rows). False for
    any other tensor or family."""
    if config.architecture is not Architecture.LONGCAT_FLASH:
        return False
    found = _LONGCAT_SKIPPED.match(name)
    if found is None:
        return False
    expert = found.group(2)
    return expert is None or int(expert) >= config.moe.num_experts


def _mla_tensors(mla: MlaConfig) -> dict[str, HFTensor]:
    """Multi-head latent attention's parameters (`models.layers.mla`), layer-relative."""
    projections = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    projections += ["q_proj"] if mla.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
    norms = ["kv_a_layernorm"] + ([] if mla.q_lora_rank is None else ["q_a_layernorm"])
    tensors = {
        f"attn.{name}.kernel": HFTensor(f"self_attn.{name}.weight", transpose=True)
        for name in projections
    }
    return tensors | {f"attn.{name}.weight": HFTensor(f"self_attn.{name}.weight") for name in norms}


def _sparse_ffn_tensors(config: DecoderConfig) -> dict[str, HFTensor]:
    """The sparse FFN's parameters (paths relative to the layer) for
    `models.layers.moe.SparseMoe` held as the layer's `mlp`, with layer-relative tensor names."""
    moe = config.moe
    shared = "shared_experts" if moe.routing is not None else "shared_expert"  # DeepSeek's
    if config.architecture is Architecture.MIXTRAL:
        prefix, names = "block_sparse_moe.", {"gate": "w1", "up": "w3", "down": "w2"}
    else:
        prefix, names = "mlp.", {part: f"{part}_proj" for part in ("gate", "up", "down")}
    experts = f"{prefix}experts.{{expert}}."
    tensors = {
        "mlp.router": HFTensor(f"{prefix}gate.weight", transpose=True),
        "mlp.gate_up_proj": HFTensor(
            experts + "{part}.weight",
            transpose=True,
            experts=moe.num_experts,
            parts=(names["gate"], names["up"]),
            part_axis=2,
        ),
        "mlp.down_proj": HFTensor(
            experts + names["down"] + ".weight", transpose=True, experts=moe.num_experts
        ),
    }
    if moe.routing is not None and moe.routing.correction_bias:
        tensors["mlp.e_score_correction_bias"] = HFTensor(f"{prefix}gate.e_score_correction_bias")
    if moe.shared_expert_intermediate_size is not None:
        tensors["mlp.shared_expert.gate_up_proj"] = HFTensor(
            f"mlp.{shared}.{{part}}_proj.weight",
            transpose=True,
            parts=("gate", "up"),
            part_axis=1,
        )
        tensors["mlp.shared_expert.down_proj"] = HFTensor(
            f"mlp.{shared}.down_proj.weight", transpose=True
        )
        if moe.shared_expert_gate:
            tensors["mlp.shared_expert.expert_gate"] = HFTensor(
                "mlp.shared_expert_gate.weight", transpose=True
            )
    return tensors


def _mamba2_tensors(spec: Mamba2Spec) -> dict[str, HFTensor]:
    """A `Mamba2Mixer` held as the layer's `mixer`: its parameters cut by row ranges from one
    `NemotronHMamba2Mixer`'s fused `in_proj` and `conv1d` (`Mamba2Spec.in_proj_rows`,
    `conv_rows`), with layer-relative tensor names."""
    in_proj, conv = spec.in_proj_rows, spec.conv_rows

    def cut(name: str, ranges: dict, parts: tuple[str, ...], axis: int, transpose: bool):
        rows = tuple(ranges[part] for part in parts)
        return HFTensor(name, transpose=transpose, parts=parts, part_axis=axis, part_rows=rows)

    fused, kernel = "mixer.in_proj.weight", "mixer.conv1d.weight"
    tensors = {
        "mixer.in_proj_zx.kernel": cut(fused, in_proj, ("z", "x"), 1, True),
        "mixer.in_proj_bc.kernel": cut(fused, in_proj, ("B", "C"), 1, True),
        "mixer.in_proj_dt.kernel": HFTensor(fused, transpose=True, rows=in_proj["dt"]),
        "mixer.conv_x.weight": HFTensor(kernel, rows=conv["x"]),
        "mixer.conv_bc.weight": cut(kernel, conv, ("B", "C"), 0, False),
        "mixer.dt_bias": HFTensor("mixer.dt_bias"),
        "mixer.a_log": HFTensor("mixer.A_log"),
        "mixer.d": HFTensor("mixer.D"),
        "mixer.norm_weight": HFTensor("mixer.norm.weight"),
        "mixer.out_proj.kernel": HFTensor("mixer.out_proj.weight", transpose=True),
    }
    if spec.conv_bias:
        bias = "mixer.conv1d.bias"
        tensors["mixer.conv_x.bias"] = HFTensor(bias, rows=conv["x"])
        tensors["mixer.conv_bc.bias"] = cut(bias, conv, ("B", "C"), 0, False)
    return tensors


def _hybrid_layer_tensors(config: DecoderConfig, kind: HybridLayer) -> dict[str, HFTensor]:
    """One Nemotron-H layer's parameters (its `norm` and its stage's `mixer`), with
    layer-relative tensor names."""
    norm = {"norm.weight": HFTensor("norm.weight")}
    if kind is HybridLayer.MAMBA2:
        return norm | _mamba2_tensors(config.hybrid.mamba)
    if kind is HybridLayer.ATTENTION:
        return norm | {
            "mixer.q_proj.kernel": HFTensor("mixer.q_proj.weight", transpose=True),
            "mixer.kv_proj.kernel": HFTensor(
                "mixer.{part}_proj.weight", transpose=True, parts=_KV_PARTS, part_axis=1
            ),
            "mixer.o_proj.kernel": HFTensor("mixer.o_proj.weight", transpose=True),
        }
    if kind is HybridLayer.MLP:
        return norm | {
            f"mixer.{proj}_proj.kernel": HFTensor(f"mixer.{proj}_proj.weight", transpose=True)
            for proj in ("up", "down")
        }
    experts = config.hybrid.moe.num_experts
    return norm | {
        "mixer.router": HFTensor("mixer.gate.weight", transpose=True),
        "mixer.e_score_correction_bias": HFTensor("mixer.gate.e_score_correction_bias"),
        "mixer.gate_up_proj": HFTensor(  # relu^2 experts: the up projection is the one part
            "mixer.experts.{expert}.{part}_proj.weight",
            transpose=True,
            experts=experts,
            parts=("up",),
            part_axis=2,
        ),
        "mixer.down_proj": HFTensor(
            "mixer.experts.{expert}.down_proj.weight", transpose=True, experts=experts
        ),
        "mixer.shared_expert.gate_up_proj": HFTensor(  # relu^2: the up projection alone
            "mixer.shared_experts.{part}_proj.weight", transpose=True, parts=("up",), part_axis=1
        ),
        "mixer.shared_expert.down_proj": HFTensor(
            "mixer.shared_experts.down_proj.weight", transpose=True
        ),
    }


def _longcat_name_map(config: DecoderConfig) -> dict[str, HFTensor]:
    """`hf_name_map` of a LongCat-Flash config (`models.families.longcat`): per layer, the
    attentions `attn_{0,1}` and dense FFNs `mlps_{0,1}` from `self_attn.{0,1}` and
    `mlps.{0,1}`, their norms `input_norm_{0,1}` and `post_attn_norm_{0,1}` from
    `input_layernorm.{0,1}` and `post_attention_layernorm.{0,1}`, and the MoE `mlp` (its
    router from `mlp.router.classifier.weight` and `mlp.router.e_score_correction_bias`)."""
    moe = _sparse_ffn_tensors(config)
    moe["mlp.router"] = HFTensor("mlp.router.classifier.weight", transpose=True)
    moe["mlp.e_score_correction_bias"] = HFTensor("mlp.router.e_score_correction_bias")
    layer = dict(moe)
    for index in (0, 1):
        for path, tensor in _mla_tensors(config.mla).items():
            name = tensor.name.replace("self_attn.", f"self_attn.{index}.")
            layer[path.replace("attn.", f"attn_{index}.")] = dataclasses.replace(tensor, name=name)
        for path in ("gate_up_proj.kernel", "down_proj.kernel"):
            tensor = _LAYER_TENSORS[f"mlp.{path}"]
            name = tensor.name.replace("mlp.", f"mlps.{index}.")
            layer[f"mlps_{index}.{path}"] = dataclasses.replace(tensor, name=name)
        layer[f"input_norm_{index}.weight"] = HFTensor(f"input_layernorm.{index}.weight")
        layer[f"post_attn_norm_{index}.weight"] = HFTensor(
            f"post_attention_layernorm.{index}.weight"
        )
    names = {"embed.embedding": HFTensor("model.embed_tokens.weight", padded_axis=0)}
    for i in range(config.num_layers):
        for path, tensor in layer.items():
            names[f"layers.{i}.{path}"] = dataclasses.replace(
                tensor, name=f"model.layers.{i}.{tensor.name}"
            )
    names["final_norm.weight"] = HFTensor("model.norm.weight")
    if not config.tie_word_embeddings:
        names["lm_head.kernel"] = HFTensor("lm_head.weight", transpose=True, padded_axis=1)
    return names


def _hybrid_name_map(config: DecoderConfig) -> dict[str, HFTensor]:
    """`hf_name_map` of a Nemotron-H config (tensors under `backbone.`, as transformers saves
    them): `layers.{i}.norm.weight` and the stage's parameters under `layers.{i}.mixer`."""
    names = {"embed.embedding": HFTensor("backbone.embeddings.weight", padded_axis=0)}
    for index, kind in enumerate(config.hybrid.layers):
        for path, tensor in _hybrid_layer_tensors(config, kind).items():
            names[f"layers.{index}.{path}"] = dataclasses.replace(
                tensor, name=f"backbone.layers.{index}.{tensor.name}"
            )
    names["final_norm.weight"] = HFTensor("backbone.norm_f.weight")
    if not config.tie_word_embeddings:
        names["lm_head.kernel"] = HFTensor("lm_head.weight", transpose=True, padded_axis=1)
    return names


def hf_name_map(config: DecoderConfig, *, scan_layers: bool = False) -> dict[str, HFTensor]:
    """`{module path: HFTensor}` for every parameter of a decoder described by `config`, built
    with or without `scan_layers`.

    Module paths are the dotted `nnx` state paths: `embed.embedding`,
    `layers.{i}.input_norm.weight`, `layers.{i}.post_attn_norm.weight` (the stages' input norms;
    a post-norm decoder's `post_attn_norm` and `post_ffn_norm` are its updates' norms, and a
    sandwich-norm one has `input_norm`, `post_attn_norm`, `pre_ffn_norm` and `post_ffn_norm`),
    `layers.{i}.attn.{q,o}_proj.kernel`, `layers.{i}.attn.kv_proj.kernel` (k and v stacked on
    axis 1), `layers.{i}.attn.{q,k}_norm.weight` (qk_norm only),
    `layers.{i}.mlp.gate_up_proj.kernel` (gate and up stacked on axis 1),
    `layers.{i}.mlp.down_proj.kernel`, `final_norm.weight`, and `lm_head.kernel` (absent with
    tied embeddings, where the head reads the embedding table).

    With q/k/v biases (Qwen2, Qwen2-MoE): `layers.{i}.attn.q_proj.bias` and
    `layers.{i}.attn.kv_proj.bias` (k and v stacked on axis 0). A sparse layer of
    an MoE decoder (`config.sparse_layers`) has, in place of the dense MLP, the parameters of a
    `models.layers.moe.SparseMoe` at `layers.{i}.mlp`: `mlp.router` [hidden, experts],
    `mlp.gate_up_proj` [experts, hidden, 2, width] (gate and up stacked on axis 2) and
    `mlp.down_proj` [experts, width, hidden] (stacked per-expert tensors), and with a shared
    expert `mlp.shared_expert.{gate,up,down}_proj` and `mlp.shared_expert.expert_gate`
    [hidden, 1].

    A DeepSeek decoder (`config.mla`) has latent attention's `layers.{i}.attn.<name>.kernel`
    for `q_proj` (or `q_a_proj` and `q_b_proj` with q LoRA), `kv_a_proj_with_mqa`,
    `kv_b_proj` and `o_proj`, and `layers.{i}.attn.kv_a_layernorm.weight` (and
    `q_a_layernorm.weight`), from `self_attn.<name>.weight`; its sparse layers' shared experts
    come from `mlp.shared_experts.*`, and the V3 router's correction bias
    `layers.{i}.mlp.e_score_correction_bias` from `mlp.gate.e_score_correction_bias`.

    The paths above are those of an unscanned model. With `scan_layers`, `layers.{b}` is block
    b of `config.layer_blocks(True)`: an unscanned layer has its paths, and a scanned run has
    `layers.{b}.layer.<path>` with the run's layers stacked on axis 0 (`HFTensor.layers`).

    A LongCat-Flash config has per layer two latent attentions, two dense FFNs, their four
    norms and one MoE (`_longcat_name_map`); it is never scanned.

    A Nemotron-H (hybrid) config has `layers.{i}.norm.weight` and its one stage's parameters
    under `layers.{i}.mixer` (a Mamba2 mixer's cut by row ranges from the fused `in_proj` and
    `conv1d`; an MoE's relu^2 experts with their up projection as the one stacked part).
    """
    if config.hybrid is not None:
        config.layer_blocks(scan_layers)  # raises for a scanned hybrid stack
        return _hybrid_name_map(config)
    if config.architecture is Architecture.LONGCAT_FLASH:
        if scan_layers:
            raise NotImplementedError(
                "scanned runs of LongCat-Flash layers are not supported: build it without "
                "scan_layers"
            )
        return _longcat_name_map(config)
    names = {"embed.embedding": HFTensor("model.embed_tokens.weight", padded_axis=0)}
    dense = (
        _NORM_TENSORS[config.residual_design]
        | _LAYER_TENSORS
        | (_QK_NORM_TENSORS if config.qk_norm else {})
        | (_QKV_BIAS_TENSORS if config.qkv_bias else {})
    )
    if config.mla is not None:
        dense = {k: v for k, v in dense.items() if not k.startswith("attn.")}
        dense |= _mla_tensors(config.mla)
    sparse = {k: v for k, v in dense.items() if not k.startswith("mlp.")}
    if config.moe is not None:
        sparse |= _sparse_ffn_tensors(config)
    for b, (block, scanned) in enumerate(config.layer_blocks(scan_layers)):
        layer_paths = sparse if config.sparse_layers[block.start] else dense
        for path, tensor in layer_paths.items():
            if not scanned:
                names[f"layers.{b}.{path}"] = dataclasses.replace(
                    tensor, name=f"model.layers.{block.start}.{tensor.name}"
                )
            else:
                names[f"layers.{b}.layer.{path}"] = dataclasses.replace(
                    tensor, name=f"model.layers.{{layer}}.{tensor.name}", layers=tuple(block)
                )
    names["final_norm.weight"] = HFTensor("model.norm.weight")
    if not config.tie_word_embeddings:
        names["lm_head.kernel"] = HFTensor("lm_head.weight", transpose=True, padded_axis=1)
    return names
