"""Pipeline parallelism: a decoder split into stages, each on its own device group.

`build_pipeline` / `load_pipeline` make one `CausalLM` per stage (its share of the layers, bound
against its neighbours); `PipelineCausalLM` runs them (forward, GPipe prefill, decode,
generate); `PipelineTrainer` trains them.
"""

from .build import build_pipeline as build_pipeline
from .build import load_pipeline as load_pipeline
from .build import pipeline_split as pipeline_split
from .runtime import PipelineCausalLM as PipelineCausalLM
from .runtime import Stage as Stage
from .schedule import Microbatch as Microbatch
from .schedule import bubble as bubble
from .schedule import gpipe_ticks as gpipe_ticks
from .schedule import split_microbatches as split_microbatches
from .split import PipelineSplit as PipelineSplit
from .training import PipelineTrainBatch as PipelineTrainBatch
from .training import PipelineTrainer as PipelineTrainer
from .transport import Collect as Collect
from .transport import Transfer as Transfer
from .transport import stage_meshes as stage_meshes
