"""Hugging Face PEFT LoRA adapters: read from their folders, stacked into a model's adapter
stacks (`layers.lora`), each device placed with only its shard of each adapter.

A PEFT LoRA folder holds `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`,
`target_modules`, ...) and `adapter_model.safetensors`, whose tensors are
`base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight`: A [r, in] and
B [out, r], as `nn.Linear` stores them. The delta of a projection is `x @ A^T @ B^T * scaling`
with `scaling = lora_alpha / r` (rsLoRA: `lora_alpha / sqrt(r)`); the scaling is folded into B
here. A module's own rank and alpha (`rank_pattern`, `alpha_pattern`) scale its own pair, and an
adapter of some layers only (`layers_to_transform`) holds no pair for the others. The
attention's q/k/v/o and the gated MLP's gate/up/down projections take adapters; an adapter on
MoE experts, on other modules, with a PEFT option that changes the product otherwise (DoRA,
LoRA biases, ...) or with an initialization that PEFT applies to the base weights on load
(PiSSA, OLoRA, ...) is refused when it is read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from safetensors.numpy import load_file, save_file

from ..config import DecoderConfig, family_of
from ..layers.lora import ATTENTION_TARGETS, LoraSpec, LoraTarget
from .load import read_json

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_TENSOR = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)
# PEFT options whose set value changes the adapter's product: refused, each with its default.
# (`fan_in_fan_out` is not one: PEFT sets it back to False on the nn.Linear projections here.)
_REFUSED = {
    "use_dora": False,
    "bias": "none",
    "lora_bias": False,
    "modules_to_save": None,
    "layer_replication": None,
    "target_parameters": None,
    "use_qalora": False,
    "alora_invocation_tokens": None,
    "trainable_token_indices": None,
    "use_bdlora": None,
    "kasa_config": None,
    "arrow_config": None,
    "monteclora_config": None,
}
# `init_lora_weights` values with which PEFT, loading the adapter, rewrites each targeted base
# weight (PiSSA and CorDA: W minus its principal part; OLoRA: minus its QR's first columns;
# LoftQ: quantized): the adapter is trained against that residual, not against the checkpoint.
_BASE_REWRITING_INITS = re.compile(r"(pissa|corda|olora|loftq)(_.*)?", re.IGNORECASE)
# The stacks a layer's modules hold (`layers.lora`), by module path, with the targets they stack.
STACKS = {
    ("attn", "q_lora"): (LoraTarget.Q,),
    ("attn", "kv_lora"): (LoraTarget.K, LoraTarget.V),
    ("attn", "o_lora"): (LoraTarget.OUT,),
    ("mlp", "gate_up_lora"): (LoraTarget.GATE, LoraTarget.UP),
    ("mlp", "up_lora"): (LoraTarget.UP,),
    ("mlp", "down_lora"): (LoraTarget.DOWN,),
}
_ROW_TARGETS = frozenset({LoraTarget.OUT, LoraTarget.DOWN})


@dataclasses.dataclass(frozen=True, eq=False)
class PeftAdapter:
    """One LoRA adapter, read from a PEFT folder.

    Attributes:
      name: What batches call it.
      rank: Its largest rank (`r`, or a module's from `rank_pattern`).
      targets: The projections it adapts.
      weights: `{(layer, target): (A [in, r], B [r, out])}` in float32 (r the module's rank),
        B scaled by `lora_alpha / r` (rsLoRA: `/ sqrt(r)`), each with the module's own.
    """

    name: str
    rank: int
    targets: frozenset[LoraTarget]
    weights: Mapping[tuple[int, LoraTarget], tuple[np.ndarray, np.ndarray]]


def projection_shape(config: DecoderConfig, target: LoraTarget) -> tuple[int, int]:
    """(in, out) features of projection `target` in a model of `config`."""
    hidden, heads = config.hidden_size, config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    return {
        LoraTarget.Q: (hidden, heads),
        LoraTarget.K: (hidden, kv),
        LoraTarget.V: (hidden, kv),
        LoraTarget.OUT: (heads, hidden),
        LoraTarget.GATE: (hidden, config.intermediate_size),
        LoraTarget.UP: (hidden, config.intermediate_size),
        LoraTarget.DOWN: (config.intermediate_size, hidden),
    }[target]


def read_peft_adapter(directory: str | Path, name: str, config: DecoderConfig) -> PeftAdapter:
    """The LoRA adapter in a PEFT folder, checked against the base model's `config`.

    Raises:
      FileNotFoundError: The folder lacks `adapter_config.json` or `adapter_model.safetensors`.
      NotImplementedError: An adapter on MoE experts or another module than the attention and
        MLP projections, a PEFT option that changes the product (DoRA, biases, ...), or an
        initialization that rewrites the base weights when PEFT loads the adapter (PiSSA, ...).
      ValueError: Not a LoRA adapter, or its tensors do not fit `config`.
    """
    directory = Path(directory)
    settings = read_json(directory / ADAPTER_CONFIG)
    if settings.get("peft_type") != "LORA":
        raise ValueError(
            f"{directory / ADAPTER_CONFIG} is a {settings.get('peft_type')!r} adapter; only "
            "PEFT LoRA adapters (peft_type LORA) load"
        )
    for option, default in _REFUSED.items():
        if settings.get(option, default) not in (default, None, {}, [], False):
            raise NotImplementedError(
                f"{directory}: the PEFT option {option}={settings[option]!r} is not built; "
                f"adapters with {option} left at {default!r} load"
            )
    init = settings.get("init_lora_weights")
    if isinstance(init, str) and _BASE_REWRITING_INITS.fullmatch(init):
        raise NotImplementedError(
            f"{directory}: init_lora_weights={init!r}: PEFT rewrites the base model's targeted "
            "weights when it loads such an adapter, which a base model shared by adapters does "
            "not; convert it to a plain LoRA adapter first (PEFT's save_pretrained with "
            "path_initial_model_for_weight_conversion)"
        )
    missing = [key for key in ("r", "lora_alpha") if not isinstance(settings.get(key), int | float)]
    if missing:
        raise ValueError(f"{directory / ADAPTER_CONFIG} needs numbers {missing}")
    ranks = _patterns(settings, "rank_pattern", int(settings["r"]), directory)
    alphas = _patterns(settings, "alpha_pattern", float(settings["lora_alpha"]), directory)
    weights_file = directory / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        raise FileNotFoundError(f"no {ADAPTER_WEIGHTS} in adapter folder {directory}")
    pairs: dict[tuple[int, LoraTarget], dict[str, np.ndarray]] = {}
    for tensor, value in load_file(weights_file).items():
        key, part = _parse(tensor, directory, config)
        pairs.setdefault(key, {})[part] = np.asarray(value, np.float32)
    weights = {}
    for (layer, target), pair in sorted(pairs.items(), key=lambda item: str(item[0])):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{directory}: layer {layer} {target.value} lacks lora_A or lora_B")
        a, b = pair["A"], pair["B"]
        module = f"model.layers.{layer}.{_MODULES[target]}.{target.value}"
        rank, alpha = ranks(module), alphas(module)
        want = projection_shape(config, target)
        if a.shape != (rank, want[0]) or b.shape != (want[1], rank):
            raise ValueError(
                f"{directory}: layer {layer} {target.value} has lora_A {a.shape} and lora_B "
                f"{b.shape}; a rank-{rank} adapter of this model needs {(rank, want[0])} and "
                f"{(want[1], rank)}. Is it an adapter of another base model?"
            )
        scaling = alpha / (math.sqrt(rank) if settings.get("use_rslora") else rank)
        weights[layer, target] = (a.T, b.T * np.float32(scaling))
    if not weights:
        raise ValueError(f"{weights_file} holds no LoRA tensors")
    targets = frozenset(target for _, target in weights)
    rank = max(a.shape[1] for a, _ in weights.values())
    return PeftAdapter(name, rank, targets, weights)


_MODULES = {target: "self_attn" if target in ATTENTION_TARGETS else "mlp" for target in LoraTarget}


def _patterns(
    settings: Mapping[str, object], key: str, default: float, directory: Path
) -> Callable[[str], float]:
    """A module's value of `rank_pattern` or `alpha_pattern` (`{pattern: value}`), as PEFT
    resolves it: the first pattern that matches the end of the module's name at a dot (a
    regular expression), else `default`."""
    patterns = settings.get(key) or {}
    if not isinstance(patterns, dict) or not all(
        isinstance(v, int | float) for v in patterns.values()
    ):
        raise ValueError(f"{directory / ADAPTER_CONFIG}: {key} must map patterns to numbers")

    def value(module: str) -> float:
        for pattern, number in patterns.items():
            if re.match(rf"(.*\.)?({pattern})$", module):
                return type(default)(number)
        return default

    return value


def _parse(tensor: str, directory: Path, config: DecoderConfig) -> tuple[tuple, str]:
    """((layer, target), "A" or "B") of a PEFT tensor name, or a refusal naming it."""
    if ".experts." in tensor or ".shared_expert" in tensor or ".mlp.gate." in tensor:
        raise NotImplementedError(
            f"{directory}: {tensor} adapts a MoE expert (or router); LoRA on MoE experts is not "
            "built. Adapt the attention and dense MLP projections only"
        )
    match = _TENSOR.fullmatch(tensor)
    targets = {t.value: t for t in LoraTarget}
    if match is None or match.group(3) not in targets:
        raise NotImplementedError(
            f"{directory}: {tensor} adapts a module other than the attention's q/k/v/o and the "
            "MLP's gate/up/down projections; only those take adapters"
        )
    layer, target = int(match.group(1)), targets[match.group(3)]
    if layer >= config.num_layers:
        raise ValueError(f"{directory}: {tensor} is past the model's {config.num_layers} layers")
    return (layer, target), match.group(4)


def read_adapters(
    sources: Mapping[str, str | Path], config: DecoderConfig
) -> tuple[PeftAdapter, ...]:
    """The adapters of `{name: folder}`, in that order (`read_peft_adapter` each), for a
    family that builds adapter stacks (`FamilyBase.check_builds_lora`)."""
    family_of(config).check_builds_lora()
    return tuple(read_peft_adapter(folder, name, config) for name, folder in sources.items())


def lora_spec(adapters: Sequence[PeftAdapter]) -> LoraSpec:
    """The stacks that hold `adapters`: their names in order, the largest rank, every target."""
    return LoraSpec(
        names=tuple(a.name for a in adapters),
        rank=max(a.rank for a in adapters),
        targets=frozenset().union(*(a.targets for a in adapters)),
    )


def is_lora_path(path: tuple, _value=None) -> bool:
    """Whether a parameter path is an adapter stack's (an `nnx` filter)."""
    return any(str(part).endswith("_lora") for part in path)


def stacked_adapters(
    adapters: Sequence[PeftAdapter],
    lora_state: nnx.State,
    mesh: Mesh,
    dtype: np.dtype,
    *,
    layers: range,
) -> nnx.State:
    """Fills a model's abstract adapter stacks (`lora_state`, the stacks' part of its state)
    with `adapters`, each device given only its shard of each stack.

    Args:
      adapters: The adapters, in the model's `LoraSpec.names` order.
      lora_state: The abstract adapter parameters (`is_lora_path`), with their shardings.
      mesh: The mesh the arrays are placed on.
      dtype: The parameters' dtype.
      layers: The model layers the state holds (its `layers.j` is model layer
        `layers.start + j`).

    Raises:
      ValueError: A stack path or shape that does not match the adapters.
    """
    specs = dict(nnx.to_flat_state(nnx.get_partition_spec(lora_state)))
    filled = []
    for path, variable in nnx.to_flat_state(lora_state):
        if path[0] != "layers" or tuple(path[2:4]) not in STACKS or path[4] not in ("a", "b"):
            raise ValueError(f"{path} is not an adapter stack of a decoder layer")
        layer = layers.start + int(path[1])
        targets = STACKS[tuple(path[2:4])]
        stack = _stack(adapters, layer, targets, path[4], variable.shape)
        sharding = NamedSharding(mesh, specs[path].get_value())
        value = jax.make_array_from_callback(
            variable.shape, sharding, lambda index, s=stack: s[index].astype(dtype)
        )
        filled.append((path, variable.replace(value=value)))
    return nnx.from_flat_state(filled)


def _stack(
    adapters: Sequence[PeftAdapter],
    layer: int,
    targets: tuple[LoraTarget, ...],
    which: str,
    shape: tuple[int, ...],
) -> np.ndarray:
    """One stack's host array: adapter k's A (or B) of each target, zero where it has none and
    past its rank. Column stacks are a [in, parts, n, R] and b [parts, n, R, out]; row
    stacks a [in, n, R] and b [n, R, out] (`layers.lora`)."""
    stack = np.zeros(shape, np.float32)
    row = targets[0] in _ROW_TARGETS
    for k, adapter in enumerate(adapters):
        for part, target in enumerate(targets):
            if (layer, target) not in adapter.weights:
                continue
            a, b = adapter.weights[layer, target]
            r = a.shape[1]
            if row and which == "a":
                stack[:, k, :r] = a
            elif row:
                stack[k, :r, :] = b
            elif which == "a":
                stack[:, part, k, :r] = a
            else:
                stack[part, k, :r, :] = b
    return stack


def peft_tensors(
    params: Mapping[str, jax.Array], spec: LoraSpec, *, index: int, scaling: float
) -> dict[str, np.ndarray]:
    """The PEFT tensors (`lora_A` [r, in], `lora_B` [out, r] with the scaling taken out of B)
    of adapter `index` (1-based) of a model's stacks, from its flat parameters by dotted path
    (`layers.{i}.attn.q_lora.a`, ...); the inverse of `read_peft_adapter` and
    `stacked_adapters`."""
    tensors = {}
    for path, value in params.items():
        parts = path.split(".")
        if len(parts) != 5 or parts[0] != "layers" or tuple(parts[2:4]) not in STACKS:
            continue
        targets = STACKS[tuple(parts[2:4])]
        row = targets[0] in _ROW_TARGETS
        axis = {("a", False): 2, ("b", False): 1, ("a", True): 1, ("b", True): 0}[parts[4], row]
        stack = np.take(np.asarray(jax.device_get(value), np.float32), index - 1, axis=axis)
        module = "self_attn" if parts[2] == "attn" else "mlp"
        for part, target in enumerate(targets):
            if target not in spec.targets:
                continue
            weight = stack
            if not row:  # a column stack: its parts on axis 1 (a) or 0 (b)
                weight = stack[:, part] if parts[4] == "a" else stack[part]
            if parts[4] == "a":
                weight, kind = weight.T, "A"  # [in, r] -> [r, in]
            else:
                weight, kind = (weight / np.float32(scaling)).T, "B"  # [r, out] -> [out, r]
            name = f"base_model.model.model.layers.{parts[1]}.{module}.{target.value}"
            tensors[f"{name}.lora_{kind}.weight"] = np.ascontiguousarray(weight)
    return tensors


def write_peft_adapter(
    params: Mapping[str, jax.Array],
    spec: LoraSpec,
    directory: str | Path,
    *,
    alpha: float,
    base: str,
    index: int = 1,
) -> None:
    """Writes adapter `index` of a model's stacks as a PEFT LoRA folder that `peft` (and
    `read_peft_adapter`) loads: `adapter_config.json` (rank `spec.rank`, `lora_alpha` `alpha`,
    the targets) and `adapter_model.safetensors`, B with what of `alpha / r` the stacks fold in
    (all of it but `spec.scaling`) taken out. `directory` must exist."""
    tensors = peft_tensors(params, spec, index=index, scaling=alpha / spec.rank / spec.scaling)
    settings = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": spec.rank,
        "lora_alpha": alpha,
        "use_rslora": False,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "target_modules": sorted(t.value for t in spec.targets),
    }
    directory = Path(directory)
    (directory / ADAPTER_CONFIG).write_text(json.dumps(settings, indent=2) + "\n")
    save_file(tensors, directory / ADAPTER_WEIGHTS)


def is_lora_parameter(path: str) -> bool:
    """Whether a dotted parameter path (`Trainer`'s form) is an adapter stack's."""
    return is_lora_path(tuple(path.split(".")))


def peft_start(model: nnx.Module, seed: int) -> nnx.Module:
    """`model` with every adapter stack as PEFT starts a new adapter: B zero, so it starts equal
    to its base model, and A uniform in +-1 / sqrt(in features) (PEFT's kaiming-uniform with
    a = sqrt(5)), drawn from `seed`. Each stack keeps its sharding."""
    rng = np.random.default_rng(seed)
    graphdef, state = nnx.split(model)
    flat = []
    for path, variable in nnx.to_flat_state(state):
        if is_lora_path(path):
            value = variable.get_value()
            if path[-1] == "b":
                start = np.zeros(value.shape, value.dtype)
            else:
                bound = value.shape[0] ** -0.5  # every A stack is [in features, ...]
                start = rng.uniform(-bound, bound, value.shape).astype(value.dtype)
            variable = variable.replace(value=jax.device_put(start, value.sharding))
        flat.append((path, variable))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
