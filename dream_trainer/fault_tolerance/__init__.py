"""Per-step fault tolerance across replica groups, on torchft: the `FaultTolerance` object a trainer holds.

Several copies of one job (replica groups, each a `torchrun` of its own) train one model together. Each step
they form a quorum through torchft's lighthouse; the step's global batch is dealt out among the quorum's
participants from one global sample cursor; their gradients are averaged across the groups; and the step
commits only when every participant finished it (`should_commit`). A replica that dies is left out of the
next quorum and the others go on; one that (re)starts receives the whole run state from a live peer (what a
checkpoint holds: weights, optimizer, loop position, RNG, loss scaler, the cursor, callbacks' state) and
continues in lockstep. See docs/fault-tolerance.md.

What lives where, one owner each:

- `setting.py`: `FaultToleranceConfig`, the setting (`DreamTrainerConfig.fault_tolerance`), checked when the
  config is built; the two exceptions of the step and the loop (`StepNotCommitted`, `Rejoined`).
- `data.py`: `SampleCursor`, where the run is in the epoch's global order (samples committed), and that order;
  `QuorumBatches`, the training loader the trainer iterates under fault tolerance: one batch per step, its
  samples assigned by that step's quorum.
- `replica.py`: `FaultTolerance`, the object the trainer holds: the torchft `Manager`, the quorum of the coming
  step (`begin_step`), the commit (`commit`: the cross-group gradient average and `should_commit`), the heal
  (`_receive`), the ledger of committed global ranges (`fault_tolerance/samples-rank<r>.jsonl` in the run
  directory) and the counts run.json shows.

torchft is imported only when a fit starts with the setting on (`pip install "dream-trainer[ft]"`).
"""

from dream_trainer.fault_tolerance.data import QuorumBatches, SampleCursor, check_loader
from dream_trainer.fault_tolerance.replica import FaultTolerance
from dream_trainer.fault_tolerance.setting import (
    FaultToleranceConfig,
    Rejoined,
    StepNotCommitted,
    as_fault_tolerance,
    check_fault_tolerance,
)

__all__ = [
    "FaultTolerance",
    "FaultToleranceConfig",
    "QuorumBatches",
    "Rejoined",
    "SampleCursor",
    "StepNotCommitted",
    "as_fault_tolerance",
    "check_fault_tolerance",
    "check_loader",
]
