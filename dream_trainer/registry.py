"""Registries: build models, optimizers, callbacks, ... from configs that name them with a `"type"` key.

```python
from dream_trainer.registry import MODELS, OPTIMIZERS, build_from_cfg

@MODELS.register()                       # or @MODELS.register, or @MODELS.register("mlp")
class MLP(nn.Module):
    def __init__(self, hidden: int = 64): ...

model = MODELS.build({"type": "MLP", "hidden": 128})
opt = OPTIMIZERS.build({"type": "AdamW", "lr": 3e-4}, params=model.parameters())
opt = build_from_cfg({"type": "torch.optim.AdamW", "lr": 3e-4}, params=model.parameters())  # dotted path
```

A `"type"` is a registered name, a dotted import path of a class (`"torch.optim.AdamW"`, `"pkg.mod:Class"`)
or the class itself; a dotted path to a function, a module or any other object is refused (`ConfigError`)
before anything is called, so a config builds only classes and what code registered. Nested dicts that
have a `"type"` key are built first (`recursive=True`, the default), so a config can describe a whole
object tree. jsonargparse-style `{"class_path": ..., "init_args": {...}}` is accepted too. An unknown
name raises `RegistryError` (a `KeyError`) naming the closest match, with what is registered.

Global registries: `MODELS`, `OPTIMIZERS` (every `torch.optim` optimizer), `SCHEDULERS` (every
`torch.optim.lr_scheduler` scheduler), `CALLBACKS` (dream_trainer's callbacks), `LOGGERS` (its loggers),
`TRAINERS`, `DATASETS`. Built-in entries are resolved on first use, so nothing is imported up front.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar, overload

from dream_trainer.errors import ConfigError, DreamTrainerError

__all__ = [
    "CALLBACKS",
    "DATASETS",
    "LOGGERS",
    "MODELS",
    "OPTIMIZERS",
    "SCHEDULERS",
    "TRAINERS",
    "Registry",
    "RegistryError",
    "build_from_cfg",
    "build_nested",
    "locate",
    "locate_class",
]

T = TypeVar("T")
MAX_FIRST_LINE = 300  # an error's first line; longer listings go on the lines below it
_OBJ = TypeVar("_OBJ", bound=Callable[..., Any])


class RegistryError(DreamTrainerError, KeyError):
    """A `"type"` names nothing registered and is not an importable dotted path."""

    def __str__(self) -> str:  # KeyError would show the message in quotes
        return str(self.args[0]) if self.args else ""


def locate(path: str) -> Any:
    """Import the object a dotted path names: `"torch.optim.AdamW"` or `"pkg.module:Class.Inner"`."""
    if ":" in path:
        module_name, _, attrs = path.partition(":")
        module = _import(module_name, path)
        return _getattrs(module, attrs.split(".") if attrs else [], path)
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:i])
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # Only "this prefix is not a module" means: try a shorter one. A missing dependency
            # *inside* an existing module is a real error and must surface.
            if exc.name is not None and module_name.startswith(exc.name):
                continue
            raise
        return _getattrs(module, parts[i:], path)
    raise RegistryError(f"cannot import {path!r}: no module found (expected e.g. 'torch.optim.AdamW')")


def locate_class(path: str) -> type:
    """The class a dotted path names (`locate`), as a config may name it: a function, a module or any other
    object is refused before it could be called, so a config's `type:` can only construct classes."""
    obj = locate(path)
    if inspect.isclass(obj):
        return obj
    raise ConfigError(
        f"{path!r} names {_kind(obj)}, not a class: a config's 'type' must be a class or a registered name; "
        "to build with a function, register it by name (e.g. MODELS.register(make_model))"
    )


def _kind(obj: Any) -> str:
    if inspect.ismodule(obj):
        return "a module"
    if inspect.isroutine(obj):
        return "a function"
    return f"a {type(obj).__name__} object"


