"""LambdaCallback: a callback made of plain functions, one per hook, without writing a class."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from dream_trainer.callbacks.base import HOOKS, Callback
from dream_trainer.errors import ConfigError

_HOOK_SET = frozenset(HOOKS)

# One subclass per set of hook names: the bus dispatches a hook only when the callback's class
# overrides it, so each LambdaCallback's class overrides exactly the hooks it was given.
_CLASSES: dict[tuple[type, frozenset[str]], type[LambdaCallback]] = {}


class LambdaCallback(Callback):
    """Build a callback from functions: `LambdaCallback(on_train_epoch_end=lambda trainer: ...)`.

    Each keyword is a hook name from `dream_trainer.callbacks.HOOKS` and its value a function taking
    that hook's arguments, trainer first (e.g. `on_train_batch_end=fn(trainer, outputs, batch,
    batch_idx)`). A keyword given as None is ignored. Only the hooks given are dispatched: the others
    cost nothing, as for a callback class that does not override them. A name that is not a hook
    raises `ConfigError` with the closest hook name.
    """

    _hooks: dict[str, Callable[..., Any]]

    def __new__(cls, **hooks: Callable[..., Any] | None) -> LambdaCallback:
        base = getattr(cls, "_lambda_base", cls)  # a class made here: build from what it was made from
        key = (base, frozenset(_validated(hooks)))
        sub = _CLASSES.get(key)
        if sub is None:
            sub = _CLASSES[key] = _make_class(base, key[1])
        return super().__new__(sub)

    def __init__(self, **hooks: Callable[..., Any] | None) -> None:
        self._hooks = _validated(hooks)
        for name, fn in self._hooks.items():
            # The instance attribute shadows the class's delegating method, so the bus binds the
            # user's function directly: no extra call per hook.
            setattr(self, name, fn)

    @property
    def hooks(self) -> dict[str, Callable[..., Any]]:
        """The functions given, by hook name."""
        return dict(self._hooks)

    def __repr__(self) -> str:
        args = ", ".join(f"{name}={fn!r}" for name, fn in self._hooks.items())
        return f"LambdaCallback({args})"

    def __reduce__(self) -> tuple[Any, ...]:
        # The per-hook-set class is not importable by name: rebuild through the constructor.
        base = getattr(type(self), "_lambda_base", type(self))
        return (_rebuild, (base, self._hooks), dict(self.__dict__))


def _rebuild(base: type[LambdaCallback], hooks: dict[str, Callable[..., Any]]) -> LambdaCallback:
    return base(**hooks)


def _validated(hooks: dict[str, Callable[..., Any] | None]) -> dict[str, Callable[..., Any]]:
    out: dict[str, Callable[..., Any]] = {}
    for name, fn in hooks.items():
        if name not in _HOOK_SET:
            close = difflib.get_close_matches(name, HOOKS, n=1, cutoff=0.6)
            hint = f"did you mean `{close[0]}`?" if close else "valid hooks are: " + ", ".join(HOOKS)
            raise ConfigError(f"LambdaCallback({name}=...) is invalid: `{name}` is not a hook; {hint}")
        if fn is None:
            continue
        if not callable(fn):
            raise ConfigError(
                f"LambdaCallback({name}={fn!r}) is invalid: expected a function taking the hook's arguments "
                f"(trainer first), e.g. `{name}=lambda trainer, *args: ...`"
            )
        out[name] = fn
    return out


def _delegate(name: str) -> Callable[..., Any]:
    def hook(self: LambdaCallback, *args: Any) -> Any:
        return self._hooks[name](*args)

    hook.__name__ = name
    hook.__qualname__ = f"LambdaCallback.{name}"
    return hook


def _make_class(base: type[LambdaCallback], names: frozenset[str]) -> type[LambdaCallback]:
    namespace: dict[str, Any] = {name: _delegate(name) for name in names}
    namespace["__module__"] = base.__module__
    namespace["__qualname__"] = base.__qualname__  # so state_key reads "LambdaCallback" (or the subclass's name)
    namespace["__doc__"] = base.__doc__
    namespace["_lambda_base"] = base
    return type(base.__name__, (base,), namespace)
