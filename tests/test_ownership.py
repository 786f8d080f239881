"""One owner for every piece of run state.

- Each attribute of the trainer is written by one class of its composition (the mixins and
  `DreamTrainer`); the others call that owner's methods (an AST audit of `dream_trainer/mixins/*.py` and
  `dream_trainer/trainer.py`).
- Everything a checkpoint saves besides the user's models, optimizers and schedulers comes from one
  registry of state owners (`trainer.state_owners`), which the tuner's snapshot iterates too, so state
  registered there is saved, resumed and put back after a tuning run, and the tuner reads no private
  member of the trainer.
"""

from __future__ import annotations

import ast
import collections
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from conftest import TinyTrainer, quiet_config

import dream_trainer
from dream_trainer.run_state import StateOwner, StateRegistry
from dream_trainer.trainer import DreamTrainer
from dream_trainer.tuner import lr_find

PACKAGE = Path(dream_trainer.__file__).parent

# Attributes still written by more than one class, each with the reason. Empty when every attribute of
# the trainer has one writer.
ALLOWED_WRITERS: dict[str, str] = {}
# `LoopState` fields assigned outside `LoopState`, as (file, function, field): the per-batch counters,
# advanced in place on the hot path (a method call costs more there than the rest of a step's bookkeeping).
HOT_PATH_LOOP_WRITES = {
    ("trainer.py", "_iter_train_batches", "batch_idx"),
    ("step.py", "_full_training_step", "batches_done"),
}


def _trainer_classes() -> dict[tuple[str, str], type]:
    """(file stem, class name) of each class `DreamTrainer` is composed of (helper classes in the same
    files, such as `StepMethod`, have a `self` of their own and are not audited)."""
    return {(cls.__module__.rsplit(".", 1)[-1], cls.__name__): cls for cls in DreamTrainer.__mro__}


def _self_writes(cls_node: ast.ClassDef) -> set[str]:
    """Attributes of `self` that the class's methods assign (`self.x = `, `self.x += `, `self.x: T = `,
    `self.x[k] = `, and `self.x.field = `, which writes `x`'s state), nested classes excluded."""
    written: set[str] = set()
    stack: list[ast.AST] = list(cls_node.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.ClassDef):
            continue
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    written.add(sub.attr)
        stack.extend(ast.iter_child_nodes(node))
    return written


def _audited_classes() -> list[tuple[str, ast.ClassDef]]:
    """`(file stem, class node)` of each class of the trainer in `mixins/*.py` and `trainer.py`."""
    composed = _trainer_classes()
    files = [*sorted((PACKAGE / "mixins").glob("*.py")), PACKAGE / "trainer.py"]
    return [
        (path.stem, node)
        for path in files
        for node in ast.parse(path.read_text(encoding="utf-8")).body
        if isinstance(node, ast.ClassDef) and (path.stem, node.name) in composed
    ]


def writers_by_attribute() -> dict[str, set[str]]:
    writers: dict[str, set[str]] = collections.defaultdict(set)
    for stem, node in _audited_classes():
        for attr in _self_writes(node):
            writers[attr].add(f"{stem}.{node.name}")
    return writers


def test_the_audit_sees_every_class_of_the_trainer() -> None:
    audited = {f"{stem}.{node.name}" for stem, node in _audited_classes()}
    assert len(audited) == len(DreamTrainer.__mro__) - 1  # all but `object`
    assert {"core.TrainerCore", "trainer.DreamTrainer", "step.StepMixin", "evaluation.EvaluationMixin"} <= audited
    assert "step.StepMethod" not in audited  # a helper class's `self` is not the trainer


def test_every_trainer_attribute_has_one_writer() -> None:
    several = {a: sorted(ws) for a, ws in writers_by_attribute().items() if len(ws) > 1}
    unexpected = {a: ws for a, ws in several.items() if a not in ALLOWED_WRITERS}
    assert not unexpected, "attributes written by more than one class (call the owner's method instead): " + "; ".join(
        f"{a}: {', '.join(ws)}" for a, ws in sorted(unexpected.items())
    )
    stale = sorted(set(ALLOWED_WRITERS) - set(several))
    assert not stale, f"ALLOWED_WRITERS lists attributes with one writer now: {stale}"


