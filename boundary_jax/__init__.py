"""boundary-jax: layer boundaries for JAX decoders under shard_map.

Declare each stage (`declare_attn`, `declare_ffn`), append the stages inside a `layer_stack`,
and run each layer as `prepare` -> compute -> `finish`, threading the `ResidualStream`
(`residual_stream.start`, `residual_stream.final_norm`). Residual designs (`designs.PostNormUpdate`,
`designs.MhcRead`, ...) say how a stage's output joins the residual and how its input reads it.
"""

from . import adapters as adapters
from . import designs as designs
from . import fusions as fusions
from . import initializers as initializers
from . import report as report
from . import residual as residual  # deprecated alias of residual_stream
from . import residual_stream as residual_stream
from .adapters import branch_input as branch_input
from .adapters import branch_output as branch_output
from .adapters import merge_branch as merge_branch
from .batch import BatchFacts as BatchFacts
from .declare import Edge as Edge
from .declare import EdgeKind as EdgeKind
from .declare import FinalRead as FinalRead
from .declare import MoeDispatch as MoeDispatch
from .declare import ProducerReduction as ProducerReduction
from .declare import StackInput as StackInput
from .declare import StackPlace as StackPlace
from .declare import StageDeclaration as StageDeclaration
from .declare import StageKind as StageKind
from .declare import declare_attn as declare_attn
from .declare import declare_ffn as declare_ffn
from .declare import declare_mixer as declare_mixer
from .designs import RMSNorm as RMSNorm
from .finalize import DeferredFinalize as DeferredFinalize
from .layout import BatchVariant as BatchVariant
from .layout import Layout as Layout
from .layout import MeshAxis as MeshAxis
from .layout import SumGroup as SumGroup
from .layout import TokenAxis as TokenAxis
from .layout import Topology as Topology
from .ops import PlanError as PlanError
from .ops import gather_last_dim as gather_last_dim
from .ops import group_order as group_order
from .ops import shard_index as shard_index
from .ops import sharded_rms_norm as sharded_rms_norm
from .ops import sharded_rms_norms as sharded_rms_norms
from .ops import total_over_rows as total_over_rows
from .ops import vocab_parallel_argmax as vocab_parallel_argmax
from .ops import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from .placement import Placement as Placement
from .plan import ExitKind as ExitKind
from .plan import OwedWork as OwedWork
from .plan import StagePlan as StagePlan
from .policy import ReductionPolicy as ReductionPolicy
from .policy import register_reduction_default as register_reduction_default
from .policy import resolve_reduction_policy as resolve_reduction_policy
from .report import CollectiveReport as CollectiveReport
from .report import collective_report as collective_report
from .report import describe_path as describe_path
from .report import parse_hlo as parse_hlo
from .residual_stream import OwedOutput as OwedOutput
from .residual_stream import ResidualStream as ResidualStream
from .scan import StackedLayers as StackedLayers
from .sharding import ShardedModule as ShardedModule
from .sharding import make_mesh as make_mesh
from .sharding import place as place
from .stack import LayerStack as LayerStack
from .stack import append_stages as append_stages
from .stack import layer_stack as layer_stack
from .stage import StageBoundary as StageBoundary
from .stage import StageExit as StageExit
