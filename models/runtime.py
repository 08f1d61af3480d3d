"""Running a decoder sharded over a mesh: `shard_map` inside `jit`, prefill, decode, generate."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import boundary_jax as bj

from .attention import KVCache
from .checkpoint import load_config, load_params
from .config import Architecture, DecoderConfig
from .decoder import CausalLM, LlamaForCausalLM, Qwen3ForCausalLM
from .moe_decoder import MixtralForCausalLM, MoeCausalLM, Qwen3MoeForCausalLM
from .rows import PackedBatch, TokenRows, decode_rows, pack_sequences

_MODEL_CLASSES = {
    Architecture.QWEN3: Qwen3ForCausalLM,
    Architecture.LLAMA: LlamaForCausalLM,
    Architecture.MISTRAL: LlamaForCausalLM,
    Architecture.QWEN3_MOE: Qwen3MoeForCausalLM,
    Architecture.MIXTRAL: MixtralForCausalLM,
}


def model_class(config: DecoderConfig) -> type[CausalLM]:
    """The decoder class for a config's architecture.

    Raises:
      NotImplementedError: Qwen2 and Qwen2-MoE (their attention needs q/k/v biases, not built).
    """
    if config.architecture not in _MODEL_CLASSES:
        raise NotImplementedError(
            f"{config.architecture.value} is not built yet (its attention needs q/k/v biases); "
            f"supported: {', '.join(a.value for a in _MODEL_CLASSES)}"
        )
    return _MODEL_CLASSES[config.architecture]


def _construct(
    config: DecoderConfig,
    topology: bj.Topology,
    moe_dispatch: bj.MoeDispatch | None,
    **options,
) -> CausalLM:
    cls = model_class(config)
    if issubclass(cls, MoeCausalLM):
        return cls(config, topology, moe_dispatch=moe_dispatch or bj.MoeDispatch.GATHER, **options)
    if moe_dispatch is not None or topology.moe_ep != 1:
        raise ValueError(
            f"{config.architecture.value} has no experts; got {moe_dispatch=} and "
            f"moe_ep={topology.moe_ep}. Leave the MoE options unset"
        )
    return cls(config, topology, **options)


def build_model(
    config: DecoderConfig,
    topology: bj.Topology,
    *,
    reduction: bj.ReductionPolicy = bj.ReductionPolicy.AUTO,
    fusions: bj.fusions.FusionProvider = bj.fusions.NO_FUSIONS,
    moe_dispatch: bj.MoeDispatch | None = None,
    dtype: jnp.dtype = jnp.float32,
    seed: int = 0,
) -> CausalLM:
    """A model of `config` with random weights (every shard different).

    `fusions` is the stack's fusion provider (default: none, the built-in path). For an MoE
    config, `moe_dispatch` picks the sparse layers' dispatch (None: `MoeDispatch.GATHER`) and
    `topology.moe_ep` their expert parallelism; a dense config takes neither.
    """
    return _construct(
        config,
        topology,
        moe_dispatch,
        reduction=reduction,
        fusions=fusions,
        dtype=dtype,
        rngs=nnx.Rngs(seed),
    )


def load_model(
    checkpoint_dir: str | Path,
    mesh: Mesh,
    *,
    reduction: bj.ReductionPolicy = bj.ReductionPolicy.AUTO,
    fusions: bj.fusions.FusionProvider = bj.fusions.NO_FUSIONS,
    moe_ep: int = 1,
    moe_dispatch: bj.MoeDispatch | None = None,
    dtype: jnp.dtype = jnp.float32,
) -> CausalLM:
    """A model loaded from a Hugging Face checkpoint directory, each device reading its shard.

    The model is built abstractly (no weights allocated), then every parameter is read straight
    into its sharded global array (stacked experts: each device reads only its experts). MoE
    checkpoints take `moe_ep` (expert-parallel size, dividing the mesh's full TP group) and
    `moe_dispatch` (None: `MoeDispatch.GATHER`).
    """
    config = load_config(checkpoint_dir)
    topology = bj.Topology.from_mesh(mesh, moe_ep=moe_ep)
    abstract = nnx.eval_shape(
        lambda: _construct(
            config,
            topology,
            moe_dispatch,
            reduction=reduction,
            fusions=fusions,
            dtype=dtype,
            rngs=nnx.Rngs(0),
        )
    )
    graphdef, abstract_state = nnx.split(abstract)
    return nnx.merge(graphdef, load_params(checkpoint_dir, abstract_state, mesh, np.dtype(dtype)))


class ShardedCausalLM:
    """A `CausalLM` placed on a mesh, with jitted sharded prefill, decode and generation.

    Attributes:
      model: The decoder (its parameters are placed on `mesh`).
      mesh: The mesh; its axes are boundary-jax's `MeshAxis` names.
      input_scattered: Run batches input-scattered (residual on attention-TP slices).
      check_vma: `shard_map`'s varying-axes check; the Pallas fusion candidates only run with
        it off (None: off on GPU and TPU, on elsewhere).
    """

    def __init__(
        self,
        model: CausalLM,
        mesh: Mesh,
        *,
        input_scattered: bool = False,
        check_vma: bool | None = None,
    ):
        mesh_topology = bj.Topology.from_mesh(mesh, moe_ep=model.topology.moe_ep)
        if mesh_topology != model.topology:
            raise ValueError(
                f"the model is bound on {model.topology} but the mesh is {mesh_topology}"
            )
        self.model = model
        self.mesh = mesh
        self.input_scattered = input_scattered
        if check_vma is None:
            check_vma = mesh.devices.flat[0].platform not in ("gpu", "cuda", "tpu")
        self.check_vma = check_vma
        rows = PartitionSpec(model.topology.spec_entry((bj.TokenAxis.ATTN_DP,)))
        self._rows = rows
        rows_spec = TokenRows(rows, rows, rows)
        variant = bj.BatchVariant.INPUT_SCATTERED if input_scattered else bj.BatchVariant.ORDINARY
        batch_spec = bj.BatchFacts(variant, model.topology, PartitionSpec())
        logits_spec = PartitionSpec(rows[0], None)
        cache_specs = tuple(KVCache.specs(model.topology) for _ in model.layers)
        sharded = bj.ShardedModule(model, mesh)
        self._state = sharded.state
        self._forward = sharded.program(
            lambda model, rows, batch: model(rows, batch)[0],
            in_specs=(rows_spec, batch_spec),
            out_specs=logits_spec,
            check_vma=check_vma,
        )
        self._step = sharded.program(
            lambda model, rows, batch, caches: model(rows, batch, caches),
            in_specs=(rows_spec, batch_spec, cache_specs),
            out_specs=(logits_spec, cache_specs),
            check_vma=check_vma,
            donate_argnums=(2,),
        )

    @property
    def topology(self) -> bj.Topology:
        return self.model.topology

    @property
    def config(self) -> DecoderConfig:
        return self.model.config

    def place(self, packed: PackedBatch) -> tuple[TokenRows, bj.BatchFacts]:
        """The packed rows and their batch facts, placed on the mesh."""
        rows = jax.device_put(packed.rows, NamedSharding(self.mesh, self._rows))
        batch = packed.batch_facts(self.topology, input_scattered=self.input_scattered)
        counts = jax.device_put(batch.token_counts, NamedSharding(self.mesh, PartitionSpec()))
        return rows, bj.BatchFacts(batch.variant, batch.topology, counts)

    def pack(self, sequences: Sequence[Sequence[int]]) -> PackedBatch:
        return pack_sequences(sequences, self.topology)

    def forward_rows(self, packed: PackedBatch) -> jax.Array:
        """[attn_dp * rows_per_rank, vocab] logits of packed rows (attention within the batch)."""
        return self._forward(self._state, *self.place(packed))

    def forward(self, sequences: Sequence[Sequence[int]]) -> np.ndarray:
        """float32 logits [sequences, longest, vocab] of ragged token-id lists, zero past ends."""
        packed = self.pack(sequences)
        return packed.unpack(jax.device_get(self.forward_rows(packed)))

    def lower_forward(self, sequences: Sequence[Sequence[int]]):
        """The lowered (not yet compiled) sharded forward for these sequences' shapes."""
        return self._forward.lower(self._state, *self.place(self.pack(sequences)))

    def new_caches(self, packed: PackedBatch, max_len: int) -> tuple[KVCache, ...]:
        slots = packed.slots_per_rank * self.topology.attn_dp
        dtype = self.model.final_norm.weight[...].dtype
        return tuple(
            KVCache.create(
                self.config,
                self.topology,
                slots=slots,
                max_len=max_len,
                dtype=dtype,
                mesh=self.mesh,
            )
            for _ in range(self.config.num_layers)
        )

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> np.ndarray:
        """Greedy continuation of each prompt: int32 [prompts, max_new_tokens].

        One prefill fills a static-shape KV cache; each further token is one decode step with a
        row per sequence.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1; got {max_new_tokens}")
        step = self._step
        packed = self.pack(prompts)
        longest = max(packed.lengths) + max_new_tokens
        if longest > self.config.max_position_embeddings:
            raise ValueError(
                f"prompt + new tokens ({longest}) exceed max_position_embeddings "
                f"({self.config.max_position_embeddings})"
            )
        caches = self.new_caches(packed, longest)
        logits, caches = step(self._state, *self.place(packed), caches)
        tokens = np.argmax(packed.last_rows(jax.device_get(logits)), axis=-1).astype(np.int32)
        generated = [tokens]
        positions = np.asarray(packed.lengths, np.int32)
        for _ in range(max_new_tokens - 1):
            rows = decode_rows(packed, tokens, positions)
            logits, caches = step(self._state, *self.place(rows), caches)
            tokens = np.argmax(rows.last_rows(jax.device_get(logits)), axis=-1).astype(np.int32)
            generated.append(tokens)
            positions = positions + 1
        return np.stack(generated, axis=1)
