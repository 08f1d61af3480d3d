"""The sparse FFN with FP8 expert weights: `MoeFfn` whose routed experts hold Hugging Face
fine-grained FP8 blocks and multiply FP8 rows.

The router reads the stage's input unquantized; the rows sent to the experts are quantized per
128-feature token group (once per token, before the rows are sorted by expert), the gated
activation again before the down projection. Each expert's weights are stored as Hugging Face
stores them, [out, in] per expert: `gate_up_proj` [experts, parts, width, hidden] (gate and up
stacked, one matmul; the up projection alone for RELU2 experts) and `down_proj` [experts,
hidden, width], with their block scales. The products run through
`pallas_kernels.fp8_matmul.fp8_grouped_matmul` on the rows sorted by expert, or, where the impl
pads (`Fp8GroupedImpl.GPU_BY_SIZE` above 2048 routed rows: `padded_product`), through
`fp8_batched_matmul` on the rows copied into capacity buckets as the bf16 layer's
`PADDED_BATCHED` does. Under
`Fp8Weights.DEQUANTIZED` the weights are `values * scales` in the model's dtype and the rows are
quantized and dequantized alike: the float64 reference. Inference only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

import boundary_jax as bj
from pallas_kernels.fp8_matmul import (
    SCALE_BLOCK,
    fp8_batched_matmul,
    fp8_grouped_matmul,
    padded_product,
)

from ...config import MoeConfig
from ..activations import ExpertActivation
from ..fp8_linear import Fp8Quantization, check_blocks, fp8_weight
from .experts import SortedRows, by_capacity, capacity_buckets, capacity_places
from .ffn import MoeFfn
from .routing import MoeOutput, Routing, finalize
from .sparse import GroupedMatmulImpl, PartitionEntry


class Fp8MoeFfn(MoeFfn):
    """`MoeFfn` with FP8 routed experts.

    Attributes (besides `MoeFfn`'s, whose `gate_up_proj` and `down_proj` are replaced):
      gate_up_proj: [experts, parts, width, hidden] float8_e4m3fn (the model's dtype under
        DEQUANTIZED), split over the expert-parallel group (axis 0) and the width group
        (axis 2).
      gate_up_proj_scale_inv: [experts, parts, width / 128, hidden / 128] float32, split alike;
        None under DEQUANTIZED.
      down_proj: [experts, hidden, width], split over axes 0 and 2.
      down_proj_scale_inv: [experts, hidden / 128, width / 128] float32; None under
        DEQUANTIZED.
      quantization: The FP8 option (weights held, how the grouped products run).
    """

    def __init__(
        self,
        hidden_size: int,
        moe: MoeConfig,
        topology: bj.Topology,
        *,
        quantization: Fp8Quantization,
        dispatch: bj.MoeDispatch = bj.MoeDispatch.GATHER,
        capacity: int | None = None,
        activation: ExpertActivation = ExpertActivation.SWIGLU,
        dtype: jnp.dtype = jnp.float32,
        init_std: float | None = None,
        rngs: nnx.Rngs,
    ):
        if moe.expert_bias:
            raise NotImplementedError(
                "FP8 experts with biases are not supported; load the model without FP8 quantization"
            )
        if moe.shared_expert_intermediate_size is not None:
            raise NotImplementedError(
                "FP8 experts with a shared expert are not supported; load the "
                "model without FP8 quantization"
            )
        check_blocks(hidden_size, 1, "the hidden size")
        check_blocks(moe.expert_intermediate_size, topology.moe_tp, "the expert width (moe_tp)")
        self.quantization = quantization
        super().__init__(
            hidden_size,
            moe,
            topology,
            dispatch=dispatch,
            capacity=capacity,
            impl=GroupedMatmulImpl.RAGGED_DOT,
            activation=activation,
            dtype=dtype,
            init_std=init_std,
            rngs=rngs,
        )
        self.out_dtype = jnp.dtype(dtype)

    def init_experts(
        self,
        num_experts: int,
        hidden_size: int,
        expert_width: int,
        *,
        expert_entry: PartitionEntry,
        width_entry: PartitionEntry,
        activation: ExpertActivation,
        dtype: jnp.dtype,
        init_std: float | None,
        rngs: nnx.Rngs,
    ) -> None:
        common = {"quantization": self.quantization, "dtype": dtype, "rngs": rngs}
        gate_up_std = 1 / np.sqrt(hidden_size) if init_std is None else init_std
        down_std = 1 / np.sqrt(expert_width) if init_std is None else init_std
        self.gate_up_proj, self.gate_up_proj_scale_inv = fp8_weight(
            (num_experts, activation.parts, expert_width, hidden_size),
            (expert_entry, None, width_entry, None),
            std=gate_up_std,
            **common,
        )
        self.down_proj, self.down_proj_scale_inv = fp8_weight(
            (num_experts, hidden_size, expert_width),
            (expert_entry, None, width_entry),
            std=down_std,
            **common,
        )

    def routed(
        self,
        x: jax.Array,
        routing: Routing,
        *,
        expert_offset: int | jax.Array = 0,
        even_share: float | None = None,
        shared: jax.Array | None = None,
        combine: bool = False,
        count_down_bias: bool | jax.Array = True,
    ) -> jax.Array:
        del count_down_bias  # FP8 experts hold no biases
        tokens, top_k = routing.experts.shape
        local = self.gate_up_proj.shape[0]
        flat = routing.experts.reshape(-1) - expert_offset  # [T*k] local expert ids
        held = (flat >= 0) & (flat < local)
        # Rows of experts held elsewhere sort last, as group `local`, which no product covers.
        order, positions, sizes = bj.ops.group_order(jnp.where(held, flat, local), local + 1)
        sorted_rows = SortedRows(order, positions, sizes[:local], jnp.where(held, flat, 0), top_k)
        rows = self.quantization.quantize(x)  # once per token, then sorted

        def finish(out: jax.Array) -> jax.Array:  # [T*k, hidden], held elsewhere unspecified
            out = jnp.where(held[:, None], out, jnp.zeros_like(out)).reshape(tokens, top_k, -1)
            return finalize(MoeOutput(out, routing, shared)) if combine else out

        def grouped() -> jax.Array:
            gathered = jax.tree.map(lambda leaf: jnp.take(leaf, order // top_k, axis=0), rows)
            out = self._experts(gathered, lambda *args: self._grouped(*args, sizes[:local]))
            return finish(jnp.take(out, positions, axis=0))

        product = padded_product(self.quantization.grouped, tokens * top_k)
        if product is None or self.gate_up_proj_scale_inv is None:
            return grouped()

        def padded(capacity: int) -> jax.Array:
            source, slot = capacity_places(sorted_rows, capacity)
            gathered = jax.tree.map(lambda leaf: jnp.take(leaf, source, axis=0), rows)
            out = self._experts(gathered, lambda *args: self._batched(*args, capacity, product))
            return finish(jnp.take(out, slot, axis=0))

        share = tokens * top_k / local if even_share is None else even_share
        return by_capacity(
            sorted_rows.sizes, capacity_buckets(share, tokens * top_k), padded, grouped
        )

    def _experts(self, rows: bj.designs.Quantized, product) -> jax.Array:
        """down(activation(gate_up(rows))) of quantized rows in some expert-major order, through
        `product(rows, weight, scales)` -> [R, parts x out] in the model's dtype."""
        gate_up = product(rows, self.gate_up_proj, self.gate_up_proj_scale_inv)
        parts = self.activation.parts
        stacked = gate_up.reshape(gate_up.shape[0], parts, -1) if parts > 1 else gate_up
        hidden = self.quantization.quantize(stacked, self.activation.function)
        return product(hidden, self.down_proj, self.down_proj_scale_inv)

    def _weight(self, weight: nnx.Param, scales: nnx.Param | None):
        """An [experts, (parts,) out, in] weight as [experts, parts x out, in], with its scales."""
        values = weight[...]
        local, *_, depth = values.shape
        values = values.reshape(local, -1, depth)
        if scales is None:
            return values, None
        return values, scales[...].reshape(local, -1, depth // SCALE_BLOCK)

    def _grouped(self, rows, weight: nnx.Param, scales: nnx.Param | None, sizes) -> jax.Array:
        """[R, in] quantized rows sorted by expert times each row's expert's [out, in] weight
        (with parts, their outputs side by side) -> [R, parts x out] in the model's dtype."""
        values, scales = self._weight(weight, scales)
        group_sizes = sizes[: values.shape[0]]
        if scales is None:  # DEQUANTIZED: the reference, in the model's dtype
            return lax.ragged_dot(
                rows.dequantize(self.out_dtype),
                jnp.swapaxes(values, 1, 2).astype(self.out_dtype),
                group_sizes,
                precision=lax.Precision.HIGHEST,
            )
        return fp8_grouped_matmul(
            rows.values,
            rows.scales,
            values,
            scales,
            group_sizes,
            out_dtype=self.out_dtype,
            impl=self.quantization.grouped,
        )

    def _batched(self, rows, weight: nnx.Param, scales: nnx.Param | None, capacity: int, product):
        """[local x capacity, in] quantized rows, expert-major, times their expert's weight ->
        [local x capacity, parts x out] in the model's dtype (`fp8_batched_matmul` by
        `product`, an `Fp8MatmulImpl`)."""
        values, scales = self._weight(weight, scales)
        local = values.shape[0]
        out = fp8_batched_matmul(
            rows.values.reshape(local, capacity, -1),
            rows.scales.reshape(local, capacity, -1),
            values,
            scales,
            out_dtype=self.out_dtype,
            impl=product,
        )
        return out.reshape(local * capacity, -1)
