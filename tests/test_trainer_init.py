"""A trainer subclass whose `__init__` forgets `super().__init__(config)` (issues 36 and 43).

Before issue 36, `fit()` failed inside the package with `AttributeError: 'MyTrainer' object has no attribute
'world_size'`, which names neither the cause nor the fix. Now constructing such a trainer says what is
missing, in its first line. The check wraps the `__init__` each trainer class defines
(`TrainerCore.__init_subclass__`): when the outermost `__init__` of a construction returns and
`super().__init__(config)` never ran, it raises. No class of a trainer has a `__getattr__`, since CPython
3.11 specialises no attribute read of a class that has one (issue 37: +1.5-2 us per training step), and a
trainer is an instance of its own class from `__new__` on: the not-yet-initialised twin class it was
created as until issue 43 changed `type(self)` in `__init__`, was never freed, survived a `deepcopy` of a
trainer with its own `__setstate__`, and called an `__init_subclass__` without its keywords.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import inspect
import weakref
from typing import Any

import pytest
import torch
from conftest import TinyTrainer, quiet_config
from torch import nn

from dream_trainer import DreamTrainer, DreamTrainerConfig
from dream_trainer.cli.loading import config_class_of, init_params
from dream_trainer.mixins import core
from dream_trainer.mixins.core import TrainerCore

SAYS = r"^MyTrainer\.__init__ did not call super\(\)\.__init__\(config\): call super\(\)\.__init__\(config\) first"


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


def test_a_missing_super_init_says_so_at_construction_in_the_first_line(tmp_path):
    with pytest.raises(
        AttributeError, match=SAYS + r" in MyTrainer\.__init__; it creates the trainer's state\.$"
    ) as info:
        MyTrainer(quiet_config(tmp_path))
    assert len(str(info.value)) < 300
    assert core._CONSTRUCTING == {}  # nothing kept once construction ended


class Forgets(DreamTrainer):
    def __init__(self, config: DreamTrainerConfig) -> None:
        self.config = config


class CallsSuper(Forgets):
    def __init__(self, config: DreamTrainerConfig) -> None:
        super().__init__(config)


class InheritsInit(Forgets):
    pass


@pytest.mark.parametrize("cls", [CallsSuper, InheritsInit])
def test_the_init_that_forgot_is_the_one_named(tmp_path, cls):
    # The class whose own __init__ returned without reaching DreamTrainer's, not the class constructed.
    with pytest.raises(AttributeError, match=r"^Forgets\.__init__ did not call super\(\)\.__init__\(config\):"):
        cls(quiet_config(tmp_path))


class ReadsTooEarly(TinyTrainer):
    """Reads a trainer attribute before calling `super().__init__(config)`."""

    def __init__(self, config: DreamTrainerConfig) -> None:
        self.device  # noqa: B018
        super().__init__(config)


def test_a_read_before_super_init_says_so_at_construction(tmp_path):
    with pytest.raises(AttributeError) as info:
        ReadsTooEarly(quiet_config(tmp_path))
    assert str(info.value).startswith(
        "ReadsTooEarly.__init__ did not call super().__init__(config) (or read self.device before it did): "
        "call super().__init__(config) first in ReadsTooEarly.__init__"
    ), info.value
    assert info.value.name == "device"
    assert isinstance(info.value.__cause__, AttributeError)  # Python's own error, with the line that read
    assert str(info.value.__cause__) == "'ReadsTooEarly' object has no attribute 'device'"


class AsksFirst(TinyTrainer):
    """Asks for an attribute before `super().__init__(config)` and handles its absence: allowed."""

    def __init__(self, config: DreamTrainerConfig) -> None:
        self.had_device = hasattr(self, "device")
        try:
            self.world_size  # noqa: B018
        except AttributeError as exc:
            self.too_early = str(exc)  # Python's message: no class hook adds to it
        super().__init__(config)


def test_a_handled_read_before_super_init_is_python_s_and_afterwards_python_s_messages_stand(tmp_path):
    trainer = AsksFirst(quiet_config(tmp_path))
    assert trainer.had_device is False
    assert trainer.too_early == "'AsksFirst' object has no attribute 'world_size'"
    # Once initialised, a missing attribute reads as Python says it, and a property that raises
    # AttributeError keeps its own message.
    with pytest.raises(AttributeError, match=r"^'AsksFirst' object has no attribute 'nope'$"):
        trainer.nope  # noqa: B018
    with pytest.raises(AttributeError, match=r"^train_loader is set by configure_dataloaders\(\)"):
        trainer.train_loader  # noqa: B018
    assert getattr(trainer, "nope", None) is None and not hasattr(trainer, "nope")
    clone = copy.deepcopy(trainer)
    assert torch.equal(clone.model.weight, trainer.model.weight)
    trainer.fit()
    assert trainer.global_step == 4


class BadArgument(TinyTrainer):
    def __init__(self, config: DreamTrainerConfig, width: int) -> None:
        if width < 1:
            raise ValueError("width must be positive")
        if width > 8:
            torch.zeros(width).widen()  # an AttributeError of another object's: the user's own bug
        super().__init__(config)


def test_errors_that_are_not_a_missing_super_init_pass_unchanged(tmp_path):
    with pytest.raises(ValueError, match=r"^width must be positive$"):
        BadArgument(quiet_config(tmp_path), width=0)
    with pytest.raises(AttributeError, match=r"^'Tensor' object has no attribute 'widen'$") as info:
        BadArgument(quiet_config(tmp_path), width=9)
    assert info.value.__cause__ is None
    with pytest.raises(TypeError, match=r"needs a DreamTrainerConfig"):
        TinyTrainer(object())  # type: ignore[arg-type]
    assert core._CONSTRUCTING == {}


def test_an_initialised_trainer_is_an_instance_of_its_own_class_which_has_no_attribute_hook(tmp_path):
    # A class with a __getattr__ anywhere in its MRO gets none of CPython 3.11's specialised attribute reads:
    # each of the ~60 reads of the trainer in a training step cost ~2.4x as much.
    trainer = TinyTrainer(quiet_config(tmp_path))
    assert type(trainer) is TinyTrainer
    assert [k.__name__ for k in type(trainer).__mro__ if "__getattr__" in vars(k)] == []
    assert type(copy.deepcopy(trainer)) is TinyTrainer


# --- issue 43: no twin class ------------------------------------------------------------------------------
class SeesItsClass(TinyTrainer):
    def __init__(self, config: DreamTrainerConfig) -> None:
        self.class_before_super = type(self)
        super().__init__(config)


def test_a_trainer_is_an_instance_of_its_own_class_from_new_on(tmp_path):
    trainer = SeesItsClass(quiet_config(tmp_path))
    assert trainer.class_before_super is SeesItsClass
    # What copy and unpickling do (`copyreg.__newobj__`): a plain instance, no `__new__`/`__setstate__` of ours.
    assert type(SeesItsClass.__new__(SeesItsClass)) is SeesItsClass
    assert TrainerCore.__new__ is object.__new__
    assert not any("__setstate__" in vars(k) for k in SeesItsClass.__mro__)


def test_a_trainer_class_gains_no_hidden_subclass_and_is_freed(tmp_path):
    def construct_one() -> weakref.ref[type]:
        class Local(TinyTrainer):
            def __init__(self, config: DreamTrainerConfig) -> None:
                super().__init__(config)

        Local(quiet_config(tmp_path))
        assert Local.__subclasses__() == []
        return weakref.ref(Local)

    gone = construct_one()
    gc.collect()
    assert gone() is None


class KeepsOwnState(TinyTrainer):
    def __getstate__(self) -> dict[str, Any]:
        return dict(vars(self))

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.restored = True


def test_deepcopy_of_a_trainer_with_its_own_setstate_is_of_its_class(tmp_path):
    clone = copy.deepcopy(KeepsOwnState(quiet_config(tmp_path)))
    assert type(clone) is KeepsOwnState and clone.restored
    clone.fit()
    assert clone.global_step == 4


class Flavoured(TinyTrainer):
    def __init_subclass__(cls, *, flavour: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.flavour = flavour


class Vanilla(Flavoured, flavour="vanilla"):
    def __init__(self, config: DreamTrainerConfig, scoops: int = 2) -> None:
        super().__init__(config)
        self.scoops = scoops


def test_an_init_subclass_that_requires_keywords_works(tmp_path):
    trainer = Vanilla(quiet_config(tmp_path), scoops=3)
    assert type(trainer) is Vanilla and trainer.flavour == "vanilla" and trainer.scoops == 3


@dataclasses.dataclass
class WideConfig(DreamTrainerConfig):
    width: int = 8


class Documented(DreamTrainer):
    def __init__(self, config: WideConfig, depth: int = 2, name: str = "net") -> None:
        """Builds `depth` layers of `config.width`."""
        super().__init__(config)
        self.depth = depth


def test_the_wrapped_init_keeps_the_user_s_signature_docstring_and_names():
    init = Documented.__init__
    assert list(inspect.signature(init).parameters) == ["self", "config", "depth", "name"]
    assert list(inspect.signature(Documented).parameters) == ["config", "depth", "name"]
    assert init.__doc__ == "Builds `depth` layers of `config.width`."
    assert init.__qualname__ == "Documented.__init__" and init.__module__ == __name__
    assert inspect.unwrap(init) is init.__wrapped__ is not init  # wrapped, once
    assert inspect.unwrap(init).__code__.co_filename == __file__
    # The CLI reads the (string, `from __future__ import annotations`) annotations of `__init__`.
    assert config_class_of(Documented) is WideConfig
    assert [(p.name, p.annotation, p.default) for p in init_params(Documented)] == [
        ("depth", int, 2),
        ("name", str, "net"),
    ]
