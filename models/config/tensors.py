"""Where each model parameter comes from in a Hugging Face checkpoint: `HFTensor`, and the tensor
names the families share.

A family's `tensor_names` (`models.config.registry.hf_name_map`) maps every parameter path of a
decoder (`layers.3.input_norm.weight`) to its `HFTensor`: the safetensors name
(`model.layers.3.input_layernorm.weight`), whether it is an `nn.Linear` weight read transposed,
the vocab padding, the stacks one parameter holds (the experts of a layer, the parts one matmul
computes together, the layers of a scanned run), and the rows it takes of a tensor that feeds
several parameters (a Mamba2 mixer's fused in_proj). The maps here are those of the layers
several families share; a family's own names stay in its file.
"""

from __future__ import annotations

import dataclasses

from .hybrid import Mamba2Spec
from .mla import MlaConfig
from .types import DecoderConfig, ResidualDesign


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
      padded_from: The checkpoint's size on `padded_axis` (the config's vocab size).
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
      interleaved: The stacked parts are interleaved in ONE tensor (`name` without a `{part}`
        field): read in the parameter's layout, its axis `part_axis` runs over the parameter's
        axes `part_axis` and `part_axis + 1` with the part fastest, so element j of part p is
        at index `j * len(parts) + p` (GPT-OSS's fused experts: gate the even columns of
        `gate_up_proj`, up the odd ones). Each device reads only its columns of the parts.
    """

    name: str
    transpose: bool = False
    padded_axis: int | None = None
    padded_from: int | None = None
    experts: int | None = None
    layers: tuple[int, ...] | None = None
    parts: tuple[str, ...] | None = None
    part_axis: int | None = None
    rows: tuple[int, int] | None = None
    part_rows: tuple[tuple[int, int], ...] | None = None
    interleaved: bool = False

    def __post_init__(self):
        if (self.padded_axis is None) != (self.padded_from is None):
            raise ValueError(
                f"a padded axis needs the size it pads from; got {self.padded_axis=}, "
                f"{self.padded_from=}"
            )
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
        if self.interleaved and (self.parts is None or self.part_rows is not None):
            raise ValueError(
                "interleaved parts need parts=(name, ...) and part_axis, and no part_rows; got "
                f"parts={self.parts!r}, part_rows={self.part_rows!r}"
            )
        named_parts = self.parts is not None and self.part_rows is None and not self.interleaved
        if ("{part}" in self.name) != named_parts or (self.parts is None) != (
            self.part_axis is None
        ):
            raise ValueError(
                "a stacked-parts HFTensor needs a {part} field in its name (or part_rows of one "
                "tensor), parts=(name, ...) and part_axis (interleaved parts of one tensor: no "
                f"{{part}} field); got name={self.name!r}, "
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

    def fused_parts(self) -> HFTensor:
        """The one tensor an interleaved-parts parameter is cut from, as a plain source (in
        the parameter's layout less the parts axis, whose axis `part_axis` holds every part)."""
        return dataclasses.replace(self, parts=None, part_axis=None, interleaved=False)

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
        if self.parts is not None and not self.interleaved:
            return tuple(name for part in self.stacked_parts() for name in part.tensor_names())
        if self.experts is None:
            return (self.name,)
        return tuple(self.name.format(expert=e) for e in range(self.experts))


NORM_TENSORS = {
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
"""Each residual design's norms (`models.decoder.designs`), by the layer attribute that holds
them, with layer-relative tensor names."""
KV_PARTS = ("k", "v")
ATTENTION_TENSORS = {
    "attn.q_proj.kernel": HFTensor("self_attn.q_proj.weight", transpose=True),
    "attn.kv_proj.kernel": HFTensor(
        "self_attn.{part}_proj.weight", transpose=True, parts=KV_PARTS, part_axis=1
    ),
    "attn.o_proj.kernel": HFTensor("self_attn.o_proj.weight", transpose=True),
}
"""Grouped-query attention's projections (k and v stacked in one parameter), layer-relative."""
QK_NORM_TENSORS = {
    "attn.q_norm.weight": HFTensor("self_attn.q_norm.weight"),
    "attn.k_norm.weight": HFTensor("self_attn.k_norm.weight"),
}
QKV_BIAS_TENSORS = {
    "attn.q_proj.bias": HFTensor("self_attn.q_proj.bias"),
    "attn.kv_proj.bias": HFTensor("self_attn.{part}_proj.bias", parts=KV_PARTS, part_axis=0),
}
GATED_MLP_TENSORS = {
    "mlp.gate_up_proj.kernel": HFTensor(
        "mlp.{part}_proj.weight", transpose=True, parts=("gate", "up"), part_axis=1
    ),
    "mlp.down_proj.kernel": HFTensor("mlp.down_proj.weight", transpose=True),
}
"""The gated MLP's projections (gate and up stacked in one parameter), layer-relative."""
GATED_MLP_BIAS_TENSORS = {
    "mlp.gate_up_proj.bias": HFTensor("mlp.{part}_proj.bias", parts=("gate", "up"), part_axis=0),
    "mlp.down_proj.bias": HFTensor("mlp.down_proj.bias"),
}
"""The gated MLP's biases (`DecoderConfig.mlp_bias`), layer-relative."""
UNGATED_MLP_TENSORS = {
    f"mlp.{name}_proj.kernel": HFTensor(f"mlp.{name}_proj.weight", transpose=True)
    for name in ("up", "down")
}
"""The ungated MLP's projections (`layers.ungated_mlp.UngatedMlp` held as `mlp`),
layer-relative."""
UNGATED_MLP_BIAS_TENSORS = {
    f"mlp.{name}_proj.bias": HFTensor(f"mlp.{name}_proj.bias") for name in ("up", "down")
}
"""The ungated MLP's biases (`DecoderConfig.mlp_bias`), layer-relative."""
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer some older checkpoints store


def mla_tensors(mla: MlaConfig) -> dict[str, HFTensor]:
    """Multi-head latent attention's parameters (`models.layers.attention.latent`),
    layer-relative."""
    projections = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    projections += ["q_proj"] if mla.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
    norms = ["kv_a_layernorm"] + ([] if mla.q_lora_rank is None else ["q_a_layernorm"])
    tensors = {
        f"attn.{name}.kernel": HFTensor(f"self_attn.{name}.weight", transpose=True)
        for name in projections
    }
    return tensors | {f"attn.{name}.weight": HFTensor(f"self_attn.{name}.weight") for name in norms}


def sparse_ffn_tensors(
    config: DecoderConfig,
    *,
    prefix: str = "mlp.",
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    shared: str = "shared_expert",
) -> dict[str, HFTensor]:
    """The sparse FFN's parameters (`models.layers.moe.sparse.SparseMoe` held as the layer's
    `mlp`), with layer-relative tensor names: the router `{prefix}gate.weight`, each expert's
    gate, up and down projections `{prefix}experts.{e}.{name}.weight` (`experts` names them),
    the router's correction bias where the routing has one, and the shared expert
    `mlp.{shared}.*` (with its gate `mlp.shared_expert_gate.weight` where gated)."""
    moe = config.moe
    gate, up, down = experts
    expert = f"{prefix}experts.{{expert}}."
    tensors = {
        "mlp.router": HFTensor(f"{prefix}gate.weight", transpose=True),
        "mlp.gate_up_proj": HFTensor(
            expert + "{part}.weight",
            transpose=True,
            experts=moe.num_experts,
            parts=(gate, up),
            part_axis=2,
        ),
        "mlp.down_proj": HFTensor(
            f"{expert}{down}.weight", transpose=True, experts=moe.num_experts
        ),
    }
    if moe.routing is not None and moe.routing.correction_bias:
        tensors["mlp.e_score_correction_bias"] = HFTensor(f"{prefix}gate.e_score_correction_bias")
    if moe.shared_expert_intermediate_size is not None:
        tensors["mlp.shared_expert.gate_up_proj"] = HFTensor(
            f"mlp.{shared}.{{part}}_proj.weight", transpose=True, parts=("gate", "up"), part_axis=1
        )
        tensors["mlp.shared_expert.down_proj"] = HFTensor(
            f"mlp.{shared}.down_proj.weight", transpose=True
        )
        if moe.shared_expert_gate:
            tensors["mlp.shared_expert.expert_gate"] = HFTensor(
                "mlp.shared_expert_gate.weight", transpose=True
            )
    return tensors


def mamba2_tensors(spec: Mamba2Spec) -> dict[str, HFTensor]:
    """A `Mamba2Mixer` held as the layer's `mixer`: its parameters cut by row ranges from one
    fused `in_proj` and `conv1d` (`Mamba2Spec.in_proj_rows`, `conv_rows`), with layer-relative
    tensor names."""
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


O_BIAS_TENSORS = {"attn.o_proj.bias": HFTensor("self_attn.o_proj.bias")}


def attention_tensors(config: DecoderConfig) -> dict[str, HFTensor]:
    """Grouped-query attention's projections with the q/k norms, q/k/v biases and o bias the
    config has (layer-relative)."""
    return (
        ATTENTION_TENSORS
        | (QK_NORM_TENSORS if config.qk_norm else {})
        | (QKV_BIAS_TENSORS if config.qkv_bias else {})
        | (O_BIAS_TENSORS if config.o_bias else {})
    )


def dense_layer_tensors(config: DecoderConfig) -> dict[str, HFTensor]:
    """A layer of grouped-query attention (`attention_tensors`) and a gated MLP (with the
    biases `mlp_bias` asks for), with its residual design's norms (layer-relative)."""
    mlp = GATED_MLP_TENSORS | (GATED_MLP_BIAS_TENSORS if config.mlp_bias else {})
    return NORM_TENSORS[config.residual_design] | attention_tensors(config) | mlp


def decoder_tensor_names(
    config: DecoderConfig,
    *,
    scan_layers: bool,
    dense: dict[str, HFTensor],
    sparse: dict[str, HFTensor] | None = None,
) -> dict[str, HFTensor]:
    """`{module path: HFTensor}` of a decoder whose layers are `dense`'s (layer-relative paths
    and names), its sparse layers (`config.sparse_layers`) with `sparse`'s FFN in place of the
    dense one's `mlp.*`, under `model.layers.{i}.`; with the embedding, the final norm and an
    untied LM head (`whole_model_names`).

    Without `scan_layers` a layer's paths are `layers.{i}.<path>`; with it, `layers.{b}` is
    block b of `config.layer_blocks(True)`: an unscanned layer has its paths, and a scanned run
    `layers.{b}.layer.<path>` with the run's layers stacked on axis 0 (`HFTensor.layers`).
    """
    layer_of_kind = {False: dense}
    if sparse is not None:
        layer_of_kind[True] = {k: v for k, v in dense.items() if not k.startswith("mlp.")} | sparse
    names = {}
    for b, (block, scanned) in enumerate(config.layer_blocks(scan_layers)):
        for path, tensor in layer_of_kind[config.sparse_layers[block.start]].items():
            if not scanned:
                names[f"layers.{b}.{path}"] = dataclasses.replace(
                    tensor, name=f"model.layers.{block.start}.{tensor.name}"
                )
            else:
                names[f"layers.{b}.layer.{path}"] = dataclasses.replace(
                    tensor, name=f"model.layers.{{layer}}.{tensor.name}", layers=tuple(block)
                )
    return whole_model_names(config, names)


def whole_model_names(
    config: DecoderConfig,
    layers: dict[str, HFTensor],
    *,
    prefix: str = "model.",
    embedding: str = "embed_tokens",
    final_norm: str = "norm",
) -> dict[str, HFTensor]:
    """`layers`' names with the embedding (`{prefix}{embedding}.weight`, vocab-padded), the
    final norm (`{prefix}{final_norm}.weight`) and, without tied embeddings, the LM head
    (`lm_head.weight`, transposed, vocab-padded)."""
    vocab = config.vocab_size
    names = {
        "embed.embedding": HFTensor(f"{prefix}{embedding}.weight", padded_axis=0, padded_from=vocab)
    }
    names |= layers
    names["final_norm.weight"] = HFTensor(f"{prefix}{final_norm}.weight")
    if not config.tie_word_embeddings:
        names["lm_head.kernel"] = HFTensor(
            "lm_head.weight", transpose=True, padded_axis=1, padded_from=vocab
        )
    return names
