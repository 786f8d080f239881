"""The callback bus: per-hook dispatch lists built once, so an unused hook costs nothing per step."""

from __future__ import annotations

import difflib
import functools
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, SupportsIndex

from dream_trainer.callbacks.base import HOOK_SPECS, HOOKS, Callback
from dream_trainer.errors import CallbackHookError
from dream_trainer.hook_spec import Receiver, hook_call_problem, hook_signature, overrides_hook
from dream_trainer.utils.heartbeat import Heartbeat

if TYPE_CHECKING:
    from dream_trainer.protocol import TrainerProtocol

_HOOK_SET = frozenset(HOOKS)


def _suggest(name: str) -> str:
    close = difflib.get_close_matches(name, HOOKS, n=1, cutoff=0.6)
    if close:
        return f"did you mean `{close[0]}`?"
    return "the hooks are: " + ", ".join(HOOKS)


def check_hook_names(cls: type, *, ignore: Iterable[str] = (), owner: str = "callback") -> None:
    """Raise `CallbackHookError` if `cls` defines an `on_*` method that is not a hook.

    A misspelled hook would otherwise never fire, silently; failing when the callback is attached
    points at the typo while the user is still looking at it.
    """
    ignored = set(ignore)
    check_hook_signatures(cls, owner=owner)
    for klass in cls.__mro__:
        if klass is object or klass is Callback:
            continue
        for name, value in vars(klass).items():
            if not name.startswith("on_") or name in _HOOK_SET or name in ignored or not callable(value):
                continue
            raise CallbackHookError(
                f"{klass.__qualname__}.{name} looks like a {owner} hook but is not one; {_suggest(name)} "
                f"(rename it, or give it a name that does not start with `on_` if it is a helper)."
            )


def check_hook_signatures(cls: type, *, owner: str = "callback") -> None:
    """Raise `CallbackHookError` if a hook `cls` overrides cannot take the arguments the bus passes.

    A callback written for Lightning (`on_train_batch_end(self, trainer, pl_module, outputs, batch,
    batch_idx)`) would otherwise be accepted and fail mid-run with a missing argument. Costs one
    `inspect.signature` per overridden hook, when the callback is attached (or the trainer set up).
    """
    receiver: Receiver = "trainer" if owner == "trainer" else "callback"
    for spec in HOOK_SPECS:
        problem = hook_call_problem(cls, spec, receiver)
        if problem is None:
            continue
        first = "(trainer, ...) without pl_module" if receiver == "callback" else "(...) without trainer or pl_module"
        raise CallbackHookError(
            f"{cls.__qualname__}.{spec.name} does not take the arguments dream_trainer passes: expected "
            f"{hook_signature(spec, receiver)}, {problem}. dream_trainer {owner} hooks take {first}: the "
            "trainer is also the LightningModule. Remove the pl_module argument (use trainer for both)."
        )


class CallbackList(list):
    """A list of callbacks that checks each one's hook names as it is added."""

    def __init__(self, callbacks: Iterable[Callback] = ()) -> None:
        items = list(callbacks)
        for cb in items:
            _check_callback(cb)
        super().__init__(items)

    def append(self, callback: Callback) -> None:
        _check_callback(callback)
        super().append(callback)

    def extend(self, callbacks: Iterable[Callback]) -> None:
        items = list(callbacks)
        for cb in items:
            _check_callback(cb)
        super().extend(items)

    def insert(self, index: SupportsIndex, callback: Callback) -> None:
        _check_callback(callback)
        super().insert(index, callback)

    def __setitem__(self, index: Any, value: Any) -> None:
        for cb in value if isinstance(index, slice) else [value]:
            _check_callback(cb)
        super().__setitem__(index, value)

    def __iadd__(self, callbacks: Iterable[Callback]) -> CallbackList:  # type: ignore[override, misc]  # takes any iterable, like list.extend (list.__add__ takes a list)
        self.extend(callbacks)
        return self


def _check_callback(callback: object) -> None:
    if not isinstance(callback, Callback):
        raise TypeError(
            f"callbacks must be instances of dream_trainer.Callback; got {type(callback).__qualname__}. "
            "Subclass Callback and override the hooks you need."
        )
    check_hook_names(type(callback))


Hooks = tuple[Callable[..., Any], ...]
"""The callables one hook runs, in order; empty when nothing overrides it."""


class CallbackBus:
    """The one dispatcher of hooks: for every hook, a tuple of the callables to run, callbacks first,
    then the trainer's own, built once when `fit()` (or `validate()`, ...) sets the trainer up.

    A hook fires by its literal name, in one of two ways, so that searching for a hook's name finds
    where it fires:

    - `bus.fire("on_fit_end")`, `bus.fire("teardown", "fit")`: everywhere off the per-batch path;
    - `for fn in bus.on_train_batch_end: fn(outputs, batch, batch_idx)`: the hooks of every batch and
      optimizer step read their tuple (an instance attribute per hook) and skip the call into `fire`.

    `fire_safely` is `fire` for the failure path. A callback or trainer contributes to a hook only when
    its class overrides the no-op default (`Callback`'s or `HooksMixin`'s; see
    `dream_trainer.hook_spec.overrides_hook`), so a hook nobody overrides is an empty tuple.
    """

    if TYPE_CHECKING:
        # The type checker's view of the per-hook tuples `__init__` sets (`bus.on_train_batch_end`: one
        # attribute per name in HOOKS). Only the type checker sees it: at run time a class `__getattr__`
        # would stop CPython specialising attribute reads on the bus, which every step makes; a read of a
        # name that is not a hook still fails (tests/test_hook_spec.py finds such reads in the package).
        def __getattr__(self, name: str) -> Hooks: ...

    def __init__(
        self, trainer: TrainerProtocol, callbacks: Iterable[Callback], heartbeat: Heartbeat | None = None
    ) -> None:
        self.callbacks = list(callbacks)
        # `fire` marks the hook it runs (for the hang watchdog): the trainer's heartbeat, handed in by its owner.
        self._heartbeat = heartbeat if heartbeat is not None else Heartbeat()
        for spec in HOOK_SPECS:
            name = spec.name
            fns: list[Callable[..., Any]] = [
                functools.partial(getattr(cb, name), trainer) for cb in self.callbacks if overrides_hook(cb, name)
            ]
            if overrides_hook(trainer, name):
                fns.append(getattr(trainer, name))
            setattr(self, name, tuple(fns))

    def fire(self, hook: str, *args: Any) -> None:
        """Run every callable registered for `hook`, in order, with `args` (after `trainer`).

        `hook` is a name in `HOOKS`, written literally at the call (tests/test_hook_spec.py checks each
        call in the package); any other name raises `AttributeError`."""
        fns = getattr(self, hook)
        if fns:
            self._heartbeat.mark(hook)
        for fn in fns:
            fn(*args)

    def fire_safely(self, hook: str, *args: Any) -> None:
        """`fire` on the failure path (`on_exception`, `teardown`): a hook that raises is reported on
        stderr, and neither hides the original error nor stops the other hooks from running."""
        for fn in getattr(self, hook):
            try:
                fn(*args)
            except Exception as exc:
                print(f"dream_trainer: {hook} hook {fn!r} raised {exc!r}", file=sys.stderr)


def empty_bus() -> CallbackBus:
    """A bus with every hook empty, used before `fit()` builds the real one."""
    bus = CallbackBus.__new__(CallbackBus)
    bus.callbacks = []
    bus._heartbeat = Heartbeat()
    for spec in HOOK_SPECS:
        setattr(bus, spec.name, ())
    return bus
