"""Every callback class of `dream_trainer.callbacks` is importable from `dream_trainer` as well
(`from dream_trainer import EarlyStopping`, as `ModelCheckpoint` always was), taken on first use by the
package's module `__getattr__`; `import dream_trainer` imports nothing more for them."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import dream_trainer
import dream_trainer.callbacks as callbacks
from dream_trainer.callbacks import Callback

INIT = Path(dream_trainer.__file__)


def _callback_classes() -> list[str]:
    return [n for n in callbacks.__all__ if isinstance(v := getattr(callbacks, n), type) and issubclass(v, Callback)]


@pytest.mark.parametrize("name", _callback_classes())
def test_every_callback_is_importable_from_the_package(name: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from dream_trainer import {name}", namespace)
    assert namespace[name] is getattr(callbacks, name)
    assert name in dream_trainer.__all__
    assert name in dir(dream_trainer)


def test_the_lazy_list_is_the_callbacks_not_imported_eagerly() -> None:
    lazy = set(dream_trainer._LAZY_CALLBACKS)
    assert lazy | {"Callback", "ModelCheckpoint"} == set(_callback_classes())
    # The `if TYPE_CHECKING:` import (for mypy and editors) names the same classes.
    tree = ast.parse(INIT.read_text())
    typed = {
        alias.name
        for node in tree.body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for stmt in node.body
        if isinstance(stmt, ast.ImportFrom)
        for alias in stmt.names
    }
    assert typed == lazy


def test_import_dream_trainer_loads_no_callback_name_and_no_rich() -> None:
    probe = (
        "import sys, dream_trainer\n"
        "eager = [n for n in dream_trainer._LAZY_CALLBACKS if n in vars(dream_trainer)]\n"
        "print(eager, 'rich' in sys.modules)\n"
        "from dream_trainer import EarlyStopping\n"
        "print('EarlyStopping' in vars(dream_trainer), 'rich' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[] False", "True False"]  # kept once taken; rich only for a bar


def test_unknown_names_are_attribute_errors() -> None:
    with pytest.raises(AttributeError, match="module 'dream_trainer' has no attribute 'EarlyStop'"):
        dream_trainer.EarlyStop  # noqa: B018
    assert not hasattr(dream_trainer, "HOOKS")  # the hook names are not a callback: dream_trainer.callbacks.HOOKS
    with pytest.raises(ImportError):
        exec("from dream_trainer import CallbackBus", {})


def test_star_import_gives_every_public_name() -> None:
    namespace: dict[str, object] = {}
    exec("from dream_trainer import *", namespace)
    assert sorted(n for n in dream_trainer.__all__ if n not in namespace) == []
    assert namespace["EarlyStopping"] is callbacks.EarlyStopping


def test_weight_averaging_is_a_public_base_class_not_a_builtin_callback() -> None:
    from dream_trainer.callbacks import EMA, BaseFinetuning, StochasticWeightAveraging, WeightAveraging

    assert issubclass(EMA, WeightAveraging) and issubclass(StochasticWeightAveraging, WeightAveraging)
    assert "WeightAveraging" in callbacks.__all__
    # Like BaseFinetuning's subclasses, the concrete ones are built-ins (a config's "type"); the base is not.
    assert "WeightAveraging" not in callbacks.BUILTINS and "BaseFinetuning" not in callbacks.BUILTINS
    assert {"EMA", "StochasticWeightAveraging"} <= set(callbacks.BUILTINS)
    assert BaseFinetuning is dream_trainer.BaseFinetuning
