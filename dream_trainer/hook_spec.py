"""The machinery of the hooks: how they are read from their declaration, checked, and told apart from
the no-op defaults.

A hook is declared by writing its no-op method on `Callback` (`callbacks/base.py`): its name, its
arguments after `trainer` with their annotations, its return annotation, and the first paragraph of its
docstring (the one-line summary) are the hook's; the order the methods are written in is the firing
order. `declare_hooks(Callback)` reads them into `HOOK_SPECS` (`dream_trainer.callbacks.base`), and
everything else derives from that or is checked against it:

- `HOOKS` (`dream_trainer.callbacks.HOOKS`) is their names, in the same order;
- `HooksMixin` (`mixins/hooks.py`), the trainer's own no-op hooks (the same methods without `trainer`),
  is checked against `HOOK_SPECS` by `@hook_defaults` when it is created (see below);
- the bus (`dream_trainer.callbacks.bus`) builds one dispatch tuple per hook, and asks
  `overrides_hook()` whether a callback or the trainer defines a hook beyond the no-op default. Every
  hook fires through the bus, by its literal name (`tests/test_hook_spec.py` finds each one's call, and
  fails on a name that is not a hook).

Why the two classes are written out rather than generated: a method created with `setattr` at import
time exists only at run time. Type checkers and IDEs read the source, so they would not see
`Callback.on_train_batch_end` at all: no completion while writing an override, no check that the
override has the right arguments, and `super().on_fit_start(trainer)` would be flagged as an error.
mkdocstrings (griffe) also reads the source, so docs/api.md would lose the hook list. Written-out
methods keep all of that. Since `Callback` must be written out anyway, it is the declaration: a separate
table would repeat each of its methods' name, arguments and summary. What generating `HooksMixin` would
have guaranteed, that it cannot drift from `Callback`, `@hook_defaults` guarantees instead: it fails at
import, naming the difference, if the class lacks a hook, has a method named like one that `Callback`
does not declare, orders them differently, or differs in an argument's name, annotation or kind, in the
return annotation, or in a docstring's first paragraph. Checking at import rather than only in a test
keeps the guarantee generation would give (a drifted class cannot even be imported) for about 1 ms
(`inspect.signature` of the 2 x 37 methods, once); `tests/test_hook_spec.py` tests the checker.

Adding a hook: write its no-op method on `Callback` (with `trainer` first) at its place in the firing
order, the same method on `HooksMixin` (without `trainer`; importing fails until the two match), and
its row in `lightning/names.py` (what Lightning calls it; importing fails with a `KeyError` naming the
hook until it has one). Then fire it from the loop by its literal name:
`self._bus.fire("on_new_hook", ...)`, or `for fn in self._bus.on_new_hook:` on the per-batch path.
`HOOKS`, the bus's tuples, the checks of a callback's hook names and signatures at attach, and
`LambdaCallback`'s keywords follow.

The names are not written a third time for the type checker: `bus.fire(name)` takes a `str`, and the
bus's per-hook tuples are typed by a `__getattr__` that only the type checker sees (see `CallbackBus`).
A `Literal` of the names, or one annotation per hook on the bus, would each be a list to keep in step
with `Callback`; what they would catch, a misspelt hook name at a call into the bus, the scan in
`tests/test_hook_spec.py` catches (every `fire("...")` and every attribute read on the bus in the
package), and at run time such a name raises `AttributeError`.

This module imports nothing from `dream_trainer`: it is the bottom layer that the callbacks and the
trainer both build on (`Callback` hands itself to `declare_hooks`; this module never imports it).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

__all__ = [
    "HookSpec",
    "declare_hooks",
    "hook_call_problem",
    "hook_defaults",
    "hook_mismatches",
    "hook_signature",
    "is_hook_name",
    "overrides_hook",
]

_C = TypeVar("_C", bound=type)


@dataclass(frozen=True)
class HookSpec:
    """One hook, as `Callback` declares it: its `name`, its `params` after `trainer` as
    `(name, annotation)` pairs, `doc`, the one-line description that starts both default methods'
    docstrings, and `returns`, the return annotation (`"None"` for all but `on_train_batch_start`, whose
    -1 skips the rest of the epoch)."""

    name: str
    params: tuple[tuple[str, str], ...]
    doc: str
    returns: str = "None"

    @property
    def args(self) -> tuple[str, ...]:
        """The argument names after `trainer` (a trainer's own hook takes exactly these)."""
        return tuple(name for name, _ in self.params)


# The no-op default of every hook, from `declare_hooks` and each class decorated with `@hook_defaults`.
_DEFAULTS: set[Callable[..., Any]] = set()

Receiver = Literal["callback", "trainer"]


def is_hook_name(name: str) -> bool:
    """Whether a method called `name` is a hook: Lightning's rule, `on_*`, `setup` and `teardown`.
    (`Callback`'s other methods, `state_dict`, `load_state_dict`, `state_key`, are not hooks.)"""
    return name.startswith("on_") or name in ("setup", "teardown")


def _summary(fn: Callable[..., Any]) -> str:
    """The first paragraph of `fn`'s docstring on one line ("" when there is none, as under `-OO`)."""
    return " ".join(inspect.cleandoc(fn.__doc__ or "").split("\n\n", 1)[0].split())


def _param(name: str, annotation: Any) -> str:
    return name if annotation is inspect.Parameter.empty else f"{name}: {annotation}"


def _lead(receiver: Receiver) -> list[tuple[str, Any]]:
    """The parameters before a hook's own: `self`, then `trainer: TrainerProtocol` for a callback."""
    first: list[tuple[str, Any]] = [("self", inspect.Parameter.empty)]
    if receiver == "callback":
        first.append(("trainer", "TrainerProtocol"))
    return first


def _shape_problems(name: str, sig: inspect.Signature) -> list[str]:
    """The bus calls a hook positionally with exactly its arguments: nothing else will do."""
    params = sig.parameters.values()
    kinds = {p.kind for p in params} - {inspect.Parameter.POSITIONAL_OR_KEYWORD}
    defaults = [p.name for p in params if p.default is not inspect.Parameter.empty]
    if kinds or defaults:
        return [f"{name}{sig} should have plain positional parameters without defaults"]
    return []


def declare_hooks(cls: type) -> tuple[HookSpec, ...]:
    """The hooks `cls` (`Callback`) declares: one `HookSpec` per method named like a hook
    (`is_hook_name`), in the order they are written, which is the firing order.

    Each must be a plain method `(self, trainer: TrainerProtocol, *params) -> <returns>` with every
    argument and the return annotated. Raises `TypeError` listing every method that is not; records the
    methods as defaults, which `overrides_hook` (and so the bus) skips.
    """
    specs: list[HookSpec] = []
    problems: list[str] = []
    lead = _lead("callback")
    for name, fn in vars(cls).items():
        if not is_hook_name(name):
            continue
        if not inspect.isfunction(fn):
            problems.append(f"{name} should be a plain method, not {type(fn).__name__}")
            continue
        sig = inspect.signature(fn)
        got = [(p.name, p.annotation) for p in sig.parameters.values()]
        problems += _shape_problems(name, sig)
        if got[: len(lead)] != lead:
            problems.append(f"{name}{sig} should start with (self, trainer: TrainerProtocol)")
        unannotated = [n for n, a in got[len(lead) :] if a is inspect.Parameter.empty]
        if unannotated or sig.return_annotation is inspect.Signature.empty:
            problems.append(f"{name}{sig} should annotate every argument after trainer, and its return")
        params = tuple((n, str(a)) for n, a in got[len(lead) :])
        specs.append(HookSpec(name, params, _summary(fn), str(sig.return_annotation)))
    if problems:
        raise TypeError(
            f"{cls.__module__}.{cls.__qualname__} declares the hooks: write each as a plain method "
            "(self, trainer: TrainerProtocol, <annotated arguments>) -> <annotation>:\n  " + "\n  ".join(problems)
        )
    _DEFAULTS.update(vars(cls)[spec.name] for spec in specs)
    return tuple(specs)


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


def hook_call_problem(cls: type, spec: HookSpec, receiver: Receiver) -> str | None:
    """Why `cls`'s own `spec.name` hook cannot be called as the bus calls it (None: it can, or it is the
    no-op default, or not a plain method): positionally, with `trainer` first for a callback, then the
    hook's arguments. Lightning's `(trainer, pl_module, ...)` fails here. Read at attach time only."""
    attr = inspect.getattr_static(cls, spec.name, None)
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
        return f"found {spec.name}{sig} ({exc})"
    return None


def hook_signature(spec: HookSpec, receiver: Receiver) -> str:
    """The signature an override of hook `spec` must accept, as written: `on_fit_start(self, trainer)`."""
    trainer = ["trainer"] if receiver == "callback" else []
    params = [_param(n, a) for n, a in spec.params]
    return f"{spec.name}({', '.join(['self', *trainer, *params])})"


def hook_mismatches(cls: type, specs: Iterable[HookSpec], receiver: Receiver) -> list[str]:
    """How `cls`'s hook methods differ from `specs` (empty when they match exactly).

    `receiver` "callback": each hook is `(self, trainer: TrainerProtocol, *params) -> <spec.returns>`;
    "trainer": `(self, *params) -> <spec.returns>`. The methods must appear in firing order, and each
    docstring must start with the hook's `doc` (a second paragraph may add detail).
    """
    by_name = {spec.name: spec for spec in specs}
    problems: list[str] = []
    own = vars(cls)
    defined = [name for name in own if name in by_name]
    missing = [name for name in by_name if name not in own]
    if missing:
        problems.append(f"missing hooks: {', '.join(missing)}")
    extra = [name for name in own if is_hook_name(name) and name not in by_name]
    if extra:
        problems.append(f"methods named like hooks that Callback does not declare: {', '.join(extra)}")
    if not missing and defined != list(by_name):
        problems.append(f"hooks out of firing order: {', '.join(defined)}")
    for name in defined:
        spec, fn = by_name[name], own[name]
        sig = inspect.signature(fn)
        got = [(p.name, p.annotation) for p in sig.parameters.values()]
        want = [*_lead(receiver), *spec.params]
        if got != want:
            problems.append(f"{name}{sig} should take ({', '.join(_param(n, a) for n, a in want)})")
        problems += _shape_problems(name, sig)
        if sig.return_annotation != spec.returns:
            problems.append(f"{name} should return {spec.returns}")
        if _summary(fn) != spec.doc:
            problems.append(f"{name}'s docstring should start with {spec.doc!r}, not {_summary(fn)!r}")
    return problems


def hook_defaults(specs: Iterable[HookSpec], receiver: Receiver) -> Callable[[_C], _C]:
    """Class decorator for a class of no-op hook defaults other than the declaring one (`HooksMixin`).

    Checks the class against `specs` (`HOOK_SPECS`, raising `TypeError` that lists every difference),
    then records its methods as defaults, which `overrides_hook` (and so the bus) skips.
    """
    specs = tuple(specs)

    def decorate(cls: _C) -> _C:
        problems = hook_mismatches(cls, specs, receiver)
        if problems:
            raise TypeError(
                f"{cls.__module__}.{cls.__qualname__} does not match the hooks Callback declares: write each as "
                "Callback's method is written (dream_trainer/callbacks/base.py):\n  " + "\n  ".join(problems)
            )
        _DEFAULTS.update(vars(cls)[spec.name] for spec in specs)
        return cls

    return decorate
