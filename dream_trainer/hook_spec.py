"""The hooks, declared once: name, arguments and a one-line description of each, in firing order.

`HOOK_SPECS` is the only list of hooks in the package. Everything else derives from it or is checked
against it:

- `HOOKS` (re-exported as `dream_trainer.callbacks.HOOKS`) is its names, in the same order, and
  `HookName` the same names as a `Literal` type (checked against `HOOKS` at import);
- the bus (`dream_trainer.callbacks.bus`) builds one dispatch tuple per entry, and asks
  `overrides_hook()` whether a callback or the trainer defines a hook beyond the no-op default. Every
  hook fires through the bus, by its literal name (`tests/test_hook_spec.py` finds each one's call);
- `Callback` (`callbacks/base.py`) and `HooksMixin` (`mixins/hooks.py`) hold the no-op defaults that
  users override. Their methods are written out, not generated, and the `@hook_defaults` decorator
  checks them against this list when the class is created (see below).

Why the two classes are written out rather than generated from this table: a method created with
`setattr` at import time exists only at run time. Type checkers and IDEs read the source, so they would
not see `Callback.on_train_batch_end` at all: no completion while writing an override, no check that
the override has the right arguments, and `super().on_fit_start(trainer)` would be flagged as an
error. mkdocstrings (griffe) also reads the source, so docs/api.md would lose the hook list. Written-out
methods keep all of that. What generating would have guaranteed, that the two classes cannot drift from
this list, `@hook_defaults` guarantees instead: it fails at import, naming the difference, if a class
lacks a hook, has one the list does not, orders them differently, or differs in an argument's name,
annotation or kind, or in a docstring's first paragraph. Checking at import rather than only in a test
keeps the guarantee generation would give (a drifted class cannot even be imported) for about 1.5 ms
(`inspect.signature` of the 2 x 37 methods, once); `tests/test_hook_spec.py` tests the checker.

Adding a hook: add a `_hook(...)` line here at its place in the firing order, then the same method to
`Callback` (with `trainer` first) and to `HooksMixin` (without it), its name to `HookName` and to
`CallbackBus`'s annotations, then fire it from the loop: `self._bus.fire("on_new_hook", ...)`.

This module imports nothing from `dream_trainer`: it is the bottom layer that the callbacks and the
trainer both build on.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_args

__all__ = [
    "HOOKS",
    "HOOK_SPECS",
    "HookName",
    "HookSpec",
    "hook_call_problem",
    "hook_defaults",
    "hook_mismatches",
    "hook_signature",
    "overrides_hook",
]

_C = TypeVar("_C", bound=type)


@dataclass(frozen=True)
class HookSpec:
    """One hook: its `name`, its `params` after `trainer` as `(name, annotation)` pairs, `doc`, the
    one-line description that starts both default methods' docstrings, and `returns`, the return
    annotation (`"None"` for all but `on_train_batch_start`, whose -1 skips the rest of the epoch)."""

    name: str
    params: tuple[tuple[str, str], ...]
    doc: str
    returns: str = "None"

    @property
    def args(self) -> tuple[str, ...]:
        """The argument names after `trainer` (a trainer's own hook takes exactly these)."""
        return tuple(name for name, _ in self.params)


def _hook(name: str, params: str, doc: str, returns: str = "None") -> HookSpec:
    """`params` as a signature writes them: `"batch: Any, batch_idx: int"`."""
    args = ast.parse(f"def f({params}): pass").body[0].args.args  # type: ignore[attr-defined]  # body[0] is the FunctionDef parsed
    return HookSpec(name, tuple((a.arg, ast.unparse(a.annotation)) for a in args), doc, returns)


# Validation hooks nest inside the training epoch; test and predict runs (`trainer.test()`,
# `trainer.predict()`) come after fit; checkpoint hooks fire whenever a checkpoint is built or read.
# Each entry: the name, the arguments after `trainer` (as the methods write them), the summary line.
# fmt: off
HOOK_SPECS: tuple[HookSpec, ...] = (
    _hook("setup", "stage: str",
          'Before `configure_models`, once the process group and device are known; `stage` is "fit".'),
    _hook("on_fit_start", "",
          "After setup (and resume), before the sanity check."),
    _hook("on_sanity_check_start", "",
          "Before the sanity validation (only when it runs)."),
    _hook("on_sanity_check_end", "",
          "After the sanity validation (only when it runs)."),
    _hook("on_train_start", "",
          "Before the first training epoch."),
    _hook("on_train_epoch_start", "",
          "At the start of each training epoch."),
    _hook("on_train_batch_start", "batch: Any, batch_idx: int",
          "Before `training_step`; `batch` is on the device; return -1 to skip the rest of the epoch.",
          returns="int | None"),
    _hook("on_before_zero_grad", "optimizer: Optimizer",
          "Before an optimizer's gradients are zeroed (the start of each accumulation window)."),
    _hook("on_before_backward", "loss: torch.Tensor",
          "Before `backward`, with the loss as `training_step` computed it (unscaled)."),
    _hook("on_after_backward", "",
          "After `backward`, gradients populated (still scaled when fp16 is on)."),
    _hook("on_before_optimizer_step", "optimizer: Optimizer",
          "Before `optimizer.step()`; gradients are unscaled and clipped."),
    _hook("on_train_batch_end", "outputs: Any, batch: Any, batch_idx: int",
          "After `training_step` and any optimizer steps it caused; `outputs` is what it returned."),
    _hook("on_validation_start", "",
          "At the start of a validation run (also during the sanity check)."),
    _hook("on_validation_epoch_start", "",
          "After `on_validation_start`, models in eval mode."),
    _hook("on_validation_batch_start", "batch: Any, batch_idx: int",
          "Before `validation_step`."),
    _hook("on_validation_batch_end", "outputs: Any, batch: Any, batch_idx: int",
          "After `validation_step`; `outputs` is what it returned."),
    _hook("on_validation_epoch_end", "",
          "After the last validation batch; values logged here join this run's results."),
    _hook("on_validation_end", "",
          "At the end of a validation run, models back in their previous mode."),
    _hook("on_train_epoch_end", "",
          "At the end of each training epoch, after that epoch's validation."),
    _hook("on_train_end", "",
          "After the last training epoch."),
    _hook("on_fit_end", "",
          "At the very end of a successful `fit()`."),
    _hook("on_test_start", "",
          "At the start of a test run (`trainer.test()`)."),
    _hook("on_test_epoch_start", "",
          "After `on_test_start`, models in eval mode."),
    _hook("on_test_batch_start", "batch: Any, batch_idx: int",
          "Before `test_step`."),
    _hook("on_test_batch_end", "outputs: Any, batch: Any, batch_idx: int",
          "After `test_step`; `outputs` is what it returned."),
    _hook("on_test_epoch_end", "",
          "After the last batch of a test run (`trainer.test()`)."),
    _hook("on_test_end", "",
          "At the end of a test run (`trainer.test()`)."),
    _hook("on_predict_start", "",
          "At the start of a prediction run (`trainer.predict()`)."),
    _hook("on_predict_epoch_start", "",
          "After `on_predict_start`, models in eval mode."),
    _hook("on_predict_batch_start", "batch: Any, batch_idx: int",
          "Before `predict_step`."),
    _hook("on_predict_batch_end", "outputs: Any, batch: Any, batch_idx: int",
          "After `predict_step`; `outputs` is what it returned."),
    _hook("on_predict_epoch_end", "",
          "After the last batch of a prediction run (`trainer.predict()`)."),
    _hook("on_predict_end", "",
          "At the end of a prediction run (`trainer.predict()`)."),
    _hook("on_save_checkpoint", "checkpoint: dict[str, Any]",
          "When `trainer.state_dict()` builds a checkpoint; may add entries to `checkpoint`."),
    _hook("on_load_checkpoint", "checkpoint: dict[str, Any]",
          "When `trainer.load_state_dict()` restores a checkpoint, before the trainer reads it."),
    _hook("on_exception", "exception: BaseException",
          "When `fit()` fails; `teardown` runs after it and the exception then propagates unchanged."),
    _hook("teardown", "stage: str",
          "Always last, also after an exception."),
)
# fmt: on

HOOKS: tuple[str, ...] = tuple(spec.name for spec in HOOK_SPECS)
"""Every hook's name, in firing order."""

HookName = Literal[
    "setup",
    "on_fit_start",
    "on_sanity_check_start",
    "on_sanity_check_end",
    "on_train_start",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_before_zero_grad",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "on_validation_start",
    "on_validation_epoch_start",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_validation_epoch_end",
    "on_validation_end",
    "on_train_epoch_end",
    "on_train_end",
    "on_fit_end",
    "on_test_start",
    "on_test_epoch_start",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_test_epoch_end",
    "on_test_end",
    "on_predict_start",
    "on_predict_epoch_start",
    "on_predict_batch_start",
    "on_predict_batch_end",
    "on_predict_epoch_end",
    "on_predict_end",
    "on_save_checkpoint",
    "on_load_checkpoint",
    "on_exception",
    "teardown",
]
"""A hook's name as a type: `CallbackBus.fire("on_test_end")` type-checks, a misspelled or computed
name does not. Written out (a type checker cannot read `HOOKS`), and checked against it below."""

if get_args(HookName) != HOOKS:  # pragma: no cover - fails at import, while editing this file
    raise TypeError(f"hook_spec.HookName must list HOOKS in order: {HOOKS}, not {get_args(HookName)}")

_BY_NAME = {spec.name: spec for spec in HOOK_SPECS}

# The no-op default of every hook, from each class decorated with `@hook_defaults`.
_DEFAULTS: set[Callable[..., Any]] = set()

Receiver = Literal["callback", "trainer"]


def overrides_hook(obj: object, name: str) -> bool:
    """True when `obj`'s class has its own `name` hook, not the no-op default it inherits from
    `Callback` or `HooksMixin` (nor none at all): only those are dispatched."""
    attr = getattr(type(obj), name, None)
    if attr is None:
        return False
    try:
        return attr not in _DEFAULTS
    except TypeError:  # unhashable, so not one of the default functions
        return True


def hook_call_problem(cls: type, name: str, receiver: Receiver) -> str | None:
    """Why `cls`'s own `name` hook cannot be called as the bus calls it (None: it can, or it is the
    no-op default, or not a plain method): positionally, with `trainer` first for a callback, then the
    hook's arguments. Lightning's `(trainer, pl_module, ...)` fails here. Read at attach time only."""
    spec = _BY_NAME[name]
    attr = inspect.getattr_static(cls, name, None)
    if attr is None or attr in _DEFAULTS:
        return None
    if isinstance(attr, staticmethod):
        fn, first = attr.__func__, []
    elif inspect.isfunction(attr):
        fn, first = attr, ["self"]
    else:
        return None  # a classmethod or a callable object: nothing simple to check
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    names = [*first, *(["trainer"] if receiver == "callback" else []), *spec.args]
    try:
        sig.bind(*names)
    except TypeError as exc:
        return f"found {name}{sig} ({exc})"
    return None


def hook_signature(name: str, receiver: Receiver) -> str:
    """The signature an override of hook `name` must accept, as written: `on_fit_start(self, trainer)`."""
    trainer = ["trainer"] if receiver == "callback" else []
    params = [_param(n, a) for n, a in _BY_NAME[name].params]
    return f"{name}({', '.join(['self', *trainer, *params])})"


def hook_mismatches(cls: type, receiver: Receiver) -> list[str]:
    """How `cls`'s hook methods differ from `HOOK_SPECS` (empty when they match exactly).

    `receiver` "callback": each hook is `(self, trainer: TrainerProtocol, *params) -> <spec.returns>`;
    "trainer": `(self, *params) -> <spec.returns>`. The methods must appear in firing order, and each
    docstring must start with the hook's `doc` (a second paragraph may add detail).
    """
    problems: list[str] = []
    own = vars(cls)
    defined = [name for name in own if name in _BY_NAME]
    missing = [name for name in HOOKS if name not in own]
    if missing:
        problems.append(f"missing hooks: {', '.join(missing)}")
    extra = [name for name in own if name.startswith("on_") and name not in _BY_NAME]
    if extra:
        problems.append(f"methods named like hooks that HOOK_SPECS lacks: {', '.join(extra)}")
    if not missing and defined != list(HOOKS):
        problems.append(f"hooks out of firing order: {', '.join(defined)}")
    first: list[tuple[str, Any]] = [("self", inspect.Parameter.empty)]
    if receiver == "callback":
        first.append(("trainer", "TrainerProtocol"))
    for name in defined:
        spec, fn = _BY_NAME[name], own[name]
        sig = inspect.signature(fn)
        got = [(p.name, p.annotation) for p in sig.parameters.values()]
        want = [*first, *spec.params]
        if got != want:
            problems.append(f"{name}{sig} should take ({', '.join(_param(n, a) for n, a in want)})")
        kinds = {p.kind for p in sig.parameters.values()} - {inspect.Parameter.POSITIONAL_OR_KEYWORD}
        defaults = [p.name for p in sig.parameters.values() if p.default is not inspect.Parameter.empty]
        if kinds or defaults:
            problems.append(f"{name}{sig} should have plain positional parameters without defaults")
        if sig.return_annotation != spec.returns:
            problems.append(f"{name} should return {spec.returns}")
        summary = " ".join(inspect.cleandoc(fn.__doc__ or "").split("\n\n", 1)[0].split())
        if summary != spec.doc:
            problems.append(f"{name}'s docstring should start with {spec.doc!r}, not {summary!r}")
    return problems


def _param(name: str, annotation: Any) -> str:
    return name if annotation is inspect.Parameter.empty else f"{name}: {annotation}"


def hook_defaults(receiver: Receiver) -> Callable[[_C], _C]:
    """Class decorator for a class of no-op hook defaults (`Callback`, `HooksMixin`).

    Checks the class against `HOOK_SPECS` (raising `TypeError` that lists every difference), then
    records its methods as defaults, which `overrides_hook` (and so the bus) skips.
    """

    def decorate(cls: _C) -> _C:
        problems = hook_mismatches(cls, receiver)
        if problems:
            raise TypeError(
                f"{cls.__module__}.{cls.__qualname__} does not match dream_trainer.hook_spec.HOOK_SPECS:\n  "
                + "\n  ".join(problems)
            )
        _DEFAULTS.update(vars(cls)[name] for name in HOOKS)
        return cls

    return decorate