def _import(module_name: str, path: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise RegistryError(f"cannot import {path!r}: there is no module {module_name!r}") from exc
        raise


def _getattrs(obj: Any, attrs: list[str], path: str) -> Any:
    for attr in attrs:
        if not hasattr(obj, attr):
            raise RegistryError(f"cannot import {path!r}: {getattr(obj, '__name__', obj)!r} has no attribute {attr!r}")
        obj = getattr(obj, attr)
    return obj


def _is_dotted(name: str) -> bool:
    return "." in name or ":" in name


class Registry(Generic[T]):
    """Maps names to classes (or factory functions) so that configs can name what to build.

    `register` adds entries, `get` looks one up, `build(cfg)` calls it with the rest of the config.
    `lazy` maps names to dotted paths that are imported only when first used.
    """

    def __init__(
        self,
        name: str,
        lazy: Mapping[str, str] | Callable[[], Mapping[str, str]] | None = None,
    ) -> None:
        self.name = name
        self._entries: dict[str, Any] = {}
        self._lazy_source = lazy
        self._lazy: dict[str, str] | None = None

    # --- registering --------------------------------------------------------------------------------
    @overload
    def register(self, obj: _OBJ, *, name: str | None = None, force: bool = False) -> _OBJ: ...
    @overload
    def register(
        self, obj: str | None = None, *, name: str | None = None, force: bool = False
    ) -> Callable[[_OBJ], _OBJ]: ...

    def register(self, obj: Any = None, *, name: str | None = None, force: bool = False) -> Any:
        """Register a class or factory under `name` (default: its `__name__`).

        Usable as `@R.register`, `@R.register()`, `@R.register("alias")`, `@R.register(name="alias")`
        or directly, `R.register(MyClass)`. Registering a different object under a taken name raises
        `ValueError` unless `force=True` (re-running the same definition, as a reloaded module does,
        simply replaces it).
        """
        if isinstance(obj, str):
            name, obj = obj, None
        if obj is None:
            return lambda o: self._add(o, name, force)
        return self._add(obj, name, force)

    def register_lazy(self, name: str, path: str) -> None:
        """Register `name` as the dotted import `path`, imported on first `get(name)`."""
        self._lazy_entries()[name] = path

    def _add(self, obj: Any, name: str | None, force: bool) -> Any:
        if not callable(obj):
            raise TypeError(f"{self.name} registry: can only register classes or callables, got {obj!r}")
        key = name if name is not None else getattr(obj, "__name__", None)
        if not isinstance(key, str) or not key:
            raise ValueError(f"{self.name} registry: give a name to register {obj!r} under")
        old = self._entries.get(key)
        if old is not None and old is not obj and not force and not _same_definition(old, obj):
            raise ValueError(
                f"{key!r} is already registered in {self.name} (as {_describe(old)}); "
                f"use another name or register(..., force=True) to replace it"
            )
        self._entries[key] = obj
        return obj

    # --- looking up ---------------------------------------------------------------------------------
    def _lazy_entries(self) -> dict[str, str]:
        if self._lazy is None:
            source = self._lazy_source
            self._lazy = dict(source() if callable(source) else (source or {}))
        return self._lazy

    def list(self) -> list[str]:
        """Registered names (including not-yet-imported built-ins), sorted."""
        return sorted(set(self._entries) | set(self._lazy_entries()))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._entries or name in self._lazy_entries())

    def __iter__(self) -> Iterator[str]:
        return iter(self.list())

    def __len__(self) -> int:
        return len(self.list())

    def __repr__(self) -> str:
        return f"Registry({self.name!r}, {len(self)} entries)"

    def get(self, name: str) -> Any:
        """The object registered as `name`, or the object a dotted path (`"torch.optim.AdamW"`) names.

        Raises `RegistryError` (a `KeyError`) listing the registered names and the closest match.
        """
        if not isinstance(name, str):
            raise TypeError(f"{self.name} registry: a name must be a string, got {name!r}")
        obj = self._find(name)
        if obj is not None:
            return obj
        if _is_dotted(name):
            return locate_class(name)
        raise RegistryError(self._not_found(name))

    def _find(self, name: str) -> Any:
        if name in self._entries:
            return self._entries[name]
        lazy = self._lazy_entries()
        if name in lazy:
            obj = locate(lazy[name])
            self._entries[name] = obj
            return obj
        return None

    def _not_found(self, name: str) -> str:
        names = self.list()
        msg = f"{name!r} is not registered in {self.name}."
        close = _closest(name, names)
        if close:
            msg += f" Did you mean {close!r}?"
        listed = f"Registered: {', '.join(names) if names else '(nothing yet)'}."
        tail = "A dotted import path (e.g. 'torch.nn.Linear' or 'my_pkg.models:MyNet') works too."
        return _first_line_then_details(msg, listed, tail)

    # --- building -----------------------------------------------------------------------------------
    def build(self, cfg: Mapping[str, Any], *, recursive: bool = True, **extra: Any) -> T:
        """Build `cfg["type"]` with the other keys as keyword arguments, plus `extra` (which wins).

        With `recursive`, nested dicts that have a `"type"` key (also inside lists) are built first;
        their names are looked up here, then in every global registry, then as dotted paths.
        """
        return _build(cfg, (self,), recursive, extra)


