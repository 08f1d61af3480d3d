"""boundary-jax: layer boundaries for JAX decoders under shard_map.

Declare each stage (`declare_attn`, `declare_ffn`, `declare_mixer`), append the stages inside a
`layer_stack`, and run each layer as `prepare` -> compute -> `finish`, threading the
`ResidualStream` (`residual_stream.start`, `residual_stream.final_norm`). Residual designs
(`designs.PostNormUpdate`, `designs.MhcRead`, ...) say how a stage's output joins the residual and
how its input reads it.

The top level holds what a model author uses. The rest lives in submodules, one namespace per
job: `declare` (edges and stage kinds), `plan` (what binding decided: `StagePlan`, `ExitKind`,
`OwedWork`, `Placement`), `policy` (per-architecture reduction defaults), `ops` (sharded tensor
operations models call: `shard_index`, `vocab_parallel_cross_entropy`, ...), `report` (plans in
words, collectives read from compiled HLO), `residual_stream` (the stream helpers), `designs`,
`fusions`, `adapters` (branches, two-batch overlap) and `initializers`. Every module is importable
by its path (`boundary_jax.stage.StageExit`, `boundary_jax.layout.Layout`); `__all__` and `dir()`
list the public names only.

Names that moved off the top level still resolve for one release, with a DeprecationWarning that
names their new spelling (`bj.ExitKind` is `bj.plan.ExitKind`); `boundary_jax.residual` is the
deprecated alias of `residual_stream`.
"""

import operator as _operator
import sys as _sys
import warnings as _warnings

from . import adapters as adapters
from . import declare as declare
from . import designs as designs
from . import fusions as fusions
from . import initializers as initializers
from . import ops as ops
from . import plan as plan
from . import policy as policy
from . import report as report
from . import residual  # noqa: F401  (the deprecated alias; not in __all__)
from . import residual_stream as residual_stream
from .batch import BatchFacts as BatchFacts
from .declare import MoeDispatch as MoeDispatch
from .declare import ProducerReduction as ProducerReduction
from .declare import StageDeclaration as StageDeclaration
from .declare import declare_attn as declare_attn
from .declare import declare_ffn as declare_ffn
from .declare import declare_mixer as declare_mixer
from .designs import RMSNorm as RMSNorm
from .finalize import DeferredFinalize as DeferredFinalize
from .layout import BatchVariant as BatchVariant
from .layout import MeshAxis as MeshAxis
from .layout import SumGroup as SumGroup
from .layout import TokenAxis as TokenAxis
from .layout import Topology as Topology
from .ops import PlanError as PlanError
from .policy import ReductionPolicy as ReductionPolicy
from .report import collective_report as collective_report
from .residual_stream import OwedOutput as OwedOutput
from .residual_stream import ResidualStream as ResidualStream
from .scan import LayerStacked as LayerStacked
from .scan import StackedLayers as StackedLayers
from .sharding import ShardedModule as ShardedModule
from .sharding import make_mesh as make_mesh
from .stack import append_stages as append_stages
from .stack import layer_stack as layer_stack
from .stage import StageBoundary as StageBoundary

__all__ = [
    # Submodules.
    "adapters",
    "declare",
    "designs",
    "fusions",
    "initializers",
    "ops",
    "plan",
    "policy",
    "report",
    "residual_stream",
    # Mesh and batch.
    "BatchFacts",
    "BatchVariant",
    "MeshAxis",
    "SumGroup",
    "TokenAxis",
    "Topology",
    "make_mesh",
    # Declaring and binding stages.
    "MoeDispatch",
    "ProducerReduction",
    "ReductionPolicy",
    "StageDeclaration",
    "append_stages",
    "declare_attn",
    "declare_ffn",
    "declare_mixer",
    "layer_stack",
    "PlanError",
    # Running them.
    "DeferredFinalize",
    "OwedOutput",
    "RMSNorm",
    "ResidualStream",
    "ShardedModule",
    "StackedLayers",
    "StageBoundary",
    "collective_report",
]

_MOVED = {
    "CollectiveReport": "report.CollectiveReport",
    "Edge": "declare.Edge",
    "EdgeKind": "declare.EdgeKind",
    "ExitKind": "plan.ExitKind",
    "FinalRead": "declare.FinalRead",
    "LayerStack": "stack.LayerStack",
    "Layout": "layout.Layout",
    "OwedWork": "plan.OwedWork",
    "Placement": "plan.Placement",
    "StackInput": "declare.StackInput",
    "StackPlace": "declare.StackPlace",
    "StageExit": "stage.StageExit",
    "StageKind": "declare.StageKind",
    "StagePlan": "plan.StagePlan",
    "branch_input": "adapters.branch_input",
    "branch_output": "adapters.branch_output",
    "describe_path": "report.describe_path",
    "gather_last_dim": "ops.gather_last_dim",
    "group_order": "ops.group_order",
    "merge_branch": "adapters.merge_branch",
    "parse_hlo": "report.parse_hlo",
    "place": "sharding.place",
    "register_reduction_default": "policy.register_reduction_default",
    "resolve_reduction_policy": "policy.resolve_reduction_policy",
    "shard_index": "ops.shard_index",
    "sharded_rms_norm": "ops.sharded_rms_norm",
    "sharded_rms_norms": "ops.sharded_rms_norms",
    "total_over_rows": "ops.total_over_rows",
    "vocab_parallel_argmax": "ops.vocab_parallel_argmax",
    "vocab_parallel_cross_entropy": "ops.vocab_parallel_cross_entropy",
}
"""Names that left the top level: `boundary_jax.<name>` is `boundary_jax.<_MOVED[name]>`. They
resolve, with a DeprecationWarning, for one release."""


def __getattr__(name: str):
    new = _MOVED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _warnings.warn(
        f"boundary_jax.{name} is deprecated; use boundary_jax.{new}",
        DeprecationWarning,
        stacklevel=2,
    )
    # Every home module is imported above (directly or by the modules it names), so this only
    # reads attributes: nothing is imported lazily.
    return _operator.attrgetter(new)(_sys.modules[__name__])


def __dir__() -> list[str]:
    return sorted(__all__)
