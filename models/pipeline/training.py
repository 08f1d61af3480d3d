"""Training a pipeline-parallel decoder: GPipe over microbatches, gradients per stage, one AdamW
step per stage after global-norm clipping over every stage.

A step runs every microbatch forward through the stages (each stage's program, the handoffs as
in serving), then backward in reverse: each stage's backward program recomputes its forward
from the input it received (the stage is its own checkpoint) and pulls the output's cotangent
back through it (`jax.vjp` of the stage's `shard_map`), adding its parameters' gradient to the
stage's sum and handing the input's cotangent to the previous stage. The last stage's output is
its microbatch's summed next-token loss; the step's loss is the sum over microbatches over the
batch's labelled rows, as `Trainer`'s mean. The optimizer is `TrainConfig`'s: the gradients'
norm over every stage (each parameter once) scales them as `optax.clip_by_global_norm` does, then
each stage runs AdamW on its own parameters. A stage's `Buffer`s are not trained, as `Trainer`
leaves them: their gradients are dropped before the norm and their updates after AdamW.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import boundary_jax as bj
from boundary_jax import residual_stream

from ..decoder.model import CausalLM
from ..inputs.rows import pack_sequences
from ..layers.attention.self_attention import AttentionImpl
from ..layers.buffer import Buffer
from ..training.trainer import TrainConfig, next_token_labels
from .runtime import PipelineCausalLM, Stage, enter_stage
from .schedule import Microbatch, gpipe_ticks, split_microbatches
from .transport import REPLICATED, Transfer, place_rows


@dataclasses.dataclass(frozen=True)
class PipelineTrainBatch:
    """A batch's microbatches placed on every stage, with their labels on the last.

    Attributes:
      parts: The microbatches.
      placed: `placed[stage][microbatch]` is `(rows, batch facts)` on that stage's devices.
      labels: Per microbatch, its next-token labels (-1: none) on the last stage's devices.
      tokens: The labelled rows of the whole batch (the loss averages over them).
    """

    parts: tuple[Microbatch, ...]
    placed: tuple[tuple[tuple, ...], ...]
    labels: tuple[jax.Array, ...]
    tokens: int


class PipelineTrainer:
    """A pipeline's stages on their device groups, with a GPipe train step (module docstring).

    Attributes:
      runner: The stages, their devices and handoffs (a `PipelineCausalLM`).
      train: The optimizer's configuration.
      params: Per stage, its parameters as its `leaves` (shapes only on a process that does not
        hold it; `stage.state_of` gives the `nnx.State`).
      opt_state: Per stage, its AdamW state.
      step_count: Steps taken.
    """

    def __init__(
        self,
        stages: Sequence[CausalLM],
        mesh: Mesh,
        train: TrainConfig,
        *,
        microbatches: int | None = None,
        input_scattered: bool = False,
    ):
        config = stages[0].config
        if any(model.options.attention is AttentionImpl.CUDNN for model in stages):
            raise NotImplementedError(
                "training with cuDNN attention is not supported (see Trainer); build the stages "
                "with BuildOptions(attention=AttentionImpl.XLA)"
            )
        if config.tie_word_embeddings and len(stages) > 1:
            raise NotImplementedError(
                "training a pipeline whose first and last stages share tied embeddings is not "
                "built (their gradients would be summed across the two stages); train an "
                "untied config, or in one program with models.training.Trainer"
            )
        self.runner = PipelineCausalLM(
            stages, mesh, microbatches=microbatches, input_scattered=input_scattered
        )
        self.train = train
        self._optimizer = optax.adamw(
            train.schedule(),
            b1=train.b1,
            b2=train.b2,
            eps=train.eps,
            weight_decay=train.weight_decay,
        )
        self.params = [stage.leaves for stage in self.runner.stages]
        self._buffers = [_buffer_leaves(stage) for stage in self.runner.stages]
        self.opt_state = [
            stage.run(self._init_program(stage), leaves=params)
            for stage, params in zip(self.runner.stages, self.params, strict=True)
        ]
        self.step_count = 0
        stage_meshes = [stage.mesh for stage in self.runner.stages]
        topology = self.runner.stages[0].topology
        self._returns = tuple(
            Transfer(b, a, topology)
            for a, b in zip(stage_meshes[:-1], stage_meshes[1:], strict=True)
        )

    # -- batches --------------------------------------------------------------------------

    def pack(
        self, sequences: Sequence[Sequence[int]], *, max_sequence_rows: int | None = None
    ) -> PipelineTrainBatch:
        """Packs token sequences (as `Trainer.pack`), splits them into microbatches and places
        them with their next-token labels."""
        runner = self.runner
        packed = pack_sequences(sequences, runner.topology, max_sequence_rows=max_sequence_rows)
        parts = split_microbatches(packed, runner.microbatches, runner.topology)
        placed = tuple(
            tuple(stage.place(part.packed, runner.variant) for part in parts)
            for stage in runner.stages
        )
        last = runner.stages[-1]
        labels = tuple(
            place_rows(next_token_labels(part.packed), last.mesh, last.rows) for part in parts
        )
        tokens = int(np.sum(next_token_labels(packed) >= 0))
        return PipelineTrainBatch(parts, placed, labels, tokens)

    # -- programs -------------------------------------------------------------------------

    def _init_program(self, stage: Stage):
        shardings = tuple(NamedSharding(stage.mesh, spec) for spec in stage.leaf_specs)
        optimizer = self._optimizer

        def make():
            out = jax.eval_shape(optimizer.init, stage.leaves)
            return jax.jit(
                optimizer.init,
                out_shardings=optax.tree_map_params(
                    optimizer,
                    lambda _, sharding: sharding,
                    out,
                    shardings,
                    transform_non_params=lambda _: NamedSharding(stage.mesh, PartitionSpec()),
                ),
            )

        return stage.cached(("init",), make)

    def _stage_function(self, stage: Stage):
        """`f(leaves, inputs, rows, batch, labels)`: the stage's handoff, or on the last stage
        its microbatch's loss summed over labelled rows (a replicated scalar)."""
        runner = self.runner
        spec = bj.BatchFacts(runner.variant, stage.topology, PartitionSpec())

        def body(model, inputs, rows, batch, labels):
            x, stream = enter_stage(model, inputs, rows.ids, batch)
            x, stream, _ = model.run_layers(x, stream, rows)
            if not stage.last:
                return residual_stream.to_pp(x, stream)
            losses = model.lm_head.cross_entropy(model.read_out(x, stream), labels)
            return bj.ops.total_over_rows(losses, stage.topology)

        rows = stage.rows
        out = PartitionSpec() if stage.last else rows
        labels = rows if stage.last else PartitionSpec()
        return stage.sharded(body, (rows, rows, spec, labels), out)

    def _forward_program(self, stage: Stage):
        return stage.cached(("train forward",), lambda: jax.jit(self._stage_function(stage)))

    def _backward_program(self, stage: Stage):
        """`(grads + d state, d inputs)` of the stage at its input, for the output's cotangent
        `grad_out`; the forward is recomputed."""
        function = self._stage_function(stage)

        def backward(leaves, inputs, rows, batch, labels, grad_out, grads):
            _, pull = jax.vjp(lambda s, i: function(s, i, rows, batch, labels), leaves, inputs)
            d_leaves, d_inputs = pull(grad_out)
            return jax.tree.map(jnp.add, grads, d_leaves), d_inputs

        return stage.cached(("train backward",), lambda: jax.jit(backward))

    def _update_program(self, stage: Stage):
        optimizer, clip = self._optimizer, self.train.clip_norm
        buffers = self._buffers[stage.index]

        def update(params, grads, opt_state, norm):
            # optax.clip_by_global_norm, with the norm taken over every stage's gradients.
            grads = jax.tree.map(
                lambda g: jax.lax.select(norm < clip, g, (g / norm.astype(g.dtype)) * clip),
                _drop(grads, buffers),
            )
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, _drop(updates, buffers)), opt_state

        return stage.cached(("update",), lambda: jax.jit(update, donate_argnums=(0, 2)))

    def _square_program(self, stage: Stage):
        """`f(grads)`: the sum of the squares of the stage's gradients, its buffers' left out."""
        buffers = self._buffers[stage.index]

        def squares(grads):
            return sum(jnp.sum(jnp.square(g)) for g in _drop(grads, buffers))

        return stage.cached(("square",), lambda: jax.jit(squares))

    # -- loss and step --------------------------------------------------------------------

    def gradients(self, batch: PipelineTrainBatch) -> tuple[float, list[tuple]]:
        """(loss, per stage the gradient of the loss w.r.t. its parameters, as its `leaves`;
        `stage.state_of` gives the `nnx.State`) at the current parameters: every microbatch
        forward, then backward in reverse."""
        stages = self.runner.stages
        count, last = len(batch.parts), len(stages) - 1
        inputs: dict[tuple[int, int], object] = {}
        losses = []
        forward = [self._forward_program(stage) for stage in stages]
        for tick in gpipe_ticks(len(stages), count):
            for index, microbatch in tick:
                received = inputs.setdefault((index, microbatch), {})
                args = (
                    received,
                    *batch.placed[index][microbatch],
                    self._labels(batch, index, microbatch),
                )
                out = stages[index].run(forward[index], *args, leaves=self.params[index])
                if index == last:
                    losses.append(out)
                else:
                    inputs[(index + 1, microbatch)] = self.runner.sends[index](out)
        scale = place_rows(np.float32(1.0 / max(batch.tokens, 1)), stages[-1].mesh, REPLICATED)
        grads = [
            stage.run(self._zeros_program(stage), leaves=params)
            for stage, params in zip(stages, self.params, strict=True)
        ]
        backward = [self._backward_program(stage) for stage in stages]
        cotangents: dict[tuple[int, int], object] = {}
        for tick in gpipe_ticks(len(stages), count):
            for mirrored, microbatch in tick:
                index = last - mirrored
                grad_out = scale if index == last else cotangents.pop((index, microbatch))
                args = (
                    inputs.pop((index, microbatch)),
                    *batch.placed[index][microbatch],
                    self._labels(batch, index, microbatch),
                    grad_out,
                    grads[index],
                )
                grads[index], d_inputs = stages[index].run(
                    backward[index], *args, leaves=self.params[index]
                )
                if index > 0:
                    cotangents[(index - 1, microbatch)] = self._returns[index - 1](d_inputs)
        loss = sum(_host_scalars(stages[-1], losses))
        return loss / max(batch.tokens, 1), grads

    def _labels(self, batch: PipelineTrainBatch, stage: int, microbatch: int):
        return batch.labels[microbatch] if stage == len(self.runner.stages) - 1 else ()

    def _zeros_program(self, stage: Stage):
        # Placed as the leaves: a scalar's zeros depend on no input, so jit would not place
        # them on the stage's devices (xIELU's scalars on attention TP 2 failed to lower).
        shardings = tuple(NamedSharding(stage.mesh, spec) for spec in stage.leaf_specs)

        def zeros(leaves):
            return jax.tree.map(jnp.zeros_like, leaves)

        return stage.cached(("zeros",), lambda: jax.jit(zeros, out_shardings=shardings))

    def step(self, batch: PipelineTrainBatch) -> dict[str, float]:
        """One optimizer step on `batch`; returns its `loss` (before the update) and the
        gradients' global `grad_norm` (before clipping), as `Trainer.step`."""
        loss, grads = self.gradients(batch)
        stages = self.runner.stages
        squares = [
            _host_scalars(stage, [stage.run(self._square_program(stage), leaves=grads[index])])[0]
            for index, stage in enumerate(stages)
        ]
        norm = float(np.sqrt(np.float32(sum(squares))))
        for index, stage in enumerate(stages):
            if not stage.held:
                continue
            value = place_rows(np.float32(norm), stage.mesh, REPLICATED)
            self.params[index], self.opt_state[index] = stage.run(
                self._update_program(stage),
                grads[index],
                self.opt_state[index],
                value,
                leaves=self.params[index],
            )
        self.step_count += 1
        return {"loss": loss, "grad_norm": norm}


def _buffer_leaves(stage: Stage) -> tuple[bool, ...]:
    """Whether each of the stage's `leaves` is a `Buffer`'s."""
    marks = jax.tree.map(
        lambda variable: isinstance(variable, Buffer),
        stage.state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return tuple(jax.tree.leaves(marks))


def _drop(leaves: tuple, buffers: tuple[bool, ...]) -> tuple:
    """`leaves` (gradients or updates of a stage's `leaves`) with the buffers' zeroed."""
    return tuple(
        jnp.zeros_like(leaf) if buffer else leaf
        for leaf, buffer in zip(leaves, buffers, strict=True)
    )


def _host_scalars(stage: Stage, values: list) -> list[float]:
    """Replicated scalars on `stage`'s devices, read on every process (all must call it)."""
    local = np.full(len(values), np.nan)
    if stage.held:
        local[:] = [float(value.addressable_data(0)) for value in values]
    if jax.process_count() == 1:
        return local.tolist()
    gathered = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, len(values))
    return [float(column[~np.isnan(column)][0]) for column in gathered.T]
