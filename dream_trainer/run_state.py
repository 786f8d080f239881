"""The run's state owners: one registry of what a checkpoint saves and a tuning run puts back.

Every piece of run state has one owner, the class that creates and writes it. Where it creates the
state (its `_init_*` method), that class registers it once, as a `StateOwner` under a name, in the
trainer's `StateRegistry` (`trainer.state_owners`). Checkpoints (`StateDictMixin.state_dict` /
`load_state_dict`) and the tuner's snapshot (`dream_trainer.tuner.session.TrainerSnapshot`) iterate
that registry, so state added to the trainer is saved, resumed and put back by registering one owner.

An owner has two pairs of methods, because a checkpoint and a snapshot are different copies:

- `state_dict()`: its entries of a checkpoint, under the checkpoint's top-level keys ("counters",
  "data", "rng", ...). Entries several owners write under one key (the "dream_trainer" header,
  "counters") are merged. `load_state_dict(checkpoint)` restores them in a process that resumes the
  run (the epoch to continue, the batches to skip); it reads the entries it wrote, and those an older
  checkpoint lacks leave their state as it is.
- `snapshot()` / `restore(saved)`: the state exactly as it is in this process, and putting it back, any
  number of times (the batch-size finder restores before every trial). None for state a tuning run
  cannot change (callbacks do not fire, no run directory is claimed): the snapshot leaves it out.

Registration order is the order a checkpoint restores the owners in (the trainer's `__init__` fixes it).
The user's own objects (models, optimizers, LR schedulers, found by type among the trainer's
attributes) are not registered: checkpoints save them by attribute name in the strategy-independent
format (`dream_trainer.mixins.state_format`), and the tuner copies them itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any


def _no_snapshot() -> None:
    return None


class StateOwner:
    """One owner's run state, as a checkpoint saves and resumes it and a tuning run snapshots it; made
    of the owning class's methods (see the module docstring)."""

    __slots__ = ("_load", "_restore", "_save", "_snapshot")

    def __init__(
        self,
        save: Callable[[], dict[str, Any]],
        load: Callable[[Mapping[str, Any]], None],
        snapshot: Callable[[], Any] | None = None,
        restore: Callable[[Any], None] | None = None,
    ) -> None:
        if (snapshot is None) != (restore is None):
            raise ValueError("a StateOwner takes snapshot and restore together, or neither")
        self._save = save
        self._load = load
        self._snapshot = snapshot
        self._restore = restore

    def state_dict(self) -> dict[str, Any]:
        """Its entries of a checkpoint, by top-level key."""
        return self._save()

    def load_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Resume from `checkpoint` (the whole checkpoint, as this rank loads it: it reads its own entries)."""
        self._load(checkpoint)

    @property
    def snapshots(self) -> bool:
        """False for state a tuning run cannot change (the snapshot leaves it out)."""
        return self._snapshot is not None

    def snapshot(self) -> Any:
        """The state exactly as it is now, a copy nothing else holds."""
        return (self._snapshot or _no_snapshot)()

    def restore(self, saved: Any) -> None:
        """Put back what `snapshot()` returned; `saved` stays valid for the next restore."""
        if self._restore is not None:
            self._restore(saved)


class StateRegistry(Mapping[str, StateOwner]):
    """The trainer's state owners by name, in registration order (the order a checkpoint restores them)."""

    def __init__(self) -> None:
        self._owners: dict[str, StateOwner] = {}

    def register(self, name: str, owner: StateOwner) -> None:
        """Add `owner` under `name`, once (a name registered twice is a programming error)."""
        if name in self._owners:
            raise ValueError(f"run state {name!r} is registered already: each piece of run state has one owner")
        self._owners[name] = owner

    def __getitem__(self, name: str) -> StateOwner:
        return self._owners[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._owners)

    def __len__(self) -> int:
        return len(self._owners)

    # --- checkpoints -------------------------------------------------------------------------------
    def state_dict(self, into: dict[str, Any] | None = None) -> dict[str, Any]:
        """Every owner's checkpoint entries, in registration order, added to `into` (a new dict by
        default). Entries of several owners under one key must be dicts: they are merged."""
        state = {} if into is None else into
        for name, owner in self._owners.items():
            for key, value in owner.state_dict().items():
                if key not in state:
                    state[key] = value
                elif isinstance(state[key], dict) and isinstance(value, dict):
                    state[key].update(value)
                else:
                    raise ValueError(
                        f"run state {name!r} writes the checkpoint entry {key!r}, which another owner wrote"
                    )
        return state

    def load_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Resume every owner from `checkpoint`, in registration order."""
        for owner in self._owners.values():
            owner.load_state_dict(checkpoint)

    # --- snapshots (in this process) ----------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Every owner's exact copy, by name (owners a tuning run cannot change are left out)."""
        return {name: owner.snapshot() for name, owner in self._owners.items() if owner.snapshots}

    def restore(self, saved: Mapping[str, Any]) -> None:
        """Put back what `snapshot()` returned (again and again: `saved` is not consumed)."""
        for name, owner in self._owners.items():
            if name in saved:
                owner.restore(saved[name])
