"""The pipeline stages, one module each, and `STAGES`, the registry in pipeline order.

`base` is the interface every stage implements (`Stage`, `StageContext`, `StageResult`); a
stage's config section lives in `leanlm.config`. Stage modules never import each other, and
modules below the stages (training, data, run folder) import `leanlm.stages.base` only.
"""

from leanlm.stages.base import STAGES, Stage, StageContext, StageResult, register_stage
from leanlm.stages.control import Control
from leanlm.stages.distill import Distill
from leanlm.stages.pretrain import Pretrain
from leanlm.stages.prune import Prune
from leanlm.stages.sparsify import Sparsify

for _stage in (Pretrain, Prune, Distill, Sparsify, Control):  # pipeline order
    register_stage(_stage)

__all__ = ["STAGES", "Stage", "StageContext", "StageResult", "register_stage"]
