"""Training a sharded decoder: next-token loss through the boundaries, an optax step, checkpoints.

The loss runs inside `jax.shard_map` (the model's forward, then a cross-entropy on the
vocab-parallel logits that never gathers them; the loss is that cross-entropy alone, with no MoE
router auxiliary loss); `jax.value_and_grad` differentiates through the
`shard_map`, so every sum a boundary completes in the forward has its transposed collective in
the backward. The optimizer runs outside it on the global (sharded) arrays: its global-norm
clipping counts every parameter once, however many ranks hold a copy, and its state is sharded
like the parameters. Parameters and optimizer state are donated to each step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import boundary_jax as bj

from ..config import hf_name_map
from ..decoder.model import CausalLM
from ..inputs.rows import PackedBatch, TokenRows, pack_sequences
from ..layers.attention.self_attention import AttentionImpl
from ..layers.buffer import Buffer
from ..precision import matmul_precision_scope


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The optimizer: AdamW on a warmup + cosine schedule, after global-norm clipping.

    Attributes:
      learning_rate: The peak learning rate.
      total_steps: Steps the schedule spans (it decays to `final_fraction` of the peak there).
      warmup_steps: Linear warmup from zero to the peak (fewer than `total_steps`).
      final_fraction: The learning rate at `total_steps`, as a fraction of the peak.
      weight_decay: AdamW's decoupled weight decay, on every parameter (norms, biases and
        embeddings too, as `torch.optim.AdamW` over `model.parameters()`; the Hugging Face
        Trainer exempts biases and norm weights).
      clip_norm: Gradients are scaled down to this global norm at most.
      b1: Adam's first-moment decay.
      b2: Adam's second-moment decay.
      eps: Adam's denominator offset. Adam's first step moves each weight by about
        `learning_rate * sign(gradient)` wherever |gradient| >> eps, so the step is a steep
        function of gradients near zero; a larger eps smooths it.
    """

    learning_rate: float = 3e-3
    total_steps: int = 100
    warmup_steps: int = 10
    final_fraction: float = 0.1
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8

    def __post_init__(self):
        if self.total_steps < 1 or not 0 <= self.warmup_steps < self.total_steps:
            raise ValueError(
                "TrainConfig needs total_steps >= 1 and 0 <= warmup_steps < total_steps; got "
                f"{self.total_steps=}, {self.warmup_steps=}"
            )
        if self.learning_rate <= 0 or self.clip_norm <= 0:
            raise ValueError(
                f"learning_rate and clip_norm must be positive; got {self.learning_rate=}, "
                f"{self.clip_norm=}"
            )

    def schedule(self) -> optax.Schedule:
        """The learning rate per step."""
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=self.learning_rate,
            warmup_steps=self.warmup_steps,
            decay_steps=self.total_steps,
            end_value=self.learning_rate * self.final_fraction,
        )

    def optimizer(self) -> optax.GradientTransformation:
        """Global-norm clipping, then AdamW on `schedule`."""
        return optax.chain(
            optax.clip_by_global_norm(self.clip_norm),
            optax.adamw(
                self.schedule(),
                b1=self.b1,
                b2=self.b2,
                eps=self.eps,
                weight_decay=self.weight_decay,
            ),
        )


def next_token_labels(packed: PackedBatch) -> np.ndarray:
    """int32 [attn_dp * rows_per_rank]: each row's next token within its sequence; -1 on a
    sequence's last row and on padding (nothing to predict there). Under context parallelism
    the labels follow the rows' zigzag CP order."""
    rows = packed.rows
    ids = np.asarray(rows.ids).reshape(-1, packed.rows_per_rank)
    segments = np.asarray(rows.segment_ids).reshape(-1, packed.rows_per_rank)
    if packed.zigzag is None:
        return _packed_labels(ids, segments).reshape(-1)
    blocks = [
        order.to_cp(_packed_labels(order.from_cp(i)[None], order.from_cp(s)[None])[0], -1)
        for order, i, s in zip(packed.zigzag, ids, segments, strict=True)
    ]
    return np.concatenate(blocks)


def _packed_labels(ids: np.ndarray, segments: np.ndarray) -> np.ndarray:
    """[blocks, rows] next-token labels of blocks whose sequences lie contiguous in row order."""
    same = (segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] >= 0)
    labels = np.full(segments.shape, -1, np.int32)
    labels[:, :-1] = np.where(same, ids[:, 1:], -1)
    return labels