def test_loop_state_fields_change_only_through_its_methods() -> None:
    """No class of the trainer (nor the tuner) assigns a field of `LoopState`: its transitions do, but for
    the per-batch counters of the hot path."""
    from dream_trainer.loop_state import LoopState

    fields = set(LoopState.__slots__)
    found = set()
    paths = [
        *sorted((PACKAGE / "mixins").glob("*.py")),
        PACKAGE / "trainer.py",
        *sorted((PACKAGE / "tuner").glob("*.py")),
    ]
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                targets = node.targets if isinstance(node, ast.Assign) else []
                if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                    targets = [node.target]
                for target in targets:
                    if isinstance(target, ast.Attribute) and target.attr in fields:
                        owner = target.value
                        name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                        if name in ("loop", "_loop"):
                            found.add((path.name, function.name, target.attr))
    assert found == HOT_PATH_LOOP_WRITES, sorted(found ^ HOT_PATH_LOOP_WRITES)


def _field_writes_outside(owner_file: str, fields: set[str], holders: tuple[str, ...]) -> list[str]:
    """Assignments `holder.field = ...` (or `+=`, annotated) in any package file but `owner_file`, where
    `holder` is one of the names the object is held or passed under (`self._window`, `window`)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).as_posix() == owner_file:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr in fields:
                    owner = target.value
                    name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                    if name in holders:
                        found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {name}.{target.attr}")
    return found


def test_the_accumulation_window_changes_only_through_its_own_methods() -> None:
    """The accumulation window is one object (`dream_trainer/accumulation.py`): no other file of the package
    assigns one of its fields (the step advances it, the optimization verbs note what they did, a checkpoint
    loads it, all through its methods), and the trainer holds no copy of them."""
    from dream_trainer.accumulation import AccumulationWindow

    found = _field_writes_outside("accumulation.py", set(AccumulationWindow.__slots__), ("window", "_window"))
    assert found == [], "call the window's methods instead of assigning its fields: " + ", ".join(found)
    # The flags that used to live on the trainer (OptimizationMixin) are the window's alone now.
    trainer = TinyTrainer(quiet_config())
    held = {"_loss_divisor", "_manual_step", "_window_backward", "_stepped_in_window", "_scaler_unscaled"}
    assert held.isdisjoint(vars(trainer)), sorted(held & set(vars(trainer)))


def test_the_run_directory_and_the_clipping_change_only_through_their_own_methods() -> None:
    """The run a trainer holds (`dream_trainer/run_directory.py`) and its gradient clipping
    (`dream_trainer/gradient_clipping.py`) are one object each: no other file assigns one of their fields
    (the mixins claim, continue, record and clip through their methods), and the trainer keeps no copy."""
    from dream_trainer.gradient_clipping import GradientClipping
    from dream_trainer.run_directory import RunDirectory

    fields = set(RunDirectory.__slots__) - {"__weakref__"}
    found = _field_writes_outside("run_directory.py", fields, ("run", "_run_directory"))
    assert found == [], "call the run directory's methods instead of assigning its fields: " + ", ".join(found)
    found = _field_writes_outside("gradient_clipping.py", set(GradientClipping.__slots__), ("clipping", "_clipping"))
    assert found == [], "call the clipping's methods instead of assigning its fields: " + ", ".join(found)
    # The fields that used to live on the trainer (RunDirectoryMixin, ResumeMixin) are the object's alone now
    # (the clipping's: tests/test_gradient_clipping.py).
    trainer = TinyTrainer(quiet_config())
    held = {"_run_dir", "_run_lock", "_run_claimed", "_run_training", "_run_hung", "_run_end_reason"}
    held |= {"_scratch_root", "_preloaded", "_continues_own_run"}
    assert held.isdisjoint(vars(trainer)), sorted(held & set(vars(trainer)))


def _private_member_uses(path: Path) -> list[str]:
    """`obj._x` uses in a module where `obj` is not `self`/`cls` (the module's own `_names` are fine)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and node.value.id not in ("self", "cls")
        ):
            found.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    return found


def test_the_tuner_uses_no_private_member_of_the_trainer() -> None:
    found = []
    for path in sorted((PACKAGE / "tuner").glob("*.py")):  # the finders, their session and `Tuner`
        found += _private_member_uses(path)
    assert found == [], "the tuner reaches into the trainer: " + ", ".join(found)


# Private reads of a trainer outside its own classes, each with its reason. Aim: empty.
KNOWN_PRIVATE_TRAINER_READS: dict[str, str] = {}


