"""A DeepSeek-routed sparse FFN on a topology (the sigmoid router with a score-correction bias
and a grouped top-k, shared experts; Nemotron-H's MoE with relu^2 experts): experts over the
expert-parallel group, on gathered rows.

`DeepseekMoeFfn` is `models.layers.deepseek_moe.DeepseekMoe` (same parameters, same checkpoint
paths) with its weights split by the topology, as `moe_ffn.MoeFfn` splits `SparseMoe`'s: the
experts over `SumGroup.MOE_EP` and each expert's width over `SumGroup.MOE_TP`. Every rank of
the full TP group holds every attention-DP rank's rows (`MoeDispatch.GATHER`), runs its experts
on all of them and returns its share, zero for experts held elsewhere; the boundary sums the
shares over the MoE output group. The shared expert is split over the full TP group when its
width divides it, otherwise computed whole on every rank and added on the MoE output group's
first rank only, so the boundary's one sum counts it once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import boundary_jax as bj

from .activations import ExpertActivation
from .deepseek_moe import DeepseekMoe, DeepseekRouting
from .moe import GroupedMatmulImpl
from .moe_ffn import deferred_finalize


class DeepseekMoeFfn(DeepseekMoe):
    """One rank's DeepSeek-routed sparse FFN on `topology`, returning what its stage's exit
    takes.

    Attributes (besides `DeepseekMoe`'s):
      topology: Where the experts and their width are split.
      shared_on_first_rank: The shared expert is whole on every rank of the MoE output group and
        counted on its first rank only.
    """

    def __init__(
        self,
        hidden_size: int,
        expert_width: int,
        rule: DeepseekRouting,
        topology: bj.Topology,
        *,
        shared_width: int | None,
        dispatch: bj.MoeDispatch = bj.MoeDispatch.GATHER,
        activation: ExpertActivation = ExpertActivation.SWIGLU,
        impl: GroupedMatmulImpl = GroupedMatmulImpl.RAGGED_DOT,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        if dispatch is not bj.MoeDispatch.GATHER:
            raise NotImplementedError(
                f"a DeepSeek-routed sparse FFN runs on gathered rows (MoeDispatch.GATHER); got "
                f"{dispatch}. Its hybrid neighbours (mixers that do not gather their input) "
                "cannot follow an FFN on its own rows"
            )
        topology.experts_per_rank(rule.num_experts)  # raises for an EP size not dividing them
        width_entry = topology.shard_entry(bj.SumGroup.MOE_TP)
        if width_entry is not None and expert_width % topology.moe_tp:
            raise ValueError(
                f"the expert width ({expert_width}) must divide over moe_tp ({topology.moe_tp} "
                f"= TP {topology.tp_size} / moe_ep {topology.moe_ep}); choose a larger moe_ep"
            )
        split_shared = shared_width is not None and shared_width % topology.tp_size == 0
        super().__init__(
            hidden_size,
            expert_width,
            rule,
            shared_width=shared_width,
            expert_entry=topology.shard_entry(bj.SumGroup.MOE_EP),
            width_entry=width_entry,
            shared_width_entry=topology.shard_entry(bj.SumGroup.TP) if split_shared else None,
            impl=impl,
            activation=activation,
            dtype=dtype,
            rngs=rngs,
        )
        self.topology = topology
        self.shared_on_first_rank = (
            shared_width is not None and not split_shared and topology.tp_size > 1
        )

    def __call__(self, x: jax.Array, *, defer: bool) -> jax.Array | bj.DeferredFinalize:
        """[T, hidden] normalized rows (every DP rank's) -> this rank's output, owing the sum
        over the MoE output group: finalized, or a `DeferredFinalize` when `defer` (the exit's
        `defer_moe_finalize`)."""
        count_shared = True
        if self.shared_on_first_rank:
            count_shared = bj.ops.shard_index(self.topology, bj.SumGroup.MOE_OUTPUT) == 0
        local = self.gate_up_proj.shape[0]
        offset = bj.ops.shard_index(self.topology, bj.SumGroup.MOE_EP) * local
        if not defer:  # combined where the experts run
            return self.finalized(x, expert_offset=offset, count_shared=count_shared)
        output = super().__call__(x, expert_offset=offset, count_shared=count_shared)
        return deferred_finalize(output)