# --- module-level building --------------------------------------------------------------------------
def build_from_cfg(
    cfg: Mapping[str, Any], registry: Registry[Any] | None = None, *, recursive: bool = True, **extra: Any
) -> Any:
    """Build an object from a config with a `"type"` key.

    `registry` None looks the name up in every global registry (`MODELS`, `OPTIMIZERS`, ...), then
    as a dotted import path. `extra` keyword arguments are added (e.g. `params=model.parameters()`).
    """
    return _build(cfg, (registry,) if registry is not None else (), recursive, extra)


def build_nested(value: Any, registry: Registry[Any] | None = None) -> Any:
    """Build every mapping with a `"type"` key in `value` (itself included, and inside lists and
    dicts); everything else is returned unchanged. Names are looked up as in `build_from_cfg`."""
    return _build_nested(value, (registry,) if registry is not None else ())


def _global_registries() -> tuple[Registry[Any], ...]:
    return (MODELS, OPTIMIZERS, SCHEDULERS, CALLBACKS, LOGGERS, TRAINERS, DATASETS)


def _resolve(type_: Any, first: tuple[Registry[Any], ...]) -> Any:
    if not isinstance(type_, str):
        if callable(type_):
            return type_
        raise ConfigError(f"'type' must be a name, a dotted path or a class, got {type_!r}")
    for reg in first:
        obj = reg._find(type_)
        if obj is not None:
            return obj
    hits: dict[str, Any] = {}
    for reg in _global_registries():
        if reg in first:
            continue
        obj = reg._find(type_)
        if obj is not None:
            hits[reg.name] = obj
    if len({id(o) for o in hits.values()}) > 1:
        raise RegistryError(
            f"{type_!r} is registered in several registries ({', '.join(hits)}) as different objects; "
            "build it through one of them, e.g. MODELS.build(cfg), or use a dotted path"
        )
    if hits:
        return next(iter(hits.values()))
    if _is_dotted(type_):
        return locate_class(type_)
    if first:
        raise RegistryError(first[0]._not_found(type_))
    names = sorted({n for reg in _global_registries() for n in reg.list()})
    close = _closest(type_, names)
    hint = f" Did you mean {close!r}?" if close else ""
    listed = "Registered: " + "; ".join(f"{reg.name}: {', '.join(reg.list()) or '-'}" for reg in _global_registries())
    raise RegistryError(
        _first_line_then_details(
            f"{type_!r} is not registered in any registry.{hint}",
            listed + ".",
            "A dotted import path (e.g. 'torch.nn.Linear') works too.",
        )
    )


