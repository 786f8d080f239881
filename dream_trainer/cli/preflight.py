"""What `dream-trainer` checks before a command runs, so that a run that cannot work fails in one line
and before it creates a run directory: the trainer defines the step the command runs, the checkpoint
`--ckpt_path` names exists, and `--ckpt_path last` finds one for `validate` / `test`."""

from __future__ import annotations

from pathlib import Path

from dream_trainer.errors import CheckpointError, MisconfigurationError
from dream_trainer.trainer import DreamTrainer

# The step each evaluating command runs, and an example of what it returns.
STEP_OF = {"validate": ("validation_step", "val_loss"), "test": ("test_step", "test_loss")}


def check_step(command: str, trainer_cls: type[DreamTrainer]) -> None:
    """`MisconfigurationError` when `trainer_cls` does not define the step `command` runs."""
    if command not in STEP_OF:
        return
    step, metric = STEP_OF[command]
    if getattr(trainer_cls, step) is getattr(DreamTrainer, step):  # the base class's placeholder
        raise MisconfigurationError(
            f"{trainer_cls.__name__} has no {step}, which `{command}` runs: define "
            f"`def {step}(self, batch, batch_idx):` returning a dict such as {{'{metric}': loss}}"
        )


def check_ckpt_path(ckpt_path: str | None) -> None:
    """`CheckpointError` when `ckpt_path` is a path (not None or "last") where nothing exists."""
    if ckpt_path is None or ckpt_path == "last" or Path(ckpt_path).exists():
        return
    raise CheckpointError(
        f"--ckpt_path {ckpt_path}: no such file or directory; give a checkpoint ModelCheckpoint wrote, or 'last'"
    )


def resolve_last(command: str, trainer: DreamTrainer) -> str:
    """The checkpoint `--ckpt_path last` means for `validate` / `test` (read once: the trainer keeps it);
    `CheckpointError` when there is none."""
    try:
        return str(trainer.resolve_checkpoint("last", command))
    except CheckpointError:
        raise CheckpointError(
            f"--ckpt_path last: no checkpoint in {trainer.where_last_looks()} to {command}; train first "
            "(dream-trainer fit), or give --ckpt_path PATH"
        ) from None


def evaluated_checkpoint(ckpt_path: str | None) -> str:
    """What `validate` / `test` say they evaluated (one line on stderr): the checkpoint, or, without
    `--ckpt_path`, the weights the trainer builds."""
    if ckpt_path is None:
        return "no --ckpt_path: evaluated the weights the trainer builds (give --ckpt_path last|PATH for a checkpoint)"
    return f"evaluated checkpoint {Path(ckpt_path).resolve()}"
