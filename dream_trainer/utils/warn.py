"""Warnings that point at the user's code, not at dream_trainer's.

`warnings.warn(stacklevel=N)` needs the caller to know how deep it is, which changes whenever the code
moves (Python 3.12's `skip_file_prefixes` does this walk itself; 3.10 and 3.11 lack it). `warn_user`
walks up from its caller past every frame in the dream_trainer package and attributes the warning to the
first frame outside it: the user's `fit()` call, their `training_step`, their callback. `warn_at`
names the line that defines a function of the user's instead: the step a warning is about, when the
warning is given after that step returned.
"""

from __future__ import annotations

import inspect
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def user_stacklevel() -> int:
    """The `stacklevel` that makes a `warnings.warn` called by this function's caller point at the first
    frame outside the package (or at the outermost frame when there is none)."""
    frame = sys._getframe(1)  # the caller, the frame `warnings.warn(stacklevel=1)` would name
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
        level += 1
    return level


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn(message, category)` attributed to the user's code."""
    warnings.warn(message, category, stacklevel=user_stacklevel())


def warn_at(function: Callable[..., Any], message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn(message, category)` attributed to the `def` line of `function` (the user's
    `training_step` a check judged after it returned); as `warn_user` when `function` is not a Python
    function of the user's."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    if code is None or code.co_filename.startswith(_PACKAGE_DIR):
        warnings.warn(message, category, stacklevel=user_stacklevel())
        return
    module_globals = getattr(inspect.unwrap(function), "__globals__", {})
    warnings.warn_explicit(
        message,
        category,
        code.co_filename,
        code.co_firstlineno,
        module=module_globals.get("__name__"),
        registry=module_globals.setdefault("__warningregistry__", {}),
        module_globals=module_globals,
    )