@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """Packed rows, their batch facts and next-token labels, placed on a mesh (a pytree).

    Attributes:
      rows: The packed token rows.
      batch: The batch facts (variant and per-DP-rank token counts).
      labels: int32 next-token label per row (-1: none).
      tokens: Static: the labelled rows (tokens the loss averages over).
    """

    rows: TokenRows
    batch: bj.BatchFacts
    labels: jax.Array
    tokens: int


jax.tree_util.register_dataclass(
    TrainBatch, data_fields=["rows", "batch", "labels"], meta_fields=["tokens"]
)


@dataclasses.dataclass(frozen=True)
class TrainState:
    """The parameters, the optimizer state (sharded like the parameters) and the step count.

    Attributes:
      params: The model's trained parameters by dotted path (`FlatParams`), global sharded
        arrays (all of them unless the trainer trains some only: `Trainer.trainable`).
      opt_state: The optimizer's state; its parameter-shaped parts share the parameters'
        shardings, its counters are replicated.
      step: int32 steps taken.
    """

    params: dict[str, jax.Array]
    opt_state: optax.OptState
    step: jax.Array


jax.tree_util.register_dataclass(
    TrainState, data_fields=["params", "opt_state", "step"], meta_fields=[]
)


class Trainer:
    """A decoder on a mesh with a jitted, sharded train step.

    Build the model with `build_model(..., mesh=mesh)` or `load_model` and drop your own
    reference: the trainer keeps the graph and the placed state only, and the step donates
    (reuses) the parameter and optimizer buffers.

    The model's `Buffer`s (DeepSeek-V3's `e_score_correction_bias`, xIELU's beta and eps) are
    not trained, as Hugging Face leaves its buffers out of the parameters: the step drops their
    gradients before the optimizer (so neither the clipping's norm nor `grad_norm` counts them)
    and its updates of them (no weight decay).

    With `trainable` only the parameters it selects are trained (a LoRA adapter's stacks over a
    frozen base): the optimizer, its state, its clipping and the gradients see those alone, and
    the others are held apart, placed once and passed to every step unchanged.

    Attributes:
      mesh: The mesh; its axes are boundary-jax's `MeshAxis` names.
      topology: The model's parallel topology.
      config: The model's architecture.
      input_scattered: Train on input-scattered batches (residual on attention-TP slices).
      optimizer: The optax transformation.
      frozen: The paths of the model's buffers, which the step leaves as they are.
      trainable: The paths the optimizer trains (`state.params`); the others are `fixed`.
      fixed: The parameters held apart from the optimizer, by dotted path (none by default).
      state: The current `TrainState`.
      matmul_precision: The precision the loss (and so its gradient) traces its matmuls with
        (the model's `options.precision`: `HIGHEST` for a float32 model).
    """

    def __init__(
        self,
        model: CausalLM,
        mesh: Mesh,
        optimizer: optax.GradientTransformation,
        *,
        input_scattered: bool = False,
        trainable: Callable[[str], bool] | None = None,
    ):
        mesh_topology = bj.Topology.from_mesh(mesh, moe_ep=model.topology.moe_ep)
        if mesh_topology != model.topology:
            raise ValueError(
                f"the model is bound on {model.topology} but the mesh is {mesh_topology}"
            )
        if model.options.attention is AttentionImpl.CUDNN:
            raise NotImplementedError(
                "training with cuDNN attention is not supported: on an H200 its train step "
                "compiled to a 1 TiB program (benchmarks/RESULTS.md run 10). Build the model "
                "with BuildOptions(attention=AttentionImpl.XLA)"
            )
        self.mesh = mesh
        self.topology = model.topology
        self.config = model.config
        self.input_scattered = input_scattered
        self.optimizer = optimizer
        self.matmul_precision = model.options.precision
        self._graphdef, params = nnx.split(model)
        self._params = FlatParams(params)
        self.frozen = frozenset(
            ".".join(str(key) for key in path)
            for path, variable in nnx.to_flat_state(params)
            if isinstance(variable, Buffer)
        )
        sources = hf_name_map(model.config, scan_layers=model.options.scan_layers)
        self._padded = {
            path: source.padded_axis
            for path, source in sources.items()
            if source.padded_axis is not None and path in self._params.paths
        }
        self._param_specs = self._params.flatten(
            nnx.get_partition_spec(params), is_leaf=lambda x: isinstance(x, PartitionSpec)
        )
        self._param_shardings = {k: self._sharding(v) for k, v in self._param_specs.items()}
        every = jax.device_put(self._params.flatten(params), self._param_shardings)
        del params
        self.trainable = tuple(p for p in self._params.paths if trainable is None or trainable(p))
        if not self.trainable:
            raise ValueError("trainable selects no parameter of the model; nothing would train")
        flat = {path: every.pop(path) for path in self.trainable}
        self.fixed = every
        shardings = {path: self._param_shardings[path] for path in self.trainable}
        self._state_shardings = TrainState(
            shardings,
            state_shardings(optimizer, flat, shardings, self._sharding(None)),
            self._sharding(None),
        )
        self._rows = self.topology.row_spec(self.topology.attention_rows())
        self._variant = (
            bj.BatchVariant.INPUT_SCATTERED if input_scattered else bj.BatchVariant.ORDINARY
        )
        model.check_batch_variant(self._variant)
        init = jax.jit(
            lambda params: TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32)),
            out_shardings=self._state_shardings,
        )
        self.state = init(flat)
        self._loss = jax.jit(self.sharded_loss)
        self._gradients = jax.jit(jax.value_and_grad(self.sharded_loss))
        self._step = jax.jit(
            self._train_step, donate_argnums=(0,), out_shardings=(self._state_shardings, None)
        )

    def _sharding(self, spec: PartitionSpec | None) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec() if spec is None else spec)

    @property
    def model(self) -> CausalLM:
        """The model over the current (sharded) parameters; no copy is made."""
        return nnx.merge(self._graphdef, self._params.unflatten(self.state.params | self.fixed))

    # -- batches --------------------------------------------------------------------------

    def pack(
        self,
        sequences: Sequence[Sequence[int]],
        *,
        rows_per_rank: int | None = None,
        max_sequence_rows: int | None = None,
        adapters: Sequence[int] | None = None,
    ) -> TrainBatch:
        """Packs token sequences onto the DP ranks (see `pack_sequences`; a `max_sequence_rows`
        bound lets attention skip keys beyond it; `adapters`, each sequence's LoRA adapter
        index, e.g. the one being trained) and places them with their next-token labels: a
        `TrainBatch`."""
        packed = pack_sequences(
            sequences,
            self.topology,
            rows_per_rank=rows_per_rank,
            max_sequence_rows=max_sequence_rows,
            adapters=adapters,
        )
        return self.place(packed)

    def place(self, packed: PackedBatch) -> TrainBatch:
        """A packed batch's rows, facts and labels, placed on the mesh."""
        rows = jax.device_put(packed.rows, NamedSharding(self.mesh, self._rows))
        counts = jax.device_put(
            np.asarray(packed.token_counts, np.int32), self._sharding(PartitionSpec())
        )
        labels = next_token_labels(packed)
        return TrainBatch(
            rows,
            bj.BatchFacts(self._variant, self.topology, counts),
            jax.device_put(labels, NamedSharding(self.mesh, self._rows)),
            int(np.sum(labels >= 0)),
        )

    # -- loss and step --------------------------------------------------------------------

    def sharded_loss(
        self,
        params: dict[str, jax.Array],
        batch: TrainBatch,
        fixed: dict[str, jax.Array] | None = None,
    ) -> jax.Array:
        """The mean next-token loss of `batch` under `params` (global arrays placed like
        `state.params`) and the parameters held apart (`fixed`; None: the trainer's own, which
        a traced caller should pass instead, so they are not baked into its program): the
        sharded forward and loss, one `shard_map`; differentiable in `params`."""
        graphdef, rows, layout = self._graphdef, self._rows, self._params
        precision = self.matmul_precision
        params = params | (self.fixed if fixed is None else fixed)

        def body(params, batch):
            model = nnx.merge(graphdef, layout.unflatten(params))
            with matmul_precision_scope(precision):
                return model.loss(batch.rows, batch.batch, batch.labels)

        batch_spec = TrainBatch(
            rows,
            bj.BatchFacts(self._variant, self.topology, PartitionSpec()),
            rows,
            batch.tokens,
        )
        return jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(self._param_specs, batch_spec),
            out_specs=PartitionSpec(),
        )(params, batch)

    def _train_step(
        self, state: TrainState, batch: TrainBatch, fixed: dict[str, jax.Array]
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        loss, grads = jax.value_and_grad(self.sharded_loss)(state.params, batch, fixed)
        grads = {
            path: jnp.zeros_like(grad) if path in self.frozen else grad
            for path, grad in grads.items()
        }
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        updates = {
            path: jnp.zeros_like(update) if path in self.frozen else update
            for path, update in updates.items()
        }
        params = optax.apply_updates(state.params, updates)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        metrics = {"loss": loss, "grad_norm": grad_norm}
        return TrainState(params, opt_state, state.step + 1), metrics

    def loss(self, batch: TrainBatch) -> float:
        """The mean next-token loss of `batch` under the current parameters (no update)."""
        return float(self._loss(self.state.params, batch, self.fixed))

    def gradients(self, batch: TrainBatch) -> tuple[float, dict[str, jax.Array]]:
        """(loss, gradients of the loss w.r.t. every parameter) at the current parameters; the
        gradients are global arrays sharded like the parameters."""
        loss, grads = self._gradients(self.state.params, batch, self.fixed)
        return float(loss), grads

    def step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on `batch`; returns its `loss` (before the update) and the
        gradients' global `grad_norm` (before clipping)."""
        self.state, metrics = self._step(self.state, batch, self.fixed)
        return {name: float(value) for name, value in metrics.items()}

    # -- checkpoints of the train state ---------------------------------------------------

    def save(self, directory: str | Path) -> None:
        """Writes the train state (parameters, optimizer state, step) with orbax; each process
        writes its shards. Vocab-parallel tables are saved cut to the real vocabulary, so the
        state restores on a mesh whose attention TP pads it differently. `directory` must not
        exist yet."""
        import orbax.checkpoint as ocp

        saved = jax.tree_util.tree_map_with_path(self._cut_vocab, self.state)
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(Path(directory).absolute(), saved)

    def restore(self, directory: str | Path) -> None:
        """Reads a train state saved by `save` (on any mesh) onto this trainer's mesh.

        Raises:
          ValueError: The saved state does not fit this model (another config or optimizer).
        """
        import orbax.checkpoint as ocp

        def target(path, value, sharding):
            cut = self._vocab_axis(path)
            if cut is None:
                return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
            shape = list(value.shape)
            shape[cut] = self.config.vocab_size  # read whole, then padded and split below
            return jax.ShapeDtypeStruct(tuple(shape), value.dtype, sharding=self._sharding(None))

        abstract = jax.tree_util.tree_map_with_path(target, self.state, self._state_shardings)
        with ocp.StandardCheckpointer() as checkpointer:
            try:
                restored = checkpointer.restore(Path(directory).absolute(), abstract)
            except ValueError as error:
                raise ValueError(
                    f"the train state in {directory} does not fit this model: {error}"
                ) from None

        def pad(path, value, like, sharding):
            cut = self._vocab_axis(path)
            if cut is None:
                return value
            widths = [(0, 0)] * value.ndim
            widths[cut] = (0, like.shape[cut] - value.shape[cut])
            return jax.device_put(jnp.pad(value, widths), sharding)

        self.state = jax.tree_util.tree_map_with_path(
            pad, restored, self.state, self._state_shardings
        )

    def _vocab_axis(self, path: tuple) -> int | None:
        """The vocab-padded axis of a train-state leaf (a parameter, or its Adam moment), or
        None."""
        name = _dotted(path[-1:])
        return self._padded.get(name)

    def _cut_vocab(self, path: tuple, value: jax.Array) -> jax.Array:
        cut = self._vocab_axis(path)
        if cut is None:
            return value
        return jax.lax.slice_in_dim(value, 0, self.config.vocab_size, axis=cut)


class FlatParams:
    """Converts between a module's parameter `nnx.State` and a flat `{dotted path: array}` dict
    (the paths of `models.config.hf_name_map`), the form the optimizer and checkpoints see.
    """

    def __init__(self, template: nnx.State):
        paths_leaves, self._treedef = jax.tree_util.tree_flatten_with_path(template)
        self.paths = tuple(_dotted(path) for path, _ in paths_leaves)

    def flatten(self, state: nnx.State, is_leaf=None) -> dict[str, Any]:
        """`{path: leaf}` of a state of the template's structure."""
        leaves = jax.tree.leaves(state, is_leaf=is_leaf)
        return dict(zip(self.paths, leaves, strict=True))

    def unflatten(self, flat: dict[str, Any]) -> nnx.State:
        """The state of the template's structure holding `flat`'s leaves."""
        return jax.tree.unflatten(self._treedef, [flat[path] for path in self.paths])


def _dotted(path: tuple) -> str:
    names = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            names.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            names.append(str(key.idx))
    return ".".join(names)


def state_shardings(
    optimizer: optax.GradientTransformation,
    params: Any,
    param_shardings: Any,
    replicated: NamedSharding,
) -> Any:
    """The shardings of `optimizer.init(params)`: every parameter-shaped part (Adam's moments)
    sharded like the parameters, the rest (step counters) replicated."""
    abstract = jax.eval_shape(optimizer.init, params)
    return optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        abstract,
        param_shardings,
        transform_non_params=lambda _: replicated,
    )
