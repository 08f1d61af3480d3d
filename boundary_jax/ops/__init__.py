"""The steps a bound plan runs and the sharded operations models call: the only package that
issues a collective.

`steps` holds the movements a plan composes (all-reduce, reduce-scatter, all-gather, a local
block slice, a deferred finalize), each stating its effect on a `Placement` at binding and running
inside `jax.shard_map`; `tensor` the model-facing sharded tensor operations; `experts` the
all-to-all token movement of an expert-parallel MoE.
"""

from .experts import Dispatched as Dispatched
from .experts import combine_from_experts as combine_from_experts
from .experts import dispatch_to_experts as dispatch_to_experts
from .experts import group_order as group_order
from .steps import AllGather as AllGather
from .steps import AllReduce as AllReduce
from .steps import Finalize as Finalize
from .steps import PlanError as PlanError
from .steps import ReduceScatter as ReduceScatter
from .steps import RowGather as RowGather
from .steps import Step as Step
from .steps import TakeBlock as TakeBlock
from .steps import all_gather as all_gather
from .steps import all_reduce as all_reduce
from .steps import complete_onto as complete_onto
from .steps import move_rows as move_rows
from .steps import reduce_scatter as reduce_scatter
from .steps import relayout as relayout
from .steps import run as run
from .steps import simulate as simulate
from .steps import take_block as take_block
from .steps import with_gather as with_gather
from .tensor import ReducingModule as ReducingModule
from .tensor import gather_last_dim as gather_last_dim
from .tensor import is_first_rank as is_first_rank
from .tensor import shard_index as shard_index
from .tensor import sharded_rms_norm as sharded_rms_norm
from .tensor import sharded_rms_norms as sharded_rms_norms
from .tensor import sum_over_group as sum_over_group
from .tensor import total_over_rows as total_over_rows
from .tensor import vocab_parallel_argmax as vocab_parallel_argmax
from .tensor import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
