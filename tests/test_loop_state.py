"""`trainer.loop`: the one owner of the loop's position, and the public questions callbacks ask."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from conftest import TinyTrainer, quiet_config

import dream_trainer
from dream_trainer import Callback, TrainerProtocol
from dream_trainer.loop_state import LoopState

PACKAGE = Path(dream_trainer.__file__).parent


class LoopRecorder(Callback):
    """Records, at every `on_train_batch_end`, what the public loop API says."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int, bool, bool]] = []

    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loop = trainer.loop
        self.seen.append((batch_idx, loop.global_step, loop.micro_batch, loop.step_ended, loop.is_logging_step))


def test_step_ended_and_logging_step_follow_accumulation_windows(tmp_path: Path) -> None:
    # 4 batches per epoch, windows of 3: the second window of each epoch is short (1 batch).
    rec = LoopRecorder()
    cfg = quiet_config(tmp_path, n_epochs=2, gradient_accumulation_steps=3, log_every_n_steps=2, callbacks=[rec])
    trainer = TinyTrainer(cfg)
    trainer.fit()
    assert rec.seen == [
        (0, 0, 1, False, False),
        (1, 0, 2, False, False),
        (2, 1, 0, True, False),  # window 1 ends: global_step 1, not a multiple of 2
        (3, 2, 0, True, True),  # the short last window ends: step 2 is a logging step
        (0, 2, 1, False, False),
        (1, 2, 2, False, False),
        (2, 3, 0, True, False),
        (3, 4, 0, True, True),
    ]
    loop = trainer.loop
    assert (loop.global_step, loop.epoch, trainer.global_step, trainer.current_epoch) == (4, 2, 4, 2)
    assert loop.epoch_length == trainer.num_training_batches == 4
    assert loop.step_ended_every(4) and not loop.step_ended_every(3)


def test_loop_is_read_only_with_a_clear_error() -> None:
    trainer = TinyTrainer(quiet_config())
    with pytest.raises(AttributeError, match=r"trainer\.loop is the trainer's LoopState"):
        trainer.loop = 1.5  # type: ignore[misc]
    assert isinstance(trainer.loop, LoopState)


def test_counters_on_the_trainer_are_the_loops() -> None:
    trainer = TinyTrainer(quiet_config())
    trainer.global_step = 7
    trainer.current_epoch = 3
    assert (trainer.loop.global_step, trainer.loop.epoch) == (7, 3)
    assert "global_step=7" in repr(trainer.loop)


def test_trainer_meets_the_public_protocol_before_and_after_fit(tmp_path: Path) -> None:
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=1))
    assert isinstance(trainer, TrainerProtocol)
    assert trainer.num_training_batches is None  # no loaders before fit
    trainer.fit()
    assert isinstance(trainer, TrainerProtocol)
    assert trainer.is_setup and trainer.num_training_batches == 4


def _private_trainer_reads(path: Path) -> list[str]:
    """`trainer._x` attribute reads in a file (any name bound to a trainer is called `trainer` here)."""
    tree = ast.parse(path.read_text())
    return [
        f"{path.name}:{node.lineno} trainer.{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and isinstance(node.value, ast.Name)
        and node.value.id in ("trainer", "_trainer")
    ]


def test_callbacks_loggers_and_utils_use_only_public_trainer_api() -> None:
    found = []
    for folder in ("callbacks", "loggers", "utils"):
        for path in sorted((PACKAGE / folder).glob("*.py")):
            found += _private_trainer_reads(path)
    assert found == [], "use the public API (trainer.loop, TrainerProtocol) instead of: " + ", ".join(found)