def test_code_outside_the_trainer_reads_no_private_attribute_of_it() -> None:
    """`trainer._x` outside `trainer.py` and `mixins/`: the owner offers a method (or the protocol a
    member) instead, so what another layer uses is named where the state lives."""
    found = set()
    for folder in ("callbacks", "loggers", "lightning", "tuner", "cli", "utils", "parallel", "data"):
        for path in sorted((PACKAGE / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not (
                    isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                ):
                    continue
                owner = node.value
                name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if name == "trainer":
                    found.add(f"{folder}/{path.name} trainer.{node.attr}")
    assert sorted(found - set(KNOWN_PRIVATE_TRAINER_READS)) == []
    assert sorted(set(KNOWN_PRIVATE_TRAINER_READS) - found) == [], "no longer read: remove from the list"


# --- the registry -----------------------------------------------------------------------------------
def test_a_checkpoint_is_the_registry_plus_the_users_objects(tmp_path: Path) -> None:
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=1))
    trainer.fit()
    state = trainer.state_dict()
    owners = trainer.state_owners
    assert list(owners) == [
        "grad_scaler",
        "optimization",
        "accumulation",
        "bad_batches",
        "run_directory",
        "metrics",
        "loop",
        "rng",
        "datamodule",
        "callbacks",
    ]
    by_key: dict[str, list[str]] = collections.defaultdict(list)
    for name, owner in owners.items():
        for key in owner.state_dict():
            by_key[key].append(name)
    users = {"schedulers", "models", "optimizers"}
    assert set(state) == {"dream_trainer"} | users | set(by_key)
    # Only the header and the counters are shared, field by field; every other entry has one owner.
    assert {k: v for k, v in by_key.items() if len(v) > 1} == {"counters": ["optimization", "loop"]}
    assert by_key["dream_trainer"] == ["run_directory"]
    assert set(state["dream_trainer"]) == {"format_version", "trainer_class", "config", "run_dir", "sections"}
    assert state["dream_trainer"]["sections"] == sorted(state)  # what a load verifies is there
    assert set(state["counters"]) == {
        "global_step",
        "current_epoch",
        "resume_epoch",
        "non_finite_counts",
        "last_val_step",
    }


def test_the_registry_refuses_a_second_owner_and_entries_written_twice() -> None:
    registry = StateRegistry()
    registry.register("a", StateOwner(lambda: {"x": 1}, lambda c: None))
    with pytest.raises(ValueError, match="'a' is registered already"):
        registry.register("a", StateOwner(lambda: {}, lambda c: None))
    registry.register("b", StateOwner(lambda: {"x": 2}, lambda c: None))
    with pytest.raises(ValueError, match="'b' writes the checkpoint entry 'x'"):
        registry.state_dict()
    with pytest.raises(ValueError, match="snapshot and restore together"):
        StateOwner(lambda: {}, lambda c: None, snapshot=lambda: None)


class CountingTrainer(TinyTrainer):
    """A trainer with run state of its own: it counts the batches it trained on, registered once."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches_seen = 0
        self.state_owners.register(
            "batches_seen",
            StateOwner(
                lambda: {"batches_seen": self.batches_seen},
                self._load_batches_seen,
                lambda: self.batches_seen,
                self._put_batches_seen,
            ),
        )

    def _load_batches_seen(self, checkpoint: Mapping[str, Any]) -> None:
        self.batches_seen = int(checkpoint.get("batches_seen", 0))

    def _put_batches_seen(self, saved: int) -> None:
        self.batches_seen = saved

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.batches_seen += 1
        return super().training_step(batch, batch_idx)


def test_state_a_trainer_registers_is_checkpointed_resumed_and_put_back_after_tuning(tmp_path: Path) -> None:
    trainer = CountingTrainer(quiet_config(tmp_path / "a", n_epochs=1))
    trainer.fit()
    assert trainer.batches_seen == 4
    path = trainer.save_checkpoint(tmp_path / "one.ckpt")

    lr_find(trainer, num_training=5, early_stop_threshold=None)  # trains: the snapshot puts the count back
    assert trainer.batches_seen == 4

    resumed = CountingTrainer(quiet_config(tmp_path / "b", n_epochs=2))
    resumed.fit(ckpt_path=path)
    assert resumed.batches_seen == 8 and resumed.global_step == 8