def _build(cfg: Any, first: tuple[Registry[Any], ...], recursive: bool, extra: Mapping[str, Any]) -> Any:
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"cannot build from {cfg!r}: expected a mapping with a 'type' key")
    params = dict(cfg)
    if "type" in params:
        type_ = params.pop("type")
    elif "class_path" in params:  # jsonargparse / LightningCLI style
        type_ = params.pop("class_path")
        params.update(params.pop("init_args", None) or {})
    else:
        raise ConfigError(f"cannot build from {dict(cfg)!r}: it has no 'type' key naming what to build")
    target = _resolve(type_, first)
    if recursive:
        params = {k: _build_nested(v, first) for k, v in params.items()}
    params.update(extra)
    _check_arguments(target, params, type_)
    return target(**params)


def _build_nested(value: Any, first: tuple[Registry[Any], ...]) -> Any:
    if isinstance(value, Mapping):
        if "type" in value or ("class_path" in value and set(value) <= {"class_path", "init_args"}):
            return _build(value, first, True, {})
        return {k: _build_nested(v, first) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_build_nested(v, first) for v in value)
    return value


def _check_arguments(target: Any, params: Mapping[str, Any], type_: Any) -> None:
    """Say which key is wrong before calling, rather than a bare TypeError from inside the call."""
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):  # some builtins have no signature: let the call decide
        return
    try:
        sig.bind(**params)
    except TypeError as exc:
        accepted = [p.name for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        name = type_ if isinstance(type_, str) else _describe(type_)
        raise ConfigError(
            _first_line_then_details(
                f"cannot build {name}: {exc}.", f"It accepts: {', '.join(accepted) or 'no arguments'}", ""
            )
        ) from None


def _first_line_then_details(head: str, listing: str, tail: str) -> str:
    """`head listing tail` on one line when that is short; else `head tail`, and the listing on the next line."""
    line = " ".join(p for p in (head, listing, tail) if p)
    if len(line) <= MAX_FIRST_LINE:
        return line
    return " ".join(p for p in (head, tail) if p) + "\n" + listing


def _closest(name: str, names: list[str]) -> str | None:
    by_lower = {n.lower(): n for n in names}
    if name.lower() in by_lower:
        return by_lower[name.lower()]
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[close[0]] if close else None


def _describe(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _same_definition(a: Any, b: Any) -> bool:
    return getattr(a, "__module__", None) == getattr(b, "__module__", object()) and getattr(
        a, "__qualname__", None
    ) == getattr(b, "__qualname__", object())


# --- the global registries --------------------------------------------------------------------------
def _torch_names(module_name: str, exclude: frozenset[str]) -> dict[str, str]:
    module = importlib.import_module(module_name)  # already imported with torch: no cost
    return {n: f"{module_name}.{n}" for n in getattr(module, "__all__", ()) if n[:1].isupper() and n not in exclude}


def _builtins(package: str) -> dict[str, str]:
    """The names `package.BUILTINS` lists (`dream_trainer.callbacks`, `dream_trainer.loggers`): the one
    list of built-ins. The package is imported on the registry's first use, never when this module loads."""
    return {n: f"{package}.{n}" for n in importlib.import_module(package).BUILTINS}


MODELS: Registry[Any] = Registry("models")
OPTIMIZERS: Registry[Any] = Registry("optimizers", lambda: _torch_names("torch.optim", frozenset({"Optimizer"})))
SCHEDULERS: Registry[Any] = Registry(
    "schedulers", lambda: _torch_names("torch.optim.lr_scheduler", frozenset({"LRScheduler"}))
)
CALLBACKS: Registry[Any] = Registry("callbacks", lambda: _builtins("dream_trainer.callbacks"))
LOGGERS: Registry[Any] = Registry("loggers", lambda: _builtins("dream_trainer.loggers"))
TRAINERS: Registry[Any] = Registry("trainers")
DATASETS: Registry[Any] = Registry("datasets", lambda: _builtins("dream_trainer.data"))
