"""The tables of Lightning's names, under their earlier import path: they live in `dream_trainer.lightning.names`."""

from dream_trainer.lightning.names import (
    CALLBACK_NAMES,
    MODULE_NAMES,
    NEVER_CALLED,
    OLDER_MODULE_HOOKS,
    OLDER_TRAINER_ARGUMENTS,
    TRAINER_ARGUMENTS,
    Moved,
    Ours,
    doc_row,
    lightning_hint,
    never_called_overrides,
)

__all__ = [
    "CALLBACK_NAMES",
    "MODULE_NAMES",
    "NEVER_CALLED",
    "OLDER_MODULE_HOOKS",
    "OLDER_TRAINER_ARGUMENTS",
    "TRAINER_ARGUMENTS",
    "Moved",
    "Ours",
    "doc_row",
    "lightning_hint",
    "never_called_overrides",
]
