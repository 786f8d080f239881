"""A trainer subclass whose `__init__` forgets `super().__init__(config)` (issue 36).

Before, `fit()` failed inside the package with `AttributeError: 'MyTrainer' object has no attribute
'world_size'`, which names neither the cause nor the fix. Now the first attribute the trainer lacks says
what is missing, in its first line. The check is a `__getattr__` fallback on the class a trainer is
created as until `super().__init__(config)` runs (`TrainerCore.__new__`): the class of an initialised
trainer has none, since CPython 3.11 specialises no attribute read of a class that has one (issue 37:
+1.5-2 us per training step).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from conftest import TinyTrainer, quiet_config
from torch import nn

from dream_trainer import DreamTrainer, DreamTrainerConfig

SAYS = r"^MyTrainer\.__init__ did not call super\(\)\.__init__\(config\) .*: call super\(\)\.__init__\(config\) first"


class MyTrainer(DreamTrainer):
    def __init__(self, config: DreamTrainerConfig) -> None:
        self.config = config  # what a forgotten super().__init__ often leaves behind
        self.model = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.model(batch).sum()

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        return {"val": self.model(batch).sum()}

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        return {"test": self.model(batch).sum()}


@pytest.mark.parametrize("entry", ["fit", "validate", "test", "global_step"])
def test_a_missing_super_init_says_so_in_the_first_line(tmp_path, entry):
    trainer = MyTrainer(quiet_config(tmp_path))
    with pytest.raises(AttributeError, match=SAYS) as info:
        value = getattr(trainer, entry)
        value() if callable(value) else None
    assert len(str(info.value)) < 300


class ReadsTooEarly(TinyTrainer):
    """Reads a trainer attribute before calling `super().__init__(config)`."""

    def __init__(self, config: DreamTrainerConfig) -> None:
        try:
            self.device  # noqa: B018
        except AttributeError as exc:
            self.too_early = str(exc)
        super().__init__(config)


def test_a_read_before_super_init_says_so_and_afterwards_python_s_messages_stand(tmp_path):
    trainer = ReadsTooEarly(quiet_config(tmp_path))
    assert trainer.too_early.startswith(
        "ReadsTooEarly.__init__ did not call super().__init__(config) (or read self.device before it did)"
    ), trainer.too_early
    # Once initialised, a missing attribute reads as Python says it, and a property that raises
    # AttributeError keeps its own message.
    with pytest.raises(AttributeError, match=r"^'ReadsTooEarly' object has no attribute 'nope'$"):
        trainer.nope  # noqa: B018
    with pytest.raises(AttributeError, match=r"^train_loader is set by configure_dataloaders\(\)"):
        trainer.train_loader  # noqa: B018
    assert getattr(trainer, "nope", None) is None and not hasattr(trainer, "nope")
    clone = copy.deepcopy(trainer)
    assert torch.equal(clone.model.weight, trainer.model.weight)
    trainer.fit()
    assert trainer.global_step == 4


def test_an_initialised_trainer_is_an_instance_of_its_own_class_which_has_no_attribute_hook(tmp_path):
    # A class with a __getattr__ anywhere in its MRO gets none of CPython 3.11's specialised attribute reads:
    # each of the ~60 reads of the trainer in a training step cost ~2.4x as much.
    trainer = TinyTrainer(quiet_config(tmp_path))
    assert type(trainer) is TinyTrainer
    assert [k.__name__ for k in type(trainer).__mro__ if "__getattr__" in vars(k)] == []
    assert type(copy.deepcopy(trainer)) is TinyTrainer
    # Not yet initialised, it is the class's twin: same name, and the hook that names the missing call.
    unready = MyTrainer(quiet_config(tmp_path / "unready"))
    assert isinstance(unready, MyTrainer) and type(unready).__name__ == "MyTrainer"
    with pytest.raises(AttributeError, match=SAYS):
        unready.world_size  # noqa: B018
