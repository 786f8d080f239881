"""What setup and the first training step say when ported Lightning code uses a name the trainer lacks.

Two seams reach this module, both outside the per-step path:

- setup (`SetupMixin._setup_fit`) runs inside `lightning_names_explained(trainer)` and first calls
  `refuse_never_called(cls)`;
- the first training step of each `fit()` runs inside `lightning_names_explained(trainer)` too (see
  `dream_trainer.lightning.step_checks.FirstStepCheck`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from dream_trainer.errors import MisconfigurationError
from dream_trainer.lightning.names import MODULE_NAMES, never_called_overrides

_MODULE_METHODS = frozenset(name for name in dir(nn.Module) if not name.startswith("_"))


def lightning_hint(owner: str, name: str) -> str | None:
    """What to write instead of `name`, a `LightningModule` (or `nn.Module`) attribute that trainer class
    `owner` lacks; None for any other name. Read only when an AttributeError is on its way out."""
    moved = MODULE_NAMES.get(name)
    if moved is not None and moved.target != name:
        where = f"`self.{moved.target}`" if moved.target and "." not in moved.target else moved.target
        instead = f"here it is {where}: " if where else ""
        return f"{owner} has no attribute {name!r} (Lightning's LightningModule has): {instead}{moved.note}"
    if name in _MODULE_METHODS:
        return (
            f"{owner} has no attribute {name!r}: a trainer is not an nn.Module, it holds them; call it on a "
            f"model, e.g. `self.model.{name}`"
        )
    return None


@contextlib.contextmanager
def lightning_names_explained(trainer: object) -> Iterator[None]:
    """Re-raise an AttributeError for a Lightning name read on `trainer` (`self.manual_backward`,
    `self.parameters()`) with the sentence that says what to write here. Wraps setup and the first
    training step, where ported code first runs: nothing is added to any later lookup."""
    try:
        yield
    except AttributeError as exc:
        name = getattr(exc, "name", None)
        hint = lightning_hint(type(trainer).__name__, name) if getattr(exc, "obj", None) is trainer and name else None
        if hint is None:
            raise
        raise AttributeError(hint, name=name, obj=trainer) from exc


def refuse_never_called(cls: type) -> None:
    """Raise when trainer class `cls` defines Lightning methods dream_trainer never calls (at setup)."""
    problems = never_called_overrides(cls)
    if problems:
        raise MisconfigurationError(
            f"{cls.__name__} defines Lightning methods that dream_trainer never calls, so they would be "
            "ignored: " + "; ".join(f"{name}: {note}" for name, note in problems) + ". (Rename a method "
            "you call yourself.)"
        )
